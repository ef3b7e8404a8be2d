"""MLflow and W&B loggers, and figures and images in TensorBoard, MLflow and W&B, read back
with each tool's own reader: TensorBoard's EventAccumulator, `MlflowClient` on a local store,
and W&B's offline run files (its `.wandb` log read with W&B's own protobuf schema)."""

import glob
import io
import os
import socket
import struct
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from toys import ToyWithMetrics

import nitro
from nitro.loggers import JSONLinesLogger, LoggerGroup, TensorBoardLogger

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402

STEPS_PER_EPOCH = 4  # ToyWithMetrics


def a_figure(value: float):
    figure, axes = plt.subplots(figsize=(2, 1.5), dpi=50)
    axes.plot([0, 1], [0, value])
    return figure


class FigureEachEpoch:
    """A reporter that logs a figure and an image through the handle's logger each epoch:
    how user code reaches the loggers."""

    def start_run(self, handle, target_epoch):
        self.handle = handle

    def end_epoch(self, row):
        logger = self.handle.logger
        figure = a_figure(row["val_loss"])
        logger.log_figure("curve", figure, step=row["step"])
        plt.close(figure)
        logger.log_image("noise", np.full((4, 6), row["epoch"] / 10), step=row["step"])


def train_with(tmp_path, logger, epochs=2, **keywords):
    n = nitro.Nitro(
        ToyWithMetrics(max_epochs=epochs),
        run_dir=str(tmp_path / "run"),
        logger=logger,
        progress=False,
        checkpointer=nitro.Checkpointer(budget=None),
        **keywords,
    )
    n.events.add(FigureEachEpoch())
    return n.train()


# ---------------------------------------------------------------------------------------------
# TensorBoard, and the protocol's defaults


def test_tensorboard_holds_the_figures_and_images_a_reporter_logs(tmp_path):
    n = train_with(tmp_path, [JSONLinesLogger(), TensorBoardLogger()])  # JSON Lines ignores them
    accumulator = event_accumulator.EventAccumulator(
        n.run_dir, size_guidance={event_accumulator.IMAGES: 0}
    )
    accumulator.Reload()
    assert set(accumulator.Tags()["images"]) == {"curve", "noise"}
    curves = accumulator.Images("curve")
    assert [image.step for image in curves] == [4, 8]
    png = Image.open(io.BytesIO(curves[0].encoded_image_string))
    assert png.size == (100, 75) == (curves[0].width, curves[0].height)
    noise = accumulator.Images("noise")
    pixels = np.asarray(Image.open(io.BytesIO(noise[1].encoded_image_string)))
    assert pixels.shape == (4, 6) and (pixels == round(0.2 * 255)).all()
    assert n.logger.loggers[0].path.endswith("metrics.jsonl")  # still on: nothing raised


def test_a_logger_without_media_verbs_is_accepted_and_bad_images_are_refused(tmp_path):
    class OnlyMetrics:  # the ten verbs, no log_figure / log_image
        run_id = run_url = None

        def __getattr__(self, name):
            return lambda *a, **k: None

    group = LoggerGroup([OnlyMetrics(), TensorBoardLogger(tmp_path)])
    group.log_image("fine", np.zeros((2, 2, 3), np.uint8), step=1)
    with pytest.raises(ValueError, match=r"log_image\('bad', \.\.\.\) takes an image of shape"):
        group.log_image("bad", np.zeros((3, 8, 8)), step=1)
    with pytest.raises(TypeError, match=r"takes uint8 pixels \(0-255\) or floats \(0-1\)"):
        group.log_image("ints", np.zeros((2, 2), np.int64), step=1)
    with pytest.raises(TypeError, match=r"log_figure\('f', \.\.\.\) takes a matplotlib Figure"):
        group.log_figure("f", np.zeros((2, 2)), step=1)
    with pytest.raises(TypeError, match=r"log it with log_figure"):
        group.log_image("fig", a_figure(1.0), step=1)
    group.finish("completed")
    assert len(group.loggers) == 2  # a bad image is the caller's error: no logger switched off
    nitro.loggers.BaseLogger().log_figure("x", a_figure(1.0), step=0)  # ignored by default


