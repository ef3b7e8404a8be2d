"""`n.lr_find()`: a log grid of learning rates trained side by side as one population.

Real JAX, Flax and Optax throughout, on the digits example with a small MLP.
"""

import math
import os
import signal
import threading

import jax
import numpy as np
import optax
import pytest

import nitro
from nitro.examples.digits import Digits

SMALL = dict(width=32, batch_size=128)  # 64-32-32-10; 9 steps an epoch


def _handle(**keywords):
    keywords = {"seed": 0, "progress": False, **keywords}
    return nitro.Nitro(Digits(**SMALL, max_epochs=keywords.pop("max_epochs", 5)), **keywords)


def _snapshot(n):
    """Everything of the handle lr_find must leave as it was: its variables (parameters,
    model and optimizer state) as host arrays, its counters, history and hyperparameters."""
    variables = [np.array(x) for x in jax.tree.leaves(n.state.variables)]
    return variables, n.step, n.epoch, n.history().copy(), n.hyperparameters, n.phase


def _same(before, after):
    for a, b in zip(before[0], after[0], strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)  # bitwise
    assert before[1:3] == after[1:3]
    assert before[3].equals(after[3])
    assert before[4] == after[4] and before[5] == after[5]


def test_lr_find_leaves_the_handle_as_it_was_and_starts_from_its_weights(tmp_path):
    fresh = _handle().lr_find(num=3, steps=9)
    n = _handle(learning_rate=1e-2)
    n.train(epochs=3).wait()  # its checkpoints written
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    before = _snapshot(n)
    result = n.lr_find(num=3, steps=9)
    _same(before, _snapshot(n))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == files  # no files
    # every member started from the trained weights, on the same first batch
    assert np.allclose(result.curves[:, 0], result.start_loss)
    assert result.start_loss < 0.5 * fresh.start_loss
    # and the handle trains on as it would have
    n.train(epochs=1)
    assert n.step == before[1] + 9


def test_one_program_for_the_whole_grid(fresh_cache):
    n = _handle()
    result = n.lr_find(num=6, steps=40)  # 40 steps round up to whole calls: 45 (K = 9)
    assert result.steps == 45 and result.curves.shape == (6, 45)
    stats = nitro.cache_stats()
    assert [p["program"] for p in stats.programs] == ["population train step"]
    assert stats.misses == 1
    again = _handle().lr_find(num=6, steps=40)  # a second probe compiles nothing
    assert nitro.cache_stats().misses == 1
    np.testing.assert_array_equal(again.curves, result.curves)


def test_the_suggestion_is_on_the_grid_and_trains_well():
    n = _handle(max_epochs=8)
    result = n.lr_find()
    assert 1e-5 <= result.suggestion <= 1.0
    assert result.suggestion in result.learning_rates.tolist()
    assert len(result.learning_rates) == 11 and result.steps == 54
    assert result.suggestion not in result.diverged
    # the rule: the smallest rate within 10% of the best member's drop from the start
    best = np.nanmin(
        [
            v
            for lr, v in zip(result.learning_rates, result.losses, strict=True)
            if lr not in result.diverged
        ]
    )
    within = result.losses <= best + 0.1 * (result.start_loss - best)
    assert result.suggestion == result.learning_rates[np.argmax(within)]
    assert result.frame.loc[result.suggestion, "loss"] == pytest.approx(
        result.losses[np.argmax(within)]
    )
    assert n.step == 0
    assert result.apply() is n
    n.train()
    assert n.hyperparameters["learning_rate"] == pytest.approx(result.suggestion)
    history = n.history()
    assert history["loss"].iloc[-1] < 0.15 and history["val_acc"].iloc[-1] > 0.85
    default = _handle(max_epochs=8).train().history()  # the default rate, 1e-3
    assert history["val_loss"].iloc[-1] < 0.5 * default["val_loss"].iloc[-1]


def test_divergent_high_rates_are_reported_not_fatal():
    n = _handle(optimizer=optax.sgd)
    result = n.lr_find(start=1e-2, end=1e10, num=5, steps=18)  # 1e-2, 10, 1e4, 1e7, 1e10
    diverged = result.diverged
    assert sorted(diverged) == [10.0, 1e4, 1e7, 1e10]
    for lr in (1e4, 1e7, 1e10):  # a non-finite loss: the guard stopped them
        assert "diverged at step" in diverged[lr]
        assert math.isnan(result.frame.loc[lr, "loss"])
        assert result.frame.loc[lr, "diverged"] == diverged[lr]
    assert diverged[10.0].startswith("its loss rose from")  # finite, but above its start
    assert result.suggestion == 1e-2  # the one rate that trained
    assert n.step == 0  # the handle did not train


def test_every_rate_diverging_is_an_error_naming_the_grid():
    n = _handle(optimizer=optax.sgd)
    with pytest.raises(nitro.DivergenceError, match="every learning rate of the grid diverged"):
        n.lr_find(start=1e7, end=1e10, num=2, steps=9)
    assert n.step == 0


