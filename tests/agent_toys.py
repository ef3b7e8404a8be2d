"""Experiments the agent-tool tests name by module (`agent_toys.Slow`): tiny, and one slow
enough to stop in the middle of an epoch."""

from __future__ import annotations

import time

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
