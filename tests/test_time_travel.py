"""Going back in a run: snapshots in host memory (`snapshots=`), `n.rewind(step)`,
`n.fork(step, **changes)` and the roll-back over loss spikes (`spike=`). Real runs of tiny
models, compared bit for bit: `==` on the history's floats, `np.array_equal` on the
parameters."""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import numpy as np
import optax
import pytest
from lifecycle_toys import Dropped, parameters
from toys import TinyMLP, Toy, X, Y

import nitro
from nitro.progress import TIMING_COLUMNS


def same_history(a, b) -> None:
    """Two histories equal bit for bit, less their timing columns."""
    columns = [c for c in a.columns if c not in TIMING_COLUMNS]
    assert list(b.columns) == list(a.columns)
    assert a[columns].equals(b[columns]), (a[columns], b[columns])


def same_parameters(a: nitro.Nitro, b: nitro.Nitro) -> None:
    pa, pb = parameters(a), parameters(b)
    assert sorted(pa) == sorted(pb)
    for name in pa:
        assert np.array_equal(pa[name], pb[name]), name


class Rewinds:
    """A reporter that keeps the `rewound` events."""

    def __init__(self):
        self.rows: list[dict] = []

    def rewound(self, row):
        self.rows.append(dict(row))


EVERY_STEP = nitro.Snapshots(every=1, keep=100)
EVERY_EPOCH = nitro.Checkpointer(budget=None)

# ---------------------------------------------------------------------------------------------
# snapshots


def test_snapshots_keep_the_newest_in_host_memory_and_list_the_checkpoints_on_disk_too():
    n = nitro.Nitro(
        Dropped(max_epochs=2),
        progress=False,
        steps_per_dispatch=1,
        snapshots=nitro.Snapshots(every=3, keep=2),
    )
    n.train()
    table = n.snapshots
    memory = table[table["where"] == "memory"]
    assert memory.index.tolist() == [12, 15]  # every 3 steps, the newest 2
    assert memory.loc[15, "epoch"] == 1 and memory.loc[15, "position"] == 7
    disk = table[table["where"] == "disk"]
    assert disk.index.tolist() == [8, 16]  # the checkpoints of epochs 1 and 2
    assert all(Path(p).is_dir() for p in disk["path"])
    # host copies: numpy arrays, nothing on a device
    snapshot = n.runtime.snapshots.entries[-1].wait()
    leaves = [leaf for group in snapshot.tree.values() for leaf in _leaves(group)]
    assert leaves and all(type(leaf) is np.ndarray for leaf in leaves)
    assert snapshot.record.step == 15 and snapshot.record.member.partial_epoch.position == 7


def _leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    else:
        yield tree


def test_snapshots_false_keeps_none_and_bad_settings_are_refused_naming_them():
    n = nitro.Nitro(Toy(max_epochs=1), progress=False, snapshots=False)
    n.train()
    assert n.snapshots["where"].tolist() == ["disk"]
    with pytest.raises(nitro.SetupError, match="snapshots must be a nitro.Snapshots"):
        nitro.Nitro(Toy(), progress=False, snapshots="often")
    with pytest.raises(nitro.SetupError, match=r"Snapshots\(every=0\)"):
        nitro.Snapshots(every=0)
    with pytest.raises(nitro.SetupError, match=r"Snapshots\(keep=0\)"):
        nitro.Snapshots(keep=0)


def test_the_default_snapshots_take_one_as_training_starts():
    n = nitro.Nitro(Toy(max_epochs=1), progress=False, checkpointer=None)
    n.train()
    assert 0 in n.snapshots.index  # "auto": the first boundary of the run, then by budget


# ---------------------------------------------------------------------------------------------
# rewind


