"""A Flax Linen CNN on the shipped 8x8 digits, DiLoCo with 2 replicas on a 2x2
CPU mesh (each replica's batch split over 2 devices), evaluated on held-out
digits with its own accuracy. It runs in ./runs/linen_cnn_digits:

    python examples/linen_cnn_digits.py [STEPS]
"""

import sys

import jax

# before JAX starts: 2 replicas x 2 data devices
jax.config.update("jax_num_cpu_devices", 4)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import diloco_jax  # noqa: E402
from diloco_jax.data.images import load_digits  # noqa: E402


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x_BxHxWxC):
        x = nn.relu(nn.Conv(16, (3, 3))(x_BxHxWxC))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


images_Nx8x8, labels_N = load_digits()
x_Nx8x8x1 = images_Nx8x8[..., None].astype("float32") / 16
model = CNN()
params = model.init(jax.random.key(0), x_Nx8x8x1[:1])["params"]


def loss(params, batch, rng):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]
    ).mean()


def evaluate(params, data):
    logits = model.apply({"params": params}, data["x"])
    nll = optax.softmax_cross_entropy_with_integer_labels(
        logits, data["y"]
    ).mean()
    return {
        "eval_loss": nll,
        "accuracy": jnp.mean(logits.argmax(-1) == data["y"]),
    }


train = {"x": x_Nx8x8x1[:1500], "y": labels_N[:1500]}
held_out = {"x": x_Nx8x8x1[1500:], "y": labels_N[1500:]}
task = diloco_jax.ArrayTask(
    params, loss, train, eval_data=held_out, evaluate=evaluate
)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
overrides = {
    "parallel.runtime": "mesh",
    "parallel.replicas": 2,
    "parallel.replica_devices": 2,
    "parallel.data_devices": 2,
    "parallel.cpu_devices": 4,
    "data.batch_size": 32,
    "outer.sync_every": 20,
    "inner.learning_rate": 3e-3,
    "train.total_steps": steps,
    "train.log_every": 20,
    "train.eval_every": steps,
    "train.checkpoint_every": 100,
}
result = diloco_jax.fit(
    task, workdir="runs/linen_cnn_digits", overrides=overrides
)
accuracy = [e["accuracy"] for e in result.history if e["event"] == "eval"][-1]
print(f"held-out loss {result.eval_loss:.4f}, accuracy {accuracy:.3f}")
