#!/usr/bin/env bash
# Why the entry points use argparse and not ml_collections' config_flags (issue 12): the same
# preset-and-overrides command lines through a minimal config_flags + absl program, in a
# throw-away virtual environment (needs PyPI), against ours. Prints what each does with --help,
# an unknown key, a bad value and a missing preset.
#   bash scripts/compare_flags_library.sh
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
uv venv -q "$tmp/venv" -p 3.11
uv pip install -q --python "$tmp/venv/bin/python" ml_collections absl-py
cat > "$tmp/cfg.py" <<'PY'
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.outer = ml_collections.ConfigDict({"sync_every": 50, "learning_rate": 0.7})
    return c
PY
cat > "$tmp/main.py" <<'PY'
from absl import app
from ml_collections import config_flags

CONFIG = config_flags.DEFINE_config_file("config")


def main(argv):
    print("ran with", CONFIG.value)


if __name__ == "__main__":
    app.run(main)
PY
mlc() { (cd "$tmp" && "$tmp/venv/bin/python" main.py "$@" 2>&1; echo "[exit $?]"); }
ours() { (cd "$repo" && uv run python -m diloco_jax.train "$@" 2>&1 | tail -n 3; echo "[exit ${PIPESTATUS[0]}]"); }
ml_version=$("$tmp/venv/bin/python" -c "import importlib.metadata as m; print(m.version('ml_collections'), m.version('absl-py'))")
echo "ml_collections, absl-py: $ml_version"
echo "== --help: lines naming outer.sync_every"
echo "config_flags: $(mlc --config cfg.py --helpfull | grep -c sync_every)"
echo "ours:         $(cd "$repo" && uv run python -m diloco_jax.train --help | grep -c sync_every)"
echo "== an unknown key (--config.outer.sync_evry=5): last lines"
mlc --config cfg.py --config.outer.sync_evry=5 | tail -n 3
ours --config.outer.sync_evry=5
echo "== a bad value (--config.outer.sync_every=abc)"
mlc --config cfg.py --config.outer.sync_every=abc
ours --config.outer.sync_every=abc
echo "== a preset that does not exist (--config nope.py)"
mlc --config nope.py
ours --config nope.py
