"""Logging: what a run writes through its loggers, read back with the tools made for each
format (json, csv, TensorBoard's own EventAccumulator)."""

from __future__ import annotations

import csv
import json
import math
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from system import child_env
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from toys import Toy, ToyWithMetrics, X, Y

import nitro
from nitro.data import ArrayLoader
from nitro.loggers import (
    BaseLogger,
    CSVLogger,
    JSONLinesLogger,
    LoggerGroup,
    LoggingReporter,
    TensorBoardLogger,
    as_logger,
    finish_status,
)


def refuse_nan(text):
    raise AssertionError(f"{text} written into a JSON Lines file")


def read_jsonl(path):
    with open(path, encoding="utf-8") as file:
        return [json.loads(line, parse_constant=refuse_nan) for line in file]


def metric_lines(records, context):
    return [r for r in records if r["type"] == "metrics" and r["context"] == context]


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def read_tensorboard(logdir):
    accumulator = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    return accumulator


def text_of(accumulator, tag):
    return [e.tensor_proto.string_val[0].decode() for e in accumulator.Tensors(tag)]


def train_logged(tmp_path, logger, experiment=None, **keywords):
    experiment = experiment or ToyWithMetrics(max_epochs=2)
    n = nitro.Nitro(experiment, run_dir=str(tmp_path), logger=logger, progress=False, **keywords)
    return n.train()


# ---------------------------------------------------------------------------------------------
# JSON Lines, the default


def test_json_lines_hold_one_train_line_per_step_and_validation_equal_to_the_history(tmp_path):
    n = train_logged(tmp_path, JSONLinesLogger())
    records = read_jsonl(tmp_path / "metrics.jsonl")
    history = n.history()

    assert [r["type"] for r in records[:3]] == ["params", "tags", "other"]
    assert records[-1]["type"] == "finish" and records[-1]["status"] == "completed"
    train = [r for r in metric_lines(records, "train") if "loss" in r["metrics"]]
    assert [r["step"] for r in train] == list(range(1, n.step + 1)) == list(range(1, 9))
    assert [r["epoch"] for r in train] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert all(set(r["metrics"]) == {"loss"} for r in train)

    validate = metric_lines(records, "validate")
    assert [(r["epoch"], r["step"]) for r in validate] == [(1, 4), (2, 8)]
    for record, (epoch, row) in zip(validate, history.iterrows(), strict=True):
        assert record["epoch"] == epoch and record["step"] == row["step"]
        assert record["metrics"] == {"val_loss": row["val_loss"], "val_acc": row["val_acc"]}

    epochs = [r for r in metric_lines(records, "train") if "epoch_loss" in r["metrics"]]
    assert [r["metrics"]["epoch_loss"] for r in epochs] == list(history["loss"])
    data = metric_lines(records, "data")
    assert [r["metrics"]["data_wait_frac"] for r in data] == list(history["data_wait_frac"])


def test_params_tags_and_the_binding_report_are_written_before_the_first_compile(
    tmp_path, fresh_cache
):
    seen_at_compile = []

    class CompileWatcher:
        def note(self, message, done=False):
            if message.startswith("compiling") and not seen_at_compile:
                seen_at_compile.extend(r["type"] for r in read_jsonl(tmp_path / "metrics.jsonl"))

    n = nitro.Nitro(
        ToyWithMetrics(max_epochs=1, width=6),
        run_dir=str(tmp_path),
        seed=3,
        learning_rate=0.01,
        logger=JSONLinesLogger(),
        progress=False,
    )
    n.events.add(CompileWatcher())
    n.train()

    assert seen_at_compile == ["params", "tags", "other"]
    params, tags, other = read_jsonl(tmp_path / "metrics.jsonl")[:3]
    assert {k: params["params"][k] for k in ("width", "scale", "seed", "learning_rate")} == {
        "width": 6,
        "scale": 1.0,
        "seed": 3,
        "learning_rate": 0.01,
    }
    assert params["params"]["optimizer"] == "optax.adam(learning_rate=0.01)"
    assert params["params"]["optimizer.b1"] == 0.9
    assert tags["tags"] == {"experiment": n.owner}
    assert other["key"] == "binding_report"

    def without_dispatch(report: str) -> list[str]:  # the dispatch decision comes later
        return [line for line in report.splitlines() if "steps per dispatch" not in line]

    assert without_dispatch(other["value"]) == without_dispatch(str(n.binding_report()))


