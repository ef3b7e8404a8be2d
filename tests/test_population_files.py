"""A population's run directory: its checkpoints read back with plain orbax, an exact resume
in a new population, a member's weights in a plain `Nitro`, one logger run per member read
back with json and TensorBoard's EventAccumulator, what is refused, and a save killed in
the middle. Real JAX, Flax, Optax, Orbax and loggers throughout."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pandas as pd
import pytest
from system import child_env
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import plugin_data_pb2

import nitro
from nitro.examples.digits import Digits
from nitro.loggers import BaseLogger, CSVLogger, JSONLinesLogger, TensorBoardLogger

SMALL = dict(width=16, batch_size=128)  # 9 steps an epoch
AXES = dict(learning_rate=[1e-3, 1e-2], scale=[1.0, 0.5])  # four members


def plain(run_dir, step=None) -> dict:
    """One saved step of a population (its newest by default), restored by orbax alone."""
    options = ocp.CheckpointManagerOptions(read_only=True)
    path = (Path(run_dir) / "checkpoints").absolute()
    with ocp.CheckpointManager(path, options=options) as manager:
        return manager.restore(manager.latest_step() if step is None else step)


def plain_steps(run_dir) -> list[int]:
    options = ocp.CheckpointManagerOptions(read_only=True)
    path = (Path(run_dir) / "checkpoints").absolute()
    with ocp.CheckpointManager(path, options=options) as manager:
        return list(manager.all_steps())


def leaves(tree) -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in leaves(value).items()})
        else:
            out[key] = np.asarray(value)
    return out


def without_timing(history: pd.DataFrame) -> pd.DataFrame:
    timing = ["epoch_seconds", "data_wait_frac", "host_ms", "device_ms"]
    return history.drop(columns=[c for c in timing if c in history])


class PruneAfterFirstEpoch:
    """A progress reporter that prunes member 1 once the first epoch's rows are in."""

    def __init__(self):
        self.population = None

    def member_rows(self, rows):
        if rows[0]["epoch"] == 1 and self.population is not None:
            self.population.stop(1, why="pruned after epoch 1")


def pruned_population(max_epochs, **keywords) -> nitro.Population:
    reporter = PruneAfterFirstEpoch()
    pop = nitro.Population(
        Digits(max_epochs=max_epochs, **SMALL), progress=reporter, **AXES, **keywords
    )
    reporter.population = pop
    return pop


# ---------------------------------------------------------------------------------------------
# exact resume


def test_two_epochs_equal_one_saved_and_resumed_in_a_new_population_bitwise():
    full = pruned_population(2, run_dir="full").train().wait()

    first = pruned_population(2, run_dir="first").train(epochs=1).wait()
    saved = plain("first")
    assert (saved["meta"]["kind"], saved["meta"]["epoch"]) == ("population", 1)
    assert saved["meta"]["prune"] == {"1": "pruned after epoch 1"}  # asked, not applied yet
    kernel = saved["state"]["params"]["hidden1"]["kernel"]
    assert kernel.shape == (4, 64, 16)  # every member's, stacked on a leading axis
    for i in range(4):
        np.testing.assert_array_equal(
            kernel[i], np.asarray(first.member(i).state.variables.params[1])
        )
    del first  # dropped: its run directory's lock goes with it

    resumed = nitro.Population(
        Digits(max_epochs=2, **SMALL), progress=False, resume="first", **AXES
    )
    assert (resumed.epoch, resumed.step) == (1, 9) and resumed.run_dir == str(
        Path("first").absolute()
    )
    resumed.train().wait()
    assert (resumed.epoch, resumed.step) == (full.epoch, full.step) == (2, 18)
    assert resumed.stopped == full.stopped == {1: "pruned after epoch 1"}
    pd.testing.assert_frame_equal(without_timing(resumed.history()), without_timing(full.history()))
    a, b = plain("full"), plain("first")
    assert sorted(leaves(a["state"])) == sorted(leaves(b["state"]))
    for name, value in leaves(a["state"]).items():  # parameters and optimizer state, bitwise
        np.testing.assert_array_equal(leaves(b["state"])[name], value, err_msg=name)
    assert [m["healthy"] for m in b["meta"]["members"]] == [True, False, True, True]
    assert [m["stopped"] for m in b["meta"]["members"]][1] == "pruned after epoch 1"


