"""Prefetching: settings, paths, order, errors, shutdown and the data-wait fraction."""

from __future__ import annotations

import os
import threading
import time
import traceback
import warnings

import jax
import numpy as np
import pytest
from pipeline_toys import (
    BATCH,
    BATCH_SHAPE,
    BrokenIterable,
    BrokenSource,
    Pipe,
    PlainBatches,
    RecordingLoader,
    X,
    Y,
    all_freed,
    live_batches,
    params_of,
    prefetch_threads,
)

import nitro
from nitro.data import ArrayLoader, NoPrefetch, Prefetcher, PrefetchSettings
from nitro.engine import loop

WAIT = 300  # seconds: a bound for conditions, never reached unless the code is wrong


def run(source, max_epochs=1, **keywords):
    n = nitro.Nitro(Pipe(max_epochs=max_epochs), data={"train": source}, progress=False, **keywords)
    return n.train()


# settings ---------------------------------------------------------------------------------------


def test_prefetch_defaults():
    settings = PrefetchSettings()
    workers = max(1, min(4, os.cpu_count() or 1))
    assert settings.workers == workers
    assert settings.device_batches == 1
    assert settings.host_depth == 2 * workers
    assert settings.ordered is True

    n = nitro.Nitro(Pipe(), prefetch="threads", progress=False)
    assert n.keywords["prefetch_workers"].value == workers
    prefetcher = n.runtime.prefetchers["train"]
    assert prefetcher.settings == settings
    assert prefetcher.path == ("fanout" if workers > 1 else "single")
    assert f"host_batches={2 * workers}, device_batches=1, ordered=True" in prefetcher.describe()


@pytest.mark.serial  # auto's choice is a measurement of this machine
def test_a_cheap_source_whose_first_build_was_slow_is_still_built_inline():
    # a cold first build (or a busy machine's pause) of 20 ms, then microseconds a batch: the
    # fastest of a few warm builds counts, so no worker thread or process starts for it
    source = SlowFirstBuild()
    n = nitro.Nitro(Pipe(), data={"train": source}, progress=False)
    assert n.runtime.prefetchers["train"].path == "inline"
    assert len(source.calls) > 1  # built again, warm


class SlowFirstBuild(RecordingLoader):
    """A loader whose first batch takes 20 ms to build, and every later one microseconds."""

    def batch_at(self, index, plan=None):
        if not self.calls:
            time.sleep(0.02)
        return super().batch_at(index, plan)


@pytest.mark.serial  # auto's choice is a measurement of this machine
def test_auto_builds_cheap_batches_inline_and_slow_ones_on_workers():
    cheap = nitro.Nitro(Pipe(), progress=False)  # an ArrayLoader: microseconds per batch
    assert cheap.keywords["prefetch"].value == "auto"
    prefetcher = cheap.runtime.prefetchers["train"]
    assert prefetcher.path == "inline"
    assert "inline: a batch builds in" in prefetcher.describe()
    slow = nitro.Nitro(
        Pipe(), data={"train": RecordingLoader(delay=lambda i: 0.002)}, progress=False
    )
    # off the training thread; threads or processes is auto's measurement (test_data_processes)
    assert slow.runtime.prefetchers["train"].path in ("fanout", "single", "processes")
    forced = nitro.Nitro(
        Pipe(),
        prefetch="inline",
        data={"train": RecordingLoader(delay=lambda i: 0.002)},
        progress=False,
    )
    assert forced.runtime.prefetchers["train"].path == "inline"
    asked = nitro.Nitro(Pipe(), prefetch_workers=2, progress=False)  # workers asked for
    assert asked.runtime.prefetchers["train"].path == "fanout"
    with pytest.raises(
        ValueError, match="prefetch must be one of 'auto', 'threads', 'processes', 'inline'"
    ):
        nitro.Nitro(Pipe(), prefetch="eager")


