#!/usr/bin/env bash
# The overlap study of docs/guides/learners.md ("Choosing a mode for your link", issue 55): the
# default preset with 2 replicas (two learners), 50 rounds at sync_every 10 and 20, 3 seeds,
# from scratch: synchronous rounds against the modes that hide the link behind computation:
# delayed and eager outer steps at outer.overlap_momentum's default (and, at sync_every 10, at
# the paper's momentum 0.9); Streaming DiLoCo with overlap tau and mixing alpha. Accounted for a
# 33 Mbit/s, 50 ms link, whose all-reduce of the model takes 80% of a round of 10 steps at 0.07
# s a step. About 100 minutes on 2 CPU cores (45 runs); finished runs are reused on a rerun.
# PYTHON: the interpreter (default: uv run python).
#   bash scripts/overlap_study.sh [WORKDIR]     (default runs/overlap)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/overlap}
link=(--config.sim.bandwidth_gbps=0.0332 --config.sim.latency_ms=50 --config.sim.step_time_s=0.07)
seeds=(--seeds 0,1,2)
python=${PYTHON:-uv run python}
# sweep H NAME ARGS...: 50 rounds of H steps from scratch, evaluated at the end only
sweep() {
  local H=$1 name=$2
  shift 2
  $python -m sim --workdir "$out/H$H/$name" --config.parallel.replicas=2 \
      --config.outer.sync_every="$H" --config.train.total_steps=$((50 * H)) \
      --config.train.eval_every=$((50 * H)) --config.train.log_every="$H" \
      --config.train.sample_chars=0 --config.data.eval_windows=64 "${link[@]}" "${seeds[@]}" "$@"
}
for H in 10 20; do
  sweep "$H" sync
  sweep "$H" eager --config.outer.mode=eager
  sweep "$H" delayed --config.outer.mode=delayed
  sweep "$H" stream-F2-tau4 --config.streaming.fragments=2 --config.streaming.overlap=4 \
      --config.streaming.mix=0.5
  if [[ $H == 10 ]]; then
    # the stale steps at the paper's momentum (delayed diverges), synchronous rounds at
    # momentum 0, and Streaming DiLoCo's one fragment at tau = 5, with and without mixing
    sweep 10 sync-0 --config.outer.momentum=0
    sweep 10 eager-0.9 --config.outer.mode=eager --config.outer.overlap_momentum=0.9
    sweep 10 delayed-0.9 --config.outer.mode=delayed --config.outer.overlap_momentum=0.9
    sweep 10 stream-tau5 --config.streaming.overlap=5 --config.streaming.mix=0.5
    sweep 10 stream-tau5-alpha0 --config.streaming.overlap=5 --config.streaming.mix=0
    # the mixing alone: synchronous rounds whose landing keeps half the local parameters
    sweep 10 sync-mix0.5 --config.streaming.mix=0.5
  else  # the delayed step at momentum 0.3, the most the linear model calls stable
    sweep 20 delayed-0.3 --config.outer.mode=delayed --config.outer.overlap_momentum=0.3
  fi
done
$python scripts/overlap_figure.py "$out" --out docs/overlap_study.png
