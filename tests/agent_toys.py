"""Experiments the agent-tool tests name by module (`agent_toys.Slow`): tiny, one slow enough to
stop in the middle of an epoch, one that waits for a file to set up, one whose hooks print, one
whose inputs are integers."""

from __future__ import annotations

import os
import time

import numpy as np
from flax import nnx
from toys import ToyWithMetrics, X, Y, loaders

import nitro


class SlowBatches:
    """A restartable source that waits `delay` seconds before each batch of 16 samples."""

    def __init__(self, n_batches: int, delay: float):
        self.n_batches, self.delay = n_batches, delay

    def __len__(self) -> int:
        return self.n_batches

    def __iter__(self):
        for i in range(self.n_batches):
            time.sleep(self.delay)
            start = (16 * i) % len(X)
            yield {"x": X[start : start + 16], "y": Y[start : start + 16]}


@nitro.experiment
class Quick(ToyWithMetrics):
    """Four steps per epoch, with an accuracy metric."""


@nitro.experiment
class Slow(ToyWithMetrics):
    """`batches` steps per epoch, `delay` seconds each."""

    batches: int = 400
    delay: float = 0.02
    max_epochs: int = 1

    def build_data(self):
        splits = loaders(self.batch_size)
        splits["train"] = SlowBatches(self.batches, self.delay)
        return splits


@nitro.experiment
class Gated(ToyWithMetrics):
    """Sets up once the file `gate` exists (a test holds a population in its setup)."""

    gate: str = ""

    def build_data(self):
        deadline = time.monotonic() + 300
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        return ToyWithMetrics.build_data(self)


@nitro.experiment
class Chatty(ToyWithMetrics):
    """Prints from its hooks, through `print` and with a C-level write to fd 1."""

    def build_data(self):
        print("chatty: building the data")
        os.write(1, b"chatty: written to fd 1\n")
        return ToyWithMetrics.build_data(self)

    def forward(self, model, *, x):
        print("chatty: tracing forward")
        return ToyWithMetrics.forward(self, model, x=x)


TOKENS = (np.abs(X) * 4).astype(np.int32) % 10  # five token ids per sample


class Bag(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(10, width, rngs=rngs)
        self.out = nnx.Linear(width, 2, rngs=rngs)

    def __call__(self, tokens):
        return self.out(self.embed(tokens).mean(1))


@nitro.experiment
class Tokens(ToyWithMetrics):
    """Integer inputs: five token ids per sample, embedded and averaged."""

    def build_data(self):
        return {
            "train": nitro.data.ArrayLoader({"x": TOKENS, "y": Y}, self.batch_size),
            "val": nitro.data.ArrayLoader(
                {"x": TOKENS[:20], "y": Y[:20]}, self.batch_size, shuffle=False, drop_last=False
            ),
        }

    def build_model(self, rngs):
        return Bag(self.width, rngs=rngs)

    def forward(self, model, *, x):
        return model(x)


@nitro.experiment
class Tagged(ToyWithMetrics):
    """Each row of the export's wire carries an id beside x, which forward does not take."""

    def export_inputs(self):
        import jax
        import jax.numpy as jnp

        return {
            "x": jax.ShapeDtypeStruct((5,), jnp.float32),
            "id": jax.ShapeDtypeStruct((), jnp.int32),
        }
