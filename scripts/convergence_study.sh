#!/usr/bin/env bash
# The convergence study of docs/convergence.md: warm start, then DiLoCo at sync_every 1..100
# against single and ddp, and an outer learning-rate sweep. ~20 minutes on 2 CPU cores.
#   bash scripts/convergence_study.sh [WORKDIR]     (default runs/study)
# A rerun reuses the finished runs (only the warm start trains again): steps 3-5 alone redraw the
# figures in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/study}
preset=configs/study.py
# 1. warm start: one worker, 300 steps from scratch at a constant learning rate after warmup
#    (no decay, so the continuation does not jump from a small to a large learning rate)
uv run python -m diloco_jax.train --config "$preset" --workdir "$out/pretrain" \
    --config.algorithm=single --config.train.total_steps=300 --config.train.eval_every=300 \
    --config.inner.final_lr_fraction=1.0
warm="--config.train.init_from=$out/pretrain"
# 2. sync_every against the baselines, all from the warm start
uv run python -m sim --config "$preset" --workdir "$out/sync_every" $warm \
    --sweep outer.sync_every=1,10,50,100 --baselines single,ddp
# 3. outer learning rate at sync_every=50
uv run python -m sim --config "$preset" --workdir "$out/outer_lr" $warm \
    --sweep outer.learning_rate=0.3,0.5,0.7,1.0,1.4
# 4. the same runs accounted for a 1 Gbit/s WAN instead of a datacenter link: nothing retrains,
#    only bytes and the clock are recomputed (results.csv then holds the WAN accounting)
uv run python -m sim --config "$preset" --workdir "$out/sync_every" $warm \
    --sweep outer.sync_every=1,10,50,100 --baselines single,ddp --config.sim.network=wan_1gbit
# 5. the figures the README and docs/convergence.md show
mkdir -p docs
cp "$out/sync_every/curves.png" docs/convergence_curves.png
cp "$out/sync_every/tradeoff.png" docs/convergence_tradeoff.png
cp "$out/outer_lr/curves.png" docs/outer_lr_curves.png
echo "tables: $out/sync_every/summary.csv, $out/outer_lr/summary.csv; figures copied to docs/"
