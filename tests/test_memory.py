"""Device memory: every batch the loop places is deleted; state the user relies on is not.

Batches are 12 x 7 (see pipeline_toys): an array of that shape in `jax.live_arrays()` is a
batch buffer nobody freed. The prefetchers' counters (`placed`, `freed`) count the rest.
"""

from __future__ import annotations

import gc
import threading
import time

import jax
import numpy as np
import pytest
from pipeline_toys import (
    BATCH,
    BATCH_SHAPE,
    BrokenSource,
    Pipe,
    PipeWithDeviceMetrics,
    PipeWithMetrics,
    RecordingLoader,
    X,
    Y,
    all_freed,
    live_batches,
    prefetch_threads,
)

import nitro
from nitro.data import ArrayLoader, NoPrefetch

# Live arrays a run may hold at once beyond those before it: the handle's state and two more
# sets of it while a step is unread (13 leaves each for this model and adam: the input of the
# step read back and of the step in flight, which the guard restores from), the batches in
# flight (staged, running, awaiting read-back: 2 arrays each), the step feed's cached blocks of
# each fused size "auto" times (up to 3) and a few scalars. A leak of one array per step would
# exceed it within the first epoch of the 2,000-step run.
LIVE_ARRAY_BOUND = 80


def assert_all_batches_freed(n: nitro.Nitro) -> None:
    assert not all_freed(n), f"placed/freed differ: {all_freed(n)}"
    assert live_batches() == []
    assert live_batches((BATCH,)) == []  # the labels
    assert prefetch_threads() == []


def state_is_alive(n: nitro.Nitro) -> bool:
    leaves = jax.tree.leaves(n.state.variables)
    return bool(leaves) and not any(leaf.is_deleted() for leaf in leaves)


def still_trains_and_predicts(n: nitro.Nitro) -> None:
    step, epoch = n.step, n.epoch
    n.train(epochs=1)
    assert n.epoch == epoch + 1 and n.step > step
    assert n.predict({"x": X[:5]}).shape == (5, 3)
    assert state_is_alive(n)


class CountingLoader(RecordingLoader):
    """Counts live batch arrays each time a worker starts building a batch."""

    def __init__(self, **options):
        super().__init__(**options)
        self.live = []

    def batch_at(self, index, plan=None):
        self.live.append(len(live_batches()))
        return super().batch_at(index, plan)


# training ---------------------------------------------------------------------------------------


def test_every_training_batch_is_deleted_across_epochs():
    n = nitro.Nitro(PipeWithMetrics(max_epochs=3), progress=False)
    n.train()
    assert n.runtime.prefetchers["train"].placed == 3 * 8
    assert n.runtime.prefetchers["val"].placed == 3 * 2
    assert_all_batches_freed(n)
    assert state_is_alive(n)


@pytest.mark.parametrize("device_batches", [1, 3])
def test_batches_are_freed_during_the_run_not_only_at_the_end(device_batches):
    source = CountingLoader(delay=lambda i: 0.001)
    n = nitro.Nitro(
        Pipe(max_epochs=4), data={"train": source}, progress=False, device_batches=device_batches
    )
    n.train()
    # staged (device_batches), one in the transfer stage, the step just dispatched and the one
    # whose loss is being read back
    assert max(source.live) <= device_batches + 3, source.live
    assert_all_batches_freed(n)


def test_no_prefetch_frees_every_batch_too():
    n = nitro.Nitro(
        Pipe(max_epochs=2), data={"train": NoPrefetch(RecordingLoader())}, progress=False
    )
    n.train()
    assert n.runtime.prefetchers["train"].placed == 16
    assert_all_batches_freed(n)


def test_batches_are_deleted_after_a_stop_from_another_thread():
    # epochs enough that only the stop ends the run, however long the wait for step 5 takes
    n = nitro.Nitro(
        Pipe(max_epochs=100_000),
        data={"train": RecordingLoader(delay=lambda i: 0.002)},
        progress=False,
    )
    n.train(background=True)
    deadline = time.monotonic() + 300
    while n.step < 5:
        assert time.monotonic() < deadline, "the background run did not start"
        time.sleep(0.01)
    threading.Thread(target=n.stop).start()
    n.wait()
    assert n.stop_reason == "requested" and n.epoch < 100_000
    assert_all_batches_freed(n)
    still_trains_and_predicts(n)
    assert_all_batches_freed(n)


class Stopper:
    handle = None
    at_step = 0


STOPPER = Stopper()


@nitro.experiment
class StopsItself(Pipe):
    """Asks its own handle to stop from a host hook, after the fifth step."""

    def train_metrics(self, logits, *, y):
        if STOPPER.handle.step + 1 >= STOPPER.at_step:
            STOPPER.handle.stop()
        return {"acc": float((logits.argmax(-1) == y).mean())}

    def metrics_residency(self, hook):
        return "host"


