"""Every feature of a run, for a population: accumulation, schedules, moving averages, SAM,
precision, the guard, fused and measured dispatch, validation within epochs, max_steps, resume
after a stop, loggers per member, early stopping per member, a never-trained population's
predict, validate and evaluate, and member(i)/best() as the member itself.

Real JAX, Flax, Optax, Orbax and loggers; each member is compared with the same settings
trained alone where that is cheap.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from tensorboard.backend.event_processing import event_accumulator

import nitro
from nitro.examples.digits import Digits
from nitro.loggers import CSVLogger, JSONLinesLogger, TensorBoardLogger

SMALL = dict(width=16, batch_size=128)  # 9 steps an epoch
RATES = [1e-3, 1e-2]
QUIET: dict[str, Any] = dict(progress=False, checkpointer=None, logger=None)


def population(epochs=1, **keywords) -> nitro.Population:
    keywords = {"learning_rate": RATES, **QUIET, **keywords}
    return nitro.Population(Digits(max_epochs=epochs, **SMALL), **keywords)


def alone(settings, epochs=1, **keywords) -> nitro.Nitro:
    keywords = {**QUIET, **settings, **keywords}
    return nitro.Nitro(Digits(max_epochs=epochs, **SMALL), **keywords).train()


def params(handle) -> list[np.ndarray]:
    return [np.asarray(leaf, np.float32) for leaf in handle.state.variables.params]


def assert_members_equal_alone(pop, epochs, atol=1e-5, **keywords):
    history = pop.history()
    for i, settings in enumerate(pop.members):
        solo = alone(settings, epochs, **keywords)
        mine = history.loc[i]
        assert mine["step"].tolist() == solo.history()["step"].tolist()
        for column in ("loss", "val_loss"):
            np.testing.assert_allclose(mine[column], solo.history()[column], rtol=0, atol=atol)
        for column in ("loss_scale", "skipped_steps"):  # float16's: each member's own
            assert (column in mine) == (column in solo.history())
            if column in mine:
                assert mine[column].tolist() == solo.history()[column].tolist()
        for a, b in zip(params(pop.member(i)), params(solo), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=atol * 10)


@pytest.mark.parametrize(
    "keywords",
    [
        dict(accum=2),
        dict(ema=0.9),
        dict(sam=0.05),
        dict(check_divergence=True),
        dict(steps_per_dispatch=4),
        dict(accum=2, steps_per_dispatch=3),
    ],
    ids=["accum", "ema", "sam", "guard", "fused", "fused-accum"],
)
def test_a_shared_feature_trains_each_member_as_it_trains_alone(keywords):
    pop = population(**keywords).train()
    assert_members_equal_alone(pop, 1, **keywords)


def test_schedules_per_member_equal_each_alone():
    schedules = [
        {"learning_rate": optax.cosine_decay_schedule(3e-3, 9)},
        {"learning_rate": optax.linear_schedule(1e-3, 1e-2, 9)},
    ]
    pop = nitro.Population(Digits(max_epochs=1, **SMALL), schedules=schedules, **QUIET).train()
    assert_members_equal_alone(pop, 1)


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_precision_trains_every_member_as_alone(precision):
    pop = population(precision=precision).train()
    assert ("loss_scale" in pop.history()) == (precision == "float16")
    assert np.isfinite(pop.history()["loss"]).all()
    assert_members_equal_alone(pop, 1, atol=5e-2, precision=precision)


def test_auto_dispatch_decides_and_trains_as_one_step_a_call(monkeypatch):
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)  # however short the run
    monkeypatch.setattr(nitro.dispatch, "TARGET_SECONDS", 0.0)
    pop = population(steps_per_dispatch="auto").train()
    assert pop.dispatch.setting == "auto" and isinstance(pop.steps_per_call, int)
    one = population(steps_per_dispatch=1).train()
    np.testing.assert_allclose(pop.history()["val_loss"], one.history()["val_loss"], atol=1e-6)


def test_val_every_steps_gives_each_member_its_alone_validations(tmp_path):
    pop = population(val_every_steps=4, logger=JSONLinesLogger(), run_dir=tmp_path / "p").train()
    table = pop.validations()
    for i, settings in enumerate(pop.members):
        solo = alone(settings, val_every_steps=4).validations()
        mine = table.loc[i]
        assert list(mine.index) == list(solo["step"] if "step" in solo else solo.index)
        np.testing.assert_allclose(mine["val_loss"], solo["val_loss"], atol=1e-5)
        # each member's logger run logs its validations within the epoch, as a run's does
        lines = (tmp_path / "p" / f"member-{i}" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        logged = [
            (r["step"], r["metrics"]["val_loss"])
            for r in records
            if r.get("type") == "metrics" and r["context"] == "validate" and r["step"] % 4 == 0
        ]
        assert [step for step, _ in logged] == list(mine.index), logged
        np.testing.assert_allclose([v for _, v in logged], mine["val_loss"], rtol=1e-6)


def test_max_steps_stops_every_member_mid_epoch():
    pop = population(epochs=3, max_steps=13).train()
    assert (pop.step, pop.epoch) == (13, 1)  # 9 steps an epoch: stopped 4 into the second
    pop.train()  # trained to max_steps already: nothing more
    assert pop.step == 13
    solo = alone(pop.members[0], 3, max_steps=13)
    assert solo.step == 13
    for a, b in zip(params(pop.member(0)), params(solo), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_resume_after_a_stop_continues_epoch_history_and_weights(tmp_path):
    keywords = dict(checkpointer=nitro.Checkpointer(), run_dir=tmp_path / "pop")
    straight = population(epochs=2).train()
    first = population(epochs=2, **keywords)
    first.train(steps=13)  # mid the second epoch
    first.close()
    again = population(epochs=2, **{**keywords, "resume": tmp_path / "pop"})
    assert (again.epoch, again.step) == (first.epoch, first.step)
    again.train()
    history, plain = again.history(), straight.history()
    assert list(history.index) == list(plain.index)
    np.testing.assert_allclose(history["val_loss"], plain["val_loss"], atol=1e-6)
    for i in range(len(again)):
        for a, b in zip(params(again.member(i)), params(straight.member(i)), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)
    again.close()


def saved_state(run_dir) -> dict:
    """The newest checkpoint's `state` item, read by orbax alone."""
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options) as m:
        return m.restore(m.latest_step())["state"]


