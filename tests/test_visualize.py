"""Looking at samples: `render`, `show_batch`, `top_losses` and `confusion` draw what the
model does with the programs a handle has (data alone compiles nothing), a `visualize` hook
that raises is reported once and switched off, and the figures reach files and loggers."""

from __future__ import annotations

import contextlib

import jax.monitoring
import matplotlib
import numpy as np
import optax
import pytest

import nitro
from nitro.examples.digits import Digits

matplotlib.use("Agg")

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_compiles():
    """What compiles inside: the compile cache's misses and jax's own compile events."""
    events: list[str] = []

    def listen(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    misses = nitro.cache_stats().misses
    counts = {}
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        counts["cache"] = nitro.cache_stats().misses - misses
        counts["jax"] = len(events)


@pytest.fixture(scope="module")
def trained():
    n = nitro.Nitro(Digits(max_epochs=1), seed=0, progress=False)
    n.train()
    return n


def test_show_batch_and_render_without_predictions_compile_nothing():
    n = nitro.Nitro(Digits(max_epochs=1, batch_size=32), seed=0, progress=False)
    with counting_compiles() as compiled:
        batch = n.show_batch(samples=12)
        data = n.render("val", batches=2, predictions=False, samples=40)
    assert compiled == {"cache": 0, "jax": 0}
    assert len(batch.rows) == 12 and "'train'" in batch.title and "data" in batch.title
    assert [row["index"] for row in data.rows] == list(range(40))  # two batches of 32
    val = nitro.datasets.digits_arrays()["val"]
    assert [row["y"] for row in data.rows] == val["y"][:40].tolist()
    assert "prediction" not in data.rows[0]
    assert batch.png().startswith(b"\x89PNG")


def test_render_top_losses_and_confusion_use_the_eval_program_validation_compiled(trained):
    n = trained
    scores = n.validate()
    with counting_compiles() as compiled:
        shown = n.render(samples=20)
        worst = n.top_losses(6)
        matrix = n.confusion()
    assert compiled == {"cache": 0, "jax": 0}
    val = nitro.datasets.digits_arrays()["val"]
    logits = n.predict({"x": val["x"]})
    losses = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, val["y"]))
    assert [r["prediction"] for r in shown.rows] == logits[:20].argmax(-1).tolist()
    assert [r["index"] for r in worst.rows] == np.argsort(-losses)[:6].tolist()
    np.testing.assert_allclose([r["loss"] for r in worst.rows], np.sort(losses)[::-1][:6], 1e-5)
    assert matrix.total == len(val["y"])
    expected = np.zeros((10, 10), np.int64)
    np.add.at(expected, (val["y"], logits.argmax(-1)), 1)
    np.testing.assert_array_equal(matrix.matrix, expected)
    assert matrix.accuracy == pytest.approx(scores["val_acc"])
    per_class = matrix.per_class()
    assert per_class["support"].tolist() == np.bincount(val["y"], minlength=10).tolist()
    assert "<img src='data:image/png;base64," in matrix._repr_html_()


def test_a_visualize_that_raises_is_reported_once_with_its_line_and_switched_off(capsys):
    @nitro.experiment
    class Broken(Digits):
        def visualize(self, sample, output=None):
            return sample["x"].reshape(7, 7)  # 64 values: raises

    n = nitro.Nitro(Broken(max_epochs=1), seed=0, progress=False)
    first = n.show_batch(samples=4)
    second = n.show_batch(samples=4)
    said = capsys.readouterr().err
    assert said.count("visualize raised ValueError") == 1
    assert f"{__file__}:" in said and "reshape(7, 7)" in said
    assert len(first.rows) == len(second.rows) == 4  # drawn by the default view instead


def test_a_visualize_hook_draws_on_the_axes_it_is_given():
    seen = []

    @nitro.experiment
    class Drawn(Digits):
        def visualize(self, sample, output=None, *, ax):
            seen.append((sorted(sample), sample["x"].shape, output is None))
            ax.imshow(sample["x"].reshape(8, 8))
            ax.set_title(f"digit {sample['y']}")

    n = nitro.Nitro(Drawn(max_epochs=1), seed=0, progress=False)
    gallery = n.show_batch("val", samples=3)
    assert seen == [(["x", "y"], (64,), True)] * 3
    titles = [ax.get_title() for ax in gallery.figure.axes[:3]]
    y = nitro.datasets.digits_arrays()["val"]["y"][:3]
    assert titles == [f"digit {v}" for v in y.tolist()]