def test_every_line_is_on_disk_when_train_and_validate_return(tmp_path):
    """The files hold their records in memory on the hot path; each call ends with them on
    disk, read back while the handle is still open."""
    n = nitro.Nitro(
        ToyWithMetrics(max_epochs=3),
        run_dir=str(tmp_path),
        logger=[JSONLinesLogger(), CSVLogger(), TensorBoardLogger()],
        progress=False,
    )
    n.train()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    train = [r["step"] for r in metric_lines(records, "train") if "loss" in r["metrics"]]
    assert train == list(range(1, n.step + 1))
    assert [r["epoch"] for r in metric_lines(records, "validate")] == [1, 2, 3]
    assert records[-1] == {**records[-1], "type": "finish", "status": "completed"}
    rows = read_csv(tmp_path / "metrics.csv")
    assert [int(r["step"]) for r in rows if r["name"] == "loss"] == train
    assert [int(r["epoch"]) for r in rows if r["name"] == "val_loss"] == [1, 2, 3]
    scalars = read_tensorboard(tmp_path).Scalars("train/loss")
    assert [s.step for s in scalars] == train

    lines = len(records)
    logger = n.logger
    assert logger is not None
    logger.log_other("note", "after the run")  # queued: a validate() ends with it on disk
    n.validate()
    (note,) = read_jsonl(tmp_path / "metrics.jsonl")[lines:]
    assert (note["type"], note["key"], note["value"]) == ("other", "note", "after the run")


def test_lines_reach_the_disk_while_a_long_run_goes_on(tmp_path):
    n = nitro.Nitro(
        Toy(max_epochs=10**6, with_val=False),
        run_dir=str(tmp_path),
        logger=[JSONLinesLogger(), CSVLogger()],
        progress=False,
        checkpointer=None,
    )
    n.train(background=True)
    seen, deadline = 0, time.monotonic() + 120
    try:
        while time.monotonic() < deadline and seen < 50:
            time.sleep(0.2)
            assert n.running
            if (tmp_path / "metrics.jsonl").exists():
                seen = len(metric_lines(read_jsonl(tmp_path / "metrics.jsonl"), "train"))
    finally:
        n.stop().wait()
    assert seen >= 50  # written during the run, not only at its end
    records = read_jsonl(tmp_path / "metrics.jsonl")
    steps = [r["step"] for r in metric_lines(records, "train") if "loss" in r["metrics"]]
    assert steps == list(range(1, n.step + 1))
    rows = read_csv(tmp_path / "metrics.csv")
    assert [int(r["step"]) for r in rows if r["name"] == "loss"] == steps


@nitro.experiment
class PoisonedLoss:
    """The loss of the second training batch is NaN with finite gradients (the NaN enters
    through stop_gradient), so training goes on with check_divergence=False; the metric
    `broken` is NaN on every validation batch."""

    max_epochs: int = 1

    def build_data(self):
        poison = np.zeros(64, np.float32)
        poison[16:32] = np.nan
        return {
            "train": ArrayLoader({"x": X, "y": Y, "poison": poison}, 16, shuffle=False),
            "val": ArrayLoader(
                {"x": X[:32], "y": Y[:32], "poison": np.zeros(32, np.float32)}, 16, shuffle=False
            ),
        }

    def build_model(self, rngs):
        return nnx.Linear(5, 2, rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y, poison):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + jax.lax.stop_gradient(poison.mean())

    def metrics(self, logits, *, y):
        return {"acc": (logits.argmax(-1) == y).mean(), "broken": jnp.nan}


