"""Grain and Hugging Face `datasets` as sources: per-epoch order from (seed, epoch), the same
run twice, a SIGKILL mid-epoch and resume with a randomly augmenting Grain pipeline, a
`datasets.Dataset` and `IterableDataset` trained by column name and resumed, sharding by
process index, and the errors for datasets that yield the wrong things. Real grain, real
datasets (built in memory: no download)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import datasets
import grain
import numpy as np
import optax
import pytest
from flax import nnx
from grain_toys import MLP, Augmented, augmented, batched_marked, rows
from lifecycle_toys import parameters
from system import child_env

import nitro
from nitro.data import GrainSource, HFIterableSource, HFSource
from nitro.errors import SetupError

EVERY_EPOCH = nitro.Checkpointer(budget=None)


def epoch_of(source, epoch: int) -> list[dict[str, np.ndarray]]:
    plan = source.begin_epoch(epoch)
    return [source.batch_at(i, plan) for i in range(len(source))]


def same(a: list[dict], b: list[dict]) -> bool:
    return all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def ids(n: int = 40):
    """A dataset of `n` samples whose field `id` says which sample it is."""
    return grain.MapDataset.source(
        [{"id": np.int64(i), "x": np.full(3, i, np.float32)} for i in range(n)]
    )


# per-epoch order -------------------------------------------------------------------------------


def test_each_epoch_is_reshuffled_and_reaugmented_as_a_function_of_seed_and_epoch():
    source = GrainSource(augmented(), batch_size=8).with_seed(3)
    epochs = [epoch_of(source, e) for e in range(3)]
    assert not same(epochs[0], epochs[1]) and not same(epochs[1], epochs[2])
    again = GrainSource(augmented(), batch_size=8).with_seed(3)  # a fresh pipeline, same seed
    assert same(epoch_of(again, 1), epochs[1]) and same(epoch_of(again, 0), epochs[0])
    other = GrainSource(augmented(), batch_size=8).with_seed(4)
    assert not same(epoch_of(other, 1), epochs[1])

    # the order is a permutation of every sample each epoch; the augmentation differs too
    plain = GrainSource(ids(), batch_size=8, drop_last=False).with_seed(3)
    orders = [np.concatenate([b["id"] for b in epoch_of(plain, e)]) for e in range(2)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(40))
    assert orders[0].tolist() != orders[1].tolist()
    first_sample = [b["x"][0] for b in (epochs[0][0], epochs[1][0])]
    assert not np.array_equal(*first_sample)


def test_a_batched_pipeline_shuffles_anew_each_epoch_by_its_own_seed():
    # before, a .shuffle(seed=0) split saw the same order every epoch
    batched = ids().shuffle(seed=0).batch(8, drop_remainder=True)
    n = nitro.Nitro(
        Ids(max_epochs=1), data={"train": batched}, progress=False, logger=None, checkpointer=None
    )
    source = n.runtime.prefetchers["train"].source
    assert isinstance(source, GrainSource) and source.batched and len(source) == 5
    firsts = [epoch_of(source, e)[0]["id"].tolist() for e in range(3)]
    assert firsts[0] != firsts[1] != firsts[2]
    assert firsts == [
        epoch_of(GrainSource(batched, shuffle=False), e)[0]["id"].tolist() for e in range(3)
    ]
    n.train()


def test_the_run_seed_orders_the_epochs_and_the_same_run_twice_is_bitwise_equal():
    def train(seed):
        n = nitro.Nitro(Augmented(max_epochs=2), seed=seed, progress=False, logger=None)
        return n.train()

    a, b, c = train(3), train(3), train(4)
    source = a.runtime.prefetchers["train"].source
    assert isinstance(source, GrainSource) and source.seed == 3  # the run's seed
    assert same(epoch_of(source, 1), epoch_of(b.runtime.prefetchers["train"].source, 1))
    assert a.history()["loss"].tolist() == b.history()["loss"].tolist()
    assert a.history()["val_loss"].tolist() == b.history()["val_loss"].tolist()
    for name, value in parameters(a).items():
        assert np.array_equal(value, parameters(b)[name]), name
    assert a.history()["loss"].tolist() != c.history()["loss"].tolist()


# crash and resume -----------------------------------------------------------------------------


def child(mode: str, *args: str, **popen) -> subprocess.Popen:
    code = "import grain_toys; grain_toys.main()"
    return subprocess.Popen(
        [sys.executable, "-c", code, mode, *args], env=child_env(), text=True, **popen
    )


def test_a_grain_run_killed_mid_epoch_resumes_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    """Four epochs of randomly augmented, shuffled Grain samples through dropout: a run
    SIGKILLed in the middle of epoch 3 and resumed in a new process against one that ran
    through."""
    full = child("full", str(tmp_path / "full"), str(tmp_path / "full"))
    crash = child("crash", str(tmp_path / "crashed"), stderr=subprocess.PIPE)
    _, crash_err = crash.communicate(timeout=300)
    assert crash.returncode == -signal.SIGKILL, crash_err
    resumed = child(
        "resume", str(tmp_path / "crashed"), str(tmp_path / "resumed"), stdout=subprocess.PIPE
    )
    said, _ = resumed.communicate(timeout=300)
    assert full.wait(timeout=300) == 0 and resumed.returncode == 0

    assert said.splitlines()[0] == "resumed at epoch 2, step 16"
    a, b = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("full", "resumed"))
    assert a["loss"] == b["loss"] and a["val_loss"] == b["val_loss"]  # bitwise
    assert (b["step"], b["epoch"]) == (32, 4)
    pa, pb = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(pa) == sorted(pb) and len(pa) == 4
    for name in pa:
        assert np.array_equal(pa[name], pb[name]), name


class StopAtStep:
    def __init__(self, at: int):
        self.at, self.handle = at, None

    def step(self, step, loss):
        if step == self.at and self.handle is not None:
            self.handle.stop()


def stop_and_resume(experiment, run_dir: str, at: int, **keywords):
    """`experiment` trained through, and the same stopped at step `at` and resumed."""
    full = nitro.Nitro(experiment, progress=False, logger=None, **keywords).train()
    reporter = StopAtStep(at)
    stopped = nitro.Nitro(experiment, run_dir=run_dir, progress=reporter, logger=None, **keywords)
    reporter.handle = stopped
    stopped.train()
    assert stopped.stop_reason == "requested" and at <= stopped.step < at + 3
    assert stopped.step % 8  # mid-epoch (8 batches an epoch)
    resumed = nitro.Nitro(experiment, run_dir=run_dir, resume="auto", progress=False, **keywords)
    assert resumed.step == stopped.step
    return full, resumed.train()


def assert_equal_runs(a, b):
    for column in ("loss", "val_loss"):
        assert a.history()[column].tolist() == b.history()[column].tolist(), column
    for name, value in parameters(a).items():
        assert np.array_equal(value, parameters(b)[name]), name


def test_a_grain_run_stopped_mid_epoch_resumes_at_that_batch_exactly(tmp_path):
    full, resumed = stop_and_resume(
        Augmented(max_epochs=3), str(tmp_path / "run"), at=11, steps_per_dispatch=1
    )
    assert (resumed.step, resumed.epoch) == (24, 3)
    assert_equal_runs(full, resumed)


# Hugging Face datasets -------------------------------------------------------------------------


def table(lo: int, hi: int) -> datasets.Dataset:
    x, y = np.asarray([r["x"] for r in rows(lo, hi)]), np.asarray([r["y"] for r in rows(lo, hi)])
    names = [f"sample-{i}" for i in range(lo, hi)]  # a string column: stays on the host
    return datasets.Dataset.from_dict({"features": x, "label": y, "name": names})


@nitro.experiment
class Columns:
    """A Hugging Face table's columns routed to the hooks by name."""

    batch_size: int = 8
    max_epochs: int = 3

    def build_data(self):
        return {"train": table(0, 64), "val": table(64, 96)}

    def build_model(self, rngs):
        return MLP(rngs)

    def forward(self, model, *, features):
        return model(features)

    def loss(self, logits, *, label):
        return optax.softmax_cross_entropy_with_integer_labels(logits, label).mean()