def test_a_population_stopped_mid_epoch_resumes_at_its_next_batch_exactly():
    keywords = dict(steps_per_dispatch=1, progress=False, **AXES)  # the same calls in both
    full = nitro.Population(Digits(max_epochs=2, **SMALL), checkpointer=None, **keywords)
    full.train()
    stopped = nitro.Population(Digits(max_epochs=2, **SMALL), run_dir="mid", **keywords)
    stopped.train(steps=13)  # epoch 2, batch 4: saved where it stopped
    assert (stopped.step, stopped.epoch) == (13, 1)
    meta = plain("mid")["meta"]
    assert (meta["step"], meta["epoch"], meta["position"]) == (13, 1, 4)
    assert meta["members"][0]["partial_epoch"]["loss_count"] == 4
    stopped.close()

    resumed = nitro.Population(Digits(max_epochs=2, **SMALL), resume="mid", **keywords)
    assert (resumed.step, resumed.epoch) == (13, 1)
    resumed.train()
    pd.testing.assert_frame_equal(without_timing(resumed.history()), without_timing(full.history()))
    for i in range(4):
        for got, want in zip(
            resumed.member(i).state.variables.params,
            full.member(i).state.variables.params,
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_resume_refuses_other_members_naming_what_differs():
    nitro.Population(Digits(max_epochs=1, **SMALL), run_dir="saved", progress=False, **AXES).train()
    cases = {
        "member 2 learning_rate: the checkpoint's 0.01, this population's 0.003": dict(
            learning_rate=[1e-3, 3e-3], scale=[1.0, 0.5]
        ),
        "axes: the checkpoint's learning_rate, scale; this population's learning_rate": dict(
            learning_rate=[1e-3, 1e-2]
        ),
        "members: the checkpoint's 4, this population's 6": dict(
            learning_rate=[1e-3, 1e-2, 3e-2], scale=[1.0, 0.5]
        ),
    }
    for expected, axes in cases.items():
        with pytest.raises(nitro.PopulationError) as refused:
            nitro.Population(Digits(max_epochs=2, **SMALL), resume="saved", progress=False, **axes)
        message = str(refused.value)
        assert expected in message, message
        assert "cannot resume the population in" in message and "population.json" in message
    with pytest.raises(nitro.PopulationError) as refused:  # a GraphConst value
        nitro.Population(
            Digits(max_epochs=2, width=32, batch_size=128), resume="saved", progress=False, **AXES
        )
    assert "width: the checkpoint's 16, this population's 32" in str(refused.value)
    with pytest.raises(nitro.PopulationError, match="metrics are .*val_acc"):
        nitro.Population(
            Digits(**SMALL),
            checkpointer=nitro.Checkpointer(metric="val_f1"),
            progress=False,
            **AXES,
        )
    # nothing was taken: the population resumes as it was built
    again = nitro.Population(Digits(max_epochs=2, **SMALL), resume="saved", progress=False, **AXES)
    assert again.train().epoch == 2


def test_resume_true_continues_this_experiments_population_and_warns_when_there_is_none():
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        first = nitro.Population(Digits(max_epochs=1, **SMALL), resume=True, progress=False, **AXES)
    assert first.step == 0
    assert any("found no population's checkpoint" in str(w.message) for w in said)
    first.train()
    single = nitro.Nitro(Digits(max_epochs=1, **SMALL), progress=False).train()  # beside it
    again = nitro.Population(Digits(max_epochs=2, **SMALL), resume=True, progress=False, **AXES)
    assert (again.run_id, again.epoch, again.step) == (first.run_id, 1, 9)
    with pytest.raises(nitro.SetupError, match="is a single run's checkpoint"):
        nitro.Population(Digits(**SMALL), resume=single.run_dir, progress=False, **AXES)
    # and a single run's resume="auto" continues the single run, never the population
    assert nitro.Nitro(Digits(max_epochs=2, **SMALL), resume="auto").run_id == single.run_id


# ---------------------------------------------------------------------------------------------
# a member's weights in a plain Nitro, and what single runs refuse


def test_a_members_weights_restore_into_a_plain_nitro_as_orbax_reads_them():
    pop = nitro.Population(Digits(max_epochs=1, **SMALL), progress=False, **AXES).train().wait()
    run_dir = Path(pop.run_dir)
    assert run_dir.parent == Path("runs/Digits").absolute()  # a single run's default place
    saved = plain(run_dir)
    info = json.loads((run_dir / "population.json").read_text())
    assert [m["settings"] for m in info["members"]] == pop.members
    for i in (0, 3):
        by_pair = nitro.Nitro(Digits(**SMALL), weights=(pop.run_dir, i), progress=False)
        by_dir = nitro.Nitro(  # its Device field too, for its validation below
            Digits(**SMALL, scale=pop.members[i]["scale"]),
            weights=str(run_dir / f"member-{i}"),
            progress=False,
        )
        handle = pop.member(i)
        want = np.asarray(saved["state"]["params"]["hidden2"]["kernel"][i])
        for n in (by_pair, by_dir, handle):
            np.testing.assert_array_equal(np.asarray(n.state.variables.params[3]), want)
        assert by_pair.weights_checkpoint["run_id"] == f"{pop.run_id}-m{i}"
        assert by_pair.weights_checkpoint["metrics"]["val_loss"] == pytest.approx(
            pop.history().loc[(i, 1), "val_loss"]
        )
        assert f"member {i} (learning_rate=" in by_pair.weights_origin
        assert by_dir.validate()["val_loss"] == pytest.approx(
            pop.history().loc[(i, 1), "val_loss"], abs=1e-6
        )
        member_info = json.loads((run_dir / f"member-{i}" / "run.json").read_text())
        assert (member_info["kind"], member_info["population"]) == ("population member", pop.run_id)
        assert member_info["settings"] == pop.members[i]

    with pytest.raises(nitro.SetupError, match="name one, weights="):
        nitro.Nitro(Digits(**SMALL), weights=pop.run_dir, progress=False)
    with pytest.raises(nitro.WeightsError, match="has 4 members"):
        nitro.Nitro(Digits(**SMALL), weights=(pop.run_dir, 4), progress=False)
    with pytest.raises(nitro.SetupError, match="is a population's checkpoint"):
        nitro.Nitro(Digits(**SMALL), resume=pop.run_dir, progress=False)
    with pytest.raises(nitro.SetupError, match="is the directory of member 2 of the population"):
        nitro.Nitro(Digits(**SMALL), run_dir=str(run_dir / "member-2"), progress=False)
    with warnings.catch_warnings(record=True) as said:  # a single run's resume skips it
        warnings.simplefilter("always")
        fresh = nitro.Nitro(Digits(**SMALL), resume="auto", progress=False)
    assert fresh.step == 0 and any("found no checkpoint" in str(w.message) for w in said)
    best = pop.best()  # pop.best() and pop.member(i) work as before
    assert best.validate()["val_loss"] == pytest.approx(pop.history()["val_loss"].min(), abs=1e-6)


# ---------------------------------------------------------------------------------------------
# defaults, one writer


def test_defaults_save_cheaply_and_nothing_is_written_without_checkpoints_or_loggers(tmp_path):
    pop = nitro.Population(Digits(max_epochs=2, **SMALL), progress=False, **AXES).train().wait()
    # the single run's defaults: Checkpointer() within its 5% budget (the first epoch and the
    # run's last are always saved), a JSON Lines file per member
    assert plain_steps(pop.run_dir)[-1] == 18 and len(plain_steps(pop.run_dir)) <= 2
    assert pop.checkpoints()["step"].tolist() == plain_steps(pop.run_dir)
    for i in range(4):
        assert (Path(pop.run_dir) / f"member-{i}" / "metrics.jsonl").is_file()
    assert sorted(p.name for p in Path(pop.run_dir).iterdir()) == [
        "checkpoints",
        "member-0",
        "member-1",
        "member-2",
        "member-3",
        "population.json",
        "run.json",
        "run.lock",
    ]
    listed = nitro.saved_runs("Digits")
    assert listed.index.tolist() == [pop.run_id] and listed["latest epoch"].tolist() == [2]

    (tmp_path / "quiet").mkdir()
    os.chdir(tmp_path / "quiet")  # the fixture's chdir puts it back
    silent = nitro.Population(
        Digits(max_epochs=1, **SMALL), checkpointer=None, logger=None, progress=False, **AXES
    )
    silent.train()
    assert not Path("runs").exists()


def test_the_best_epoch_off_the_save_schedule_is_kept_as_a_single_runs_is():
    # every=2 saves epoch 2; by mode="max" the best val_loss is epoch 1's (it falls each
    # epoch): held on the host and written with the run's end save, as a single run's
    keep = nitro.Checkpointer(k=1, mode="max", every=2, budget=None)
    pop = nitro.Population(
        Digits(max_epochs=2, **SMALL),
        checkpointer=keep,
        progress=False,
        learning_rate=[1e-3, 1e-2],
        scale=[1.0, 0.5],
    )
    pop.train().wait()
    best = pop.history()["val_loss"].groupby(level="epoch").max()
    assert best[1] > best[2]  # epoch 1 is the best by mode="max"
    assert plain_steps(pop.run_dir) == [9, 18]
    assert plain(pop.run_dir, 9)["meta"]["metrics"]["val_loss"] == pytest.approx(best[1])
    assert pop.checkpoints()["val_loss"].tolist() == pytest.approx([best[1], best[2]])


def test_one_writer_per_population_directory():
    busy = nitro.Population(
        Digits(max_epochs=10**6, **SMALL), run_dir="busy", progress=False, **AXES
    )
    busy.train(epochs=1)  # its directory is written, and held
    with pytest.raises(nitro.SetupError, match="already holds a population"):
        nitro.Population(Digits(**SMALL), run_dir="busy", progress=False, **AXES)
    busy.train(background=True)
    try:
        with pytest.raises(nitro.SetupError, match="has a writer already"):
            nitro.Population(Digits(**SMALL), resume="busy", progress=False, **AXES)
    finally:
        busy.stop().wait()
    assert busy.stop_reason == "requested"
    # an idle population is taken over by one that resumes it; it no longer writes there
    taken = nitro.Population(
        Digits(max_epochs=busy.epoch + 1, **SMALL), resume="busy", progress=False, **AXES
    )
    assert (taken.step, taken.run_id) == (busy.step, busy.run_id)
    with pytest.raises(nitro.SetupError, match="no longer writes run"):
        busy.train(epochs=1)
    taken.train()


# ---------------------------------------------------------------------------------------------
# one logger run per member


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file]