def test_a_rewind_to_a_snapshot_trains_on_bitwise_as_the_first_time_and_marks_the_branch():
    reporter = Rewinds()
    n = nitro.Nitro(
        Dropped(max_epochs=3), progress=reporter, steps_per_dispatch=1, snapshots=EVERY_STEP
    )
    n.train()
    first, weights = n.history(), parameters(n)
    assert n.rewind(11) is n  # a snapshot in memory, in the middle of epoch 2
    assert (n.step, n.epoch, n.state.position) == (11, 1, 3)
    assert len(n.history()) == 1
    assert reporter.rows[-1]["from_step"] == 24 and reporter.rows[-1]["step"] == 11
    n.train()
    same_history(first, n.history())
    assert all(np.array_equal(weights[k], v) for k, v in parameters(n).items())
    both = n.history(abandoned=True)
    assert both["abandoned"].tolist() == [0, 0, 1, 0, 1]  # epochs 2 and 3 ran twice
    same_history(
        first.iloc[1:].drop(columns=[]),
        both[both["abandoned"] == 1].drop(columns="abandoned"),
    )
    # the loggers mark it
    lines = (Path(n.run_dir) / "metrics.jsonl").read_text().splitlines()
    marks = [json.loads(line) for line in lines if '"rewind/step_24"' in line]
    assert marks and marks[0]["value"]["step"] == 11 and marks[0]["value"]["reason"] == "rewind"


def test_a_rewind_to_a_checkpoint_on_disk_moves_the_later_ones_aside_and_replays_bitwise():
    n = nitro.Nitro(
        Dropped(max_epochs=3), progress=False, snapshots=False, checkpointer=EVERY_EPOCH
    )
    n.train()
    first, weights = n.history(), parameters(n)
    assert n.snapshots.index.tolist() == [8, 16, 24]
    fork = n.fork(16)  # from a checkpoint too
    fork.train()
    same_history(first, fork.history())
    same_parameters(n, fork)
    n.rewind(8)
    assert (n.step, n.epoch) == (8, 1)
    assert n.snapshots.index.tolist() == [8]  # the branch's later checkpoints moved aside
    aside = sorted(p.name for p in (Path(n.run_dir) / "abandoned").glob("*/*"))
    assert aside == ["16", "24"]
    n.train()
    same_history(first, n.history())
    assert all(np.array_equal(weights[k], v) for k, v in parameters(n).items())
    assert n.snapshots.index.tolist() == [8, 16, 24]  # saved again, on this branch


def test_a_rewind_restores_the_device_values_the_snapshot_was_taken_with():
    n = nitro.Nitro(Toy(max_epochs=2, scale=0.5), progress=False, snapshots=EVERY_STEP)
    n.train(steps=4)
    n.set_device(scale=2.0)
    n.train()
    n.rewind(3)
    assert n.device_value("scale") == 0.5 and n.experiment.scale == 0.5


def test_a_rewind_undoes_the_schedule_changes_made_after_its_step_and_keeps_the_earlier():
    lr = lambda rate: lambda step: rate  # noqa: E731

    def run(*edits):
        n = nitro.Nitro(
            Dropped(max_epochs=3), progress=False, steps_per_dispatch=1, snapshots=EVERY_STEP
        )
        for steps, rate in edits:
            n.train(steps=steps)
            n.set_schedule(learning_rate=lr(rate))
        n.train()
        return n

    plain, early = run(), run((4, 0.05))
    n = run((4, 0.05), (8, 0.2))  # changed at step 4, then at step 12
    n.rewind(6)  # after the first change, before the second: the first holds
    n.train()
    assert (
        n.history()["loss"].tolist()
        == early.history()["loss"].tolist()
        != (plain.history()["loss"].tolist())
    )
    same_history(early.history(), n.history())
    same_parameters(early, n)
    n.rewind(2)  # before both: the run's own learning rate
    n.train()
    same_history(plain.history(), n.history())
    same_parameters(plain, n)
    fork = run((4, 0.05), (8, 0.2)).fork(6)  # a fork inherits the changes up to its step
    fork.train()
    same_history(early.history(), fork.history())


