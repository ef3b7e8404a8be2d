"""Named checkpoints (`Checkpointer(name=)`): the name on disk, every reader and lister of a
run's checkpoints finding them by it, resume, weights=, rewinds and retention with names, runs
saved with step directories going on with names, bad names refused naming the hook, and a
process killed while it saves leaving no half-written named checkpoint. Real orbax
throughout; plain orbax reads the files back."""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from lifecycle_toys import Dropped, Wide, parameters
from test_lifecycle import Zygote, flat, kill
from toys import Toy, ToyWithMetrics

import nitro
from nitro.runs import NamedSteps, checkpoint_name

NAMED = nitro.Checkpointer(budget=None, name=checkpoint_name)


def listed(n: nitro.Nitro) -> list[str]:
    """The checkpoints directory as `ls` shows it (its checkpoints, less orbax's own)."""
    n.wait()
    return sorted(os.listdir(Path(n.run_dir) / "checkpoints"))


def read_plain(directory: Path, step: int) -> dict:
    """One saved checkpoint, restored by orbax alone, its step naming given."""
    options = ocp.CheckpointManagerOptions(read_only=True, step_name_format=NamedSteps())
    with ocp.CheckpointManager(directory.absolute(), options=options) as manager:
        return manager.restore(step)


def expected_name(row) -> str:
    return f"epoch-{int(row.name):04d}-step-{int(row['step'])}-val_loss={row['val_loss']:.6g}"


# ---------------------------------------------------------------------------------------------
# the names on disk, and the readers


def test_named_checkpoints_show_on_disk_and_every_reader_lists_and_reads_them():
    keep = nitro.Checkpointer(k=2, mode="max", budget=None, name=checkpoint_name)
    n = nitro.Nitro(ToyWithMetrics(max_epochs=4), checkpointer=keep, progress=False).train()
    history = n.history()
    # mode="max" on a falling val_loss: the first two epochs are the best two, plus the newest
    kept = [expected_name(history.loc[e]) for e in (1, 2, 4)]
    assert listed(n) == sorted(kept)
    assert kept[0] == f"epoch-0001-step-4-val_loss={history.loc[1, 'val_loss']:.6g}"

    rows = n.checkpoints()
    assert rows["name"].tolist() == kept
    assert [Path(p).name for p in rows["path"]] == kept
    assert rows["epoch"].tolist() == [1, 2, 4]
    assert Path(n.best_checkpoint).name == kept[0]

    # a checkpoint given by its path (its name) is read by each reader
    path = Path(n.run_dir) / "checkpoints" / kept[1]
    record = nitro.runs.read(path)
    assert (record.step, record.epoch) == (8, 2)
    assert nitro.runs.read(n.run_dir).step == 16
    assert nitro.runs.read(n.run_dir).stop_reason == "completed"
    assert nitro.runs.read(n.run_dir, "best").epoch == 1
    arrays = nitro.weights.read(path)
    plain = read_plain(Path(n.run_dir) / "checkpoints", 8)
    assert plain["meta"]["epoch"] == 2
    for name, value in flat(plain["state"]["params"]).items():
        assert np.array_equal(arrays[name], value), name
    averaged = nitro.Nitro(ToyWithMetrics(), weights=nitro.average(n.run_dir, k=2), progress=False)
    expected = (
        flat(read_plain(path.parent, 4)["state"]["params"])["out.kernel"] + arrays["out.kernel"]
    ) / 2
    assert np.allclose(parameters(averaged)["out.kernel"], expected)
    # and its items are plain orbax by path too
    state = ocp.StandardCheckpointer().restore(path.absolute() / "state")
    assert np.array_equal(flat(state["params"])["out.kernel"], arrays["out.kernel"])


