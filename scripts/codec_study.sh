#!/usr/bin/env bash
# The codec study of docs/compression.md: from the convergence study's warm start, DiLoCo
# (sync_every=50, R=4) with each pseudo-gradient codec, with and without error feedback.
# ~15 minutes on 2 CPU cores.
#   bash scripts/codec_study.sh [WORKDIR]     (default runs/study; reuses its warm start)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/study}
preset=configs/study.py
if [[ ! -d "$out/pretrain/params" ]]; then  # the same warm start as scripts/convergence_study.sh
  uv run python -m diloco_jax.train --config "$preset" --workdir "$out/pretrain" \
      --config.algorithm=single --config.train.total_steps=300 --config.train.eval_every=300 \
      --config.inner.final_lr_fraction=1.0
fi
uv run python -m sim --config "$preset" --workdir "$out/codecs" \
    --config.train.init_from="$out/pretrain" \
    --sweep compress.codec=none,bf16,int8,fp8,int4,topk --sweep compress.error_feedback=false,true
mkdir -p docs
cp "$out/codecs/tradeoff.png" docs/codec_tradeoff.png
echo "table: $out/codecs/summary.csv; figure copied to docs/codec_tradeoff.png"