def read_tensorboard(logdir):
    accumulator = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    return accumulator


def test_each_member_has_its_own_logger_run_read_back_with_json_and_tensorboard():
    pop = nitro.Population(
        Digits(max_epochs=2, **SMALL),
        logger=[JSONLinesLogger(), TensorBoardLogger()],
        progress=False,
        **AXES,
    ).train()
    history = pop.history()
    for i, settings in enumerate(pop.members):
        directory = Path(pop.run_dir) / f"member-{i}"
        records = read_jsonl(directory / "metrics.jsonl")
        (params,) = [r["params"] for r in records if r["type"] == "params"]
        assert (params["learning_rate"], params["scale"]) == (
            settings["learning_rate"],
            settings["scale"],
        )
        (tags,) = [r["tags"] for r in records if r["type"] == "tags"]
        assert (tags["population"], tags["member"]) == (pop.run_id, str(i))
        assert tags["learning_rate"] == str(settings["learning_rate"])
        train = [r for r in records if r["type"] == "metrics" and r["context"] == "train"]
        assert [r["step"] for r in train if "loss" in r["metrics"]] == list(range(1, 19))
        validate = [r for r in records if r["type"] == "metrics" and r["context"] == "validate"]
        assert [r["metrics"]["val_loss"] for r in validate] == history.loc[i]["val_loss"].tolist()
        assert [r["status"] for r in records if r["type"] == "finish"] == ["completed"]

        accumulator = read_tensorboard(directory)
        assert len(accumulator.Scalars("train/loss")) == 18
        assert [e.value for e in accumulator.Scalars("validate/val_loss")] == pytest.approx(
            history.loc[i]["val_loss"].tolist()
        )
        content = accumulator.PluginTagToContent("hparams")
        start = plugin_data_pb2.HParamsPluginData.FromString(
            content["_hparams_/session_start_info"]
        ).session_start_info
        assert start.hparams["learning_rate"].number_value == pytest.approx(
            settings["learning_rate"]
        )
        assert start.hparams["scale"].number_value == settings["scale"]