def test_a_named_run_resumes_and_starts_other_runs_from_a_checkpoint_given_by_name(tmp_path):
    run_dir = str(tmp_path / "run")
    n = nitro.Nitro(Toy(max_epochs=2), run_dir=run_dir, checkpointer=NAMED, progress=False)
    n.train().wait()
    trained = parameters(n)

    again = nitro.Nitro(
        Toy(max_epochs=3), run_dir=run_dir, resume="auto", checkpointer=NAMED, progress=False
    )
    assert (again.step, again.epoch) == (8, 2)
    assert all(np.array_equal(trained[k], v) for k, v in parameters(again).items())
    again.train().wait()
    assert [name.split("-val_loss")[0] for name in listed(again)] == [
        "epoch-0001-step-4",
        "epoch-0002-step-8",
        "epoch-0003-step-12",
    ]

    first = Path(run_dir) / "checkpoints" / listed(again)[0]
    started = nitro.Nitro(Toy(), weights=str(first), progress=False)
    saved = flat(read_plain(first.parent, 4)["state"]["params"])
    assert all(np.array_equal(saved[k], v) for k, v in parameters(started).items())
    assert started.step == 0

    # resume= a named checkpoint before the newest: it goes on in a new run directory
    branch = nitro.Nitro(Toy(max_epochs=3), resume=str(first), progress=False)
    assert (branch.step, branch.epoch) == (4, 1)
    assert Path(branch.run_dir) != Path(run_dir)


def test_a_format_string_names_checkpoints_and_a_missing_score_reads_none():
    named = nitro.Checkpointer(budget=None, name="e{epoch:02d}-s{step}-{metric}-{score:.3f}")
    n = nitro.Nitro(Toy(max_epochs=2, with_val=False), checkpointer=named, progress=False)
    n.train()
    # no val split: no val_loss to score by; the newest checkpoint is kept
    assert listed(n) == ["e02-s8-val_loss-none"]
    with_val = nitro.Nitro(Toy(max_epochs=1), checkpointer=named, progress=False).train()
    (name,) = listed(with_val)
    assert re.fullmatch(r"e01-s4-val_loss-\d\.\d{3}", name), name


def test_a_run_saved_with_step_directories_goes_on_with_names_and_keeps_its_best_k(tmp_path):
    run_dir = str(tmp_path / "run")
    keep = nitro.Checkpointer(k=1, mode="max", budget=None)
    n = nitro.Nitro(Toy(max_epochs=2), run_dir=run_dir, checkpointer=keep, progress=False)
    n.train()
    assert listed(n) == ["4", "8"]  # the default: orbax's step directories

    named = nitro.Checkpointer(k=1, mode="max", budget=None, name="epoch-{epoch}-step-{step}")
    again = nitro.Nitro(
        Toy(max_epochs=4), run_dir=run_dir, resume="auto", checkpointer=named, progress=False
    )
    assert (again.step, again.epoch) == (8, 2)
    again.train()
    # the best (the first epoch, mode="max" on a falling loss) and the newest stay, whatever
    # their naming
    assert listed(again) == ["4", "epoch-4-step-16"]
    assert again.checkpoints()["name"].tolist() == ["4", "epoch-4-step-16"]
    assert nitro.runs.read(run_dir).epoch == 4
    # and back: the named run resumes without names, and reads its named checkpoints
    plain = nitro.Nitro(Toy(max_epochs=5), run_dir=run_dir, resume="auto", progress=False)
    assert (plain.step, plain.epoch) == (16, 4)


class Notes:
    """A progress reporter that keeps the notes a run reports."""

    def __init__(self):
        self.notes: list[str] = []

    def note(self, message, done=False):
        self.notes.append(message)


def test_a_stopped_run_saves_where_it_stopped_under_its_name_and_records_why():
    named = nitro.Checkpointer(budget=None, name="toy-e{epoch}-s{step}")
    notes = Notes()
    cut = nitro.Nitro(ToyWithMetrics(max_epochs=9), checkpointer=named, max_steps=6, progress=notes)
    cut.train().wait()  # step 6: the middle of epoch 2 (4 steps an epoch)
    assert listed(cut) == ["toy-e1-s4", "toy-e1-s6"]  # epoch 1 committed, 2 steps into epoch 2
    path = Path(cut.run_dir) / "checkpoints" / "toy-e1-s6"
    assert any(f"saved {path}: resume= continues from there" in n for n in notes.notes), notes
    assert nitro.runs.read(path).stop_reason == "max_steps"

    # a stop that comes while epoch 2 is saved: that save, under its name, records why
    between = nitro.Nitro(ToyWithMetrics(max_epochs=9), checkpointer=named, progress=False)
    between.on_phase(lambda c: between.stop() if (c.phase, c.epoch) == ("checkpointing", 2) else 0)
    between.train()
    assert (between.stop_reason, between.step) == ("requested", 8)
    assert listed(between) == ["toy-e1-s4", "toy-e2-s8"]
    assert nitro.runs.read(between.run_dir).stop_reason == "requested"
    assert nitro.runs.read(Path(between.run_dir) / "checkpoints" / "toy-e1-s4").stop_reason is None