def test_a_rewind_to_a_step_with_no_snapshot_lists_the_steps_there_are():
    n = nitro.Nitro(Toy(max_epochs=1), progress=False, snapshots=2, steps_per_dispatch=1)
    n.train()
    with pytest.raises(
        nitro.SetupError, match=r"no snapshot or checkpoint of step 3.*memory 0, 2; on disk 4"
    ):
        n.rewind(3)
    with pytest.raises(TypeError, match="step must be an int"):
        n.rewind("3")


def test_a_rewind_while_training_in_the_background_is_refused_and_changes_nothing():
    gate = threading.Event()

    @nitro.experiment
    class Slow(Toy):
        max_epochs: int = 50

        def metrics(self, logits, *, y):  # host metrics: the run waits here between epochs
            gate.wait(60)
            return {}

    n = nitro.Nitro(Slow(), progress=False, snapshots=EVERY_STEP)
    n.train(background=True)
    try:
        with pytest.raises(
            nitro.RunningError, match=r"cannot start rewinding to step 0.*n.stop\(\)"
        ):
            n.rewind(0)
        assert n.running
    finally:
        n.stop()
        gate.set()
        n.wait()
    assert not n.state.rewinds


# ---------------------------------------------------------------------------------------------
# fork


FORKS = {
    "default step": ({}, {}),
    "fused calls": ({"steps_per_dispatch": 2}, {}),
    "accumulation": ({"accum": 2}, {}),
    "SAM": ({"sam": 0.05}, {}),
    "EMA": ({"ema": 0.9}, {}),
    "a schedule": (
        {"schedules": {"learning_rate": lambda total: optax.cosine_decay_schedule(1e-2, total)}},
        {},
    ),
    "a Device schedule": ({"schedules": {"scale": lambda step: 1.0 + step / 10}}, {}),
    "a Device field": ({}, {"scale": 0.5}),
}


@pytest.mark.parametrize("setting", list(FORKS))
def test_a_fork_with_no_changes_trains_on_bitwise_as_its_parent(setting):
    keywords, fields = FORKS[setting]
    parent = nitro.Nitro(
        Toy(max_epochs=3, **fields),
        progress=False,
        snapshots=EVERY_STEP,
        **{"steps_per_dispatch": 1, **keywords},
    )
    if setting == "a Device field":
        parent.set_device(scale=0.25)  # the live value the fork takes from the snapshot
    parent.train()
    k = {"accumulation": 3, "fused calls": 6}.get(setting, 5)  # in the middle of epoch 2
    assert parent.snapshots.loc[k, "position"] > 0
    fork = parent.fork(k)
    assert fork.run_dir != parent.run_dir and fork.forked_from["run_id"] == parent.run_id
    fork.train()
    same_history(parent.history(), fork.history())
    same_parameters(parent, fork)
    if setting == "EMA":
        assert np.array_equal(
            np.asarray(parent.state.variables.ema[0]), np.asarray(fork.state.variables.ema[0])
        )


def test_a_fork_takes_device_values_schedules_and_keywords_that_keep_its_programs():
    parent = nitro.Nitro(Dropped(max_epochs=2), progress=False, snapshots=EVERY_STEP)
    parent.train()
    before = nitro.cache_stats().misses
    fork = parent.fork(8, learning_rate=1e-2, max_epochs=3)
    fork.train()
    assert nitro.cache_stats().misses == before  # nothing compiled
    assert fork.epoch == 3 and fork.history()["loss"].iloc[1] != parent.history()["loss"].iloc[1]
    assert parent.history()["loss"].iloc[0] == fork.history()["loss"].iloc[0]
    toy = nitro.Nitro(Toy(max_epochs=2), progress=False, snapshots=EVERY_STEP)
    toy.train()
    scaled = toy.fork(4, scale=3.0)
    assert scaled.device_value("scale") == 3.0 and toy.device_value("scale") == 1.0


