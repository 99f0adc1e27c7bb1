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


def encode(fields: dict, arrays: dict[str, np.ndarray] | None = None) -> Iterator[bytes]:
    """The chunks of a message: ``fields`` (JSON-able) and named arrays."""
    arrays = arrays or {}
    blobs = [np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
             for a in arrays.values()]  # fmt: skip
    digest = hashlib.sha256()
    for b in blobs:
        digest.update(b)
    header = {"fields": fields,
              "leaves": [[n, list(a.shape), str(a.dtype)] for n, a in arrays.items()],
              "bytes": sum(len(b) for b in blobs), "sha256": digest.hexdigest()}  # fmt: skip
    yield json.dumps(header).encode()
    buffer = b"".join(blobs)
    for start in range(0, len(buffer), CHUNK):
        yield buffer[start : start + CHUNK]


def decode(chunks: Iterable[bytes], max_bytes: int) -> tuple[dict, dict[str, np.ndarray]]:
    """``(fields, arrays)`` of a message's chunks; refuses one whose data exceed ``max_bytes``
    (before reading them), is cut short or longer than it says, or fails its checksum."""
    it = iter(chunks)
    try:
        first = next(it)
    except StopIteration:
        raise WireError("an empty message (no header)") from None
    if len(first) > MAX_HEADER:
        raise WireError(f"a header of {len(first):,} bytes (at most {MAX_HEADER:,})")
    try:
        header = json.loads(first)
        size, leaves, fields = int(header["bytes"]), header["leaves"], header["fields"]
    except (ValueError, KeyError, TypeError) as e:
        raise WireError(f"an unreadable header: {e}") from None
    if size > max_bytes:
        raise WireError(f"a message of {size:,} bytes, more than the limit of {max_bytes:,}")
    parts, got = [], 0
    for chunk in it:
        got += len(chunk)
        if got > size:
            raise WireError(f"a message longer than the {size:,} bytes its header declares")
        parts.append(chunk)
    if got < size:
        raise WireError(f"a truncated message: {got:,} of {size:,} bytes")
    data = b"".join(parts)
    if hashlib.sha256(data).hexdigest() != header.get("sha256"):
        raise WireError("a message whose bytes do not match its checksum")
    arrays, offset = {}, 0
    for name, shape, dtype in leaves:
        dt = np.dtype(dtype).newbyteorder("<")
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        arrays[name] = np.frombuffer(data, dt, n // dt.itemsize, offset).reshape(shape)
        arrays[name] = arrays[name].astype(np.dtype(dtype), copy=False)
        offset += n
    if offset != size:
        raise WireError(f"leaves of {offset:,} bytes in a message of {size:,}")
    return fields, arrays


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