def test_an_experiment_names_its_checkpoints_through_its_checkpointer_method():
    @nitro.experiment
    class Named(Toy):
        tag: str = "toy"

        def checkpointer(self):
            return nitro.Checkpointer(budget=None, name=self.checkpoint_name)

        def checkpoint_name(self, *, epoch, step, metric, score):
            return f"{self.tag}-{step:06d}"

    n = nitro.Nitro(Named(max_epochs=2, tag="mlp"), progress=False).train()
    assert listed(n) == ["mlp-000004", "mlp-000008"]


def test_a_rewind_moves_the_later_named_checkpoints_aside_and_saves_them_again():
    n = nitro.Nitro(Dropped(max_epochs=3), progress=False, snapshots=False, checkpointer=NAMED)
    n.train()
    names = listed(n)
    assert [name.split("-val_loss")[0] for name in names] == [
        "epoch-0001-step-8",
        "epoch-0002-step-16",
        "epoch-0003-step-24",
    ]
    fork = n.fork(16)  # from its named checkpoint on disk
    assert (fork.step, fork.epoch) == (16, 2)
    n.rewind(8)
    assert (n.step, n.epoch) == (8, 1)
    assert listed(n) == names[:1]
    aside = sorted(p.name for p in (Path(n.run_dir) / "abandoned").glob("*/*"))
    assert aside == names[1:]  # moved whole, with their names
    n.train()
    # the same steps again, bit for bit: the same names, given again on this branch
    assert listed(n) == names
    assert n.snapshots.index.tolist() == [8, 16, 24]


def test_a_population_names_its_checkpoints_and_resumes_from_them(tmp_path):
    from nitro.examples.digits import Digits

    small = dict(width=16, batch_size=128, max_epochs=2)  # 9 steps an epoch
    axes = dict(learning_rate=[1e-3, 1e-2])
    keep = nitro.Checkpointer(budget=None, name="pop-{epoch}-{step}")
    run_dir = str(tmp_path / "pop")
    pop = nitro.Population(
        Digits(**small), run_dir=run_dir, checkpointer=keep, progress=False, **axes
    )
    pop.train().wait()
    assert sorted(os.listdir(Path(run_dir) / "checkpoints")) == ["pop-1-9", "pop-2-18"]
    assert pop.checkpoints()["name"].tolist() == ["pop-1-9", "pop-2-18"]
    saved = read_plain(Path(run_dir) / "checkpoints", 18)
    assert [m["member"] for m in saved["meta"]["members"]] == [0, 1]
    again = nitro.Population(
        Digits(**{**small, "max_epochs": 3}),
        run_dir=run_dir,
        resume="auto",
        checkpointer=keep,
        progress=False,
        **axes,
    )
    assert again.step == 18
    again.train().wait()
    assert again.checkpoints()["name"].tolist()[-1] == "pop-3-27"


# ---------------------------------------------------------------------------------------------
# bad names


def test_a_name_that_cannot_work_is_refused_when_the_checkpointer_is_built():
    with pytest.raises(nitro.SetupError, match=r"format string fails.*\{epoch\}, \{step\}"):
        nitro.Checkpointer(name="epoch-{epochs}")
    with pytest.raises(nitro.SetupError, match="without path separators"):
        nitro.Checkpointer(name="runs/{step}")
    with pytest.raises(nitro.SetupError, match=r"without fields names every checkpoint alike"):
        nitro.Checkpointer(name="nitro.runs.checkpoint_name")

    def positional(epoch, step):
        return f"{epoch}-{step}"

    with pytest.raises(
        nitro.SetupError, match=r"name=.*positional\): the hook is called with the keywords"
    ):
        nitro.Checkpointer(name=positional)
    with pytest.raises(nitro.SetupError, match=r"name=3\): a hook called as name\(epoch="):
        nitro.Checkpointer(name=3)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize(
    ("returns", "expected"),
    [
        (lambda step: step, r"must be a str, got int 4"),
        (lambda step: "", r"must be a non-empty str"),
        (lambda step: f"a/{step}", r"must be a name without path separators, got 'a/4'"),
        (lambda step: "..", r"does not start with '\.'"),
        (lambda step: "7", r"not another step's number"),
        (lambda step: "deleting", r"other than 'deleting' or 'metadata'"),
        (lambda step: {}[step], r"raised KeyError: 4, naming"),
    ],
)
def test_a_hook_returning_a_bad_name_is_refused_naming_it_and_saves_nothing(returns, expected):
    def bad_name(*, epoch, step, metric, score):
        return returns(step)

    keep = nitro.Checkpointer(budget=None, name=bad_name)
    n = nitro.Nitro(Toy(max_epochs=2), checkpointer=keep, progress=False)
    with pytest.raises(nitro.SetupError, match=expected) as raised:
        n.train()
    message = str(raised.value)
    assert "Checkpointer(name=" in message and "bad_name" in message
    assert "epoch 1, step 4" in message and "return a file name" in message.lower()
    assert n.checkpoints().empty


