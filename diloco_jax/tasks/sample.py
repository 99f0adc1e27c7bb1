"""Text generation from a trained language model."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from diloco_jax.data.tokenizer import ByteTokenizer
from diloco_jax.tasks import model as model_lib


@partial(jax.jit, static_argnames=("graphdef", "num_tokens", "seq_len", "temperature"))
def _generate(graphdef, params, prompt_P, key, *, num_tokens, seq_len, temperature):
    prompt_len = prompt_P.shape[0]
    total = prompt_len + num_tokens
    buf_T = jnp.zeros([total], jnp.int32).at[:prompt_len].set(prompt_P)

    def body(t, carry):
        buf_T, key = carry
        start = jnp.clip(t - seq_len, 0, total - seq_len)
        window_L = lax.dynamic_slice_in_dim(buf_T, start, seq_len)
        logits_V = model_lib.apply(graphdef, params, window_L[None])[0, t - 1 - start]
        key, sub = jax.random.split(key)
        token = jax.random.categorical(sub, logits_V / temperature)
        return buf_T.at[t].set(token), key

    buf_T, _ = lax.fori_loop(prompt_len, total, body, (buf_T, key))
    return buf_T


def generate_text(
    graphdef: nnx.GraphDef,
    params,
    prompt: str,
    *,
    num_chars: int,
    seq_len: int,
    seed: int = 0,
    temperature: float = 0.8,
    tokenizer=None,
) -> str:
    """``prompt`` followed by ``num_chars`` tokens (bytes, with the default byte tokenizer)
    sampled from the model at ``temperature``."""
    tokenizer = tokenizer or ByteTokenizer()
    prompt_P = tokenizer.encode(prompt or "\n")
    pad = max(0, seq_len - (len(prompt_P) + num_chars))
    # The window must hold seq_len tokens; pad the front with newlines (dropped from the text).
    newline = tokenizer.encode("\n")
    filler = np.full(pad, newline[0] if len(newline) else 0, np.int32)
    out_T = _generate(
        graphdef,
        params,
        jnp.asarray(np.concatenate([filler, prompt_P]).astype(np.int32)),
        jax.random.key(seed),
        num_tokens=num_chars,
        seq_len=seq_len,
        temperature=temperature,
    )
    return tokenizer.decode(np.asarray(out_T)[pad:])
