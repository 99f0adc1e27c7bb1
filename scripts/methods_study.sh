#!/usr/bin/env bash
# The methods study of docs/methods.md (issue 15): from the convergence study's warm start, the
# same model, data, R=4, sync_every=50 and 400 inner steps for every method; 3 seeds for the
# methods compared (DiLoCo, SparseLoCo, MuLoCo, DES-LOC, NoLoCo, quorum), one for the rest. Accounted
# for a 1 Gbit/s, 50 ms WAN (sim.network=wan_1gbit). About 40 minutes on 2 CPU cores (32 runs).
# Finished runs are reused on a rerun.
#   bash scripts/methods_study.sh [WORKDIR]     (default runs/study)
source "$(dirname "$0")/study_lib.sh"  # strict mode, cd, $out, $preset, the warm start, sweep
methods="$out/methods"
seeds=(--seeds 0,1,2)
sweep --workdir "$methods/baselines" --baselines single,ddp
sweep --workdir "$methods/diloco" "${seeds[@]}"
# SparseLoCo: the accumulator stands in for outer momentum (the paper's outer SGD, lr 1)
sweep --workdir "$methods/sparseloco" "${seeds[@]}" --config.compress.codec=sparseloco \
    --config.outer.momentum=0 --config.outer.learning_rate=1.0
# at 8 syncs 1.6% leaves most of each pseudo-gradient in the accumulator: 10% for comparison
sweep --workdir "$methods/sparseloco-10pct" --config.compress.codec=sparseloco \
    --config.compress.sparse_topk=410 --config.outer.momentum=0 --config.outer.learning_rate=1.0
sweep --workdir "$methods/muloco" "${seeds[@]}" --config.inner.optimizer=muon
# DES-LOC with the issue's periods: first moments every 3 syncs, second every 6
sweep --workdir "$methods/desloc" "${seeds[@]}" --config.desloc.first_moment_every=150 \
    --config.desloc.second_moment_every=300
sweep --workdir "$methods/desloc-equal" --config.desloc.first_moment_every=150 \
    --config.desloc.second_moment_every=150
# NoLoCo with the authors' outer step: heavy-ball SGD, lr 0.7, momentum 0.5
sweep --workdir "$methods/noloco" "${seeds[@]}" --config.noloco.enabled=true \
    --config.outer.nesterov=false --config.outer.momentum=0.5
# Adam on the pseudo-gradient: its learning rate is a step size per coordinate
sweep --workdir "$methods/outer-adam" --config.outer.optimizer=adam \
    --sweep outer.learning_rate=0.003,0.01,0.03
sweep --workdir "$methods/codecs" --sweep compress.codec=int4,dct \
    --config.compress.error_feedback=false
# Under stragglers (speeds 1, 1, 0.8, 0.4): DiLoCo waiting for the slowest, a quorum of 2 with a
# grace window of a quarter round (takes the 0.8 replica, not the 0.4 one), no grace, and DyLU
stragglers=(--config.sim.speeds=1,1,0.8,0.4)
sweep --workdir "$methods/stragglers-wait" "${seeds[@]}" "${stragglers[@]}"
sweep --workdir "$methods/quorum" "${seeds[@]}" "${stragglers[@]}" --config.sim.quorum=2 \
    --config.sim.grace=0.25
sweep --workdir "$methods/quorum-no-grace" "${stragglers[@]}" --config.sim.quorum=2
sweep --workdir "$methods/stragglers-dylu" "${stragglers[@]}" --config.sim.dylu=true
uv run python -m sim.combine "$methods"/{baselines,diloco,sparseloco,sparseloco-10pct,muloco,desloc,desloc-equal,noloco,outer-adam,codecs,stragglers-wait,quorum,quorum-no-grace,stragglers-dylu} \
    --out "$methods" --title "R=4, sync_every=50, 400 steps: final loss against bytes sent"
mkdir -p docs
cp "$methods/tradeoff.png" docs/methods_tradeoff.png
echo "table: $methods/table.md; figure copied to docs/methods_tradeoff.png"
