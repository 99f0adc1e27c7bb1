#!/usr/bin/env bash
# The robust merging study of docs/guides/learners.md ("Learners you do not trust", issue 63):
# the tiny preset with R = 8 replicas on their own data shards, 50 rounds of sync_every 10 from
# scratch, 3 seeds; every merge rule (the mean, the mean after clipping each norm to 1.5 x the
# round's median, the trimmed mean of 2 per side, the median, centered clipping) without an
# attack and against every attack (sign_flip, scale, gaussian, alie, ipm, inflate) by f = 1 and
# f = 2 hostile replicas, drawn from the seed. About 40 minutes on 2 CPU cores (195 runs); a
# run under attack compiles its own step (its hostile replicas are constants of it). Finished
# runs are reused on a rerun. PYTHON: the interpreter (default: uv run python).
#   bash scripts/robust_study.sh [WORKDIR]     (default runs/robust)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/robust}
python=${PYTHON:-uv run python}
H=10
rounds=50
common=(--config configs/tiny.py --config.parallel.replicas=8 --config.outer.sync_every=$H
        --config.train.total_steps=$((rounds * H)) --config.train.eval_every=$((rounds * H))
        --config.train.log_every=$H --config.train.sample_chars=0 --config.data.eval_windows=64
        --seeds 0,1,2)
attacks=sign_flip,scale,gaussian,alie,ipm,inflate
# rule NAME ARGS...: the rule without an attack, then against every attack by f = 1 and 2
rule() {
  local name=$1
  shift
  $python -m sim --workdir "$out/$name/clean" "${common[@]}" "$@"
  for f in 1 2; do
    $python -m sim --workdir "$out/$name/f$f" "${common[@]}" --config.sim.attackers=$f \
        --sweep sim.attack=$attacks "$@"
  done
}
rule mean
rule clipped_mean --config.merge.clip=1.5
rule trimmed_mean --config.merge.rule=trimmed_mean --config.merge.trim=2
rule median --config.merge.rule=median
rule centered_clip --config.merge.rule=centered_clip
$python scripts/robust_figure.py "$out" --out docs/robust_study.png