def test_a_logger_factory_gives_each_member_its_own_and_others_are_refused_naming_the_fix():
    made = []

    def factory(i):
        made.append(i)
        return CSVLogger()

    pop = nitro.Population(
        Digits(max_epochs=1, **SMALL), logger=factory, checkpointer=None, progress=False, **AXES
    ).train()
    assert made == [0, 1, 2, 3]
    for i in range(4):
        assert (Path(pop.run_dir) / f"member-{i}" / "metrics.csv").is_file()

    class Mine(BaseLogger):
        pass

    with pytest.raises(nitro.PopulationError, match=r"logger=lambda i: .*Mine\(\.\.\.\)"):
        nitro.Population(Digits(**SMALL), logger=Mine(), progress=False, **AXES)
    with pytest.raises(nitro.PopulationError, match="one file per member"):
        nitro.Population(
            Digits(**SMALL), logger=JSONLinesLogger("all.jsonl"), progress=False, **AXES
        )


def test_mlflow_holds_one_run_per_member_with_its_settings_as_params(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="MLflowLogger needs pip install 'nitro[mlflow]'")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it
    store = (tmp_path / "mlruns").as_uri()
    pop = nitro.Population(
        Digits(max_epochs=1, **SMALL),
        logger=nitro.loggers.MLflowLogger(store, experiment="population"),
        checkpointer=None,
        progress=False,
        learning_rate=[1e-3, 1e-2],
    ).train()
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("population")
    runs = client.search_runs([experiment.experiment_id])
    by_name = {run.info.run_name: run for run in runs}
    assert sorted(by_name) == [f"{pop.run_id}-m0", f"{pop.run_id}-m1"]
    for i, settings in enumerate(pop.members):
        run = by_name[f"{pop.run_id}-m{i}"]
        assert run.info.status == "FINISHED"
        assert float(run.data.params["learning_rate"]) == settings["learning_rate"]
        assert run.data.tags["member"] == str(i) and run.data.tags["population"] == pop.run_id
        val = client.get_metric_history(run.info.run_id, "val_loss")
        assert [m.value for m in val] == pytest.approx(pop.history().loc[i]["val_loss"].tolist())


