"""A Flax NNX MLP on NumPy arrays, trained with DiLoCo (4 simulated replicas) at two sync periods.

python examples/nnx_mlp.py [STEPS]     # runs in ./runs/nnx_mlp_sync*; prints a table
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
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
graphdef, state = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)


def loss(params, batch, rng):
    model = nnx.merge(graphdef, nnx.State(params))
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


train, held_out = ({k: v[s] for k, v in data.items()} for s in (np.s_[:3584], np.s_[3584:]))
task = diloco_jax.ArrayTask(nnx.to_pure_dict(state), loss, train, eval_data=held_out)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 500
table = diloco_jax.sweep(task, workdir="runs/nnx_mlp", sweeps=["outer.sync_every=10,50"],
                         overrides={"train.total_steps": steps, "train.log_every": 10,
                                    "train.eval_every": max(10, steps // 100 * 10),
                                    "data.batch_size": 32})  # fmt: skip
print("sync_every | eval MSE")
for row in table:
    print(f"{row['run'].split('=')[1]:>10} | {row['final_eval_loss']:.4f}")