# ---------------------------------------------------------------------------------------------
# MLflow, on a local tracking store


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="MLflowLogger needs pip install 'nitro[mlflow]'")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it
    return (tmp_path / "mlruns").as_uri()


def test_mlflow_holds_params_metrics_by_step_tags_figures_and_the_final_status(
    tmp_path, mlflow_store
):
    from mlflow.tracking import MlflowClient

    logger = nitro.loggers.MLflowLogger(mlflow_store, experiment="toys")
    n = train_with(tmp_path, logger)
    client = MlflowClient(tracking_uri=mlflow_store)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == n.run_id
    assert client.get_experiment(run.info.experiment_id).name == "toys"
    assert run.data.params["max_epochs"] == "2" and run.data.params["seed"] == str(n.seed)
    assert run.data.tags["experiment"] == n.owner
    assert run.data.tags["nitro.finish_status"] == "completed"
    losses = client.get_metric_history(logger.run_id, "loss")
    assert [m.step for m in losses] == list(range(1, 9))
    val = client.get_metric_history(logger.run_id, "val_acc")
    assert [(m.step, m.value) for m in val] == [
        (row["step"], pytest.approx(row["val_acc"])) for _, row in n.history().iterrows()
    ]
    artifacts = {a.path for a in client.list_artifacts(logger.run_id)}
    assert {"binding_report.txt", "figures", "images"} <= artifacts
    figures = {a.path for a in client.list_artifacts(logger.run_id, "figures/curve")}
    assert figures == {"figures/curve/step_4.png", "figures/curve/step_8.png"}
    local = client.download_artifacts(logger.run_id, "figures/curve/step_8.png", str(tmp_path))
    assert Image.open(local).size == (100, 75)
    images = [a.path for a in client.list_artifacts(logger.run_id, "images")]
    assert any(p.startswith("images/noise+step+8+") and p.endswith(".png") for p in images)
    text = client.download_artifacts(logger.run_id, "binding_report.txt", str(tmp_path))
    assert "splits" in open(text).read()


