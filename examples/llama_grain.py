"""A Llama-style decoder (RoPE, RMSNorm, SwiGLU; Flax NNX) trained with DiLoCo
on a text file through a grain pipeline. Stop it at any point (Ctrl-C, or
even kill -9) and run the same command again: it resumes from its last
checkpoint, each replica's pipeline where it was, and ends with the
parameters an uninterrupted run would have.

    python examples/llama_grain.py [--text FILE] [--steps N] [--workdir DIR]
"""

import argparse
import lzma
import pathlib

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import diloco_jax

SEQ, DIM, HEADS, LAYERS, VOCAB = 64, 64, 4, 2, 256  # bytes as tokens


class RMSNorm(nnx.Module):
    def __init__(self):
        self.scale = nnx.Param(jnp.ones(DIM))

    def __call__(self, x_BxLxD):
        rms_BxLx1 = jnp.sqrt(
            jnp.mean(x_BxLxD**2, axis=-1, keepdims=True) + 1e-6
        )
        return x_BxLxD / rms_BxLx1 * self.scale


def rope(x_BxLxHxK):
    half = x_BxLxHxK.shape[-1] // 2
    angle_LxK = jnp.arange(x_BxLxHxK.shape[1])[:, None] * 10000.0 ** (
        -jnp.arange(half) / half
    )
    cos, sin = jnp.cos(angle_LxK)[:, None], jnp.sin(angle_LxK)[:, None]
    x1, x2 = x_BxLxHxK[..., :half], x_BxLxHxK[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.attn_norm, self.mlp_norm = RMSNorm(), RMSNorm()
        self.qkv = nnx.Linear(DIM, 3 * DIM, use_bias=False, rngs=rngs)
        self.proj = nnx.Linear(DIM, DIM, use_bias=False, rngs=rngs)
        self.gate_up = nnx.Linear(DIM, 2 * 3 * DIM, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(3 * DIM, DIM, use_bias=False, rngs=rngs)

    def __call__(self, x_BxLxD):
        b, length, _ = x_BxLxD.shape
        qkv = self.qkv(self.attn_norm(x_BxLxD)).reshape(
            b, length, 3, HEADS, DIM // HEADS
        )
        q, k, v = rope(qkv[:, :, 0]), rope(qkv[:, :, 1]), qkv[:, :, 2]
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x_BxLxD = x_BxLxD + self.proj(attended.reshape(b, length, DIM))
        gate, up = jnp.split(self.gate_up(self.mlp_norm(x_BxLxD)), 2, axis=-1)
        return x_BxLxD + self.down(jax.nn.silu(gate) * up)  # SwiGLU


class Llama(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = RMSNorm()
        self.head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens_BxL):
        x_BxLxD = self.embed(tokens_BxL)
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD)
        return self.head(self.norm(x_BxLxD))


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shipped = (
        pathlib.Path(diloco_jax.__file__).parent / "data" / "shakespeare.txt.xz"
    )
    parser.add_argument(
        "--text", default=str(shipped), help="a text file (.xz or plain)"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workdir", default="runs/llama_grain")
    return parser.parse_args()


def byte_tokens(path):  # the first MiB of the file, a token per byte
    text = lzma.open(path).read() if path.suffix == ".xz" else path.read_bytes()
    return np.frombuffer(text[: 2**20], np.uint8).astype(np.int32)


def main():
    args = arguments()
    tokens_N = byte_tokens(pathlib.Path(args.text))
    windows = len(tokens_N) // SEQ - 1
    held_out = windows - 256  # the last 256 windows: the evaluation
    window = lambda i: tokens_N[i * SEQ : (i + 1) * SEQ + 1]  # noqa: E731
    train_windows = grain.MapDataset.range(held_out).map(window)

    def pipeline(*, replica, replicas, batch_size, seed):  # a replica's batches
        return diloco_jax.replica_batches(
            train_windows,
            replica=replica,
            replicas=replicas,
            batch_size=batch_size,
            seed=seed,
        )

    graphdef, state = nnx.split(Llama(nnx.Rngs(0)), nnx.Param)

    def loss(params, tokens_BxL1, rng):
        logits_BxLxV = nnx.merge(graphdef, nnx.State(params))(
            tokens_BxL1[:, :-1]
        )
        return optax.softmax_cross_entropy_with_integer_labels(
            logits_BxLxV, tokens_BxL1[:, 1:]
        ).mean()

    eval_windows = np.stack([window(i) for i in range(held_out, windows)])
    task = diloco_jax.GrainTask(
        nnx.to_pure_dict(state),
        loss,
        pipeline,
        eval_windows,
        unit="token",
        tokens_per_row=SEQ,
    )
    overrides = {
        "train.total_steps": args.steps,
        "train.log_every": 5,
        "train.eval_every": 50,
        "train.checkpoint_every": 10,
        "data.batch_size": 16,
        "parallel.replicas": 4,
        "outer.sync_every": 10,
        "inner.learning_rate": 3e-3,
        "inner.warmup_steps": 10,
    }
    result = diloco_jax.fit(task, workdir=args.workdir, overrides=overrides)
    steps = result.summary["steps"]
    print(
        f"eval loss {result.eval_loss:.3f} nats per byte after {steps} steps; "
        f"parameters in {args.workdir}/params"
    )


if __name__ == "__main__":
    main()