def test_a_hugging_face_dataset_trains_by_column_name_and_resumes_exactly(tmp_path):
    full, resumed = stop_and_resume(Columns(), str(tmp_path / "run"), at=11, steps_per_dispatch=1)
    assert (resumed.step, resumed.epoch) == (24, 3)
    assert_equal_runs(full, resumed)
    split = full.setup.splits["train"]
    assert split.fields == ("features", "label", "name")
    assert split.device_fields == ("features", "label")  # the names go nowhere near the device
    source = full.runtime.prefetchers["train"].source
    assert isinstance(source, HFSource) and source.seed == 0
    orders = [np.concatenate([b["label"] for b in epoch_of(source, e)]) for e in range(2)]
    names = [np.concatenate([b["name"] for b in epoch_of(source, e)]) for e in range(2)]
    assert names[0].tolist() != names[1].tolist() and sorted(names[0]) == sorted(names[1])
    assert orders[0].sum() == orders[1].sum()


@nitro.experiment
class Stream(Columns):
    def build_data(self):
        return {"train": table(0, 64).to_iterable_dataset(num_shards=4)}


def test_a_hugging_face_iterable_dataset_is_reshuffled_each_epoch_and_resumes_exactly(tmp_path):
    source = HFIterableSource(table(0, 64).to_iterable_dataset(num_shards=4), 8).with_seed(2)
    names = [[b["name"].tolist() for b in source.iter_epoch(e)] for e in (0, 1, 1)]
    assert names[1] == names[2] and names[0] != names[1]  # a function of (seed, epoch)
    assert sorted(sum(names[0], [])) == sorted(sum(names[1], []))  # every row, once
    full, resumed = stop_and_resume(Stream(), str(tmp_path / "run"), at=11, steps_per_dispatch=1)
    assert (resumed.step, resumed.epoch) == (24, 3)
    for name, value in parameters(full).items():
        assert np.array_equal(value, parameters(resumed)[name]), name
    assert full.history()["loss"].tolist() == resumed.history()["loss"].tolist()