def test_two_checkpoints_given_one_name_are_refused_and_the_first_is_kept():
    def latest(*, epoch, step, metric, score):
        return "latest"

    keep = nitro.Checkpointer(budget=None, name=latest)
    n = nitro.Nitro(Toy(max_epochs=3), checkpointer=keep, progress=False)
    with pytest.raises(nitro.SetupError, match=r"step 8 'latest', the name of step 4's") as e:
        n.train()
    assert "Put the step in the name" in str(e.value)
    assert listed(n) == ["latest"]
    assert nitro.runs.read(Path(n.run_dir) / "checkpoints" / "latest").step == 4


# ---------------------------------------------------------------------------------------------
# a process killed while it saves


def first_saved(directory: Path) -> None:
    """Wait (minutes at most) until a named checkpoint is in place in `directory`."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if directory.is_dir() and any(
            re.fullmatch(r"wide-\d{5}", n) for n in os.listdir(directory)
        ):
            return
        time.sleep(0.01)
    raise AssertionError(f"no named checkpoint in {directory} after 300 s")


def test_a_process_killed_while_saving_named_checkpoints_leaves_only_finished_ones(tmp_path):
    """Children save a 3 MB state every epoch under names (two steps an epoch, so most of
    their time is saving); each is killed between 0 and 0.8 s after its first named
    checkpoint is in place. An unfinished save is orbax's temporary directory, which no reader
    lists and the next writer removes; every named checkpoint listed reads whole."""
    zygote = Zygote(tmp_path)
    draw = random.Random(5)
    tries = []
    try:
        for attempt in range(8):
            run_dir = tmp_path / f"try{attempt}"
            pid = zygote.train(Path(f"named:{run_dir}"))
            first_saved(run_dir / "checkpoints")
            time.sleep(draw.uniform(0.0, 0.8))
            kill(pid)
            directory = run_dir / "checkpoints"
            names = os.listdir(directory) if directory.is_dir() else []
            unfinished = [name for name in names if ".orbax-checkpoint-tmp" in name]
            finished = sorted(name for name in names if re.fullmatch(r"wide-\d{5}", name))
            tries.append((run_dir, unfinished, finished))
            options = ocp.CheckpointManagerOptions(read_only=True, step_name_format=NamedSteps())
            with ocp.CheckpointManager(directory.absolute(), options=options) as manager:
                steps = list(manager.all_steps())
                assert [f"wide-{step:05d}" for step in steps] == finished  # never an unfinished one
                for step in steps:
                    assert manager.restore(step)["meta"]["step"] == step
            assert nitro.runs.read(run_dir).step == steps[-1]
    finally:
        zygote.close()
    # some kills cut a save short: orbax's temporary directory, under the checkpoint's name
    assert any(unfinished for _, unfinished, _ in tries), tries
    assert all(name.startswith("wide-") for _, unfinished, _ in tries for name in unfinished)

    # a run resumed where a save was cut short removes the unfinished one, and saves on
    run_dir = next(d for d, unfinished, finished in tries if unfinished and finished)
    keep = nitro.Checkpointer(k=2, budget=None, name="wide-{step:05d}")
    n = nitro.Nitro(
        Wide(), run_dir=str(run_dir), resume="auto", checkpointer=keep, progress=False, logger=None
    )
    n.train(epochs=1).wait()
    names = listed(n)
    assert all(re.fullmatch(r"wide-\d{5}", name) for name in names), names
    assert n.checkpoints()["epoch"].max() == n.epoch