def test_a_fork_takes_edited_hooks_where_a_live_edit_would():
    parent = nitro.Nitro(Toy(max_epochs=2), progress=False, snapshots=EVERY_STEP)
    parent.train()

    def doubled(self, logits, *, y):
        return 2 * optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    fork = parent.fork(4, hooks=nitro.hooks(loss=doubled))
    fork.train()
    assert fork.history()["loss"].iloc[0] == parent.history()["loss"].iloc[0]
    assert fork.history()["loss"].iloc[1] == pytest.approx(
        2 * parent.history()["loss"].iloc[1], rel=0.05
    )
    added = nitro.hooks(metrics=lambda self, logits, *, y: {"acc": (logits.argmax(-1) == y)})
    with pytest.raises(nitro.SetupError, match=r"the hooks: added \['metrics'\]"):
        parent.fork(4, hooks=added)


def test_a_fork_of_a_run_given_its_data_trains_on_that_data():
    data = {"train": nitro.data.ArrayLoader({"x": X[::-1].copy(), "y": Y[::-1].copy()}, 16)}
    parent = nitro.Nitro(
        Toy(max_epochs=2), data=data, progress=False, snapshots=EVERY_STEP, steps_per_dispatch=1
    )
    parent.train()
    fork = parent.fork(3)
    fork.train()
    assert fork.forked_from["step"] == 3 and fork.step == parent.step == 8
    same_history(parent.history(), fork.history())
    same_parameters(parent, fork)


def test_a_fork_that_would_change_the_program_is_refused_naming_the_change():
    parent = nitro.Nitro(Toy(max_epochs=1), progress=False, snapshots=EVERY_STEP)
    parent.train()
    with pytest.raises(
        nitro.SetupError, match="fork.width=.... changes the program: width is a GraphConst"
    ):
        parent.fork(2, width=16)
    with pytest.raises(
        nitro.SetupError, match=r"fork\(accum=...\) changes the program.*micro-batches"
    ):
        parent.fork(2, accum=2)
    with pytest.raises(TypeError, match="unknown change 'widht'.*width"):
        parent.fork(2, widht=16)
    with pytest.raises(nitro.SetupError, match="'train' batches' x: float32.16, 5. -> float32.8"):
        parent.fork(2, batch_size=8)  # a Host field build_data reads


def test_a_fork_of_now_is_refused_while_the_parent_trains_and_both_train_at_once():
    parent = nitro.Nitro(Dropped(max_epochs=4), progress=False, snapshots=EVERY_STEP)
    parent.train(epochs=1)
    fork = parent.fork()  # the state now: step 8
    assert fork.step == 8
    parent.train(background=True)
    fork.train(background=True)
    parent.wait()
    fork.wait()
    same_history(parent.history(), fork.history())
    same_parameters(parent, fork)


# ---------------------------------------------------------------------------------------------
# spikes

POISONED = 5  # the batch that spikes: rows 40..47 of 64, 8 batches an epoch, not shuffled


