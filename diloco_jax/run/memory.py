"""The memory plan of a run, per device, before any state exists: the bytes of each field of the
replica-stacked state, of the data, and of XLA's own buffers for one compiled call of the train
step (from the compiled program's memory analysis), against the device's memory.

The parts add up to XLA's figure for the call (arguments + outputs - donated + temporaries) plus
what stays on the devices between calls (evaluation data). Everything is per device; for the
simulator that is the one device holding all replicas.
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import jax

GIB = 2**30


class MemoryPlan(NamedTuple):
    """``parts``: (name, bytes per device) rows that add up to ``total``; ``limit``: the memory
    of one device (None: unknown) and ``limit_source`` where it came from."""

    parts: list[tuple[str, int]]
    total: int
    limit: int | None
    limit_source: str

    @property
    def fits(self) -> bool:
        return self.limit is None or self.total <= self.limit

    def summary(self) -> str:
        """One line: the total against the limit."""
        limit = f"{size(self.limit)} ({self.limit_source})" if self.limit else "an unknown limit"
        return f"memory per device: {size(self.total)} of {limit}; the whole plan: --dry_run"

    def table(self) -> str:
        """The plan as aligned text lines, one part per line."""
        width = max(len(name) for name, _ in self.parts + [("total", 0)])
        lines = [f"  {name:<{width}}  {size(n):>10}" for name, n in self.parts]
        share = f" ({100 * self.total / self.limit:.1f}% of it)" if self.limit else ""
        lines.append(f"  {'total':<{width}}  {size(self.total):>10}{share}")
        limit = size(self.limit) if self.limit else "unknown"
        return "\n".join([f"memory per device; a device has {limit} ({self.limit_source}):",
                          *lines])  # fmt: skip


def size(n: int) -> str:
    """``n`` bytes in words: ``1.50 GiB``."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def bytes_per_device(tree: Any) -> int:
    """Bytes of ``tree``'s leaves (arrays or ``ShapeDtypeStruct`` with shardings) that one
    device holds: its shard of each, a whole copy of a replicated one."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return total


def device_limit(device: jax.Device, override_gib: float = 0.0) -> tuple[int | None, str]:
    """One device's memory in bytes and where the figure came from: ``override_gib`` if set,
    the runtime's ``bytes_limit`` (GPU, TPU), else for a CPU device the machine's RAM shared by
    the process's CPU devices."""
    if override_gib:
        return int(override_gib * GIB), "parallel.device_memory_gib"
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"{device.platform} bytes_limit"
    if device.platform == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        count = len(jax.local_devices(backend="cpu"))
        return ram // count, f"RAM / {count} CPU device{'s' * (count > 1)}"
    return None, "unknown"


def plan(state: Any, data: dict[str, Any], compiled, limit: tuple[int | None, str], *,
         resident: dict[str, Any] | None = None) -> MemoryPlan:  # fmt: skip
    """The plan of a compiled call of the step whose arguments are ``state`` (a NamedTuple: a row
    per field) and ``data`` (a row per entry); ``limit`` from :func:`device_limit`.
    ``resident``: more rows, for what stays on the devices without being an argument of the call
    (evaluation data)."""
    parts = [(name, bytes_per_device(getattr(state, name))) for name in state._fields]
    parts += [(name, bytes_per_device(tree)) for name, tree in data.items()]
    m = compiled.memory_analysis()
    rest = m.argument_size_in_bytes - sum(n for _, n in parts)
    parts += [
        ("other arguments (step controls)", max(rest, 0)),
        ("outputs not in donated buffers", m.output_size_in_bytes - m.alias_size_in_bytes),
        ("XLA temporaries (activations, gradients)", m.temp_size_in_bytes),
    ]
    parts += [(name, bytes_per_device(tree)) for name, tree in (resident or {}).items()]
    parts = [(name, n) for name, n in parts if n > 0]
    return MemoryPlan(parts, sum(n for _, n in parts), *limit)
