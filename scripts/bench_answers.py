"""Benchmark: the bytes of a learner's push and of the syncer's answer, measured on the wire.

    uv run python scripts/bench_answers.py [--preset tiny] [--codec int8]
        [--min_sizes 4096,1024,256,64,0] [--steps 10] [--answers on|off|both]

For each ``compress.min_size``, one learner of ``--preset`` (one replica, its syncs every
``outer.sync_every`` steps) trains ``--steps`` steps against a syncer served in this process,
with ``compress.codec=--codec`` and ``compress.answers`` on (``--answers``: off, or both in
turn; ``dct`` and ``sparseloco``, whose answers stay float32, need ``--answers off``); and once
with float32 pushes and answers. From the learner's ``round`` events: the
bytes it sent (the push) and received (the answer) in its last round, framing included (a JSON
header naming the leaves, a checksum); ``values``: the arrays alone (``payload.push_bytes`` of
the push, and of the answer's encoded change: the same code, one replica), each also as a
share of float32's values. The final evaluation loss is printed too; a short run says little
of what the codec costs in loss.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile

import jax
import numpy as np

from diloco_jax.config import apply_overrides, load_preset, recipe
from diloco_jax.learners import answers, payload, service, wire
from diloco_jax.learners.command import make_syncer
from diloco_jax.run.setup import build
from diloco_jax.simulated import comms
from diloco_jax.train import train

TOKEN = "bench-answers"


def _config(args, overrides: dict):
    base = {"train.total_steps": args.steps, "train.sample_chars": 0, "log.figures": False,
            "log.progress_bar": False, "parallel.replicas": 1,
            "parallel.runtime": "sim", "syncer.address": "127.0.0.1:1"}  # fmt: skip
    pairs = [(k, str(v)) for k, v in {**base, **overrides}.items()]
    return apply_overrides(load_preset(args.preset), pairs)


def values(cfg) -> tuple[int, int, int]:
    """``(float32, push, answer)``: the bytes of the values alone, from the model's shapes (the
    answer's: a change of the anchor through the codec, as the syncer encodes it)."""
    anchor = build(cfg, abstract=True).state.anchor
    leaves = [np.zeros(x.shape, np.float32) for x in jax.tree.leaves(anchor)]
    names = wire.leaf_names(anchor)
    codec = recipe.codec_of(cfg)
    whole = sum(x.nbytes for x in leaves)
    if recipe.dct_of(cfg) is not None:  # dct, sparseloco: the replica's message, float32 answers
        return whole, comms.push_payload(anchor, None, dct_config=recipe.dct_of(cfg)), whole
    if codec is None or codec.name == "none":
        return whole, whole, whole
    change = answers.following(answers.first(leaves, 0), leaves, names, codec).delta
    push = payload.push_bytes(payload.encode(names, leaves, codec))
    return whole, push, payload.push_bytes(change)


def measured(cfg, workdir: pathlib.Path) -> tuple[dict, float]:
    """The learner's last ``round`` event and its final evaluation loss (the syncer's
    address in ``cfg`` stands for the port it is given)."""
    import json

    syncer = make_syncer(cfg, workdir / "syncer")
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    try:
        learner = apply_overrides(cfg, [("syncer.address", f"127.0.0.1:{server.port}")])
        out = train(learner, workdir / "learner", show_progress=False)
    finally:
        server.stop()
        syncer.close()
    lines = (workdir / "learner" / "metrics.jsonl").read_text().splitlines()
    rounds = [e for e in map(json.loads, lines) if e["event"] == "round"]
    return rounds[-1], float(out["final_eval_loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--min_sizes", default="4096,1024,256,64,0")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--answers", choices=("on", "off", "both"), default="on")
    args = parser.parse_args()
    os.environ["DILOCO_SERVE_TOKEN"] = TOKEN
    which = {"on": (True,), "off": (False,), "both": (True, False)}[args.answers]
    runs = [("float32", {})] + [
        (f"{args.codec}, min_size {m}, answers {'on' if on else 'off'}",
         {"compress.codec": args.codec, "compress.min_size": m, "compress.answers": on})
        for m in map(int, args.min_sizes.split(",")) for on in which]  # fmt: skip
    print(
        "| run | push values | answer values | push on the wire | answer on the wire | "
        "final eval loss |\n|---|---|---|---|---|---|"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(runs):
            cfg = _config(args, overrides)
            whole, push, answer = values(cfg)
            if not cfg.compress.answers:
                answer = whole
            last, loss = measured(cfg, pathlib.Path(tmp) / str(i))
            print(f"| {name} | {push:,} ({push / whole:.3f}) | {answer:,} ({answer / whole:.3f}) "
                  f"| {last['bytes_sent']:,} | {last['bytes_received']:,} | {loss:.4f} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