@nitro.experiment
class Spiky:
    """Batch 5 of every epoch spikes (inputs scaled up, or not finite); `poison=None` is the
    same data without that batch."""

    poison: str | None = "large"
    max_epochs: int = 3
    dropped: int = 1  # poison=None: the batches left out, the last of them batch 5

    def build_data(self):
        x, y = X.copy(), Y
        rows = slice(POISONED * 8, (POISONED + 1) * 8)
        if self.poison == "large":
            x[rows] *= 1e3
        elif self.poison == "nan":
            x[rows] = np.nan
        else:
            keep = np.r_[0 : (POISONED + 1 - self.dropped) * 8, rows.stop : len(x)]
            x, y = x[keep], y[keep]
        val = {"x": X[:16], "y": Y[:16]}
        return {
            "train": nitro.data.ArrayLoader({"x": x, "y": y}, 8, shuffle=False),
            "val": nitro.data.ArrayLoader(val, 8, shuffle=False, drop_last=False),
        }

    def build_model(self, rngs):
        return TinyMLP(5, 8, 2, rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


SPIKE = nitro.Spike(rtol=1.0, window=2, max_rollbacks=5)


@pytest.mark.parametrize(
    ("poison", "keywords"),
    [
        ("large", {}),
        ("nan", {}),
        ("nan", {"check_divergence": False}),  # calls that donate their variables
        ("large", {"steps_per_dispatch": 2}),  # the call of batches 4 and 5 left out
        ("large", {"accum": 2}),  # the step of micro-batches 4 and 5 left out
    ],
)
def test_a_run_that_rolled_back_over_a_batch_equals_one_whose_data_never_had_it(poison, keywords):
    keywords = {"steps_per_dispatch": 1, **keywords}
    run = nitro.Nitro(
        Spiky(poison=poison), progress=False, snapshots=EVERY_STEP, spike=SPIKE, **keywords
    )
    run.train()
    dropped = 2 if keywords["steps_per_dispatch"] == 2 or "accum" in keywords else 1
    left_out = [[epoch, index] for epoch in (1, 2, 3) for index in range(6 - dropped, 6)]
    assert run.skipped_batches()[["epoch", "index"]].values.tolist() == left_out
    assert [r["reason"] for r in run.state.rewinds] == ["spike"] * 3
    clean = nitro.Nitro(Spiky(poison=None, dropped=dropped), progress=False, **keywords)
    clean.train()
    same_history(clean.history(), run.history())
    same_parameters(clean, run)


def test_a_spike_in_a_fused_call_leaves_out_every_batch_of_the_call():
    run = nitro.Nitro(
        Spiky(), progress=False, snapshots=EVERY_STEP, spike=SPIKE, steps_per_dispatch=2
    )
    run.train(epochs=1)
    assert run.skipped_batches()["index"].tolist() == [4, 5]  # the call of steps 5 and 6
    assert run.step == 6 and run.epoch == 1


def test_past_max_rollbacks_the_run_stops_naming_the_batches_and_keeps_the_weights_before():
    run = nitro.Nitro(
        Spiky(),
        progress=False,
        snapshots=EVERY_STEP,
        spike=nitro.Spike(rtol=1.0, window=3, max_rollbacks=1),
        steps_per_dispatch=1,
    )
    with pytest.raises(
        nitro.SpikeError, match=r"step 13 .*epoch 2.*left out so far: epoch 1 batch 5"
    ):
        run.train()
    assert run.stop_reason == "error" and run.step == 12
    assert all(np.isfinite(v).all() for v in parameters(run).values())


def test_skipped_batches_survive_a_resume():
    whole = nitro.Nitro(
        Spiky(), progress=False, snapshots=EVERY_STEP, spike=SPIKE, steps_per_dispatch=1
    )
    whole.train()
    first = nitro.Nitro(
        Spiky(),
        progress=False,
        snapshots=EVERY_STEP,
        spike=SPIKE,
        steps_per_dispatch=1,
        name="spiky",
    )
    first.train(steps=6)  # rolled back over batch 5 of epoch 1, stopped one step after it
    first.close()
    assert first.skipped_batches()["index"].tolist() == [5]
    resumed = nitro.Nitro(
        Spiky(), progress=False, spike=SPIKE, steps_per_dispatch=1, resume="auto", name="spiky"
    )
    assert resumed.skipped_batches().values.tolist() == first.skipped_batches().values.tolist()
    resumed.train()
    same_history(whole.history(), resumed.history())
    same_parameters(whole, resumed)


def test_a_population_keeps_no_snapshots_and_spike_settings_are_checked():
    # a population's spikes roll its members back one by one: tests/test_population_spikes.py
    pop = nitro.Population(Toy(max_epochs=1), learning_rate=[1e-3, 1e-2], snapshots=1)
    assert pop.train().epoch == 1
    with pytest.raises(nitro.SetupError, match=r"Spike\(window=0\)"):
        nitro.Spike(window=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nitro.Nitro(Toy(), progress=False, spike=True)  # nitro.Spike()