@pytest.mark.parametrize(
    "keywords, names",
    [
        ({"prefetch_workers": 0}, ["prefetch_workers", ">= 1"]),
        ({"device_batches": 0}, ["device_batches", ">= 1"]),
        ({"prefetch_workers": 3, "host_batches": 2}, ["host_batches", "deadlock", "(3)"]),
        ({"host_batches": "4"}, ["host_batches", "'4'"]),
        ({"ordered": "yes"}, ["ordered", "True or False"]),
    ],
)
def test_invalid_prefetch_settings_are_refused(keywords, names):
    with pytest.raises(ValueError) as error:
        nitro.Nitro(Pipe(), progress=False, **keywords)
    for name in names:
        assert name in str(error.value)


@pytest.mark.parametrize("field", ["workers", "device_batches"])
@pytest.mark.parametrize("value", [0, True, 1.5])
def test_prefetch_settings_refuse_non_positive_ints(field, value):
    with pytest.raises(ValueError, match=f"{field}.*>= 1.*NoPrefetch"):
        PrefetchSettings(**{field: value})


# order and paths --------------------------------------------------------------------------------


def _indices(source, **settings):
    prefetcher = Prefetcher(source, place=jax.device_put, settings=PrefetchSettings(**settings))
    seen = []
    with prefetcher.epoch(0) as stream:
        for staged in stream:
            seen.append(staged.index)
            np.testing.assert_array_equal(
                np.asarray(staged.device["x"]), source.batch_at(staged.index, None)["x"]
            )
            staged.free()
    assert prefetcher.placed == prefetcher.freed == len(source)
    return seen


def test_ordered_delivery_follows_the_source_order():
    # batch 0 is by far the slowest to build: with 4 workers the others are ready first
    slow_first = RecordingLoader(shuffle=False, delay=lambda i: 0.08 if i == 0 else 0.0)
    assert _indices(slow_first, workers=4, ordered=True) == list(range(len(slow_first)))

    slow_first = RecordingLoader(shuffle=False, delay=lambda i: 0.08 if i == 0 else 0.0)
    unordered = _indices(slow_first, workers=4, ordered=False)
    assert sorted(unordered) == list(range(len(slow_first)))  # every batch exactly once
    assert unordered[0] != 0  # ... as soon as it is ready


def test_ordered_prefetch_makes_runs_reproducible_and_equal_to_no_prefetch():
    jitter = np.random.default_rng(1).uniform(0, 0.004, size=8)
    results = []
    for source in (
        RecordingLoader(delay=lambda i: jitter[i]),
        RecordingLoader(delay=lambda i: jitter[::-1][i]),
        NoPrefetch(RecordingLoader()),
    ):
        n = run(source, max_epochs=2, prefetch_workers=3)
        results.append((n.history()["loss"].tolist(), params_of(n)))
    for losses, params in results[1:]:
        assert losses == results[0][0]
        for a, b in zip(params, results[0][1], strict=True):
            np.testing.assert_array_equal(a, b)


def test_index_addressable_source_is_built_by_several_workers():
    source = RecordingLoader(delay=lambda i: 0.01)
    n = run(source, prefetch_workers=3)
    assert n.runtime.prefetchers["train"].path == "fanout"
    workers = {t for t in source.threads if t != "MainThread"}  # not the setup probe
    assert len(workers) >= 2, workers
    assert all(name.startswith("nitro-prefetch-train-worker") for name in workers)
    assert n.step == len(source)


def test_unordered_fanout_trains_every_batch():
    n = run(RecordingLoader(delay=lambda i: 0.002 * (i % 3)), prefetch_workers=2, ordered=False)
    assert n.runtime.prefetchers["train"].path == "fanout_unordered"
    assert n.step == 8 and not all_freed(n)


@pytest.mark.parametrize(
    "source",
    [
        PlainBatches(),
        [{"x": X[i : i + BATCH], "y": Y[i : i + BATCH]} for i in range(0, 96, BATCH)],
        (lambda: (yield from PlainBatches())),
    ],
    ids=["iterable-class", "list", "generator-function"],
)
def test_any_restartable_iterable_of_dicts_is_a_source(source):
    if callable(source):  # a generator function is not restartable: wrap it in a class
        make = source
        source = type("Regenerating", (), {"__iter__": lambda self: make()})()
    n = run(source, max_epochs=3)
    assert n.runtime.prefetchers["train"].path == "single"
    assert n.step == 3 * 8
    assert np.isfinite(n.history()["loss"]).all()


