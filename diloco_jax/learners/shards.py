"""Which syncer shard holds which leaf of the anchor (issue 62, ``syncer.shards`` S): each leaf
whole, in one shard, the shards balanced by bytes.

The assignment depends only on the model's description (each leaf's name, shape and dtype, as
:func:`diloco_jax.learners.wire.describe` gives it), never on the order the leaves come in, so
every learner and every shard computes the same one from its own copy of the model. It is the
longest-processing-time rule: leaves by size, largest first (ties by name), each to the shard
that holds the fewest bytes so far (ties: the lowest index). The busiest shard then holds at
most the mean share plus the largest leaf, and at most 4/3 of the best split's busiest.

Leaves stay whole: what a push without a codec carries is each leaf under its own name, and
the outer step reads a leaf alone (every outer optimizer built here works leaf by leaf), so a
shard of whole leaves merges and steps exactly what one syncer does for them. The price is
balance where one leaf outweighs a shard's share (an embedding table of a large vocabulary at
many shards): :func:`busiest` says how much.

With a codec this is not enough. A push's leaves of at least ``codec.min_size`` values travel
as one flat vector, encoded block by block (:func:`diloco_jax.learners.payload.encode`, the
core's exchange), and a block may hold the end of one leaf and the start of the next. A shard's
part must then be a range of whole blocks of that vector, not a set of leaves, for its bits to
equal one syncer's (a block's scale is its own); top-k codecs choose over the whole vector and
cannot be cut at all. :func:`plan` cuts so: each shard a range of whole blocks of that vector,
the ranges contiguous and as equal as whole blocks allow (each at least ``codec.min_size``
values, so that the shard's codec encodes it too), and the small leaves, whole, onto the
lightest shards; :func:`cut` takes a shard's part out of a push encoded whole, its blocks
bit for bit those of the whole push. A shard's anchor holds its range as one leaf
(:data:`FLAT`, in the large leaves' one dtype): :func:`split` cuts an anchor into each shard's
piece, :func:`gather` puts the pieces back. The outer step is elementwise and a compressed
answer blockwise, so a shard's step and its answer's blocks are one syncer's, value for value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from diloco_jax.learners import payload

FLAT = "blocks"  # the name of a shard's range of the large leaves' flat vector


def leaf_bytes(shape: Sequence[int], dtype: str) -> int:
    """The bytes of a leaf of ``shape`` and ``dtype`` (a numpy dtype's name)."""
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def assign(describe: Sequence[Sequence], shards: int) -> list[int]:
    """The shard of each leaf of ``describe`` (``[[name, shape, dtype], ...]``), in its order:
    balanced by bytes, the same for any order of the same leaves. Raises ValueError for
    ``shards`` < 1 or two leaves of one name (the name is what orders ties)."""
    if shards < 1:
        raise ValueError(f"syncer.shards must be at least 1, not {shards}")
    names = [str(name) for name, _, _ in describe]
    if len(set(names)) != len(names):
        raise ValueError("two leaves of one name: a shard assignment needs distinct names")
    sizes = {str(name): leaf_bytes(shape, dtype) for name, shape, dtype in describe}
    load = [0] * shards
    owner: dict[str, int] = {}
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        shard = min(range(shards), key=lambda s: (load[s], s))
        owner[name] = shard
        load[shard] += sizes[name]
    return [owner[name] for name in names]


def loads(describe: Sequence[Sequence], assignment: Sequence[int], shards: int) -> list[int]:
    """The bytes each of ``shards`` holds under ``assignment``."""
    held = [0] * shards
    for (_, shape, dtype), shard in zip(describe, assignment, strict=True):
        held[shard] += leaf_bytes(shape, dtype)
    return held


def busiest(describe: Sequence[Sequence], shards: int) -> float:
    """The busiest shard's bytes over the mean share (1.0: perfectly balanced)."""
    held = loads(describe, assign(describe, shards), shards)
    return max(held) * shards / max(sum(held), 1)


@dataclasses.dataclass(frozen=True)
class Part:
    """One shard's share of the anchor and of every push: whole ``leaves`` (indices into the
    model's description) and, with a blockwise codec, the blocks ``[first, end)`` of the flat
    vector of the large leaves, which ``values`` of that vector hold."""

    leaves: tuple[int, ...]
    blocks: tuple[int, int] = (0, 0)
    values: tuple[int, int] = (0, 0)

    @property
    def size(self) -> int:
        """How many values of the flat vector the shard holds."""
        return self.values[1] - self.values[0]


def plan(describe: Sequence[Sequence], shards: int, codec=None,
         fragments: Sequence[int] | None = None) -> list[Part]:  # fmt: skip
    """Each of ``shards``' :class:`Part` of a model described by ``describe`` whose pushes
    travel through ``codec`` (None or ``none``: whole leaves, :func:`assign`; a blockwise
    codec: block ranges and the small leaves, see the module's docstring). With streaming
    fragments (``fragments``: each leaf's, more than one), each fragment's leaves are assigned
    on their own, so that every shard holds leaves of every fragment (a round's push is one
    fragment's). Raises ValueError for a codec that chooses over the whole vector (``topk``,
    DCT momentum, SparseLoCo), for a codec with fragments, and for a fragment of fewer leaves
    than shards."""
    name = getattr(codec, "name", None)
    count = len(set(fragments)) if fragments is not None else 1
    if count > 1:
        assert fragments is not None
        if codec is not None and name != "none":
            raise ValueError(f"codec {name} with streaming fragments cannot be cut into syncer "
                             "shards yet")  # fmt: skip
        owner = [0] * len(describe)
        for f in sorted(set(fragments)):
            mine = [i for i, g in enumerate(fragments) if g == f]
            if len(mine) < shards:
                raise ValueError(f"streaming fragment {f} holds {len(mine)} leaves, fewer than "
                                 f"syncer.shards = {shards}: each shard holds leaves of every "
                                 "fragment")  # fmt: skip
            for i, k in zip(mine, assign([describe[i] for i in mine], shards), strict=True):
                owner[i] = k
        return [Part(tuple(i for i, s in enumerate(owner) if s == k)) for k in range(shards)]
    if codec is None or name == "none":
        owner = assign(describe, shards)
        return [Part(tuple(i for i, s in enumerate(owner) if s == k)) for k in range(shards)]
    if shards < 1:
        raise ValueError(f"syncer.shards must be at least 1, not {shards}")
    if name not in ("bf16", "int8", "fp8", "int4"):
        kind = name or type(codec).__name__
        raise ValueError(f"codec {kind} chooses what it sends over the whole vector: a push "
                         "through it cannot be cut into syncer shards")  # fmt: skip
    sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape, _ in describe]
    big = set(payload._big(sizes, codec))
    _flat_dtype(describe, codec)  # one, or refused
    total = sum(sizes[i] for i in big)
    blocks = -(-total // codec.block)
    # as equal as whole blocks allow, each non-empty range at least min_size values
    least = -(-max(codec.min_size, 1) // codec.block)
    per = max(-(-blocks // shards), least) if blocks else 0
    edges = [min(k * per, blocks) for k in range(shards)] + [blocks]
    held = [k for k in range(shards) if edges[k] < edges[k + 1]]
    if len(held) > 1 and total - edges[held[-1]] * codec.block < codec.min_size:
        edges[held[-1]] = blocks  # a short last range joins the one before it
    load = [4 * (min(edges[k + 1] * codec.block, total) - min(edges[k] * codec.block, total))
            for k in range(shards)]  # fmt: skip
    whole: list[list[int]] = [[] for _ in range(shards)]
    small = [i for i in range(len(describe)) if i not in big]
    for i in sorted(small, key=lambda i: (-sizes[i], str(describe[i][0]))):
        k = min(range(shards), key=lambda s: (load[s], s))
        whole[k].append(i)
        load[k] += leaf_bytes(describe[i][1], describe[i][2])
    return [Part(tuple(sorted(whole[k])), (edges[k], edges[k + 1]),
                 (min(edges[k] * codec.block, total), min(edges[k + 1] * codec.block, total)))
            for k in range(shards)]  # fmt: skip


def cut(
    message: dict[str, np.ndarray], describe: Sequence[Sequence], part: Part, codec
) -> dict[str, np.ndarray]:
    """Shard ``part``'s message out of ``message``, a push of the whole model (described by
    ``describe``) encoded through ``codec`` (:func:`~diloco_jax.learners.payload.encode`): its
    whole leaves by name, and the rows of its blocks of every encoded array (a block per row),
    under the names they have there. Decoded against :func:`described` it gives the shard's
    leaves and its range of the flat vector, bit for bit those of the whole push."""
    out = {
        str(describe[i][0]): message[str(describe[i][0])]
        for i in part.leaves
        if str(describe[i][0]) in message
    }  # (a streaming round's push: its fragment's)
    if part.size:
        first, end = part.blocks
        for name in payload._names(codec):
            out[name] = message[name][first:end]
    return out


def described(describe: Sequence[Sequence], part: Part, codec=None) -> list[list]:
    """The ``[name, shape, dtype]`` of what shard ``part`` holds: its whole leaves, then its
    range of the flat vector (named :data:`FLAT`, in the large leaves' dtype), if any."""
    mine = [[str(describe[i][0]), list(describe[i][1]), str(describe[i][2])] for i in part.leaves]
    if not part.size:
        return mine
    return [*mine, [FLAT, [part.size], _flat_dtype(describe, codec)]]


def _large(describe: Sequence[Sequence], codec) -> list[int]:
    """The leaves whose values travel in the codec's flat vector, in its order."""
    return payload._big([int(np.prod(s, dtype=np.int64)) for _, s, _ in describe], codec)


def _flat_dtype(describe: Sequence[Sequence], codec) -> str:
    """The one dtype of the large leaves (an anchor's range of them is held in it, so that a
    shard's outer step is a single syncer's, value for value). Raises ValueError for several."""
    dtypes = sorted({str(describe[i][2]) for i in _large(describe, codec)})
    if len(dtypes) > 1:
        raise ValueError(f"the large leaves are of several dtypes ({', '.join(dtypes)}): "
                         "syncer shards hold ranges of them in one")  # fmt: skip
    return dtypes[0] if dtypes else "float32"


def split(named: dict[str, np.ndarray], describe: Sequence[Sequence], parts: Sequence[Part],
          codec=None) -> list[dict[str, np.ndarray]]:  # fmt: skip
    """Each shard's piece of the whole-model arrays ``named`` (an anchor, by name; described by
    ``describe``): its whole leaves by name and its range of the large leaves' flat vector
    (:data:`FLAT`), as :func:`described` says. :func:`gather` is its inverse."""
    big = _large(describe, codec) if any(p.size for p in parts) else []
    flat = None
    if big:
        dtype = _flat_dtype(describe, codec)
        flat = np.concatenate([np.asarray(named[str(describe[i][0])]).reshape(-1) for i in big])
        flat = flat.astype(dtype, copy=False)
    pieces = []
    for part in parts:
        piece = {str(describe[i][0]): named[str(describe[i][0])] for i in part.leaves}
        if part.size:
            assert flat is not None
            piece[FLAT] = flat[part.values[0] : part.values[1]]
        pieces.append(piece)
    return pieces


def gather(pieces: Sequence[dict[str, np.ndarray]], describe: Sequence[Sequence],
           parts: Sequence[Part], codec=None) -> dict[str, np.ndarray]:  # fmt: skip
    """The whole model's arrays by name, in ``describe``'s order, from every shard's piece
    (:func:`split`'s inverse: the anchor a learner rebuilds from its shards' answers). Raises
    ValueError for a piece without a leaf or a range of another size than its part's."""
    out: dict[str, np.ndarray] = {}
    for k, (piece, part) in enumerate(zip(pieces, parts, strict=True)):
        for i in part.leaves:
            name = str(describe[i][0])
            if name not in piece:
                raise ValueError(f"syncer shard {k}'s answer lacks {name}")
            out[name] = piece[name]
        got = np.shape(piece[FLAT]) if FLAT in piece else None
        if part.size and got != (part.size,):
            raise ValueError(f"syncer shard {k}'s answer holds {got} values of the large "
                             f"leaves, not ({part.size},)")  # fmt: skip
    big = _large(describe, codec) if any(p.size for p in parts) else []
    if big:
        flat = np.concatenate([piece[FLAT] for piece, p in zip(pieces, parts, strict=True)
                               if p.size])  # fmt: skip
        at = 0
        for i in big:
            name, shape, dtype = describe[i]
            size = int(np.prod(shape, dtype=np.int64))
            out[str(name)] = flat[at : at + size].reshape(shape).astype(dtype, copy=False)
            at += size
    return {str(n): out[str(n)] for n, _, _ in describe}
