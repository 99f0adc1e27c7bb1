# Shared by the study scripts (sourced, not run, with the script's arguments): strict mode, the
# repository as the working directory, $out (the first argument, default runs/study), the
# study preset, the convergence study's warm start, and a sweep from it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-runs/study}
preset=configs/study.py

# warm_start: a short single-worker run whose final parameters every study run starts from
warm_start() {
  if [[ ! -d "$out/pretrain/params" ]]; then
    uv run python -m diloco_jax.train --config "$preset" --workdir "$out/pretrain" \
        --config.algorithm=single --config.train.total_steps=300 \
        --config.train.eval_every=300 --config.inner.final_lr_fraction=1.0
  fi
}

# sweep ARGS...: python -m sim from the warm start, accounted for a 1 Gbit/s, 50 ms WAN
sweep() {
  uv run python -m sim --config "$preset" --config.train.init_from="$out/pretrain" \
      --config.sim.network=wan_1gbit "$@"
}

warm_start
