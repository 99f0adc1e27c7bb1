"""Why a stale outer step needs less momentum: a linear model of a round, per direction.

    python scripts/overlap_model.py [--learning_rate 0.7] [--replicas 2]

Along one direction of the loss, a round of inner steps from a start ``s`` ends at
``s - c (s - optimum)``: ``c`` in (0, 1] is how far the inner steps get in a round (near 1 where
the loss is steep and they converge, near 0 where it is flat). The pseudo-gradient is then
``c e``, ``e`` the anchor's distance to the optimum. The outer step is Nesterov SGD
(``v' = mu v + g``, ``e' = e - lr (g + mu v')``) fed

* ``sync``: this round's pseudo-gradient, ``g_t = c e_t``;
* ``delayed``: the last round's, ``g_t = c e_{t-1}`` (the replicas restart from the anchor, so
  this round's work reaches it a round late);
* ``eager``: the last round's with this replica's fresh share in place of its stale one
  (``R`` replicas alike): ``g_t = c e_{t-1} + c (e_t - e_{t-1}) / R``.

Each is a linear recurrence; the spectral radius of its matrix is the factor by which the
distance shrinks (< 1) or grows (> 1) per round, in the slowest mode. Prints, for each mode and
momentum, the worst radius over ``c`` in [0.02, 1] and the radius at a steep (``c = 1``) and a
flat (``c = 0.02``) direction. No training: arithmetic on 3 x 3 matrices.
"""

from __future__ import annotations

import argparse

import numpy as np

MODES = ("sync", "delayed", "eager")


def radius(mode: str, c: float, lr: float, momentum: float, replicas: int) -> float:
    """The per-round factor of ``mode`` along a direction where a round gets ``c`` of the way."""

    def step(x: np.ndarray) -> np.ndarray:
        e, v, before = x  # the anchor's distance, the momentum, last round's pseudo-gradient
        now = c * e
        g = {"sync": now, "delayed": before, "eager": before + (now - before) / replicas}[mode]
        v = momentum * v + g
        return np.array([e - lr * (g + momentum * v), v, now])

    matrix = np.stack([step(b) for b in np.eye(3)], axis=1)
    return float(np.abs(np.linalg.eigvals(matrix)).max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--learning_rate", type=float, default=0.7)
    p.add_argument("--replicas", type=int, default=2)
    args = p.parse_args()
    cs = np.linspace(0.02, 1.0, 99)
    print(f"outer Nesterov SGD, lr {args.learning_rate}, {args.replicas} replicas: the factor "
          "by which a round scales the anchor's distance (> 1: it grows)\n")  # fmt: skip
    print("| mode | momentum | worst over c | steep (c = 1) | flat (c = 0.02) |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        for momentum in (0.9, 0.7, 0.5, 0.3, 0.0):
            r = [radius(mode, c, args.learning_rate, momentum, args.replicas) for c in cs]
            print(f"| {mode} | {momentum} | {max(r):.3f} | {r[-1]:.3f} | {r[0]:.3f} |")


if __name__ == "__main__":
    main()
