"""The sync plan: what happens at inner step ``t``, asked by the device step and by the host.

DiLoCo syncs every ``sync_every`` inner steps. Streaming DiLoCo (Douillard et al., 2025, arXiv
2501.18512) splits the parameters into ``F`` fragments: fragment ``f`` starts its sync every
``sync_every`` steps at offset ``f * sync_every / F``, so one fragment starts every
``period = sync_every / F`` steps (fragment ``(t / period) mod F`` at step ``t``), and its merged
value lands ``overlap`` steps later while training goes on (``overlap = 0``: at once). ``F = 1``,
``overlap = 0`` is the paper's DiLoCo.

Steps count from 1: "after inner step ``t``". Every method works on Python ints (the host: logs,
byte accounting, the network clock, fault masks, checkpoint boundaries, the anchor check) and on
traced int32 scalars (the device step), so both read one schedule.
"""

from __future__ import annotations

from typing import NamedTuple

from diloco_jax.algorithm.options import require


class SyncPlan(NamedTuple):
    """The sync plan: at which inner steps a fragment's sync starts and when its merged value
    lands. Its methods take Python ints (the host) and traced int32 scalars (the device step)
    alike.

    Args:
      sync_every: inner steps per round (of each fragment).
      fragments: Streaming DiLoCo's fragments (F; 1: plain DiLoCo).
      overlap: inner steps between a fragment's sync start and its landing (tau; 0: at once).
    """

    sync_every: int
    fragments: int = 1
    overlap: int = 0

    def validate(self) -> None:
        """Raises :class:`~diloco_jax.algorithm.options.OptionError` for a plan that cannot
        run."""
        require(self.sync_every >= 1, "sync_every", self.sync_every, "must be an integer >= 1")
        require(self.fragments >= 1, "streaming.fragments", self.fragments,
                "must be an integer >= 1")  # fmt: skip
        require(self.sync_every % self.fragments == 0, "streaming.fragments", self.fragments,
                f"must divide {{sync_every}} = {self.sync_every}")  # fmt: skip
        require(self.overlap >= 0, "streaming.overlap", self.overlap, "must be >= 0")
        require(self.overlap < self.period, "streaming.overlap", self.overlap,
                f"must be < {{sync_every}} / {{streaming.fragments}} = {self.period}")  # fmt: skip

    @property
    def period(self) -> int:
        """Inner steps between two fragments' sync starts."""
        return self.sync_every // self.fragments

    @property
    def streaming(self) -> bool:
        return self.fragments > 1 or self.overlap > 0

    def starting(self, step):
        """``(whether a sync starts after inner step `step`, which fragment)``."""
        return step % self.period == 0, (step // self.period) % self.fragments

    def landing(self, step):
        """``(whether a fragment lands after inner step `step`, which)``: the one whose sync
        started ``overlap`` steps earlier."""
        started, fragment = self.starting(step - self.overlap)
        return started & (step > self.overlap), fragment

    def sync_steps(self, first: int, last: int) -> list[tuple[int, int]]:
        """``(step, fragment)`` of every sync start after steps ``first .. last`` (inclusive)."""
        start = max(self.period, -(-first // self.period) * self.period)
        return [(s, self.starting(s)[1]) for s in range(start, last + 1, self.period)]

    def round_fragment(self, rnd: int) -> int:
        """The fragment of sync ``rnd`` (counted from 0) of a run started at step 0: the one
        starting after step ``(rnd + 1) * period`` (a syncer's round of streaming learners)."""
        return self.starting((rnd + 1) * self.period)[1]

    def rounds(self, step: int) -> int:
        """Outer steps completed after ``step`` inner steps (whole rounds of ``sync_every``)."""
        return step // self.sync_every

    def boundary(self, step: int) -> bool:
        """Whether ``step`` ends a round (every fragment has started one sync since the last
        boundary): where checkpoints are taken."""
        return step % self.sync_every == 0
