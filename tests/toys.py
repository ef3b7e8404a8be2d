"""Small experiments shared by the tests: tiny models, few steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nitro
from nitro import Device, GraphConst

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 5)).astype(np.float32)
Y = (X.sum(1) > 0).astype(np.int32)


class TinyMLP(nnx.Module):
    def __init__(self, din: int, width: int, dout: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(din, width, rngs=rngs)
        self.out = nnx.Linear(width, dout, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def loaders(batch_size: int = 16, val: int = 20):
    return {
        "train": nitro.data.ArrayLoader({"x": X, "y": Y}, batch_size),
        "val": nitro.data.ArrayLoader(
            {"x": X[:val], "y": Y[:val]}, batch_size, shuffle=False, drop_last=False
        ),
        "test": nitro.data.ArrayLoader(
            {"x": X[val:], "y": Y[val:]}, batch_size, shuffle=False, drop_last=False
        ),
    }


@nitro.experiment
class Toy:
    """64 samples, 4 batches of 16 per epoch."""

    width: GraphConst[int] = 8
    offset: GraphConst[float] = 0.0
    scale: Device[float] = 1.0
    batch_size: int = 16
    max_epochs: int = 2
    with_val: bool = True

    def build_data(self):
        splits = loaders(self.batch_size)
        if not self.with_val:
            del splits["val"]
        return splits

    def build_model(self, rngs: nnx.Rngs):
        return TinyMLP(5, self.width, 2, rngs=rngs)

    def forward(self, model, *, x):
        return model(x * self.scale + self.offset)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nitro.experiment
class ToyWithMetrics(Toy):
    def metrics(self, logits, *, y):
        return {"acc": (logits.argmax(-1) == y).mean()}


@nitro.experiment
class Tagged(Toy):
    """Each row carries an id on the wire that forward does not take (a bundle may return it
    as it came: echo)."""

    def export_inputs(self):
        return {
            "x": jax.ShapeDtypeStruct((5,), jnp.float32),
            "id": jax.ShapeDtypeStruct((), jnp.int32),
        }