def test_refusals_name_the_argument_and_change_nothing():
    n = _handle()
    compiles = nitro.cache_stats().misses
    for arguments, words in (
        (dict(start=0), "start=0"),
        (dict(start=-1e-3), "start=-0.001"),
        (dict(end=float("inf")), "end=inf"),
        (dict(start=1e-2, end=1e-3), "end must be above start"),
        (dict(num=1), "num=1"),
        (dict(num=2.5), "num=2.5"),
        (dict(steps=0), "steps=0"),
        (dict(steps=10_000), "steps=10000"),
        (dict(method="cyclic"), "method='cyclic'"),
    ):
        with pytest.raises(nitro.SetupError, match=words.replace("(", r"\(")):
            n.lr_find(**arguments)
    no_train = _handle(data={k: v for k, v in _handle().splits.items() if k != "train"})
    with pytest.raises(nitro.SetupError, match="'train' split"):
        no_train.lr_find()
    baked = _handle(optimizer=optax.sgd(0.1))  # a transformation with its own rate
    with pytest.raises(nitro.OptimizerError, match="inject_hyperparams"):
        baked.lr_find()
    assert n.step == 0 and nitro.cache_stats().misses == compiles  # refused before any build


def test_a_running_handle_is_refused():
    n = _handle(max_epochs=10_000)
    started = threading.Event()

    class Started:
        def step(self, step, loss):
            started.set()

    n.events.add(Started())
    n.train(background=True)
    try:
        assert started.wait(60)
        with pytest.raises(nitro.RunningError, match="is training"):
            n.lr_find()
    finally:
        n.stop().wait()
    assert n.lr_find(num=2, steps=9).steps == 9  # idle again: it runs


def test_a_scheduled_learning_rate_is_left_out_and_apply_refuses_to_replace_it():
    n = _handle(schedules={"learning_rate": optax.cosine_decay_schedule(1e-3, 90)})
    result = n.lr_find(num=3, steps=9)
    assert result.suggestion in result.learning_rates.tolist()
    with pytest.raises(nitro.ScheduleError, match="schedules its learning rate"):
        result.apply()
    n.train(steps=1)
    assert n.hyperparameters["learning_rate"] == pytest.approx(1e-3)  # the schedule's


def test_the_ramp_stops_past_four_times_its_minimum():
    n = _handle(optimizer=optax.sgd)
    before = _snapshot(n)
    result = n.lr_find(method="ramp", start=1e-3, end=1e4, steps=100)
    _same(before, _snapshot(n))
    assert result.method == "ramp" and result.steps < 100  # it stopped early
    (where,) = result.diverged.values()
    assert "4x its minimum" in where or "non-finite" in where
    rates = result.learning_rates
    assert rates[0] == pytest.approx(1e-3) and np.all(np.diff(rates) > 0)
    assert rates[1] / rates[0] == pytest.approx(1e7 ** (1 / 99))  # geometric, 100 steps
    lowest = rates[int(np.argmin(result.losses))]
    assert result.suggestion == pytest.approx(lowest / 10)
    assert list(result.frame.columns) == ["learning_rate", "loss", "smoothed"]


def test_the_result_shows_itself(tmp_path):
    result = _handle().lr_find(num=3, steps=9)
    assert "suggestion" in repr(result) and "grid of 3 learning rates" in repr(result)
    html = result._repr_html_()
    assert html.startswith("<table>") and "suggestion" in html
    figure = result.plot(tmp_path / "lr.png")
    (ax,) = figure.axes
    assert ax.get_xscale() == "log"
    assert (tmp_path / "lr.png").stat().st_size > 0
    assert list(result.frame.columns) == ["loss", "diverged"]
    assert result.frame.index.name == "learning_rate"


def test_the_plot_spans_the_rates_that_trained_when_one_diverged_to_a_huge_loss():
    rates = np.geomspace(1e-4, 1.0, 5)
    result = nitro.LRFindResult(
        method="grid",
        learning_rates=rates,
        losses=np.array([2.1, 1.2, 0.6, 0.9, 42_000.0]),
        suggestion=1e-2,
        rule="within 10% of the best drop",
        diverged={1.0: "its loss rose from 2.3 to 42000"},
        curves=np.zeros((5, 10)),
        start_loss=2.3,
        steps=10,
        seconds=1.0,
    )
    (ax,) = result.plot().axes
    low, high = ax.get_ylim()
    assert 0.4 < low < 0.6 and 2.3 < high < 3.0  # the trained rates and the start, not 42,000
    (crossed,) = [line for line in ax.get_lines() if line.get_label() == "diverged (above)"]
    assert list(crossed.get_xdata()) == [1.0]
    assert ax.get_window_extent().contains(*crossed.get_transform().transform((1.0, 0.96)))


def test_a_population_takes_weights_and_data_shared_by_every_member():
    n = _handle()
    n.train(epochs=1)
    data = n.splits
    pop = nitro.Population(
        Digits(**SMALL), learning_rate=[1e-3, 1e-2], weights=n, data=data, progress=False
    )
    for index in range(2):
        member = pop.member(index)
        for a, b in zip(
            jax.tree.leaves(member.state.variables.params),
            jax.tree.leaves(n.state.variables.params),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert member.splits["train"] is data["train"]


def test_ctrl_c_stops_it_and_changes_nothing():
    n = _handle()
    before = _snapshot(n)

    def interrupt(change):  # the population trains: press Ctrl-C
        if change.phase == "training":
            nitro.events.remove_monitor(interrupt)
            os.kill(os.getpid(), signal.SIGINT)

    nitro.on_phase(interrupt)
    try:
        with pytest.raises(nitro.Interrupted, match="nothing changed"):
            n.lr_find(num=2, steps=900)
    finally:
        nitro.events.remove_monitor(interrupt)
    _same(before, _snapshot(n))
    assert n.lr_find(num=2, steps=9).steps == 9