def test_a_plain_iterable_is_read_by_one_producer_thread():
    source = PlainBatches()
    run(source, max_epochs=2)
    assert source.iterations == 3  # the setup probe and two epochs
    assert source.threads - {"MainThread"} == {"nitro-prefetch-train-producer"}


def test_no_prefetch_builds_batches_on_the_training_thread():
    source = RecordingLoader()
    n = run(NoPrefetch(source), max_epochs=2)
    prefetcher = n.runtime.prefetchers["train"]
    assert prefetcher.path == "inline" and prefetcher.describe() == "no prefetch (inline)"
    built = [t for t in source.threads if t != "MainThread"]  # not the setup probe
    assert {name.split("-")[1] for name in built} == {"training"}
    assert n.step == 16 and not all_freed(n)


# errors and shutdown ----------------------------------------------------------------------------


@pytest.mark.parametrize("source", [BrokenSource, BrokenIterable], ids=["fanout", "single"])
def test_a_producer_exception_surfaces_in_train_with_its_traceback(source):
    n = nitro.Nitro(Pipe(), data={"train": source()}, progress=False)
    with pytest.raises(RuntimeError, match="corrupt record in batch 3") as error:
        n.train()
    frames = [frame.name for frame in traceback.extract_tb(error.value.__traceback__)]
    assert "read_corrupt_record" in frames  # raised on the producer thread ...
    assert "train" in frames  # ... and re-raised through n.train()
    assert n.phase == "failed"
    assert prefetch_threads() == []
    assert not all_freed(n)
    assert live_batches() == []


def test_closing_an_epoch_early_stops_the_workers_and_frees_what_they_staged():
    source = RecordingLoader(delay=lambda i: 0.001)
    prefetcher = Prefetcher(
        source, place=jax.device_put, settings=PrefetchSettings(workers=2, device_batches=2)
    )
    stream = prefetcher.epoch(0)
    received = [next(stream), next(stream)]
    assert _wait_for(lambda: prefetcher.placed >= 4)  # two received, two staged ahead
    assert any(t.name.startswith("nitro-prefetch") for t in threading.enumerate())
    stream.close()
    assert prefetch_threads() == []
    assert prefetcher.freed == prefetcher.placed - 2  # all but the two the loop holds
    for staged in received:
        staged.free()
    assert prefetcher.freed == prefetcher.placed
    assert live_batches() == []


def test_no_prefetch_thread_outlives_train_stop_or_error():
    n = run(RecordingLoader(), max_epochs=2, prefetch_workers=2)
    assert prefetch_threads() == []
    # epochs enough that only the stop ends the run, however long the wait for step 3 takes
    n = nitro.Nitro(
        Pipe(max_epochs=100_000),
        data={"train": RecordingLoader(delay=lambda i: 0.002)},
        progress=False,
    )
    n.train(background=True)
    assert _wait_for(lambda: n.step >= 3)
    n.stop().wait()
    assert n.stop_reason == "requested"
    assert prefetch_threads() == []
    with pytest.raises(RuntimeError):
        run(BrokenSource())
    assert prefetch_threads() == []