def test_non_finite_values_never_reach_the_loggers(tmp_path):
    json_logger, csv_logger = JSONLinesLogger(), CSVLogger()
    n = train_logged(tmp_path, [json_logger, csv_logger], PoisonedLoss(), check_divergence=False)
    assert n.step == 4 and math.isnan(n.state.history[0]["val_broken"])

    records = read_jsonl(tmp_path / "metrics.jsonl")  # refuses NaN and Infinity literals
    train = [r for r in metric_lines(records, "train") if "loss" in r["metrics"]]
    assert [r["step"] for r in train] == [1, 3, 4]
    (validate,) = metric_lines(records, "validate")
    assert set(validate["metrics"]) == {"val_loss", "val_acc"}
    assert all(
        value is not None for r in metric_lines(records, "train") for value in r["metrics"].values()
    )
    rows = read_csv(tmp_path / "metrics.csv")
    assert [int(r["step"]) for r in rows if r["name"] == "loss"] == [1, 3, 4]
    assert not any(r["name"] == "val_broken" for r in rows)


def test_a_logger_called_directly_writes_non_finite_values_as_null_or_empty(tmp_path):
    json_logger = JSONLinesLogger(tmp_path / "direct.jsonl")
    csv_logger = CSVLogger(tmp_path / "direct.csv")
    for logger in (json_logger, csv_logger):
        logger.log_metrics(
            {"a": float("nan"), "b": np.float32(0.5), "c": float("inf")},
            step=7,
            epoch=None,
            context="validate",
        )
        logger.finish("completed")
    (line, _) = read_jsonl(tmp_path / "direct.jsonl")
    assert line["metrics"] == {"a": None, "b": 0.5, "c": None}
    assert line["epoch"] is None and line["step"] == 7
    assert [(r["name"], r["value"], r["epoch"]) for r in read_csv(tmp_path / "direct.csv")] == [
        ("a", "", ""),
        ("b", "0.5", ""),
        ("c", "", ""),
    ]


# ---------------------------------------------------------------------------------------------
# appending: a second train(), a new handle on the same run directory


def test_a_second_train_appends_to_the_same_files_and_the_steps_continue(tmp_path):
    loggers = [JSONLinesLogger(), CSVLogger(), TensorBoardLogger()]
    n = nitro.Nitro(
        ToyWithMetrics(max_epochs=1),
        run_dir=str(tmp_path),
        logger=loggers,
        progress=False,
        checkpointer=None,  # a directory holding checkpoints takes a new run only by resuming
    )
    n.train()
    n.train(epochs=1)

    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["status"] for r in records if r["type"] == "finish"] == ["completed", "completed"]
    # what describes the run is logged once, and again only when it changes
    assert sum(r["type"] == "params" for r in records) == 1
    train = [r for r in metric_lines(records, "train") if "loss" in r["metrics"]]
    assert [r["step"] for r in train] == list(range(1, 9))
    rows = read_csv(tmp_path / "metrics.csv")
    assert [int(r["step"]) for r in rows if r["name"] == "loss"] == list(range(1, 9))
    with open(tmp_path / "metrics.csv", encoding="utf-8") as file:
        assert sum(line.startswith("time,context") for line in file) == 1
    scalars = read_tensorboard(tmp_path).Scalars("train/loss")
    assert [s.step for s in scalars] == list(range(1, 9))
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2

    # a new handle with new loggers on the same directory appends too
    m = nitro.Nitro(
        ToyWithMetrics(max_epochs=1),
        run_dir=str(tmp_path),
        logger=JSONLinesLogger(),
        progress=False,
        checkpointer=None,
    )
    m.train()
    again = read_jsonl(tmp_path / "metrics.jsonl")
    assert again[: len(records)] == records
    assert sum(r["type"] == "finish" for r in again) == 3
    assert sum(r["type"] == "params" for r in again) == 2  # a new handle describes its run

    m.set_device(scale=2.0).train(epochs=1)  # a Device field changed: the params again
    params = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["type"] == "params"]
    assert len(params) == 3 and params[-1]["params"]["scale"] == 2.0


