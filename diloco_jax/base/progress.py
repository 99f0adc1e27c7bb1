"""The progress bar every long piece of work shows on stderr (tqdm), and ``TQDM_DISABLE``."""

from __future__ import annotations

import os
import sys

import tqdm


def progress_disabled() -> bool:
    """Whether ``TQDM_DISABLE`` is set to something other than empty, 0, false, no or off
    (tqdm reads it only for bars that do not pass ``disable`` themselves)."""
    return os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no", "off")


def progress_bar(
    total: int, *, initial: int = 0, enabled: bool = True, unit: str = "step", desc: str = ""
) -> tqdm.tqdm:
    """The bar on stderr; off unless ``enabled`` and not :func:`progress_disabled`."""
    return tqdm.tqdm(
        total=total,
        desc=desc or None,
        initial=initial,
        unit=unit,
        dynamic_ncols=True,
        disable=not enabled or progress_disabled(),
        mininterval=0.5,
        file=sys.stderr,
    )