def _wait_for(condition, seconds=WAIT) -> bool:
    """Whether `condition()` holds within `seconds`: minutes, for a busy machine's compiles."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# data_wait_frac ---------------------------------------------------------------------------------


def test_data_wait_frac_is_in_the_history_of_every_epoch():
    n = run(RecordingLoader(), max_epochs=3)
    frac = n.history()["data_wait_frac"]
    assert len(frac) == 3
    assert ((frac >= 0) & (frac <= 1)).all()


@pytest.mark.parametrize("prefetch", ["inline", "threads"])
def test_data_wait_frac_does_not_count_the_pipeline_fill_for_arrays_in_memory(prefetch):
    # the digits MLP's 9-step epochs, one fused call each: the only waits are the stream's
    # fill and its end, which no pipeline could hide: nothing is counted
    from nitro.examples.digits import Digits

    n = nitro.Nitro(
        Digits(width=16, max_epochs=3),
        steps_per_dispatch=9,
        prefetch=prefetch,
        checkpointer=None,
        logger=None,
        progress=False,
    )
    n.train()
    assert n.step == 27
    assert n.history()["data_wait_frac"].tolist() == [0.0, 0.0, 0.0]


def test_a_slow_source_warns_how_to_fix_it():
    loop.DATA_WAIT_WARNING.reset()  # the warning fires once per process
    x = np.resize(X, (60 * BATCH, X.shape[1]))
    y = np.resize(Y, 60 * BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = run(PlainBatches(x, y, sleep=0.005))
    frac = n.history()["data_wait_frac"].iloc[0]
    assert frac > loop.DATA_WAIT_WARN
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    message = messages[0]
    assert "waited for data" in message
    assert "prefetch_workers" in message and "batch_at" in message


# grain ------------------------------------------------------------------------------------------


def _rows():
    return [{"x": X[i], "y": Y[i]} for i in range(len(X))]


def _reference_losses():
    source = ArrayLoader({"x": X, "y": Y}, BATCH, shuffle=False)
    return run(source, max_epochs=2).history()["loss"].tolist()


def test_grain_map_dataset_is_a_source():
    grain = pytest.importorskip("grain")
    dataset = grain.MapDataset.source(_rows()).batch(BATCH, drop_remainder=True)
    # threads: "auto" may measure processes faster on a busy machine, which is not this test's
    n = run(dataset, max_epochs=2, prefetch="threads")
    # random access: an index-addressable GrainSource, built by the prefetch workers
    assert isinstance(n.runtime.prefetchers["train"].source, nitro.data.GrainSource)
    assert n.runtime.prefetchers["train"].path in ("fanout", "inline")
    assert n.step == 16
    np.testing.assert_allclose(n.history()["loss"].tolist(), _reference_losses(), rtol=1e-6)


def test_grain_data_loader_is_a_source():
    grain = pytest.importorskip("grain")
    loader = grain.DataLoader(
        data_source=_rows(),
        sampler=grain.samplers.IndexSampler(len(X), shuffle=False, num_epochs=1),
        operations=[grain.transforms.Batch(BATCH, drop_remainder=True)],
        worker_count=0,  # worker processes take seconds to start: too slow for a unit test
    )
    n = run(loader, max_epochs=2)
    assert n.step == 16
    np.testing.assert_allclose(n.history()["loss"].tolist(), _reference_losses(), rtol=1e-6)
    assert prefetch_threads() == []
    assert live_batches(BATCH_SHAPE) == []


# multi-process loaders --------------------------------------------------------------------------


def test_a_per_process_loader_in_one_process_yields_the_whole_batch():
    # across processes it yields its slice (tests/test_multihost.py); alone, everything
    shared = ArrayLoader({"x": X, "y": Y}, BATCH, per_process=True)
    plain = ArrayLoader({"x": X, "y": Y}, BATCH)
    assert (shared.process, shared.processes) == (0, 1)
    assert shared.batch_size == shared.global_batch_size == BATCH
    plan = shared.begin_epoch(2)
    for index in range(len(shared)):
        np.testing.assert_array_equal(
            shared.batch_at(index, plan)["x"], plain.batch_at(index, plan)["x"]
        )


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_array_loader_gathers_consecutive_batches_as_the_stacked_batches(shuffle):
    x = np.arange(70 * 3, dtype=np.float32).reshape(70, 3)
    y = np.arange(70, dtype=np.int32)
    loader = ArrayLoader({"x": x, "y": y}, 8, shuffle=shuffle, seed=5)
    plan = loader.begin_epoch(2)
    block = loader.block_at(3, 4, plan)
    for name in ("x", "y"):
        expected = np.stack([loader.batch_at(i, plan)[name] for i in range(3, 7)])
        np.testing.assert_array_equal(block[name], expected)
    block["x"][...] = -1  # a copy: the loader's arrays are untouched
    assert x.min() == 0
    assert loader.block_at(6, 3, plan) is None  # batch 8 is the partial one (70 = 8 x 8 + 6)