def test_a_logger_with_a_path_keeps_it_and_a_pathless_one_adopts_the_run_directory(tmp_path):
    elsewhere = tmp_path / "logs" / "mine.jsonl"
    given, pathless = JSONLinesLogger(elsewhere), JSONLinesLogger()
    train_logged(tmp_path / "run", [given, pathless])
    assert given.path == str(elsewhere) and pathless.path == str(tmp_path / "run" / "metrics.jsonl")
    mine, adopted = read_jsonl(elsewhere), read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r.get("metrics") for r in mine] == [r.get("metrics") for r in adopted]
    assert len(mine) == 3 + 8 + 2 * 3 + 1  # params, tags, other; steps; epochs; finish
    assert pathless.info() == {"type": "JSONLinesLogger", "path": pathless.path}
    assert pathless.run_url == (tmp_path / "run" / "metrics.jsonl").resolve().as_uri()


# ---------------------------------------------------------------------------------------------
# fan-out and isolation


def test_a_list_of_loggers_fans_out_the_same_values_to_every_format(tmp_path):
    n = train_logged(tmp_path, [JSONLinesLogger(), CSVLogger(), TensorBoardLogger()])
    json_train = [
        r["metrics"]["loss"]
        for r in metric_lines(read_jsonl(tmp_path / "metrics.jsonl"), "train")
        if "loss" in r["metrics"]
    ]
    csv_train = [
        float(r["value"]) for r in read_csv(tmp_path / "metrics.csv") if r["name"] == "loss"
    ]
    assert csv_train == json_train and len(json_train) == n.step

    accumulator = read_tensorboard(tmp_path)
    tb_train = accumulator.Scalars("train/loss")
    assert [s.step for s in tb_train] == list(range(1, n.step + 1))
    np.testing.assert_allclose([s.value for s in tb_train], json_train, rtol=1e-6)
    val = accumulator.Scalars("validate/val_acc")
    assert [s.step for s in val] == list(n.history()["step"])
    np.testing.assert_allclose([s.value for s in val], n.history()["val_acc"], rtol=1e-6)
    assert {"train/epoch_loss", "data/data_wait_frac", "validate/val_loss"} <= set(
        accumulator.Tags()["scalars"]
    )


class Broken(BaseLogger):
    def __init__(self, fail_at: int):
        self.fail_at, self.calls = fail_at, 0

    def log_metrics(self, metrics, *, step, epoch, context):
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError("disk full")


def test_a_logger_that_raises_is_switched_off_with_one_warning_and_the_others_go_on(tmp_path):
    broken = Broken(fail_at=3)
    with pytest.warns(RuntimeWarning) as warned:
        n = train_logged(tmp_path, [broken, JSONLinesLogger()])
    messages = [str(w.message) for w in warned if "logger" in str(w.message)]
    assert messages == [
        "logger Broken raised OSError in log_metrics(): disk full; it is switched off for the "
        "rest of this run, which goes on"
    ]
    assert broken.calls == 3
    assert (n.step, n.stop_reason) == (8, "completed")
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert len([r for r in metric_lines(records, "train") if "loss" in r["metrics"]]) == 8

    # a new run switches it back on
    broken.fail_at = None
    n.train(epochs=1)
    assert broken.calls == 3 + 4 + 3  # 4 steps, then the epoch's train, validate, data lines


def test_a_lone_logger_that_raises_does_not_stop_training(tmp_path):
    broken = Broken(fail_at=1)
    with pytest.warns(RuntimeWarning, match="logger Broken raised OSError"):
        n = train_logged(tmp_path, broken)
    assert (n.step, n.stop_reason, broken.calls) == (8, "completed", 1)


