"""Transformer options (tied embeddings, dropout, bf16 compute, remat) and the size presets."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diloco_jax.config import apply_overrides, load_preset, validate
from diloco_jax.tasks import model as model_lib

SMALL = dict(vocab_size=256, seq_len=16, d_model=16, num_layers=2, num_heads=2, mlp_ratio=2)
TOKENS = jax.random.randint(jax.random.key(0), (3, 12), 0, 256)


@functools.partial(jax.jit, static_argnums=0)  # one program, not an op-by-op compile per op
def loss_and_grads(graphdef, params, key=None):
    def loss(p):
        logits = model_lib.apply(graphdef, p, TOKENS[:, :-1], key)
        return model_lib.token_nll(logits, TOKENS[:, 1:]).mean()

    return jax.value_and_grad(loss)(params)


def test_default_model_is_unchanged_by_the_options():
    """The options' defaults build the same parameters and logits as the plain model."""
    graphdef, params = model_lib.init_model(0, **SMALL)
    same_graphdef, same = model_lib.init_model(
        0, **SMALL, tied_embeddings=False, dropout=0.0, compute_dtype="float32", remat=False
    )
    chex.assert_trees_all_equal(params, same)
    assert sorted(params) == ["blocks", "embed", "head", "norm", "pos_LxD"]


def test_tied_embeddings_use_the_embedding_as_head():
    graphdef, params = model_lib.init_model(0, **SMALL, tied_embeddings=True)
    _, untied = model_lib.init_model(0, **SMALL)
    assert "head" not in params
    assert model_lib.count_params(untied) - model_lib.count_params(params) == 256 * 16
    # logits are the final hidden states times the embedding table, by hand
    model = model_lib.nnx.merge(graphdef, model_lib.nnx.State(params))
    x = model.embed(TOKENS) + model.pos_LxD[: TOKENS.shape[1]]
    for block in model.blocks:
        x = block(x)
    expected = model.norm(x) @ params["embed"]["embedding"].T
    np.testing.assert_allclose(model_lib.apply(graphdef, params, TOKENS), expected, atol=1e-5)


def test_dropout_only_with_a_key_and_deterministic_given_it():
    graphdef, params = model_lib.init_model(0, **SMALL, dropout=0.3)
    _, plain = model_lib.init_model(0, **SMALL)
    plain_graphdef, _ = model_lib.init_model(0, **SMALL)
    chex.assert_trees_all_equal(params, plain)  # dropout has no parameters
    no_key, _ = loss_and_grads(graphdef, params)
    reference, _ = loss_and_grads(plain_graphdef, plain)
    assert float(no_key) == float(reference)  # evaluation: no dropout
    a, grads_a = loss_and_grads(graphdef, params, jax.random.key(1))
    b, grads_b = loss_and_grads(graphdef, params, jax.random.key(1))
    c, _ = loss_and_grads(graphdef, params, jax.random.key(2))
    assert float(a) == float(b) and float(a) != float(no_key) and float(a) != float(c)
    chex.assert_trees_all_equal(grads_a, grads_b)


@pytest.mark.slow  # ~12 s; bf16 parameters train every variant by default (test_dtypes)
def test_bf16_compute_keeps_float32_params_and_stays_close():
    graphdef, params = model_lib.init_model(0, **SMALL, compute_dtype="bfloat16")
    _, plain = model_lib.init_model(0, **SMALL)
    plain_graphdef, _ = model_lib.init_model(0, **SMALL)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    assert model_lib.apply(graphdef, params, TOKENS).dtype == jnp.bfloat16
    loss, grads = loss_and_grads(graphdef, params)
    reference, _ = loss_and_grads(plain_graphdef, plain)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    # bf16 keeps 8 bits of mantissa: the loss (~5.5 nats) moves by ~1e-2, not more
    assert abs(float(loss) - float(reference)) < 5e-2
    assert float(loss) != float(reference)


def test_remat_gives_the_same_gradients():
    graphdef, params = model_lib.init_model(0, **SMALL, remat=True)
    plain_graphdef, plain = model_lib.init_model(0, **SMALL)
    loss, grads = loss_and_grads(graphdef, params)
    reference, reference_grads = loss_and_grads(plain_graphdef, plain)
    np.testing.assert_allclose(loss, reference, rtol=1e-6)
    chex.assert_trees_all_close(grads, reference_grads, atol=1e-6)
    # the backward pass recomputes: the jaxpr holds a checkpoint (remat) primitive
    jaxpr = jax.make_jaxpr(lambda p: loss_and_grads(graphdef, p)[0])(params)
    assert "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)


@pytest.mark.parametrize("name,nominal", [("lm_1m", 1e6), ("lm_10m", 1e7), ("lm_100m", 1e8),
                                          ("lm_1b", 1e9)])  # fmt: skip
def test_size_presets_validate_and_have_their_size(name, nominal):
    cfg = load_preset(f"configs/{name}.py")
    validate(cfg)
    model = dataclasses.asdict(cfg.model)
    shapes = jax.eval_shape(
        lambda: model_lib.init_model(0, vocab_size=256, seq_len=cfg.data.seq_len, **model)[1]
    )
    count = sum(x.size for x in jax.tree.leaves(shapes))
    assert 0.9 * nominal < count < 1.15 * nominal, count


