#!/usr/bin/env bash
# N processes of one training run on this machine, joined through jax.distributed (gloo on CPU).
#
#   scripts/launch_local.sh N [--devices_per_process K] [--] --workdir DIR [train flags ...]
#
# Same as `uv run python -m diloco_jax.launch -n N ...`: Ctrl-C asks every process to save and
# stop (a second Ctrl-C kills them), a failed process stops the others, nothing is left behind.
set -euo pipefail
if [[ $# -lt 1 || ! $1 =~ ^[0-9]+$ ]]; then
  echo "usage: $0 N [--devices_per_process K] [--] --workdir DIR [train flags ...]" >&2
  exit 2
fi
n=$1
shift
cd "$(dirname "$0")/.."
exec uv run python -m diloco_jax.launch -n "$n" "$@"
