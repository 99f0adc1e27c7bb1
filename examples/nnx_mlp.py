"""A Flax NNX MLP on NumPy arrays, trained with DiLoCo (4 simulated replicas) at
two sync periods, with your own inner optimizer (clipped AdamW on a
warmup-cosine schedule) and several seeds, each initialising the MLP anew: the
figures show the seeds' mean and a band from their min to max.

    python examples/nnx_mlp.py [STEPS] [SEEDS]

It runs in ./runs/nnx_mlp and prints a table; runs/nnx_mlp/curves.png holds
the curves with bands.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import diloco_jax


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(2, 64, rngs=rngs)
        self.out = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x_BxD):
        return self.out(jax.nn.gelu(self.hidden(x_BxD)))[:, 0]


rng = np.random.default_rng(0)
x_Nx2 = rng.uniform(-2, 2, (4096, 2)).astype(np.float32)
data = {"x": x_Nx2, "y": np.sin(x_Nx2[:, 0]) * np.cos(x_Nx2[:, 1])}
graphdef = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)[0]


def init(key):  # called with the run's seed: each seed starts from its own MLP
    return nnx.to_pure_dict(nnx.split(MLP(nnx.Rngs(params=key)), nnx.Param)[1])


def loss(params, batch, rng):
    model = nnx.merge(graphdef, nnx.State(params))
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


train, held_out = (
    {k: v[s] for k, v in data.items()} for s in (np.s_[:3584], np.s_[3584:])
)
task = diloco_jax.ArrayTask(init, loss, train, eval_data=held_out)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 500
seeds = list(range(int(sys.argv[2]) if len(sys.argv) > 2 else 3))
schedule = optax.warmup_cosine_decay_schedule(
    0.0, 3e-3, warmup_steps=steps // 10, decay_steps=steps
)
inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
table = diloco_jax.sweep(
    task,
    workdir="runs/nnx_mlp",
    sweeps=["outer.sync_every=10,50"],
    seeds=seeds,
    inner=inner,
    overrides={
        "train.total_steps": steps,
        "train.log_every": 10,
        "train.eval_every": max(10, steps // 100 * 10),
        "data.batch_size": 32,
        "sim.plot_label": "validation MSE",  # what the figures call the loss
    },
)
print("sync_every | eval MSE (mean ± std over seeds)")
for row in table:
    sync_every = row["run"].split("=")[1]
    mean, std = row["final_eval_loss"], row["final_eval_loss_std"]
    print(f"{sync_every:>10} | {mean:.4f} ± {std:.4f}")
