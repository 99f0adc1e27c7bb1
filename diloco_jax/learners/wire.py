"""What travels between learners and the syncer: a JSON header and a pytree's arrays, cut into
chunks of at most :data:`CHUNK` bytes.

A message is the chunks ``[header, data, data, ...]``. The header (UTF-8 JSON) holds the
message's fields, each leaf's name (its path in the tree), shape and dtype, the data's byte
count and its SHA-256. The data are the leaves' bytes, little-endian, one after another in
the header's order. Leaves are matched by name, never by position, so a reordered tree cannot
load shifted. A message larger than its receiver's limit, cut short, or whose bytes do not
match the checksum is refused with a :class:`WireError` naming what is wrong.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

CHUNK = 1 << 20  # bytes of one gRPC message: far below gRPC's 4 MiB default limit
MAX_HEADER = 16 << 20


class WireError(ValueError):
    """A message that cannot be read: too large, cut short, damaged or not what was expected."""


def leaf_names(tree: Any) -> list[str]:
    """Each leaf's path in ``tree`` (``['blocks'][0]['kernel']``), in the tree's leaf order."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def describe(tree: Any) -> list[list]:
    """``[[name, shape, dtype], ...]`` of the leaves: what two sides compare before training."""
    leaves = jax.tree.leaves(tree)
    return [[n, list(np.shape(x)), str(np.dtype(x.dtype))]
            for n, x in zip(leaf_names(tree), leaves, strict=True)]  # fmt: skip


def first_mismatch(ours: list[list], theirs: list[list]) -> str | None:
    """A one-line description of the first leaf where two :func:`describe` lists differ, or
    None when they are the same."""
    mine = {n: (s, d) for n, s, d in ours}
    other = {n: (s, d) for n, s, d in theirs}
    for name, shape, dtype in ours:
        if name not in other:
            return f"parameter {name} is missing (expected shape {shape}, {dtype})"
        if other[name] != (shape, dtype):
            got = other[name]
            return f"parameter {name} is {got[0]} {got[1]}, expected {shape} {dtype}"
    for name, shape, dtype in theirs:
        if name not in mine:
            return f"parameter {name} ({shape}, {dtype}) is not in the model"
    return None


def bytes_of(a: np.ndarray) -> np.ndarray:
    """``a``'s little-endian bytes as a flat uint8 view (a copy only where it is not contiguous
    or not little-endian already)."""
    a = np.ascontiguousarray(a)
    return a.astype(a.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8)


def encode(fields: dict, arrays: dict[str, np.ndarray] | None = None,
           sha256: str | None = None) -> Iterator[bytes]:  # fmt: skip
    """The chunks of a message: ``fields`` (JSON-able) and named arrays (``sha256``: their
    checksum where it is known already: a syncer answers every learner with one anchor). The
    arrays are read in place, chunk by chunk: no copy of the whole message is made."""
    arrays = arrays or {}
    views = [bytes_of(np.asarray(a)) for a in arrays.values()]
    digest = hashlib.sha256()
    for v in views if sha256 is None else ():
        digest.update(v.data)
    header = {"fields": fields,
              "leaves": [[n, list(a.shape), str(a.dtype)] for n, a in arrays.items()],
              "bytes": sum(v.size for v in views),
              "sha256": sha256 or digest.hexdigest()}  # fmt: skip
    yield json.dumps(header).encode()
    pending: list[np.ndarray] = []  # parts of the next chunk
    filled = 0
    for v in views:
        start = 0
        while start < v.size:
            take = min(CHUNK - filled, v.size - start)
            pending.append(v[start : start + take])
            filled, start = filled + take, start + take
            if filled == CHUNK:
                yield b"".join(p.tobytes() for p in pending) if len(pending) > 1 else (
                    pending[0].tobytes())  # fmt: skip
                pending, filled = [], 0
    if pending:
        yield b"".join(p.tobytes() for p in pending)