# sharding by process ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["grain", "grain batched", "datasets"])
def test_shards_by_process_index_are_disjoint_and_cover_every_global_batch(kind):
    processes = 4

    def source(shard):
        if kind == "grain":
            return GrainSource(ids(), batch_size=8, shard=shard).with_seed(5)
        if kind == "grain batched":
            return GrainSource(ids().shuffle(seed=1).batch(2), shard=shard).with_seed(5)
        table = datasets.Dataset.from_dict({"id": np.arange(40)})
        return HFSource(table, batch_size=8, shard=shard).with_seed(5)

    whole = source((0, 1))
    shards = [source((p, processes)) for p in range(processes)]
    for epoch in (0, 1):
        seen = [np.concatenate([b["id"] for b in epoch_of(s, epoch)]) for s in shards]
        together = np.concatenate(seen)
        assert len(set(together.tolist())) == len(together)  # disjoint
        assert sorted(together.tolist()) == sorted(
            np.concatenate([b["id"] for b in epoch_of(whole, epoch)]).tolist()
        )  # and together the whole epoch
        if kind != "grain batched":  # each process's rows are its slice of the global batch
            for index, global_batch in enumerate(epoch_of(whole, epoch)):
                parts = [epoch_of(s, epoch)[index]["id"] for s in shards]
                assert np.concatenate(parts).tolist() == global_batch["id"].tolist()
    assert [len(s) for s in shards] == [
        len(whole) // (processes if kind == "grain batched" else 1)
    ] * 4


def test_a_global_batch_that_does_not_divide_across_processes_is_refused():
    with pytest.raises(SetupError, match=r"batch_size=6 does not divide across 4 processes"):
        GrainSource(ids(), batch_size=6, shard=(1, 4))