class StateBroken(BaseLogger):
    def state(self):
        raise RuntimeError("no state today")


def test_a_logger_whose_state_raises_is_switched_off_once_and_checkpoints_go_on(tmp_path):
    broken = StateBroken()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = train_logged(
            tmp_path,
            [broken, JSONLinesLogger()],
            ToyWithMetrics(max_epochs=3),
            checkpointer=nitro.Checkpointer(budget=None),
        )
    messages = [str(w.message) for w in caught if "logger" in str(w.message)]
    assert messages == [
        "logger StateBroken raised RuntimeError in state(): no state today; it is switched "
        "off for the rest of this run, which goes on"
    ]
    assert (n.epoch, n.stop_reason) == (3, "completed")
    assert sorted(n.checkpoints()["epoch"]) == [1, 2, 3]
    resumed = nitro.Nitro(
        ToyWithMetrics(max_epochs=4),
        run_dir=str(tmp_path),
        resume="auto",
        logger=[StateBroken(), JSONLinesLogger()],
        progress=False,
    )
    assert resumed.epoch == 3  # the checkpoint holds no state for it: it reattaches as new


def test_an_object_missing_verbs_is_refused_naming_them():
    class OnlyMetrics:
        def log_metrics(self, metrics, *, step, epoch, context):
            pass

    with pytest.raises(TypeError) as raised:
        LoggingReporter(OnlyMetrics())
    message = str(raised.value)
    assert "OnlyMetrics lacks log_params, log_tags, log_other, log_confusion, finish" in message
    assert "subclass nitro.loggers.BaseLogger" in message
    assert as_logger(None) is None
    assert isinstance(as_logger([JSONLinesLogger("a.jsonl")]), LoggerGroup)


# ---------------------------------------------------------------------------------------------
# finish statuses


def test_finish_says_requested_after_a_stop_and_error_after_a_failure(tmp_path):
    class StopAtTwo:
        def step(self, step, loss):
            if step == 2:
                handle.stop()

    handle = nitro.Nitro(
        Toy(max_epochs=2),
        run_dir=str(tmp_path / "stopped"),
        logger=JSONLinesLogger(),
        progress=False,
    )
    handle.events.add(StopAtTwo())
    handle.train()
    records = read_jsonl(tmp_path / "stopped" / "metrics.jsonl")
    assert handle.stop_reason == "requested" and records[-1] == {
        **records[-1],
        "type": "finish",
        "status": "requested",
    }

    with pytest.raises(nitro.DivergenceError):
        train_logged(tmp_path / "failed", JSONLinesLogger(), PoisonedLoss())
    records = read_jsonl(tmp_path / "failed" / "metrics.jsonl")
    assert (records[-1]["type"], records[-1]["status"]) == ("finish", "error")
    assert [finish_status(r) for r in ("completed", "early_stop", None, "odd")] == [
        "completed",
        "early_stop",
        "error",
        "error",
    ]


# ---------------------------------------------------------------------------------------------
# TensorBoard


def test_tensorboard_holds_params_the_binding_report_hparams_and_the_status(tmp_path):
    n = train_logged(tmp_path, TensorBoardLogger())
    accumulator = read_tensorboard(tmp_path)

    (params,) = text_of(accumulator, "params/text_summary")
    assert "| width | 8 |" in params and "| seed | 0 |" in params
    (report,) = text_of(accumulator, "other/binding_report/text_summary")
    assert "run keywords" in report
    assert text_of(accumulator, "run/status/text_summary") == ["completed"]

    content = accumulator.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/session_start_info"]
    ).session_start_info
    assert start.hparams["width"].number_value == 8
    assert start.hparams["prefetch"].string_value == "auto"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/experiment"]
    ).experiment
    assert [m.name.tag for m in experiment.metric_infos] == [
        "validate/val_loss",
        "validate/val_acc",
    ]
    end = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/session_end_info"]
    ).session_end_info
    assert end.status == 1  # STATUS_SUCCESS
    assert len(accumulator.Scalars("train/loss")) == n.step


