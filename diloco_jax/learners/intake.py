"""Pushes as they reach the syncer over the network: checked against the anchor before their
bytes are read, written to a file as they stream in, read back leaf by leaf when their round
is merged. The syncer's memory so stays about the model's size however many learners push at
once (the merge itself is :func:`diloco_jax.learners.rounds.merge`, in learner order).

A push's file holds its data as it came (:mod:`.wire`'s layout). Uncompressed, that is already
the pseudo-gradient's leaves; with a codec (:mod:`.payload`) the push is decoded once it is
whole, one push at a time (:data:`DECODING`), and the float32 leaves written to a second file.
"""

from __future__ import annotations

import dataclasses
import pathlib
import threading

import numpy as np

from diloco_jax.learners import payload, wire

BLOCK = 1 << 20  # values read at once to check a push
DECODING = threading.Semaphore(1)  # codec pushes decoded at once: each holds the model in memory


@dataclasses.dataclass
class Spilled:
    """A pseudo-gradient in a file: each anchor leaf's ``(offset, shape, dtype)`` there."""

    path: pathlib.Path
    layout: list[tuple[int, list, str]]

    def leaves(self) -> list[np.ndarray]:
        """The float32 leaves, read now (fresh arrays: a caller may write into them)."""
        return [self.leaf(i) for i in range(len(self.layout))]

    def leaf(self, i: int) -> np.ndarray:
        offset, shape, dtype = self.layout[i]
        count = int(np.prod(shape, dtype=np.int64))
        x = np.fromfile(self.path, np.dtype(dtype).newbyteorder("<"), count, offset=offset)
        return x.astype(np.float32, copy=False).reshape(shape)

    def finite(self) -> bool:
        """Whether every value is finite, read in blocks of :data:`BLOCK` values (pushes of
        many learners are checked at once: each holds a block, not a leaf)."""
        for offset, shape, dtype in self.layout:
            dt = np.dtype(dtype).newbyteorder("<")
            count = int(np.prod(shape, dtype=np.int64))
            for start in range(0, count, BLOCK):
                x = np.fromfile(self.path, dt, min(BLOCK, count - start),
                                offset=offset + start * dt.itemsize)  # fmt: skip
                if not np.isfinite(x).all():
                    return False
        return True

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def receive(it, header: wire.Header, path: pathlib.Path) -> None:
    """Writes the data chunks of ``it`` (after ``header``) to ``path`` as they come; raises
    :class:`wire.WireError` (and removes the file) for a message cut short, too long or
    damaged."""
    try:
        with path.open("wb") as f:
            wire.read_data(it, header, f.write)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def spilled(described: list[list], header: wire.Header, path: pathlib.Path,
            codec) -> Spilled:  # fmt: skip
    """The push received at ``path`` as :class:`Spilled` leaves in the anchor's order
    (``described``): uncompressed, where they lie in the file; with a codec, decoded to a second
    file ``path.f32`` (and ``path`` removed). Raises :class:`wire.WireError` for a push that
    does not decode (a top-k position out of range or sent twice)."""
    offsets, at = {}, 0
    for name, shape, dtype in header.leaves:
        offsets[name] = (at, shape, dtype)
        at += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if all(name in offsets for name, _, _ in described):  # no codec: the file is the leaves
        return Spilled(path, [offsets[name] for name, _, _ in described])
    out = path.with_suffix(".f32")
    with DECODING:
        try:
            data = np.memmap(path, np.uint8, "r") if header.size else b""
            leaves = payload.decode(described, wire.arrays_in(data, header.leaves), codec)
            del data
            layout, at = [], 0
            with out.open("wb") as f:
                for x in leaves:
                    x = np.ascontiguousarray(x, np.float32)
                    x.astype("<f4", copy=False).tofile(f)
                    layout.append((at, list(x.shape), "float32"))
                    at += x.nbytes
        finally:
            path.unlink(missing_ok=True)
    return Spilled(out, layout)