def test_resume_restores_each_members_float16_loss_scale(tmp_path):
    half = nitro.Precision("float16", loss_scale=2.0**10, growth_interval=2)
    keywords: dict[str, Any] = dict(precision=half, checkpointer=nitro.Checkpointer())
    first = population(run_dir=tmp_path / "a", **keywords)
    first.train(steps=5)  # the scale has grown twice
    first.close()
    again = population(resume=tmp_path / "a", **{**keywords, "run_dir": tmp_path / "a"})
    again.train()
    again.close()
    straight = population(run_dir=tmp_path / "b", **keywords).train()
    straight.close()
    resumed, plain = saved_state(tmp_path / "a"), saved_state(tmp_path / "b")
    assert set(plain["loss_scale"]) and np.all(np.asarray(plain["loss_scale"]["scale"]) > 2.0**10)
    for key in plain["loss_scale"]:
        np.testing.assert_array_equal(resumed["loss_scale"][key], plain["loss_scale"][key])
    np.testing.assert_allclose(again.history()["loss"], straight.history()["loss"], atol=1e-6)


def test_resume_restores_each_members_validations(tmp_path):
    keywords = dict(val_every_steps=3, checkpointer=nitro.Checkpointer(), run_dir=tmp_path / "p")
    first = population(epochs=2, **keywords)
    first.train(steps=13)
    before = first.validations()
    first.close()
    again = population(epochs=2, **{**keywords, "resume": tmp_path / "p"})
    assert len(before) > 0
    np.testing.assert_allclose(again.validations()["val_loss"], before["val_loss"])
    again.train()
    straight = population(epochs=2, val_every_steps=3).train()
    np.testing.assert_allclose(
        again.validations()["val_loss"], straight.validations()["val_loss"], atol=1e-6
    )
    again.close()


def test_each_member_logs_to_its_own_files_read_back(tmp_path):
    logger = [JSONLinesLogger(), CSVLogger(), TensorBoardLogger()]
    keywords: dict[str, Any] = dict(
        progress=False, checkpointer=None, logger=logger, run_dir=tmp_path / "p"
    )
    pop = nitro.Population(Digits(max_epochs=2, **SMALL), learning_rate=RATES, **keywords)
    pop.train()
    pop.close()
    history = pop.history()
    for i in range(len(pop)):
        folder = Path(pop.run_dir) / f"member-{i}"
        lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        losses = [r["metrics"]["val_loss"] for r in lines if r.get("context") == "validate"]
        np.testing.assert_allclose(losses, history.loc[i]["val_loss"], rtol=1e-6)
        with open(folder / "metrics.csv") as file:
            rows = [row for row in csv.DictReader(file) if row["name"] == "val_loss"]
        np.testing.assert_allclose(
            [float(r["value"]) for r in rows], history.loc[i]["val_loss"], rtol=1e-6
        )
        events = event_accumulator.EventAccumulator(str(folder))
        events.Reload()
        tags = events.Tags()["scalars"]
        tag = next(t for t in tags if t.endswith("val_loss"))
        np.testing.assert_allclose(
            [e.value for e in events.Scalars(tag)], history.loc[i]["val_loss"], rtol=1e-6
        )