def test_tensorboard_refuses_a_metric_that_is_not_a_number(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    with pytest.raises(TypeError, match="metric 'name' is str"):
        logger.log_metrics({"name": "adam"}, step=1, epoch=1, context="train")


# ---------------------------------------------------------------------------------------------
# resume: state() and reattach()


def test_tensorboard_state_round_trips_and_purges_the_steps_logged_after_it(tmp_path):
    crashed = TensorBoardLogger(tmp_path)
    for step in range(1, 7):
        crashed.log_metrics({"loss": float(step)}, step=step, epoch=1, context="train")
    saved = json.loads(json.dumps(crashed.state()))  # what a checkpoint stores
    assert saved == {"logdir": str(tmp_path.resolve()), "step": 6}
    for step in range(7, 11):  # logged, then lost with the crash
        crashed.log_metrics({"loss": -1.0}, step=step, epoch=2, context="train")
    crashed.close()

    resumed = TensorBoardLogger()
    resumed.reattach(saved)
    resumed.bind_run(str(tmp_path / "elsewhere"), None)  # reattached: it stays put
    for step in range(7, 11):
        resumed.log_metrics({"loss": 100.0 + step}, step=step, epoch=2, context="train")
    resumed.finish("completed")

    scalars = read_tensorboard(tmp_path).Scalars("train/loss")
    assert [(s.step, s.value) for s in scalars] == [
        *[(step, float(step)) for step in range(1, 7)],
        *[(step, 100.0 + step) for step in range(7, 11)],
    ]


@pytest.mark.parametrize("make", [JSONLinesLogger, CSVLogger], ids=["jsonl", "csv"])
def test_a_file_logger_reattached_drops_what_the_crashed_run_wrote_after_its_checkpoint(
    tmp_path, make
):
    crashed = make()
    crashed.bind_run(str(tmp_path), None)
    for step in range(1, 7):
        crashed.log_metrics({"loss": float(step)}, step=step, epoch=1, context="train")
    saved = json.loads(json.dumps(crashed.state()))  # what a checkpoint stores
    assert saved["path"] == str(tmp_path.resolve() / make.filename) and saved["step"] == 6
    for step in range(7, 11):  # logged after the checkpoint, then lost with the crash
        crashed.log_metrics({"loss": -1.0}, step=step, epoch=2, context="train")
    crashed.log_other("kept", "a fact, not a step")
    crashed.flush()
    with open(tmp_path / make.filename, "a", encoding="utf-8") as file:
        file.write('{"type": "metrics", "step": 11, "metr')  # a line the crash cut short

    resumed = make()
    resumed.reattach(saved)
    resumed.bind_run(str(tmp_path), None)
    for step in range(7, 11):
        resumed.log_metrics({"loss": 100.0 + step}, step=step, epoch=2, context="train")
    resumed.finish("completed")

    expected = [*[(s, float(s)) for s in range(1, 7)], *[(s, 100.0 + s) for s in range(7, 11)]]
    if make is JSONLinesLogger:
        records = read_jsonl(tmp_path / make.filename)
        losses = [(r["step"], r["metrics"]["loss"]) for r in metric_lines(records, "train")]
        assert [r["key"] for r in records if r["type"] == "other"] == ["kept"]
    else:
        rows = read_csv(tmp_path / make.filename)
        losses = [(int(r["step"]), float(r["value"])) for r in rows]
    assert losses == expected


def test_a_run_resumes_with_a_logger_added_or_the_default_left_out(tmp_path):
    every_epoch = nitro.Checkpointer(budget=None)
    n = train_logged(tmp_path, JSONLinesLogger(), checkpointer=every_epoch)
    n.close()
    more = nitro.Nitro(
        ToyWithMetrics(max_epochs=3),
        run_dir=str(tmp_path),
        resume="auto",
        logger=[TensorBoardLogger(), JSONLinesLogger()],
        progress=False,
        checkpointer=every_epoch,
    ).train()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in metric_lines(records, "validate")] == [1, 2, 3]
    assert [s.step for s in read_tensorboard(tmp_path).Scalars("validate/val_loss")] == [more.step]


