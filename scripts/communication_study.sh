#!/usr/bin/env bash
# The communication study of docs/communication.md: from the convergence study's warm start,
# DiLoCo (R=4, sync_every=50, 400 inner steps) with each way of sending less: pseudo-gradient
# codecs (with and without error feedback), Streaming DiLoCo (fragments, overlap, mixing),
# delayed and eager outer steps, and DCT momentum; against ddp and single.
# Accounted for a 1 Gbit/s, 50 ms WAN (sim.network=wan_1gbit), where communication shows.
# About 30 minutes on 2 CPU cores (22 runs of ~75 s). Finished runs are reused on a rerun.
#   bash scripts/communication_study.sh [WORKDIR]     (default runs/study)
source "$(dirname "$0")/study_lib.sh"  # strict mode, cd, $out, $preset, the warm start, sweep
comm="$out/communication"
sweep --workdir "$comm/baselines" --baselines single,ddp
sweep --workdir "$comm/codecs" --sweep compress.codec=none,bf16,int8,fp8,int4,topk
sweep --workdir "$comm/error-feedback" --sweep compress.codec=int4,topk \
    --config.compress.error_feedback=true
sweep --workdir "$comm/streaming" --config.streaming.fragments=2 \
    --sweep streaming.overlap=0,5 --sweep streaming.mix=0,0.5
sweep --workdir "$comm/streaming-int4" --config.streaming.fragments=2 \
    --config.streaming.overlap=5 --config.compress.codec=int4 --config.compress.error_feedback=true
# at the synchronous step's momentum (0.9), as these runs were made before the stale steps got
# their own (outer.overlap_momentum; scripts/overlap_study.sh)
sweep --workdir "$comm/overlapped-outer" --sweep outer.mode=delayed,eager \
    --config.outer.overlap_momentum=0.9
sweep --workdir "$comm/overlapped-outer-lr0.35" --sweep outer.mode=delayed,eager \
    --config.outer.learning_rate=0.35 --config.outer.overlap_momentum=0.9
sweep --workdir "$comm/dct-momentum" --config.compress.codec=dct --sweep compress.dct_topk=4,16
uv run python -m sim.combine "$comm"/{baselines,codecs,error-feedback,streaming,streaming-int4,overlapped-outer,overlapped-outer-lr0.35,dct-momentum} \
    --out "$comm" --title "DiLoCo R=4, sync_every=50, 400 steps: final loss against bytes sent"
mkdir -p docs
cp "$comm/tradeoff.png" docs/communication_tradeoff.png
echo "table: $comm/table.md; figure copied to docs/communication_tradeoff.png"