# errors -----------------------------------------------------------------------------------------


@nitro.experiment
class Ids:
    batch_size: int = 8
    max_epochs: int = 1

    def build_data(self):
        return {"train": ids()}

    def build_model(self, rngs):
        return nnx.Linear(3, 1, rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, out, *, id):
        return ((out[:, 0] - id) ** 2).mean()


def build(train, **keywords):
    return nitro.Nitro(Ids(**keywords), data={"train": train}, progress=False, logger=None)


def test_a_grain_dataset_of_non_dicts_is_refused_naming_the_split_and_what_was_expected():
    arrays = grain.MapDataset.source([np.ones(3, np.float32)] * 16)
    with pytest.raises(
        SetupError,
        match=r"the 'train' split yields ndarray elements; each sample must be a dict of arrays",
    ):
        build(arrays)
    with pytest.raises(SetupError, match=r"the 'train' split yields tuple elements; each batch"):
        build(grain.MapDataset.source([(np.ones(3),)] * 16).batch(4))


def test_ragged_samples_and_batches_are_refused_naming_the_split_and_the_field():
    ragged = grain.MapDataset.source(
        [{"id": np.int64(i), "x": np.ones(3 if i % 2 else 4, np.float32)} for i in range(16)]
    )
    with pytest.raises(
        SetupError,
        match=r"the 'train' split: field 'x' is ragged in batch 0: its samples have shapes \[\(3,\), \(4,\)\]",
    ):
        build(GrainSource(ragged, batch_size=8, shuffle=False))
    with pytest.raises(
        SetupError,
        match=r"(?s)the 'train' split failed to build batch 0: .*Every sample of a batch needs the same fields",
    ):
        build(ragged.batch(8))
    short = ids().batch(8).map(lambda b: {"id": b["id"][:3], "x": b["x"]})
    with pytest.raises(
        SetupError, match=r"the 'train' split: batch 0 is ragged: .*'id': 3, 'x': 8"
    ):
        build(short)


def test_a_dataset_of_samples_without_a_batch_size_is_refused_with_the_fixes():
    @nitro.experiment
    class NoSize:
        build_data, build_model, forward, loss = (
            Ids.build_data,
            Ids.build_model,
            Ids.forward,
            Ids.loss,
        )

    with pytest.raises(
        SetupError, match=r"the 'train' split yields single samples .* batch_size field"
    ):
        nitro.Nitro(NoSize(), progress=False)
    with pytest.raises(SetupError, match=r"is batched already .* drop batch_size="):
        GrainSource(ids().batch(4), batch_size=4)
    with pytest.raises(SetupError, match=r"DatasetDict of splits \['train'\]; give one split each"):
        build(datasets.DatasetDict({"train": table(0, 8)}))


def test_a_batched_pipeline_runs_its_map_in_the_worker_processes_with_the_batches_of_threads(
    tmp_path,
):
    losses, marks = {}, {}
    for mode in ("threads", "processes"):
        folder = tmp_path / mode
        folder.mkdir()
        n = nitro.Nitro(
            Augmented(max_epochs=2),
            data={
                "train": batched_marked(str(folder)),
                "val": grain.MapDataset.source(rows(64, 96)),
            },
            prefetch=mode,
            prefetch_workers=2,
            steps_per_dispatch=1,
            checkpointer=None,
            progress=False,
        )
        losses[mode] = n.train().history()["loss"].tolist()
        marks[mode] = {int(p.name): len(p.read_text().split()) for p in folder.iterdir()}
    assert losses["processes"] == losses["threads"]
    trained = 2 * 8  # batches: the rest the parent reads at setup, for the shapes
    assert list(marks["threads"]) == [os.getpid()] and marks["threads"][os.getpid()] > trained
    in_workers = {pid: count for pid, count in marks["processes"].items() if pid != os.getpid()}
    assert sum(in_workers.values()) == trained  # the workers ran the map of every batch
    assert marks["processes"][os.getpid()] == marks["threads"][os.getpid()] - trained