def lifecycle_child(mode: str, *args: str, **popen) -> subprocess.Popen:
    """A child process running `lifecycle_toys.main([mode, *args])` (see test_lifecycle)."""
    code = "import lifecycle_toys; lifecycle_toys.main()"
    return subprocess.Popen(
        [sys.executable, "-c", code, mode, *args], env=child_env(), text=True, **popen
    )


def test_a_run_killed_mid_epoch_and_resumed_logs_every_step_and_epoch_once(tmp_path):
    """The default logger of a run SIGKILLed in the middle of epoch 3 (after epoch 2's
    checkpoint) and resumed in a new process: the file reads as one uninterrupted run."""
    run_dir = tmp_path / "crashed"
    crash = lifecycle_child("crash", str(run_dir), stderr=subprocess.PIPE)
    _, crash_err = crash.communicate(timeout=180)
    assert crash.returncode == -signal.SIGKILL, crash_err
    resumed = lifecycle_child("resume", str(run_dir), str(tmp_path / "resumed"))
    assert resumed.wait(timeout=180) == 0

    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r["step"] for r in metric_lines(records, "train") if "loss" in r["metrics"]]
    assert steps == list(range(1, 41))  # 5 epochs of 8 steps, none twice, none missing
    assert [r["epoch"] for r in metric_lines(records, "validate")] == [1, 2, 3, 4, 5]
    summaries = [r["epoch"] for r in metric_lines(records, "train") if "epoch_loss" in r["metrics"]]
    assert summaries == [1, 2, 3, 4, 5]
    history = json.loads((tmp_path / "resumed.json").read_text())
    assert [r["metrics"]["val_loss"] for r in metric_lines(records, "validate")] == (
        history["val_loss"]
    )
    assert [r["status"] for r in records if r["type"] == "finish"] == ["completed"]
    assert sum(r["type"] == "params" for r in records) == 2  # the crashed call and the resumed


def test_reattach_refuses_another_directory_or_another_logger_type(tmp_path):
    saved = {"logdir": str(tmp_path / "a"), "step": 3}
    with pytest.raises(ValueError, match=r"give TensorBoardLogger\(logdir="):
        TensorBoardLogger(tmp_path / "b").reattach(saved)
    with pytest.raises(TypeError, match="takes the state\\(\\) of a JSONLinesLogger"):
        JSONLinesLogger().reattach(saved)
    with pytest.raises(TypeError, match="keeps no state to resume"):
        BaseLogger().reattach(saved)

    group = LoggerGroup([JSONLinesLogger(), TensorBoardLogger(tmp_path / "a")])
    state = json.loads(json.dumps(group.state()))
    assert [entry["type"] for entry in state] == ["JSONLinesLogger", "TensorBoardLogger"]
    LoggerGroup([JSONLinesLogger(), TensorBoardLogger()]).reattach(state)
    reordered = TensorBoardLogger()  # each saved state goes to the logger of its type
    LoggerGroup([reordered, JSONLinesLogger()]).reattach(state)
    assert reordered.logdir == str(tmp_path / "a")
    LoggerGroup([JSONLinesLogger(), CSVLogger()]).reattach(state)  # no TensorBoard now: unused
    with pytest.raises(TypeError, match="a list of"):
        LoggerGroup([JSONLinesLogger()]).reattach({"logdir": "x"})
    assert LoggerGroup([JSONLinesLogger(), CSVLogger()]).state() is None


# ---------------------------------------------------------------------------------------------
# CSV format and confusion matrices


