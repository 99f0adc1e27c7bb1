#!/usr/bin/env bash
# Disk size of a fresh Python 3.11 virtual environment holding diloco-jax: this checkout's
# default install and its [all], and optionally the default install of another git revision.
#
#   bash scripts/bench_install_size.sh [REV]    # REV: a revision to compare with, e.g. main
#
# Each install is `uv pip install SOURCE` into a new virtual environment (the newest versions
# pyproject.toml allows, as `pip install .` resolves them); a size is `du --apparent-size` of the
# whole environment, in MB (10^6 bytes). Needs uv and PyPI (or uv's cache). Prints a markdown
# table with the five largest entries of each environment's site-packages.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mb() { awk '{printf "%.0f", $1 / 1e6}'; }

measure() {  # LABEL SOURCE
  local venv="$work/venv"
  rm -rf "$venv"
  uv venv --quiet --python 3.11 "$venv"
  VIRTUAL_ENV="$venv" uv pip install --quiet "$2"
  local site="$venv/lib/python3.11/site-packages" total top
  total=$(du -s --apparent-size --block-size=1 "$venv" | mb)
  top=$(du -s --apparent-size --block-size=1 "$site"/* | sort -rn | head -5 |
        awk '{n = $2; sub(".*/", "", n); printf "%s%s %.0f", sep, n, $1 / 1e6; sep = ", "}')
  printf '| %s | %s MB | %s |\n' "$1" "$total" "$top"
}

echo "| install | environment | largest in site-packages (MB) |"
echo "|---|---:|---|"
if [[ $# -ge 1 ]]; then
  mkdir "$work/rev"
  git archive "$1" | tar -x -C "$work/rev"
  measure "diloco-jax at $1" "$work/rev"
fi
measure "diloco-jax" "$PWD"
measure "diloco-jax[all]" "diloco-jax[all] @ file://$PWD"