def test_mlflow_resume_continues_the_same_run(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    first = nitro.loggers.MLflowLogger(mlflow_store)
    n = train_with(tmp_path, first)
    n.close()
    second = nitro.loggers.MLflowLogger(mlflow_store)
    more = train_with(tmp_path, second, epochs=3, resume="auto")
    assert second.run_id == first.run_id and more.step == 12
    client = MlflowClient(tracking_uri=mlflow_store)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "ToyWithMetrics"
    assert [m.step for m in client.get_metric_history(first.run_id, "val_loss")] == [4, 8, 12]
    assert run.data.params["max_epochs"] == "2"  # MLflow keeps a parameter's first value
    assert run.data.tags["param_changed.max_epochs"] == "3"


def test_mlflow_keeps_both_values_of_a_step_the_crashed_run_sent_after_its_checkpoint(
    tmp_path, mlflow_store
):
    from mlflow.tracking import MlflowClient

    crashed = nitro.loggers.MLflowLogger(mlflow_store, experiment="crashes")
    crashed.bind_run(str(tmp_path), "r1")
    for step in range(1, 7):
        crashed.log_metrics({"loss": float(step)}, step=step, epoch=1, context="train")
    saved = crashed.state()  # what a checkpoint stores, after a flush
    assert saved is not None and saved["step"] == 6
    for step in range(7, 10):  # sent after the checkpoint, then the process dies
        crashed.log_metrics({"loss": float(step)}, step=step, epoch=2, context="train")
    crashed.flush()

    resumed = nitro.loggers.MLflowLogger(mlflow_store, experiment="crashes")
    resumed.reattach(saved)
    resumed.bind_run(str(tmp_path), "r1")
    for step in range(7, 11):  # resume is exact: the same values again
        resumed.log_metrics({"loss": float(step)}, step=step, epoch=2, context="train")
    resumed.finish("completed")

    client = MlflowClient(tracking_uri=mlflow_store)
    history = client.get_metric_history(crashed.run_id, "loss")
    steps = sorted(m.step for m in history)
    assert steps == [1, 2, 3, 4, 5, 6, 7, 7, 8, 8, 9, 9, 10]  # nothing is deleted
    assert all(m.value == float(m.step) for m in history)
    assert client.get_run(crashed.run_id).data.metrics["loss"] == 10.0
    last = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
    assert last == {step: float(step) for step in range(1, 11)}  # the reading the docs give


def test_mlflow_refuses_a_run_its_store_does_not_hold(tmp_path, mlflow_store):
    logger = nitro.loggers.MLflowLogger(mlflow_store)
    with pytest.raises(ValueError, match=r"is not in the tracking store .*give MLflowLogger"):
        logger.reattach({"run_id": "0123456789abcdef", "tracking_uri": "file:///elsewhere"})
    with pytest.raises(TypeError, match=r"takes the state\(\) of an MLflowLogger"):
        logger.reattach({"logdir": "x"})
    with pytest.raises(TypeError, match=r"tracking_uri=\.\.\.\) takes a URI string"):
        nitro.loggers.MLflowLogger(42)


def test_mlflow_with_no_tracking_uri_writes_a_local_store_out_of_the_box(tmp_path, monkeypatch):
    """What `pip install 'nitro[mlflow]'` gives a first run with no server and no settings:
    MLflow's default store (`sqlite:///mlflow.db` in the working directory) works."""
    pytest.importorskip("mlflow", reason="MLflowLogger needs pip install 'nitro[mlflow]'")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    script = """
import nitro
from nitro.examples.digits import Digits
from mlflow.tracking import MlflowClient

logger = nitro.loggers.MLflowLogger()
n = nitro.Nitro(Digits(max_epochs=1), logger=logger, progress=False)
n.train()
run = MlflowClient().get_run(logger.run_id)
print(run.info.status, len(MlflowClient().get_metric_history(logger.run_id, "loss")))
"""
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["FINISHED", "9"]
    assert os.path.isfile(tmp_path / "mlflow.db")


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on: a connection is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_tracking_server_that_is_down_is_switched_off_with_one_warning_and_the_run_stops_on_request(
    tmp_path,
):
    pytest.importorskip("mlflow", reason="MLflowLogger needs pip install 'nitro[mlflow]'")
    uri = f"http://127.0.0.1:{closed_port()}"
    n = nitro.Nitro(
        ToyWithMetrics(max_epochs=100_000),
        run_dir=str(tmp_path / "run"),
        logger=nitro.loggers.MLflowLogger(uri),
        progress=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n.train(background=True)
        deadline = time.monotonic() + 120  # MLflow's own retries alone take about 4 minutes
        while n.step < 3 * STEPS_PER_EPOCH and n.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert n.step >= 3 * STEPS_PER_EPOCH, "the run did not get past its first steps"
        n.stop().wait()
    assert (n.running, n.stop_reason) == (False, "requested")
    assert n.epoch < 100_000 and len(n.history()) >= 2
    mentions = [str(w.message) for w in caught if "MLflowLogger" in str(w.message)]
    assert len(mentions) == 1, mentions
    assert f"no MLflow server answers at {uri}" in mentions[0]
    assert "switched off for the rest of this run" in mentions[0]


# ---------------------------------------------------------------------------------------------
# W&B, offline


def wandb_records(path):
    """The records of a W&B run's `.wandb` file: a LevelDB-format log (32 KiB blocks, each
    record a 7-byte header: checksum, length, kind) of `wandb_internal_pb2.Record`s, after a
    7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, parts, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (kind, length) == (0, 0):
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):  # a full record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


def finished_wandb_records(path, timeout=120.0):
    """The records of a finished run's `.wandb` file, once W&B's service process has written
    them all (its `exit` record; it may land a moment after `finish()` returns)."""
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} never got its exit record"
        time.sleep(0.2)


def wandb_history(records):
    import json

    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    ".".join(item.nested_key) or item.key: json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="WandbLogger needs pip install 'nitro[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    return tmp_path / "wb"


def test_wandb_offline_run_holds_config_metrics_tags_images_and_exit(tmp_path, wandb_offline):
    import json

    logger = nitro.loggers.WandbLogger("nitro-tests", dir=wandb_offline, tags=["toy"])
    n = train_with(tmp_path, logger)
    (run_dir,) = glob.glob(str(wandb_offline / "wandb" / f"offline-run-*-{logger.run_id}"))
    records = finished_wandb_records(f"{run_dir}/run-{logger.run_id}.wandb")
    kinds = [r.WhichOneof("record_type") for r in records]
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "nitro-tests" and run.display_name == n.run_id
    config = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") in ("run", "config")
        for item in (
            r.run.config.update if r.WhichOneof("record_type") == "run" else r.config.update
        )
    }
    assert config["max_epochs"] == 2 and config["seed"] == n.seed
    history = wandb_history(records)
    losses = [row["_step"] for row in history if "loss" in row]
    assert losses == list(range(1, 9))
    by_step = {row["_step"]: row for row in history}
    assert by_step[8]["val_acc"] == pytest.approx(n.history()["val_acc"].iloc[-1])
    assert by_step[8]["curve._type"] == by_step[8]["noise._type"] == "image-file"
    images = sorted(glob.glob(f"{run_dir}/files/media/images/*.png"))
    assert len(images) == 4 and Image.open(images[0]).size in ((100, 75), (6, 4))
    tags = [r.run.tags for r in records if r.WhichOneof("record_type") == "run"]
    assert "toy" in tags[0]
    assert "exit" in kinds and next(r.exit for r in records if r.HasField("exit")).exit_code == 0
    assert open(f"{run_dir}/files/binding_report.txt").read().startswith("experiment toys.")


def test_wandb_resume_continues_the_same_run(tmp_path, wandb_offline):
    first = nitro.loggers.WandbLogger("nitro-tests", dir=wandb_offline)
    train_with(tmp_path, first).close()
    second = nitro.loggers.WandbLogger("nitro-tests", dir=wandb_offline)
    more = train_with(tmp_path, second, epochs=3, resume="auto")
    assert second.run_id == first.run_id and more.step == 12
    # the resumed part is a second offline directory of the same run id (`-1` appended when
    # it starts within the same second), which `wandb sync` joins
    pattern = str(wandb_offline / "wandb" / f"offline-run-*-{first.run_id}*")

    def loss_steps():
        records = [
            record
            for run in sorted(glob.glob(pattern))
            for record in finished_wandb_records(f"{run}/run-{first.run_id}.wandb")
        ]
        ids = {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}
        return ids, [row["_step"] for row in wandb_history(records) if "loss" in row]

    assert len(glob.glob(pattern)) == 2
    assert loss_steps() == ({first.run_id}, list(range(1, 13)))


def test_wandb_refuses_bad_arguments(wandb_offline):
    with pytest.raises(ValueError, match=r"mode=\.\.\.\) takes 'online', 'offline'"):
        nitro.loggers.WandbLogger(mode="cloud")
    with pytest.raises(TypeError, match=r"tags=\.\.\.\) takes a list of strings"):
        nitro.loggers.WandbLogger(tags="one")
    with pytest.raises(TypeError, match=r"takes the state\(\) of a WandbLogger"):
        nitro.loggers.WandbLogger().reattach({"run_id": "x"})