class Header:
    """A message's header, read and checked before any of its data: ``fields``, ``leaves``
    (``[[name, shape, dtype], ...]`` in data order), ``size`` (data bytes) and ``sha256``."""

    def __init__(self, first: bytes, max_bytes: int):
        if len(first) > MAX_HEADER:
            raise WireError(f"a header of {len(first):,} bytes (at most {MAX_HEADER:,})")
        try:
            header = json.loads(first)
            self.size, self.leaves = int(header["bytes"]), header["leaves"]
            self.fields, self.sha256 = header["fields"], str(header.get("sha256", ""))
            declared = sum(_nbytes(shape, dtype) for _, shape, dtype in self.leaves)
        except (ValueError, KeyError, TypeError) as e:
            raise WireError(f"an unreadable header: {e}") from None
        if not isinstance(self.fields, dict):
            raise WireError("an unreadable header: its fields are not an object")
        if self.size > max_bytes:
            raise WireError(f"a message of {self.size:,} bytes, more than the limit of "
                            f"{max_bytes:,}")  # fmt: skip
        if declared != self.size:
            raise WireError(f"leaves of {declared:,} bytes in a message of {self.size:,}")


def _nbytes(shape, dtype) -> int:
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"a shape of {shape}")
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def read_header(it: Iterator[bytes], max_bytes: int) -> Header:
    """The header of the message whose chunks ``it`` yields (its first chunk)."""
    try:
        first = next(it)
    except StopIteration:
        raise WireError("an empty message (no header)") from None
    return Header(first, max_bytes)


def read_data(it: Iterator[bytes], header: Header, write) -> None:
    """Passes the data chunks of ``it`` to ``write`` as they come, checking that they add up to
    the header's size and checksum; raises :class:`WireError` (whatever was written then is
    not the message)."""
    digest, got = hashlib.sha256(), 0
    for chunk in it:
        got += len(chunk)
        if got > header.size:
            raise WireError(f"a message longer than the {header.size:,} bytes its header "
                            "declares")  # fmt: skip
        digest.update(chunk)
        write(chunk)
    if got < header.size:
        raise WireError(f"a truncated message: {got:,} of {header.size:,} bytes")
    if digest.hexdigest() != header.sha256:
        raise WireError("a message whose bytes do not match its checksum")


def arrays_in(data, leaves: list) -> dict[str, np.ndarray]:
    """The named arrays laid out one after another in ``data`` (a buffer: bytes, bytearray,
    a memory map), as the header's ``leaves`` say; views, not copies, where the byte order
    allows."""
    arrays, offset = {}, 0
    for name, shape, dtype in leaves:
        dt = np.dtype(dtype).newbyteorder("<")
        n = _nbytes(shape, dtype)
        arrays[name] = np.frombuffer(data, dt, n // dt.itemsize, offset).reshape(shape)
        arrays[name] = arrays[name].astype(np.dtype(dtype), copy=False)
        offset += n
    return arrays


def decode(chunks: Iterable[bytes], max_bytes: int) -> tuple[dict, dict[str, np.ndarray]]:
    """``(fields, arrays)`` of a message's chunks; refuses one whose data exceed ``max_bytes``
    (before reading them), is cut short or longer than it says, or fails its checksum."""
    it = iter(chunks)
    header = read_header(it, max_bytes)
    data, at = bytearray(header.size), 0

    def write(chunk: bytes) -> None:
        nonlocal at
        data[at : at + len(chunk)] = chunk
        at += len(chunk)

    read_data(it, header, write)
    return header.fields, arrays_in(data, header.leaves)


def named(tree: Any) -> dict[str, np.ndarray]:
    """The leaves of ``tree`` as host arrays by name (:func:`leaf_names`)."""
    return dict(zip(leaf_names(tree), (np.asarray(x) for x in jax.tree.leaves(tree)), strict=True))


def unnamed(like: Any, arrays: dict[str, np.ndarray]) -> Any:
    """``arrays`` (by name) put into the structure of ``like``; raises :class:`WireError`
    naming the first leaf missing or of another shape or dtype."""
    problem = first_mismatch(describe(like), [[n, list(a.shape), str(a.dtype)]
                                              for n, a in arrays.items()])  # fmt: skip
    if problem:
        raise WireError(problem)
    return jax.tree.unflatten(jax.tree.structure(like), [arrays[n] for n in leaf_names(like)])
