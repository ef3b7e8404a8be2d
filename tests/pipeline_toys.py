"""Sources and a tiny experiment for the data pipeline and device memory tests.

Batches are 12 rows of 7 features: no parameter or optimizer leaf has the shape (12, 7), so
an array of that shape alive in `jax.live_arrays()` is a batch that was never freed.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import optax
from flax import nnx

import nitro
from nitro.data import ArrayLoader

BATCH = 12
FEATURES = 7
BATCH_SHAPE = (BATCH, FEATURES)
RNG = np.random.default_rng(0)
X = RNG.normal(size=(96, FEATURES)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32) + (X[:, 1] > 0).astype(np.int32)


class TinyMLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 16, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


@nitro.experiment
class Pipe:
    """96 samples, 8 batches of 12 per epoch; a 'val' split of 2 batches (the last one short)."""

    max_epochs: int = 1
    with_val: bool = False

    def build_data(self):
        splits = {"train": ArrayLoader({"x": X, "y": Y}, BATCH)}
        if self.with_val:
            splits["val"] = ArrayLoader(
                {"x": X[:20], "y": Y[:20]}, BATCH, shuffle=False, drop_last=False
            )
        return splits

    def build_model(self, rngs: nnx.Rngs):
        return TinyMLP(rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nitro.experiment
class PipeWithMetrics(Pipe):
    with_val: bool = True

    def metrics(self, logits, *, y):
        return {"acc": (logits.argmax(-1) == y).mean()}


@nitro.experiment
class PipeWithDeviceMetrics(PipeWithMetrics):
    def metrics_residency(self, hook):
        return "device"


class RecordingLoader(ArrayLoader):
    """An index-addressable loader that records which thread built each batch and can sleep
    `delay(index)` seconds before returning it."""

    def __init__(self, arrays=None, batch_size=BATCH, *, delay=None, **options):
        super().__init__(arrays or {"x": X, "y": Y}, batch_size, **options)
        self.delay = delay
        self.threads: list[str] = []
        self.calls: list[int] = []

    def batch_at(self, index, plan=None):
        self.threads.append(threading.current_thread().name)
        self.calls.append(index)
        if self.delay is not None:
            time.sleep(self.delay(index))
        return super().batch_at(index, plan)


class PlainBatches:
    """A restartable iterable of dicts of numpy arrays, and nothing else (no len, no
    batch_at): the most basic source."""

    def __init__(self, x=X, y=Y, batch_size=BATCH, *, sleep=0.0):
        self.x, self.y, self.batch_size, self.sleep = x, y, batch_size, sleep
        self.iterations = 0
        self.threads: set[str] = set()

    def __iter__(self):
        self.iterations += 1
        for start in range(0, len(self.x) - self.batch_size + 1, self.batch_size):
            self.threads.add(threading.current_thread().name)
            if self.sleep:
                time.sleep(self.sleep)
            yield {
                "x": self.x[start : start + self.batch_size],
                "y": self.y[start : start + self.batch_size],
            }


class BrokenSource(ArrayLoader):
    """Fails to build batch `fail_at` of the first `failures` epochs that reach it."""

    def __init__(self, fail_at=3, failures=1):
        super().__init__({"x": X, "y": Y}, BATCH, shuffle=False)
        self.fail_at, self.failures = fail_at, failures

    def batch_at(self, index, plan=None):
        if index == self.fail_at and self.failures > 0:
            self.failures -= 1
            read_corrupt_record(index)
        return super().batch_at(index, plan)


def read_corrupt_record(index):
    raise RuntimeError(f"corrupt record in batch {index}")


class BrokenIterable(PlainBatches):
    def __iter__(self):
        for i, batch in enumerate(super().__iter__()):
            if i == 3:
                read_corrupt_record(i)
            yield batch


def prefetch_threads() -> list[str]:
    """Names of live prefetch threads, after giving exiting ones time to finish (minutes at
    most: a busy machine may not schedule a thread that is exiting for a while)."""
    deadline = time.monotonic() + 300.0
    while True:
        names = [t.name for t in threading.enumerate() if t.name.startswith("nitro-prefetch")]
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.01)


def live_batches(shape=BATCH_SHAPE) -> list[jax.Array]:
    return [a for a in jax.live_arrays() if a.shape == shape]


def all_freed(n: nitro.Nitro) -> dict[str, tuple[int, int]]:
    """split -> (placed, freed) for every split whose counters differ."""
    return {
        split: (p.placed, p.freed)
        for split, p in n.runtime.prefetchers.items()
        if p.placed != p.freed
    }


def params_of(n: nitro.Nitro) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(n.model, nnx.Param))]
