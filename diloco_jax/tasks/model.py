"""A decoder-only Transformer LM in Flax NNX, and its pure functional form.

Pre-norm blocks (RMSNorm -> causal self-attention -> residual; RMSNorm -> GELU MLP -> residual),
learned absolute positions. The model is defined as an NNX object and split once into
``(graphdef, params)``; training works on the ``params`` pytree only.

Options: ``tied_embeddings`` (the output head is the transposed token embedding), ``dropout``
(after attention and MLP, active only when :func:`apply` gets a ``dropout_key``),
``compute_dtype`` (``bfloat16`` computes in bf16 while parameters stay float32) and ``remat``
(recompute each block's activations in the backward pass instead of storing them).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention with one fused QKV projection.

    Computed head-major (``[B, N, L, K]``) with einsums straight from the QKV and output
    kernels: the same function, parameters and precision as ``jax.nn.dot_product_attention``
    (logits and softmax in float32, probabilities cast back to the compute dtype), but XLA gets
    every matmul in a layout that needs no transpose of the activations between them, which
    made the vmapped replicas' step 3-5% faster on CPU (``scripts/profile_step.py``,
    docs/benchmarks.md)."""

    def __init__(self, d_model: int, num_heads: int, *, dtype, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        _, seq, d = x_BxLxD.shape
        n, k = self.num_heads, d // self.num_heads
        dtype = self.qkv.dtype or jnp.result_type(x_BxLxD, self.qkv.kernel[...])
        x_BxLxD = x_BxLxD.astype(dtype)
        w_Dx3xNxK = self.qkv.kernel[...].astype(dtype).reshape(d, 3, n, k)
        q_BxNxLxK, k_BxNxLxK, v_BxNxLxK = jnp.einsum("bld,dtnk->tbnlk", x_BxLxD, w_Dx3xNxK)
        logits_BxNxLxL = jnp.einsum("bnqk,bnsk->bnqs", q_BxNxLxK, k_BxNxLxK,
                                    preferred_element_type=jnp.float32)  # fmt: skip
        logits_BxNxLxL = logits_BxNxLxL * jnp.float32(1.0 / np.sqrt(k))
        causal_LxL = jnp.tril(jnp.ones((seq, seq), bool))
        logits_BxNxLxL = jnp.where(causal_LxL, logits_BxNxLxL, jnp.finfo(jnp.float32).min)
        probs_BxNxLxL = jax.nn.softmax(logits_BxNxLxL, axis=-1).astype(dtype)
        y_BxNxLxK = jnp.einsum("bnqs,bnsk->bnqk", probs_BxNxLxL, v_BxNxLxK)
        w_NxKxD = self.out.kernel[...].astype(dtype).reshape(n, k, d)
        return jnp.einsum("bnlk,nkd->bld", y_BxNxLxK, w_NxKxD)


class Block(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int, *, dropout: float, dtype,
                 rngs: nnx.Rngs):  # fmt: skip
        self.dropout = dropout
        self.norm1 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.attn = Attention(d_model, num_heads, dtype=dtype, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, mlp_ratio * d_model, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(mlp_ratio * d_model, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x_BxLxD: jax.Array, key: jax.Array | None = None) -> jax.Array:
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        x_BxLxD = x_BxLxD + _dropout(self.attn(self.norm1(x_BxLxD)), self.dropout, keys[0])
        y_BxLxD = self.down(jax.nn.gelu(self.up(self.norm2(x_BxLxD))))
        return x_BxLxD + _dropout(y_BxLxD, self.dropout, keys[1])


class Transformer(nnx.Module):
    """Decoder-only LM: ``tokens_BxL`` (int) -> ``logits_BxLxV``."""

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        mlp_ratio: int,
        tied_embeddings: bool = False,
        dropout: float = 0.0,
        compute_dtype: str = "float32",
        remat: bool = False,
        rngs: nnx.Rngs,
    ):
        dtype = COMPUTE_DTYPES[compute_dtype]
        self.remat = remat
        self.embed = nnx.Embed(vocab_size, d_model, dtype=dtype, rngs=rngs)
        self.pos_LxD = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model)))
        self.blocks = nnx.List([
            Block(d_model, num_heads, mlp_ratio, dropout=dropout, dtype=dtype, rngs=rngs)
            for _ in range(num_layers)
        ])  # fmt: skip
        self.norm = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.tied = tied_embeddings
        if not tied_embeddings:  # else the head is the transposed embedding (no parameter)
            self.head = nnx.Linear(d_model, vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens_BxL: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        seq = tokens_BxL.shape[1]
        x_BxLxD = self.embed(tokens_BxL) + self.pos_LxD[:seq].astype(self.embed.dtype)
        keys = [None] * len(self.blocks)
        if dropout_key is not None:
            keys = list(jax.random.split(dropout_key, len(self.blocks)))
        run = nnx.remat(lambda block, x, key: block(x, key)) if self.remat else None
        for block, key in zip(self.blocks, keys, strict=True):
            x_BxLxD = run(block, x_BxLxD, key) if run else block(x_BxLxD, key)
        x_BxLxD = self.norm(x_BxLxD)
        return self.embed.attend(x_BxLxD) if self.tied else self.head(x_BxLxD)


def split_built(make: Callable[[nnx.Rngs], nnx.Module], seed: int, *,
                same_as: Hashable | None = None,
                abstract: bool = False) -> tuple[nnx.GraphDef, Any]:  # fmt: skip
    """``(graphdef, params)`` of the module that ``make(rngs)`` builds from ``nnx.Rngs(params=
    seed)``, its parameters (a pure pytree) from one compiled call, which the persistent
    compilation cache keeps, rather than from one small compile per initialiser (about 1 s of
    every command's start for the default Transformer). The seed is an input of that call, so
    one compiled call serves every seed. The graph definition holds no values: it is kept from
    the trace.

    ``same_as``: a hashable description of what ``make`` builds (its class and arguments); calls
    with equal ones share one traced and compiled call in this process, so the runs of a sweep
    (or of a test session) after the first skip the model's trace, lowering and executable load
    (about 0.5 s of a warm tiny run on a 2-core CPU). Each call returns new arrays; with
    ``abstract``, their shapes and dtypes only (nothing allocated: a dry run's)."""
    if same_as is None:
        return _builder(make)(seed, abstract)
    try:
        hash(same_as)
    except TypeError:
        return _builder(make)(seed, abstract)
    if same_as not in _builders:
        if len(_builders) >= _MAX_BUILDERS:
            _builders.pop(next(iter(_builders)))
        _builders[same_as] = _builder(make)
    return _builders[same_as](seed, abstract)


_MAX_BUILDERS = 16
_builders: dict[Hashable, _Build] = {}


_Build = Callable[[int, bool], tuple[nnx.GraphDef, Any]]  # (seed, abstract) -> (graphdef, params)


def _builder(make: Callable[[nnx.Rngs], nnx.Module]) -> _Build:
    """``seed -> (graphdef, params)`` through one jitted call (see :func:`split_built`)."""
    graphdefs = []

    def build(seed):
        graphdef, params = nnx.split(make(nnx.Rngs(params=jax.random.key(seed))), nnx.Param)
        graphdefs.append(graphdef)
        return nnx.to_pure_dict(params)

    jitted = jax.jit(build)

    def call(seed: int, abstract: bool = False) -> tuple[nnx.GraphDef, Any]:
        seed_ = np.int32(seed)
        params = jax.eval_shape(build, seed_) if abstract else jitted(seed_)
        return graphdefs[0], params

    return call


def described(kwargs: dict[str, Any]) -> tuple:
    """``kwargs`` as a hashable key for :func:`split_built`'s ``same_as``, each value with its
    type (``1``, ``1.0`` and ``True`` are equal keys in a dict, but may build different modules)."""
    return tuple((k, type(v).__name__, v) for k, v in sorted(kwargs.items()))


def init_model(seed: int, *, abstract: bool = False, **model_kwargs) -> tuple[nnx.GraphDef, Any]:
    """Builds the model and splits it once into a graph definition and a pure params pytree
    (of shapes only with ``abstract``)."""
    same_as = ("Transformer", described(model_kwargs))
    return split_built(lambda rngs: Transformer(**model_kwargs, rngs=rngs), seed, same_as=same_as,
                       abstract=abstract)  # fmt: skip


def apply(
    graphdef: nnx.GraphDef, params: Any, tokens_BxL: jax.Array, dropout_key: jax.Array | None = None
) -> jax.Array:
    """Pure forward pass: ``logits_BxLxV`` of ``tokens_BxL`` under ``params`` (dropout only with
    a ``dropout_key``)."""
    state = nnx.State(params) if not isinstance(params, nnx.State) else params
    return nnx.merge(graphdef, state)(tokens_BxL, dropout_key)


def token_nll(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Next-token negative log-likelihood ``nll_BxL`` in nats (computed in float32)."""
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]


def count_params(params: Any) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
