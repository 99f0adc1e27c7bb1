"""A learner's mean pseudo-gradient as it travels to the syncer: encoded with the run's codec
(``compress.codec``), by the core's own encoder and decoder (:mod:`diloco_jax.algorithm.compress`).

The message's arrays, by name:

* codec ``none``: every leaf under its own name, as it is (float32);
* a blockwise codec (``bf16``, ``int8``, ``fp8``, ``int4``): leaves of fewer than
  ``codec.min_size`` values under their own names in float32 (as the core's exchange keeps
  them); the others concatenated in leaf order (float32), zero-padded to whole blocks of
  ``codec.block`` values and encoded: ``codec/0`` (the codes) and, but for ``bf16``,
  ``codec/1`` (each block's float32 scale);
* ``topk``: the small leaves as above; of the concatenated rest, the ``k`` values of largest
  magnitude (``codec/values``, float32) and their positions (``codec/positions``, int32), with
  ``k = replicas x topk_count``: the mean of a learner's ``replicas`` replicas, each of which
  sent its own top-k, has at most that many nonzero values, so none is dropped.

The learner's replicas exchange among themselves as in any run (with the codec and its error
feedback, kept per replica in the state): the mean they agree on is already on the codec's grid
(the last step of the compressed sum encodes it), and the learner's message encodes it again
(for one replica or a power-of-two count, without changing a value: the block scales divide
exactly). The syncer decodes every push to float32 and merges them
(:func:`diloco_jax.learners.rounds.merge`). What a push costs is :func:`push_bytes`, the
simulator's ``parameter_server`` payload (:func:`diloco_jax.simulated.comms.push_payload`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from diloco_jax.algorithm import compress
from diloco_jax.algorithm.compress import Codec
from diloco_jax.learners.wire import WireError

PREFIX = "codec/"


def _big(sizes: list[int], codec: Codec | None) -> list[int]:
    if codec is None or codec.name == "none":
        return []
    return [i for i, s in enumerate(sizes) if s >= codec.min_size]


@functools.partial(jax.jit, static_argnames=("codec", "k"))
def _encode(flat_P: jax.Array, codec: Codec, k: int) -> tuple[jax.Array, ...]:
    if codec.name == "topk":
        _, idx_K = lax.top_k(jnp.abs(flat_P), k)
        return flat_P[idx_K], idx_K.astype(jnp.int32)
    padded = compress.padded_size(flat_P.shape[0], 1, codec.block)  # whole blocks
    x_NxB = jnp.pad(flat_P, (0, padded - flat_P.shape[0])).reshape(-1, codec.block)
    return compress.encode(x_NxB, codec.name)


@functools.partial(jax.jit, static_argnames=("codec", "size"))
def _decode(arrays: tuple[jax.Array, ...], codec: Codec, size: int) -> jax.Array:
    if codec.name == "topk":
        values_K, idx_K = arrays
        # distinct positions (:func:`_arrays` checks): no order of addition to fix
        return jnp.zeros((size,), jnp.float32).at[idx_K].add(values_K)
    return compress.decode(arrays, codec.name).reshape(-1)[:size]


def _names(codec: Codec) -> tuple[str, ...]:
    if codec.name == "topk":
        return (PREFIX + "values", PREFIX + "positions")
    return (PREFIX + "0",) if codec.name == "bf16" else (PREFIX + "0", PREFIX + "1")


def encode(names: list[str], leaves: list, codec: Codec | None,
           replicas: int = 1) -> dict[str, np.ndarray]:  # fmt: skip
    """The message of a learner's mean pseudo-gradient (``leaves``, named ``names``) from its
    ``replicas`` replicas (see the module's docstring)."""
    leaves = [np.asarray(x) for x in leaves]
    big = _big([x.size for x in leaves], codec)
    out = {n: (x.astype(np.float32) if big else x)
           for i, (n, x) in enumerate(zip(names, leaves, strict=True)) if i not in big}  # fmt: skip
    if not big:
        return out
    assert codec is not None
    flat = np.concatenate([leaves[i].reshape(-1).astype(np.float32) for i in big])
    k = min(flat.size, replicas * compress.topk_count(flat.size, codec.topk_fraction))
    arrays = _encode(jnp.asarray(flat), codec, k)
    out.update(zip(_names(codec), (np.asarray(a) for a in arrays), strict=True))
    return out


def _float_dtypes(param_dtype: str) -> tuple[np.dtype, ...]:
    """The dtypes a leaf of the push may have: float32 (the exchange's), or the parameter's own
    float dtype."""
    own = np.dtype(param_dtype)
    return (np.dtype(np.float32), own) if np.issubdtype(own, np.floating) else (
        np.dtype(np.float32),)  # fmt: skip


def check_leaves(described: list[list], leaves: list[list], codec: Codec | None) -> None:
    """Checks a push's arrays as its header declares them (``leaves``: ``[[name, shape, dtype],
    ...]``) against what a push of the anchor ``described`` with ``codec`` holds: every name,
    shape and dtype, nothing more. Raises :class:`WireError` naming the first difference, before
    any of the push's data is read."""
    got = {}
    for name, shape, dtype in leaves:
        if name in got:
            raise WireError(f"the push sends {name} twice")
        try:
            got[name] = (list(shape), np.dtype(dtype))
        except TypeError:
            raise WireError(f"the push's {name} has an unknown dtype {dtype!r}") from None
    sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape, _ in described]
    big = _big(sizes, codec)
    wanted = set()
    for i, (name, shape, dtype) in enumerate(described):
        if i in big:
            continue
        wanted.add(name)
        if name not in got or got[name][0] != list(shape):
            raise WireError(f"the push lacks {name} {list(shape)} or has another shape")
        if got[name][1] not in _float_dtypes(dtype):
            allowed = " or ".join(dict.fromkeys(str(d) for d in _float_dtypes(dtype)))
            raise WireError(f"the push's {name} is {got[name][1]}, expected {allowed}")
    if big:
        assert codec is not None
        size = sum(sizes[i] for i in big)
        _check_codec({n: got[n] for n in _names(codec) if n in got}, codec, size)
        wanted |= set(_names(codec))
    extra = sorted(set(got) - wanted)
    if extra:
        raise WireError(f"the push has {extra[0]}, which the model does not")