def test_model_option_errors():
    from diloco_jax.config import Config, ConfigError

    with pytest.raises(ConfigError, match=r"model.dropout = 1.0 .*\[0, 1\)"):
        validate(apply_overrides(Config(), [("model.dropout", "1.0")]))
    with pytest.raises(ConfigError, match="model.compute_dtype = 'fp16' .*one of"):
        validate(apply_overrides(Config(), [("model.compute_dtype", "fp16")]))


@pytest.mark.slow  # ~20 s; each option is tested on its own by default
def test_training_with_every_option_runs_and_learns(tmp_path):
    from diloco_jax.train import train

    overrides = {"model.num_layers": 2, "model.tied_embeddings": True, "model.dropout": 0.1,
                 "model.compute_dtype": "bfloat16", "model.remat": True,
                 "parallel.runtime": "sim", "train.sample_chars": 0,
                 "train.checkpoint": False}  # fmt: skip
    cfg = apply_overrides(load_preset("configs/tiny.py"),
                          [(k, str(v)) for k, v in overrides.items()])  # fmt: skip
    summary = train(cfg, tmp_path, show_progress=False)
    assert np.isfinite(summary["final_eval_loss"])
    assert summary["final_eval_loss"] < np.log(256)  # below a uniform guess over bytes


def _reference_attention(attn, x_BxLxD):
    """What the model computed before its head-major einsums: the fused QKV Linear, then
    ``jax.nn.dot_product_attention`` (causal), then the output Linear."""
    b, seq, d = x_BxLxD.shape
    n = attn.num_heads
    qkv = attn.qkv(x_BxLxD).reshape(b, seq, 3, n, d // n)
    y = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
    return attn.out(y.reshape(b, seq, d))


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_attention_equals_dot_product_attention_values_and_gradients(compute_dtype):
    """The head-major attention is jax.nn.dot_product_attention's function: the same outputs
    and parameter gradients (float32 to rounding; bf16 within a few bf16 ulps)."""
    dtype = model_lib.COMPUTE_DTYPES[compute_dtype]
    attn = model_lib.Attention(32, 4, dtype=dtype, rngs=nnx.Rngs(params=1))
    x = jax.random.normal(jax.random.key(2), (3, 10, 32))
    graphdef, params = nnx.split(attn, nnx.Param)

    def run(fn):
        def loss(p):
            y = fn(nnx.merge(graphdef, p), x)
            return (y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size).reshape(y.shape))).sum()

        # one compiled program each (op by op, each operation would compile on its own)
        return jax.jit(lambda p: (fn(nnx.merge(graphdef, p), x), jax.grad(loss)(p)))(params)

    (y, grads), (ref, ref_grads) = run(lambda m, x: m(x)), run(_reference_attention)
    assert y.dtype == ref.dtype == dtype
    # float32: two programs with matmuls of other shapes, whose kernels each CPU picks for
    # itself; the outputs differ by 7e-7 at most on an AMD EPYC (atol 2e-6)
    tol = {"float32": dict(rtol=1e-5, atol=2e-6), "bfloat16": dict(rtol=0.05, atol=0.05)}
    y32, ref32 = y.astype(jnp.float32), ref.astype(jnp.float32)
    chex.assert_trees_all_close(y32, ref32, **tol[compute_dtype])
    # gradient entries are sums over 30 positions in another order, and the largest are ~3: an
    # entry near 0 can differ by a few ulps of those (2e-6 seen), hence atol 1e-5 in float32
    grad_tol = dict(tol[compute_dtype], atol=max(1e-5, tol[compute_dtype]["atol"]))
    chex.assert_trees_all_close(grads, ref_grads, **grad_tol)
    assert float(jnp.abs(ref.astype(jnp.float32)).max()) > 0.1  # not a trivially zero output


def test_equal_models_share_one_trace_and_each_call_gets_its_own_arrays():
    """``split_built(..., same_as=...)``: calls with equal descriptions trace once (any seed),
    return new arrays (one run donating its parameters leaves the next run's intact), and
    descriptions that differ only in a value's type (1 and True) do not share."""
    traces = []

    def make(rngs):
        traces.append(1)
        return nnx.Linear(3, 2, rngs=rngs)

    same_as = ("linear-test", model_lib.described({"a": 1}))
    _, first = model_lib.split_built(make, 0, same_as=same_as)
    kept = jax.tree.map(np.asarray, first)
    jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)(first)
    _, second = model_lib.split_built(make, 0, same_as=same_as)
    _, other_seed = model_lib.split_built(make, 1, same_as=same_as)
    assert len(traces) == 1
    chex.assert_trees_all_equal(second, kept)
    assert not np.array_equal(other_seed["kernel"], second["kernel"])
    model_lib.split_built(make, 0, same_as=("linear-test", model_lib.described({"a": True})))
    assert len(traces) == 2
