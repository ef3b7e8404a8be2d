"""Sources for the worker-process tests: `pipeline_toys`' samples, augmented in Python.

Worker processes import this module to unpickle the sources, so it stays small.
"""

from __future__ import annotations

import os
import time

import numpy as np
from pipeline_toys import BATCH, X, Y

from nitro.data import ArrayLoader


def busy(rounds: int) -> None:
    """A fixed amount of pure Python work, which holds the interpreter lock (about 2 us a
    round; a loop timed by the clock would not: two threads would both end on time)."""
    for _ in range(rounds):
        sum(range(100))


class Augmented(ArrayLoader):
    """8 shuffled batches of 12 whose samples get noise drawn from (epoch, batch index), after
    `work` rounds of pure Python and `sleep` seconds asleep per batch; batch `fail_at` fails,
    and the process that builds batch `die_at` exits at once (as a crash or a kill would)."""

    def __init__(
        self,
        work: int = 0,
        sleep: float = 0.0,
        fail_at: int | None = None,
        die_at: int | None = None,
    ):
        super().__init__({"x": X, "y": Y}, BATCH, seed=0)
        self.work, self.sleep, self.fail_at, self.die_at = work, sleep, fail_at, die_at

    def begin_epoch(self, epoch):
        return epoch, super().begin_epoch(epoch)

    def batch_at(self, index, plan=None):
        epoch, rows = plan if plan is not None else (0, None)
        if index == self.die_at:
            os._exit(3)
        if index == self.fail_at:
            raise ValueError(f"cannot decode the record of sample {index * BATCH}")
        batch = super().batch_at(index, rows)
        noise = np.random.default_rng((epoch, index)).normal(scale=0.1, size=batch["x"].shape)
        batch["x"] = batch["x"] + noise.astype(np.float32)
        busy(self.work)
        time.sleep(self.sleep)
        return batch


class StartsInNoWorker(Augmented):
    """An `Augmented` that cannot be loaded in another process (as a source whose module a
    worker cannot import): worker processes die before their first batch."""

    def __init__(self, work: int = 0):
        super().__init__(work=work)
        self.home = os.getpid()

    def __setstate__(self, state):
        if state["home"] != os.getpid():
            raise ImportError("this source cannot be loaded in a worker process")
        self.__dict__.update(state)