def test_batches_are_deleted_after_a_stop_from_a_hook():
    n = nitro.Nitro(StopsItself(max_epochs=3), progress=False)
    STOPPER.handle, STOPPER.at_step = n, 5
    n.train()
    assert n.stop_reason == "requested"
    assert 5 <= n.step < 24
    assert_all_batches_freed(n)
    STOPPER.at_step = 10**9
    still_trains_and_predicts(n)


def test_batches_are_deleted_after_a_source_error():
    n = nitro.Nitro(Pipe(max_epochs=3), data={"train": BrokenSource(fail_at=5)}, progress=False)
    with pytest.raises(RuntimeError, match="corrupt record"):
        n.train()
    assert_all_batches_freed(n)
    assert state_is_alive(n)
    still_trains_and_predicts(n)  # the source fails once only


def test_batches_are_deleted_after_a_divergence():
    x = X.copy()
    x[5 * BATCH] = np.nan  # batch 5 makes the loss NaN
    source = ArrayLoader({"x": x, "y": Y}, BATCH, shuffle=False)
    n = nitro.Nitro(Pipe(max_epochs=2), data={"train": source}, progress=False)
    with pytest.raises(nitro.DivergenceError):
        n.train()
    assert_all_batches_freed(n)
    assert state_is_alive(n)
    assert np.isfinite(n.predict({"x": X[:5]})).all()


# evaluation -------------------------------------------------------------------------------------


def _new_arrays(held: list) -> list:
    """Batch-shaped arrays (inputs, outputs, per-sample losses: a leading axis of BATCH) alive
    now that were not among `held` (which this test keeps alive, so their ids stay theirs).
    Counting all live arrays instead fails when another thread frees its own, or makes some:
    a run of an earlier test winding down in this process (a 10-class model's arrays)."""
    gc.collect()
    ids = {id(a) for a in held}
    return [a for a in jax.live_arrays() if id(a) not in ids and a.shape[:1] == (BATCH,)]


@pytest.mark.parametrize("experiment", [PipeWithMetrics, PipeWithDeviceMetrics])
def test_eval_inputs_and_outputs_are_deleted(experiment):
    n = nitro.Nitro(experiment(), progress=False)
    n.validate(), n.predict({"x": X[:30]})  # compile first: compiling may hold constants
    gc.collect()
    held = jax.live_arrays()
    assert set(n.validate()) == {"val_loss", "val_acc"}
    assert _new_arrays(held) == []
    assert n.evaluate(split="val")["val_loss"] > 0
    assert _new_arrays(held) == []
    assert n.predict({"x": X[:30]}).shape == (30, 3)  # three chunks of 12, the last padded
    assert _new_arrays(held) == []
    assert live_batches((BATCH, 3)) == []  # the outputs
    assert n.runtime.prefetchers["val"].placed == 2 * 3
    assert_all_batches_freed(n)
    still_trains_and_predicts(n)


def test_user_held_arrays_are_never_deleted():
    n = nitro.Nitro(PipeWithMetrics(max_epochs=1), progress=False)
    model = n.model
    kept = jax.numpy.ones(BATCH_SHAPE)
    n.train()
    n.validate()
    assert not kept.is_deleted()
    assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(nitro_state(model)))
    live_batches_now = live_batches()
    assert len(live_batches_now) == 1 and live_batches_now[0] is kept


def nitro_state(model):
    from flax import nnx

    return nnx.state(model)


# a long run -------------------------------------------------------------------------------------


class LiveCountingLoader(ArrayLoader):
    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.live = []

    def batch_at(self, index, plan=None):
        if threading.current_thread() is not threading.main_thread():  # not the setup probe
            self.live.append(len(jax.live_arrays()))
        return super().batch_at(index, plan)


@pytest.mark.filterwarnings("ignore:the training loop waited for data")  # live_arrays is slow
def test_live_arrays_stay_bounded_over_2000_steps():
    x = np.resize(X, (250 * BATCH, X.shape[1]))
    y = np.resize(Y, 250 * BATCH)
    source = LiveCountingLoader({"x": x, "y": y}, BATCH)
    # threads: the counting batch_at is slow (live_arrays), and "auto" could measure it onto
    # worker processes, whose counts this process never sees
    n = nitro.Nitro(Pipe(max_epochs=8), data={"train": source}, prefetch="threads", progress=False)
    baseline = len(jax.live_arrays())
    n.train()
    assert n.step == 2000
    samples = source.live
    assert len(samples) >= 2000  # every step's batch, plus the setup's probes of the source
    assert max(samples) <= baseline + LIVE_ARRAY_BOUND, (baseline, max(samples))
    # + the step feed's two cached blocks (hyperparameters, Device values) for fused steps
    assert len(jax.live_arrays()) <= baseline + 2
    assert_all_batches_freed(n)