def test_render_writes_files_and_tensorboard_images(trained, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    gallery = trained.render(where=[tmp_path / "figures", tmp_path / "one.svg"], samples=4)
    assert gallery.paths == [
        str(tmp_path / "figures" / f"render_val_step{trained.step}.png"),
        str(tmp_path / "one.svg"),
    ]
    assert all((tmp_path / p).stat().st_size > 0 for p in gallery.paths)
    logged = nitro.Nitro(
        Digits(max_epochs=1), seed=0, progress=False, logger=nitro.loggers.TensorBoardLogger()
    )
    logged.show_batch(samples=4, where="logger")
    logged.confusion(where="logger")
    events = EventAccumulator(logged.run_dir)
    events.Reload()
    images = events.Tags()["images"]
    assert {"batch/train", "confusion/val"} <= set(images)
    assert events.Images("batch/train")[0].encoded_image_string.startswith(b"\x89PNG")


def test_render_sends_the_figure_to_mlflow_as_an_artifact(trained, tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="MLflowLogger needs pip install 'nitro[mlflow]'")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = (tmp_path / "mlruns").as_uri()
    logger = nitro.loggers.MLflowLogger(store)
    n = nitro.Nitro(Digits(max_epochs=1), seed=0, progress=False, logger=logger)
    n.train()
    n.top_losses(4, where="logger")
    n.close()
    client = MlflowClient(tracking_uri=store)
    figures = {a.path for a in client.list_artifacts(logger.run_id, "figures/top_losses/val")}
    assert figures == {f"figures/top_losses/val/step_{n.step}.png"}


def test_render_refuses_a_logger_it_does_not_have_and_bad_counts(trained):
    with pytest.raises(nitro.SetupError, match=r"loggers \(JSONLinesLogger\) store no images"):
        trained.render(where="logger")
    with pytest.raises(ValueError, match="samples must be an int >= 1, got 0"):
        trained.render(samples=0)
    with pytest.raises(KeyError, match="no split 'tset'"):
        trained.render("tset")


def test_a_population_answers_per_member():
    pop = nitro.Population(Digits(max_epochs=1), learning_rate=[1e-3, 1e-2], progress=False)
    pop.train()
    with counting_compiles() as compiled:
        matrices = pop.confusion()
        worst = pop.top_losses(3, member=1)
    assert compiled == {"cache": 0, "jax": 0}
    scores = pop.validate()["val_acc"].tolist()
    assert [m.accuracy for m in matrices] == pytest.approx(scores)
    assert all(m.total == 180 for m in matrices)
    assert len(worst.rows) == 3 and "member 1" in worst.title


def test_fused_evaluation_calls_give_the_same_rows_and_counts_as_single_batches():
    fused = nitro.Nitro(
        Digits(max_epochs=1, batch_size=16), seed=0, progress=False, steps_per_dispatch=2
    )
    fused.train()
    fused.validate()
    with counting_compiles() as compiled:
        matrix = fused.confusion()
        worst = fused.top_losses(5)
        shown = fused.render(batches=3, samples=40)
    assert compiled == {"cache": 0, "jax": 0}
    val = nitro.datasets.digits_arrays()["val"]
    logits = fused.predict({"x": val["x"]})
    expected = np.zeros((10, 10), np.int64)
    np.add.at(expected, (val["y"], logits.argmax(-1)), 1)
    np.testing.assert_array_equal(matrix.matrix, expected)  # 12 batches, the last one short
    losses = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, val["y"]))
    assert [r["index"] for r in worst.rows] == np.argsort(-losses)[:5].tolist()
    assert [r["index"] for r in shown.rows] == list(range(40))
    assert [r["y"] for r in shown.rows] == val["y"][:40].tolist()


def test_render_sends_the_figure_to_wandb_as_an_image(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="WandbLogger needs pip install 'nitro[wandb]'")
    import glob

    from test_loggers_tracking import finished_wandb_records, wandb_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    logger = nitro.loggers.WandbLogger("nitro-tests", dir=tmp_path)
    n = nitro.Nitro(Digits(max_epochs=1), seed=0, progress=False, logger=logger)
    n.show_batch(samples=4, where="logger")  # its logger run opened, written and finished here
    n.close()
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{logger.run_id}"))
    records = finished_wandb_records(f"{run_dir}/run-{logger.run_id}.wandb")
    logged = [k for row in wandb_history(records) for k in row if k.endswith("._type")]
    assert any(key.startswith("batch") for key in logged), logged
    assert glob.glob(f"{run_dir}/files/media/images/batch/*.png")
