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
  sent its own top-k, has at most that many nonzero values, so none is dropped;
* ``dct`` and ``sparseloco`` (an exchange with its own per-replica state, DCT momentum:
  :func:`diloco_jax.algorithm.exchange.dct_momentum`): the small leaves as above, the mean of
  the learner's replicas; of the rest, every replica's own message as the core's sync
  all-gathers it (:meth:`~diloco_jax.algorithm.Diloco.messages`), stacked ``[R, ...]`` in
  replica order: ``dct/values`` (``[R, N, K]`` float32 coefficients, or SparseLoCo's 2-bit
  codes, four per uint8), ``dct/positions`` (``[R, N, K]``, each chunk's top-k), ``dct/scales``
  (``[R, N]`` float32, 2-bit codes only) and ``dct/weights`` (``[R]`` float32, each replica's
  weight, 0: left out). The syncer decodes them with the core's own decoder
  (:func:`~diloco_jax.algorithm.exchange.dct_mean`: the coefficients summed in replica order,
  the inverse DCT, divided by the weights' sum), so a learner's decoded push is the mean its
  replicas' own sync would take; the accumulator stays with each replica.

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

from diloco_jax.algorithm import compress, dct, exchange
from diloco_jax.algorithm.compress import Codec
from diloco_jax.algorithm.dct import DctConfig
from diloco_jax.learners.wire import WireError

PREFIX = "codec/"
DCT = "dct/"  # DCT momentum's and SparseLoCo's messages


def _big(sizes: list[int], codec: Codec | DctConfig | None) -> list[int]:
    if codec is None or getattr(codec, "name", None) == "none":
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


def encode(names: list[str], leaves, codec: Codec | DctConfig | None,
           replicas: int = 1) -> dict[str, np.ndarray]:  # fmt: skip
    """The message of a learner's mean pseudo-gradient (``leaves``, named ``names``) from its
    ``replicas`` replicas (see the module's docstring). DCT momentum: ``leaves`` is what
    :meth:`~diloco_jax.algorithm.Diloco.messages` gives, ``(small, messages_R, w_R)``."""
    if isinstance(codec, DctConfig):
        return _encode_messages(names, leaves, codec)
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


def _encode_messages(names: list[str], sent, config: DctConfig) -> dict[str, np.ndarray]:
    small, messages_R, w_R = sent
    big = messages_R is not None
    out = {n: (np.asarray(x, np.float32) if big else np.asarray(x))
           for n, x in zip(names, small, strict=True) if x is not None}  # fmt: skip
    if big:
        values, positions, scales = messages_R
        arrays = (values, positions, *([scales] if config.bits != 32 else []), w_R)
        out.update(zip(_dct_names(config), (np.asarray(a) for a in arrays), strict=True))
    return out


def _dct_names(config: DctConfig) -> tuple[str, ...]:
    scales = (DCT + "scales",) if config.bits != 32 else ()  # float32 values need none
    return (DCT + "values", DCT + "positions", *scales, DCT + "weights")


def _float_dtypes(param_dtype: str) -> tuple[np.dtype, ...]:
    """The dtypes a leaf of the push may have: float32 (the exchange's), or the parameter's own
    float dtype."""
    own = np.dtype(param_dtype)
    return (np.dtype(np.float32), own) if np.issubdtype(own, np.floating) else (
        np.dtype(np.float32),)  # fmt: skip


def check_leaves(described: list[list], leaves: list[list],
                 codec: Codec | DctConfig | None) -> None:  # fmt: skip
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
        if isinstance(codec, DctConfig):
            _check_messages({n: got[n] for n in _dct_names(codec) if n in got}, codec, size)
            wanted |= set(_dct_names(codec))
        else:
            _check_codec({n: got[n] for n in _names(codec) if n in got}, codec, size)
            wanted |= set(_names(codec))
    extra = sorted(set(got) - wanted)
    if extra:
        raise WireError(f"the push has {extra[0]}, which the model does not")


def decode(described: list[list], message: dict[str, np.ndarray],
           codec: Codec | DctConfig | None) -> list[np.ndarray]:  # fmt: skip
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
        if isinstance(codec, DctConfig):
            flat = np.asarray(_decode_messages(_messages(message, codec), codec))[:size]
        else:
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


def _check_messages(got: dict[str, tuple[list, np.dtype]], config: DctConfig, size: int) -> None:
    """DCT momentum's arrays (``{name: (shape, dtype)}``) against the core's message of ``size``
    values (:func:`diloco_jax.algorithm.dct.extract`), one per replica: ``R`` from
    ``dct/weights``, the same for every array."""
    weights = got.get(DCT + "weights")
    if weights is None or weights[1] != np.float32 or len(weights[0]) != 1 or weights[0][0] < 1:
        raise WireError(f"the push lacks {DCT}weights (float32, one per replica) for "
                        f"{_label(config)}")  # fmt: skip
    replicas = weights[0][0]
    for name, want in zip(_dct_names(config)[:-1], _message_like(config, size), strict=True):
        shape = [replicas, *want.shape]
        if name not in got or got[name][1] != want.dtype:
            raise WireError(f"the push lacks {name} ({want.dtype}) for {_label(config)}")
        if got[name][0] != shape:
            raise WireError(f"{name} is {got[name][0]}, expected {shape} for {size:,} values "
                            f"of {replicas} replica(s) in {_label(config)}")  # fmt: skip


@functools.lru_cache(maxsize=8)
def _message_like(config: DctConfig, size: int) -> tuple:
    """The shapes and dtypes of one replica's message of ``size`` values, as the core makes it
    (float32 values: no scale)."""
    flat = jax.ShapeDtypeStruct((dct.padded(size, config.chunk),), jnp.float32)
    like = jax.eval_shape(lambda x: dct.extract(x, config)[0], flat)
    return like if config.bits != 32 else like[:2]


def _label(config: DctConfig) -> str:
    return f"{'dct' if config.dct else 'sparseloco'} (chunk {config.chunk}, topk {config.topk})"


def _messages(message: dict[str, np.ndarray], config: DctConfig):
    """``(messages_R, w_R)`` of ``message`` (checked by :func:`check_leaves`), the positions
    in range and none twice in a chunk (the decoder's scatter needs them distinct), the weights
    finite and >= 0."""
    got = [message[name] for name in _dct_names(config)]
    positions, w_R = got[1], got[-1]
    if positions.size and (positions.min() < 0 or positions.max() >= config.chunk):
        raise WireError(f"a position of {DCT}positions outside [0, {config.chunk})")
    ordered = np.sort(positions, axis=-1)
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise WireError(f"a position of {DCT}positions sent twice in one chunk")
    if not (np.isfinite(w_R).all() and (w_R >= 0).all()):
        raise WireError(f"{DCT}weights must be finite and >= 0")
    scale = got[2] if config.bits != 32 else np.zeros(positions.shape[:2], np.float32)
    return (got[0], positions, scale), w_R


@functools.partial(jax.jit, static_argnames=("config",))
def _decode_messages(messages_w, config: DctConfig) -> jax.Array:
    messages_R, w_R = messages_w
    return exchange.dct_mean(messages_R, w_R, config)


def push_bytes(message: dict[str, np.ndarray]) -> int:
    """The bytes of a message's values (the framing aside)."""
    return sum(a.nbytes for a in message.values())
