#!/usr/bin/env bash
# The checks to run on a machine with one NVIDIA GPU, in one go (the device time is short):
#
#     bash scripts/gpu_check.sh OUTDIR            (all parts: about 10 minutes at most)
#     PARTS="tests determinism" bash scripts/gpu_check.sh OUTDIR
#
# from the repository's root, with a Python whose JAX sees the GPU and which has this project's
# dependencies (PYTHONPATH may hold what is missing, e.g. tensorboardX). Each part has its own
# time limit, so one that hangs loses only itself; its log lands in OUTDIR:
#   env.log         the GPU, the versions
#   tests.log       a part of the suite on the GPU (single-device tests of the core algorithm;
#                   tests/conftest.py asks for full-fp32 matmuls and deterministic ops there)
#   determinism.log the same run twice, with a sparsifying and a quantizing codec: equal bits?
#                   (train.deterministic, on by default), and once more with it off
#   quickstart.log  the README's default command, timed
#   command.log     scripts/bench_command.py at R=4 (cold and warm compilation cache)
#   sim.log         scripts/bench_sim.py (vmapped workers against one big model, MFU)
#   lm100m.log      configs/lm_100m.py for 60 steps at R=2: tokens/s of a 100 M model, with
#                   train.deterministic on (the default) and off
set -uo pipefail
out=${1:?usage: bash scripts/gpu_check.sh OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
work=$(mktemp -d)
parts=" ${PARTS:-env tests determinism quickstart command sim lm100m} "

part() {  # part NAME SECONDS COMMAND...: runs COMMAND under a time limit into NAME.log
  local name=$1 limit=$2
  shift 2
  [[ $parts == *" ${name%%_*} "* ]] || return 0
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - start)) s (limit $limit s)" | tee -a "$out/summary.log"
}

part env 60 bash -c "nvidia-smi; $py -c 'import jax, flax, optax, orbax.checkpoint as o; \
print(jax.__version__, flax.__version__, optax.__version__, o.__version__); \
print(jax.devices())'"

# the tests compile per test; two-process tests must not take 75% of the GPU each
part tests 100 env JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
  "$py" -m pytest -p no:cacheprovider -n 0 -rfE -v tests/test_diloco.py tests/test_dtypes.py

determinism() {  # determinism [false]: train.deterministic
  for codec in sparseloco int8; do
    for run in a b; do
      "$py" -m diloco_jax.train --config tiny --workdir "$work/det_${codec}_$run${1:-}" \
        --config.train.total_steps=40 --config.compress.codec=$codec \
        --config.train.deterministic=${1:-true} --config.log.progress_bar=false \
        --config.train.sample_chars=0 >/dev/null 2>&1 || return 1
    done
    "$py" - "$work/det_${codec}_a${1:-}" "$work/det_${codec}_b${1:-}" "$codec" <<'EOF'
import json, sys
def losses(d):
    rows = [json.loads(line) for line in open(f"{d}/metrics.jsonl")]
    return [(r["event"], r.get("step"), r[k]) for r in rows for k in sorted(r) if "loss" in k]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
print(sys.argv[3], len(a), "losses;", "bitwise equal" if a == b else "DIFFER:")
if a != b:
    print("\n".join(f"  {x}\n  {y}" for x, y in zip(a, b) if x != y))
EOF
  done
}
export -f determinism
export py work
part determinism 60 bash -c determinism
part determinism_off 60 bash -c "determinism false"

part quickstart 60 bash -c "time $py -m diloco_jax.train --workdir $work/quickstart \
  --config.log.progress_bar=false"

part command 50 "$py" scripts/bench_command.py --replicas 4

part sim 90 "$py" scripts/bench_sim.py --replicas 1,4,16 --share_replicas 4 --loop_replicas 4

lm100m() {  # lm100m true|false: train.deterministic
  "$py" -m diloco_jax.train --config lm_100m --workdir "$work/lm100m_$1" \
    --config.parallel.replicas=2 --config.train.total_steps=60 --config.train.log_every=20 \
    --config.train.eval_every=1000 --config.data.eval_windows=8 --config.train.checkpoint=false \
    --config.log.progress_bar=false --config.train.sample_chars=0 \
    --config.train.deterministic="$1" || return 1
  grep -h '"event": "train"' "$work/lm100m_$1/metrics.jsonl"
}
export -f lm100m
part lm100m 80 bash -c "lm100m true"
part lm100m_off 80 bash -c "lm100m false"
cat "$out/summary.log"