def test_csv_is_long_format_with_fixed_columns_and_refuses_a_foreign_file(tmp_path):
    train_logged(tmp_path, CSVLogger())
    rows = read_csv(tmp_path / "metrics.csv")
    assert list(rows[0]) == ["time", "context", "epoch", "step", "name", "value"]
    assert {r["context"] for r in rows} == {"train", "validate", "data"}

    foreign = tmp_path / "other.csv"
    foreign.write_text("a,b\n1,2\n")
    logger = CSVLogger(foreign)
    with pytest.raises(ValueError, match="is not a metrics CSV of this logger"):
        logger.log_metrics({"loss": 1.0}, step=1, epoch=1, context="train")


def test_log_confusion_writes_rows_true_columns_predicted(tmp_path):
    logger = JSONLinesLogger(tmp_path / "c.jsonl")
    logger.log_confusion(np.array([[5, 1], [2, 7]]), ["cat", "dog"], epoch=3)
    (record,) = read_jsonl(tmp_path / "c.jsonl")
    assert (record["type"], record["epoch"]) == ("confusion", 3)
    assert (record["labels"], record["matrix"]) == (["cat", "dog"], [[5, 1], [2, 7]])
    with pytest.raises(ValueError, match="3 labels for a 2x2 matrix"):
        logger.log_confusion([[1, 0], [0, 1]], ["a", "b", "c"], epoch=1)

    board = TensorBoardLogger(tmp_path / "tb")
    board.log_confusion([[5, 1], [2, 7]], ["cat", "dog"], epoch=3)
    board.finish("completed")
    (text,) = text_of(read_tensorboard(tmp_path / "tb"), "confusion/text_summary")
    assert "| **dog** | 2 | 7 |" in text


def test_jsonl_metric_lines_read_back_exactly_whatever_the_names_and_numbers(tmp_path):
    logger = JSONLinesLogger(tmp_path / "m.jsonl")
    cases = [
        ({"loss": 0.1 + 0.2}, 1, 1, "train"),
        ({'a "quoted" name': 1e-310, "ünï": 12345678901234567.0, "count": 3}, None, 2, "validate"),
        ({"flag": True, "half": np.float32(0.5)}, 4, None, "train"),  # through the encoder
    ]
    for metrics, step, epoch, context in cases:
        logger.log_metrics(metrics, step=step, epoch=epoch, context=context)
    logger.close()
    records = read_jsonl(tmp_path / "m.jsonl")
    for (metrics, step, epoch, context), record in zip(cases, records, strict=True):
        assert (record["step"], record["epoch"], record["context"]) == (step, epoch, context)
        assert record["metrics"] == {
            k: float(v) if isinstance(v, np.floating) else v for k, v in metrics.items()
        }


def test_fused_calls_log_every_steps_loss_once_and_reporters_without_steps_get_each_step(
    tmp_path,
):
    class EachStep:  # a reporter with `step` only: still called once per step
        def __init__(self):
            self.seen = []

        def step(self, step, loss):
            self.seen.append((step, loss))

    class Batched(EachStep):  # one with `steps`: called once per call
        def __init__(self):
            super().__init__()
            self.calls = 0

        def steps(self, first, losses):
            self.calls += 1
            self.seen.extend((first + i, loss) for i, loss in enumerate(losses))

    each, batched = EachStep(), Batched()
    n = nitro.Nitro(
        Toy(max_epochs=3),
        run_dir=str(tmp_path),
        steps_per_dispatch=4,
        checkpointer=None,
        progress=each,
    )
    n.events.add(batched)
    n.train()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    steps = [s for s, _ in each.seen]
    assert steps == list(range(1, n.step + 1))
    assert batched.seen == each.seen and batched.calls < n.step  # whole calls at a time
    per_step = [r for r in metric_lines(records, "train") if set(r["metrics"]) == {"loss"}]
    assert [(r["step"], r["metrics"]["loss"]) for r in per_step] == each.seen