# ---------------------------------------------------------------------------------------------
# a save killed in the middle


CHILD = """
import sys
import nitro
from nitro.examples.digits import Digits

pop = nitro.Population(
    Digits(max_epochs=10**6, width=256, batch_size=512),
    run_dir=sys.argv[1],
    checkpointer=nitro.Checkpointer(k=1, budget=None),
    progress=False,
    learning_rate=[1e-3, 3e-3, 1e-2, 3e-2],
)
pop.train()
"""


def test_a_save_killed_in_the_middle_leaves_the_earlier_checkpoints_readable(tmp_path):
    """The child saves its population (4 x 85 k parameters and their Adam moments) every
    epoch until it is killed, by SIGKILL, once a save of its third checkpoint or later is
    under way (orbax writes a step into a temporary directory, renamed once whole)."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    run_dir = tmp_path / "killed"
    child = subprocess.Popen(
        [sys.executable, str(script), str(run_dir)], env=child_env(), stderr=subprocess.PIPE
    )
    checkpoints = run_dir / "checkpoints"
    cut = None
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and child.poll() is None:
            names = os.listdir(checkpoints) if checkpoints.is_dir() else []
            finished = [n for n in names if n.isdigit()]
            writing = [n for n in names if "orbax-checkpoint-tmp" in n]
            if len(finished) >= 2 and writing:
                os.kill(child.pid, signal.SIGKILL)
                cut = writing[0]
                break
    finally:
        if child.poll() is None:
            child.kill()
        _, err = child.communicate(timeout=60)
    assert cut is not None, f"the child never saved: {err.decode()[-2000:]}"
    assert child.returncode == -signal.SIGKILL

    steps = plain_steps(run_dir)  # orbax lists the finished steps only
    assert len(steps) >= 2, (steps, cut)
    if (checkpoints / cut).exists():  # killed before orbax renamed it into place
        assert int(cut.split(".")[0]) not in steps
    for step in steps:  # each restores whole, its record consistent with it
        saved = plain(run_dir, step)
        assert saved["meta"]["step"] == step and len(saved["meta"]["members"]) == 4
        assert saved["state"]["params"]["out"]["kernel"].shape == (4, 256, 10)
        assert np.isfinite(saved["state"]["params"]["out"]["kernel"]).all()

    resumed = nitro.Population(
        Digits(max_epochs=10**6, width=256, batch_size=512),
        run_dir=str(run_dir),
        resume="auto",
        checkpointer=nitro.Checkpointer(k=1, budget=None),
        progress=False,
        learning_rate=[1e-3, 3e-3, 1e-2, 3e-2],
    )
    assert resumed.step == steps[-1]
    resumed.train(epochs=1).wait()
    assert resumed.checkpoints()["step"].max() == resumed.step
    assert all(name.isdigit() for name in os.listdir(checkpoints))  # the remnant is gone


def test_wandb_holds_one_run_per_member_grouped_by_the_population(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="WandbLogger needs pip install 'nitro[wandb]'")
    from test_loggers_tracking import finished_wandb_records

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    pop = nitro.Population(
        Digits(max_epochs=1, **SMALL),
        logger=nitro.loggers.WandbLogger("nitro-tests"),
        checkpointer=None,
        progress=False,
        learning_rate=[1e-3, 1e-2],
    ).train()
    for i, settings in enumerate(pop.members):
        (path,) = glob.glob(f"{pop.run_dir}/member-{i}/wandb/offline-run-*/run-*.wandb")
        records = finished_wandb_records(path)
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        assert (run.display_name, run.run_group) == (f"{pop.run_id}-m{i}", pop.run_id)
        config = {
            item.key: json.loads(item.value_json)
            for r in records
            if r.WhichOneof("record_type") in ("run", "config")
            for item in (
                r.run.config.update if r.WhichOneof("record_type") == "run" else r.config.update
            )
        }
        assert config["learning_rate"] == settings["learning_rate"]
        tags = [r.run.tags for r in records if r.WhichOneof("record_type") == "run"]
        assert f"member={i}" in tags[-1] and f"population={pop.run_id}" in tags[-1]