def test_early_stopping_stops_a_member_and_its_epoch_stops_counting():
    stop = nitro.EarlyStopping(metric="val_loss", patience=1, min_delta=10.0)
    pop = population(epochs=4, learning_rate=[1e-3, 1e-2], early_stop=stop).train()
    assert set(pop.stopped) == {0, 1}
    assert pop.stop_reason == "early_stop"
    for i, settings in enumerate(pop.members):
        solo = alone(settings, 4, early_stop=stop)
        assert pop.history().loc[i].index.tolist() == solo.history().index.tolist()
        assert pop.stopped_at[i] == solo.step
        assert pop.history().loc[i]["step"].iloc[-1] == solo.step


def test_a_never_trained_population_predicts_validates_and_evaluates():
    pop = population()
    x = np.zeros((5, 64), np.float32)
    out = pop.predict({"x": x})
    assert np.asarray(out).shape[:2] == (2, 5)
    scores = pop.validate()
    assert len(scores) == 2 and np.isfinite(scores["val_loss"]).all()
    tests = pop.evaluate()
    assert len(tests) == 2 and np.isfinite(tests["test_loss"]).all()
    for i, settings in enumerate(pop.members):
        solo = nitro.Nitro(Digits(max_epochs=1, **SMALL), **QUIET, **settings)
        assert scores["val_loss"].iloc[i] == pytest.approx(solo.validate()["val_loss"], abs=1e-6)


def test_a_population_evaluates_and_predicts_with_each_members_moving_average():
    pop = population(ema=0.9).train()
    x = {"x": np.zeros((3, 64), np.float32)}
    scores, outputs = pop.validate(weights="ema"), pop.predict(x, weights="ema")
    for i, settings in enumerate(pop.members):
        solo = alone(settings, ema=0.9)
        assert scores["val_loss"].iloc[i] == pytest.approx(
            solo.validate(weights="ema")["val_loss"], abs=1e-5
        )
        np.testing.assert_allclose(outputs[i], solo.predict(x, weights="ema"), atol=1e-5)


def test_member_and_best_are_handles_equal_to_the_member():
    pop = population().train()
    best = pop.best("val_loss")
    index = int(np.argmin(pop.history().groupby(level="member")["val_loss"].last().to_numpy()))
    member = pop.member(index)
    for a, b in zip(params(best), params(member), strict=True):
        np.testing.assert_array_equal(a, b)
    assert best.validate()["val_loss"] == pytest.approx(
        pop.history().loc[index]["val_loss"].iloc[-1], abs=1e-6
    )
    np.testing.assert_allclose(
        member.predict({"x": np.zeros((3, 64), np.float32)}),
        pop.predict({"x": np.zeros((3, 64), np.float32)})[index],
        atol=1e-6,
    )


def test_a_member_that_stops_early_keeps_its_epoch_while_the_others_train_on(tmp_path):
    stop = nitro.EarlyStopping(metric="val_loss", patience=1, min_delta=0.05)
    keywords: dict[str, Any] = dict(early_stop=stop, checkpointer=nitro.Checkpointer())
    pop = population(epochs=4, learning_rate=[1e-4, 3e-2], run_dir=tmp_path / "p", **keywords)
    pop.train(epochs=3)
    pop.close()
    again = population(epochs=4, learning_rate=[1e-4, 3e-2], resume=tmp_path / "p", **keywords)
    assert again.stopped == pop.stopped and again.stopped_at == pop.stopped_at
    again.train()
    history = again.history()
    for i, settings in enumerate(again.members):
        solo = alone(settings, 4, early_stop=stop)
        assert history.loc[i].index.tolist() == solo.history().index.tolist()
        np.testing.assert_allclose(
            history.loc[i]["val_loss"], solo.history()["val_loss"], atol=1e-5
        )
    assert 0 in again.stopped and len(history.loc[0]) < len(history.loc[1])
    again.close()


@pytest.mark.parametrize(
    "keywords",
    [
        dict(ema=nitro.EMA(0.9, evaluate=True)),
        dict(precision="float16", accum=2, steps_per_dispatch=3),
        dict(precision="bfloat16", sam=0.05, check_divergence=True),
    ],
    ids=["ema-evaluated", "float16-accum-fused", "bfloat16-sam-guard"],
)
def test_features_combined_train_each_member_as_alone(keywords):
    pop = population(**keywords).train()
    atol = 5e-2 if "precision" in keywords else 1e-5
    assert_members_equal_alone(pop, 1, atol=atol, **keywords)