def decode(described: list[list], message: dict[str, np.ndarray],
           codec: Codec | None) -> list[np.ndarray]:  # fmt: skip
    """The float32 leaves (in the order of ``described``, the anchor's ``[name, shape, dtype]``)
    of a :func:`encode` message; raises :class:`WireError` naming the first array missing or of
    another shape or dtype (:func:`check_leaves`), or a position out of range."""
    check_leaves(described, [[n, list(a.shape), str(a.dtype)] for n, a in message.items()], codec)
    sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape, _ in described]
    big = _big(sizes, codec)
    out: list = [None] * len(described)
    for i, (name, _, _) in enumerate(described):
        if i not in big:
            out[i] = np.asarray(message[name], np.float32)
    if big:
        assert codec is not None
        size = sum(sizes[i] for i in big)
        flat = np.asarray(_decode(_arrays(message, codec, size), codec, size))
        start = 0
        for i in big:
            out[i] = flat[start : start + sizes[i]].reshape(described[i][1])
            start += sizes[i]
    return out


def _check_codec(got: dict[str, tuple[list, np.dtype]], codec: Codec, size: int) -> None:
    """The codec's arrays (``{name: (shape, dtype)}``) against what ``size`` values encode to."""
    like = jax.eval_shape(_encode, jax.ShapeDtypeStruct((size,), jnp.float32), codec,
                          min(size, compress.topk_count(size, codec.topk_fraction)))  # fmt: skip
    for name, want in zip(_names(codec), like, strict=True):
        if name not in got or got[name][1] != want.dtype:
            raise WireError(f"the push lacks {name} ({want.dtype}) for codec {codec.name}")
        shape = got[name][0]
        if codec.name == "topk":  # k: one replica's count or a multiple of it, at most size
            n = shape[0] if len(shape) == 1 else -1
            ok = 0 < n <= size and (n % want.shape[0] == 0 or n == size)
        else:
            ok = tuple(shape) == want.shape
        if not ok:
            raise WireError(f"{name} is {list(shape)}, expected {list(want.shape)} "
                            f"for {size:,} values in codec {codec.name}")  # fmt: skip
    if codec.name == "topk" and got[_names(codec)[0]][0] != got[_names(codec)[1]][0]:
        raise WireError(f"{got[_names(codec)[0]][0]} top-k values with "
                        f"{got[_names(codec)[1]][0]} positions")  # fmt: skip


def _arrays(message: dict[str, np.ndarray], codec: Codec, size: int) -> tuple[np.ndarray, ...]:
    """The codec's arrays of ``message`` (checked by :func:`check_leaves`); top-k positions
    checked too: in range, none twice."""
    got = tuple(message[name] for name in _names(codec))
    if codec.name == "topk":
        positions = got[1]
        if positions.min() < 0 or positions.max() >= size:
            raise WireError(f"a top-k position outside [0, {size:,})")
        if np.unique(positions).size != positions.size:
            raise WireError("a top-k position sent twice")
    return got


def push_bytes(message: dict[str, np.ndarray]) -> int:
    """The bytes of a message's values (the framing aside)."""
    return sum(a.nbytes for a in message.values())
