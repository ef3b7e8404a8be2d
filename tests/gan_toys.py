"""A toy GAN on 2-D data: a generator and a critic, each with its own optimizer, trained by a
`train_step` hook."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nitro
from nitro.data import ArrayLoader

RNG = np.random.default_rng(0)
DATA = (RNG.normal(size=(512, 2)) * 0.3 + np.array([2.0, -1.0])).astype(np.float32)
NOISE = RNG.normal(size=(512, 2)).astype(np.float32)


class MLP(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(din, 32, rngs=rngs)
        self.out = nnx.Linear(32, dout, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def critic_loss(models, x, z):
    real = models["disc"](x)
    fake = models["disc"](models["gen"](z))
    ones, zeros = jnp.ones_like(real), jnp.zeros_like(fake)
    return (
        optax.sigmoid_binary_cross_entropy(real, ones).mean()
        + optax.sigmoid_binary_cross_entropy(fake, zeros).mean()
    )


def generator_loss(models, z):
    fake = models["disc"](models["gen"](z))
    return optax.sigmoid_binary_cross_entropy(fake, jnp.ones_like(fake)).mean()


@nitro.experiment
class GAN:
    """Learn to generate points of a 2-D Gaussian centred at (2, -1)."""

    batch_size: int = 64
    max_epochs: int = 20

    def build_data(self):
        return {"train": ArrayLoader({"x": DATA, "z": NOISE}, self.batch_size)}

    def build_model(self, rngs):
        return {"gen": MLP(2, 2, rngs=rngs), "disc": MLP(2, 1, rngs=rngs)}

    def optimizer(self):
        return {"gen": optax.adam, "disc": optax.adam}

    def forward(self, models, *, z):
        return models["gen"](z)

    def train_step(self, step, *, x, z):
        d_loss, grads = step.grad("disc", lambda m: critic_loss(m, x, z))
        step.apply("disc", grads)
        g_loss, grads = step.grad("gen", lambda m: generator_loss(m, z))
        step.apply("gen", grads)
        return {"loss": d_loss + g_loss, "d_loss": d_loss, "g_loss": g_loss}
