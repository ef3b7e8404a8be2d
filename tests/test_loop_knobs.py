"""Loop knobs: gradient accumulation with a remainder, `max_steps`, validation every N steps
and more than one evaluation split, each through the public API against a reference."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from toys import TinyMLP, ToyWithMetrics, X, Y

import nitro
from nitro.data import ArrayLoader


@nitro.experiment
class Unshuffled(ToyWithMetrics):
    """64 samples in unshuffled batches of `batch_size`: 16 batches of 4 by default."""

    batch_size: int = 4

    def build_data(self):
        return {"train": ArrayLoader({"x": X, "y": Y}, self.batch_size, shuffle=False)}


def params_of(n):
    return [np.asarray(a) for a in n.state.variables.params]


# ---------------------------------------------------------------------------------------------
# accumulation with a remainder


def _accumulated_sgd(groups, epochs: int, rate: float):
    """Plain SGD on the mean gradient of each group of 4-sample micro-batches, by hand."""
    graphdef, params, rest = nnx.split(TinyMLP(5, 8, 2, rngs=nnx.Rngs(0)), nnx.Param, ...)

    def loss_fn(p, lo, hi):
        logits = nnx.merge(graphdef, p, rest)(X[lo:hi])
        return optax.softmax_cross_entropy_with_integer_labels(logits, Y[lo:hi]).mean()

    for _ in range(epochs):
        start = 0
        for size in groups:
            micro = [
                jax.grad(loss_fn)(params, 4 * (start + i), 4 * (start + i + 1)) for i in range(size)
            ]
            mean = jax.tree.map(lambda *g: sum(g) / len(g), *micro)
            params = jax.tree.map(lambda w, g: w - rate * g, params, mean)
            start += size
    return jax.tree.leaves(params)


def test_accum_applies_the_epochs_last_partial_group_as_the_mean_of_its_micro_batches():
    # 16 micro-batches, accum=6: updates of 6, 6 and the 4 left, each the mean of its own
    n = nitro.Nitro(
        Unshuffled(max_epochs=2),
        accum=6,
        optimizer=optax.sgd,
        learning_rate=0.1,
        steps_per_dispatch=1,
        progress=False,
    )
    assert n.total_steps == 6  # 2 epochs x ceil(16 / 6)
    n.train()
    assert n.step == 6
    expected = _accumulated_sgd([6, 6, 4], epochs=2, rate=0.1)
    for a, b in zip(params_of(n), expected, strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-6)


def test_accum_remainder_matches_optax_multisteps_over_the_same_grouping():
    # optax.MultiSteps takes a fixed k; an epoch of 12 + 4 micro-batches with accum=12 and
    # k=12, then the 4 left as a k=4 group, is the same arithmetic: check against both.
    n = nitro.Nitro(Unshuffled(max_epochs=1), accum=12, steps_per_dispatch=1, progress=False)
    n.train()
    graphdef, params, rest = nnx.split(TinyMLP(5, 8, 2, rngs=nnx.Rngs(0)), nnx.Param, ...)

    def loss_fn(p, i):
        logits = nnx.merge(graphdef, p, rest)(X[4 * i : 4 * i + 4])
        return optax.softmax_cross_entropy_with_integer_labels(logits, Y[4 * i : 4 * i + 4]).mean()

    adam = optax.adam(1e-3)  # the default optimizer at the default learning rate
    state = adam.init(params)
    for group in (range(0, 12), range(12, 16)):
        multi = optax.MultiSteps(adam, every_k_schedule=len(group))
        multi_state = multi.init(params)._replace(inner_opt_state=state)
        for i in group:
            updates, multi_state = multi.update(jax.grad(loss_fn)(params, i), multi_state, params)
            params = optax.apply_updates(params, updates)
        state = multi_state.inner_opt_state
    for a, b in zip(params_of(n), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-6)


def test_accum_remainder_with_fused_steps_equals_one_step_per_call_bitwise():
    base = nitro.Nitro(Unshuffled(max_epochs=2), accum=6, steps_per_dispatch=1, progress=False)
    fused = nitro.Nitro(Unshuffled(max_epochs=2), accum=6, steps_per_dispatch=2, progress=False)
    base.train()
    fused.train()
    assert base.step == fused.step == 6
    for a, b in zip(params_of(base), params_of(fused), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(base.history()["loss"], fused.history()["loss"])


def test_accum_larger_than_the_epoch_makes_one_update_of_every_batch():
    n = nitro.Nitro(
        Unshuffled(max_epochs=1), accum=20, optimizer=optax.sgd, learning_rate=0.1, progress=False
    )
    n.train()
    assert n.step == 1
    for a, b in zip(params_of(n), _accumulated_sgd([16], epochs=1, rate=0.1), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# more than one evaluation split


def test_each_eval_split_is_evaluated_every_epoch_under_its_prefix(tmp_path):
    n = nitro.Nitro(
        ToyWithMetrics(max_epochs=3),
        eval_splits=("val", "test"),
        checkpointer=nitro.Checkpointer(k=1, metric="test_loss"),
        early_stop=nitro.EarlyStopping(metric="test_acc", mode="max", patience=1),
        run_dir=str(tmp_path / "run"),
        progress=False,
    )
    n.train()
    history = n.history()
    assert {"val_loss", "val_acc", "test_loss", "test_acc"} <= set(history.columns)
    last = history.iloc[-1]
    assert last["test_loss"] == pytest.approx(n.evaluate("test")["test_loss"], rel=1e-6)
    assert last["val_loss"] == pytest.approx(n.validate()["val_loss"], rel=1e-6)
    # the checkpoints are ranked by test_loss: the best one saved is the run's lowest
    saved = n.checkpoints()
    assert "test_loss" in saved.columns
    best = history["test_loss"].min()
    assert saved["test_loss"].min() == pytest.approx(best, rel=1e-6)
    # early stopping read test_acc: it stopped once an epoch did not improve it, or ran out
    accs = list(history["test_acc"])
    if n.stop_reason == "early_stop":
        assert accs[-1] <= max(accs[:-1]) + 1e-4
    else:
        assert n.stop_reason == "completed" and len(accs) == 3
    # the logger gets every eval split's metrics as validation, at the epoch's step
    with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as file:
        records = [json.loads(line) for line in file]
    validate = [r for r in records if r["type"] == "metrics" and r["context"] == "validate"]
    assert [r["step"] for r in validate] == list(history["step"])
    assert {"val_loss", "test_loss", "test_acc"} <= set(validate[-1]["metrics"])
    assert validate[-1]["metrics"]["test_loss"] == pytest.approx(last["test_loss"])


def test_eval_splits_may_leave_val_out_and_default_to_val():
    only_test = nitro.Nitro(ToyWithMetrics(max_epochs=1), eval_splits=("test",), progress=False)
    only_test.train()
    columns = set(only_test.history().columns)
    assert {"test_loss", "test_acc"} <= columns and not any(c.startswith("val_") for c in columns)
    default = nitro.Nitro(ToyWithMetrics(max_epochs=1), progress=False)
    default.train()
    columns = set(default.history().columns)
    assert "val_loss" in columns and not any(c.startswith("test_") for c in columns)
    none = nitro.Nitro(ToyWithMetrics(max_epochs=1), eval_splits=(), progress=False)
    none.train()
    assert not any(c.startswith(("val_", "test_")) for c in none.history().columns)


def test_bad_eval_splits_are_refused_naming_the_fix():
    with pytest.raises(nitro.SetupError, match=r"eval_splits names 'tset', which build_data"):
        nitro.Nitro(ToyWithMetrics(), eval_splits=("val", "tset"), progress=False)
    with pytest.raises(nitro.SetupError, match="eval_splits names 'train'"):
        nitro.Nitro(ToyWithMetrics(), eval_splits=("train",), progress=False)
    with pytest.raises(nitro.SetupError, match="eval_splits must be a tuple of split names"):
        nitro.Nitro(ToyWithMetrics(), eval_splits=("val", "val"), progress=False)
    with pytest.raises(nitro.SetupError, match=r"pass eval_splits=\('val', 'test'\)"):
        nitro.Nitro(
            ToyWithMetrics(), early_stop=nitro.EarlyStopping(metric="test_loss"), progress=False
        )
    with pytest.raises(nitro.SetupError, match=r"pass eval_splits=\('val', 'test'\)"):
        nitro.Nitro(
            ToyWithMetrics(), checkpointer=nitro.Checkpointer(metric="test_acc"), progress=False
        )


# ---------------------------------------------------------------------------------------------
# max_steps and train(steps=)


def test_max_steps_stops_mid_epoch_saves_there_and_a_resume_continues_bitwise(tmp_path):
    # 4 steps an epoch, fused 3 per call: max_steps=6 cuts the epoch's second call to end at 6
    whole = nitro.Nitro(
        ToyWithMetrics(max_epochs=3), steps_per_dispatch=3, checkpointer=None, progress=False
    )
    whole.train()
    run_dir = str(tmp_path / "run")
    cut = nitro.Nitro(
        ToyWithMetrics(max_epochs=3),
        max_steps=6,
        steps_per_dispatch=3,
        run_dir=run_dir,
        progress=False,
    )
    cut.train()
    assert (cut.step, cut.epoch, cut.stop_reason) == (6, 1, "max_steps")
    assert cut.state.position == 2  # two batches into epoch 2
    cut.train()  # already there: a note, nothing trains
    assert cut.step == 6
    saved = cut.checkpoints()
    assert list(saved["step"])[-1] == 6  # the stop is checkpointed
    resumed = nitro.Nitro(
        ToyWithMetrics(max_epochs=3), resume=run_dir, steps_per_dispatch=3, progress=False
    )
    assert (resumed.step, resumed.epoch, resumed.state.position) == (6, 1, 2)
    resumed.train()
    assert (resumed.step, resumed.epoch, resumed.stop_reason) == (12, 3, "completed")
    for a, b in zip(params_of(whole), params_of(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(whole.history()["loss"], resumed.history()["loss"])
    np.testing.assert_array_equal(whole.history()["val_loss"], resumed.history()["val_loss"])


def test_train_steps_trains_that_many_more_steps_across_epochs_bitwise():
    whole = nitro.Nitro(
        ToyWithMetrics(max_epochs=3), steps_per_dispatch=3, checkpointer=None, progress=False
    )
    whole.train()
    n = nitro.Nitro(
        ToyWithMetrics(max_epochs=3), steps_per_dispatch=3, checkpointer=None, progress=False
    )
    n.train(steps=5)
    assert (n.step, n.epoch, n.state.position) == (5, 1, 1)
    assert n.target_epoch == 2  # the epoch its steps end in, as every count shows it
    n.train()  # steps= does not move where train() goes: max_epochs
    assert (n.step, n.epoch) == (12, 3)
    for a, b in zip(params_of(whole), params_of(n), strict=True):
        np.testing.assert_array_equal(a, b)
    n.train(steps=2)  # past max_epochs, like train(epochs=N)
    assert n.step == 14


def test_max_steps_at_an_epochs_end_commits_the_epoch_and_bad_values_are_refused():
    n = nitro.Nitro(ToyWithMetrics(max_epochs=3), max_steps=8, checkpointer=None, progress=False)
    n.train()
    assert (n.step, n.epoch, n.stop_reason) == (8, 2, "max_steps")
    assert len(n.history()) == 2
    with pytest.raises(nitro.SetupError, match=r"max_steps must be an int >= 1.*got 0"):
        nitro.Nitro(ToyWithMetrics(), max_steps=0, progress=False)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        n.train(steps=0)
    with pytest.raises(ValueError, match="epochs= or steps=, not both"):
        n.train(epochs=1, steps=1)


# ---------------------------------------------------------------------------------------------
# validation every N steps


def test_val_every_steps_evaluates_within_epochs_logs_and_resumes_with_them():
    # 4 training batches an epoch: evaluations after steps 3, 6 and 9, not at 4, 8 or 12
    # (an epoch's end validates anyway, into the history)
    n = nitro.Nitro(ToyWithMetrics(max_epochs=3), val_every_steps=3, progress=False)
    n.train()
    table = n.validations()
    assert list(table.index) == [3, 6, 9] and list(table["epoch"]) == [1, 2, 3]
    assert {"val_loss", "val_acc"} <= set(table.columns)
    assert list(n.history()["step"]) == [4, 8, 12]  # the epochs' rows are as before
    # the weights at step 6, evaluated on their own, give the row's figures
    six = nitro.Nitro(ToyWithMetrics(max_epochs=3), progress=False, checkpointer=None)
    six.train(steps=6)
    np.testing.assert_allclose(six.validate()["val_loss"], table.loc[6, "val_loss"], rtol=1e-6)
    n.close()
    records = [json.loads(line) for line in open(f"{n.run_dir}/metrics.jsonl")]
    within = [
        r["step"]
        for r in records
        if r["type"] == "metrics" and r["context"] == "validate" and r["step"] % 4
    ]
    assert within == [3, 6, 9]  # the loggers have them, at their steps
    resumed = nitro.Nitro(
        ToyWithMetrics(max_epochs=4), resume=n.run_dir, val_every_steps=3, progress=False
    )
    assert list(resumed.validations().index) == [3, 6, 9]  # saved with the checkpoint
    resumed.train()
    assert list(resumed.validations().index) == [3, 6, 9, 15]


def test_val_every_steps_with_fused_steps_cuts_the_calls_and_matches_one_step_per_call():
    one = nitro.Nitro(
        ToyWithMetrics(max_epochs=2),
        val_every_steps=3,
        steps_per_dispatch=1,
        progress=False,
        checkpointer=None,
    )
    four = nitro.Nitro(
        ToyWithMetrics(max_epochs=2),
        val_every_steps=3,
        steps_per_dispatch=4,
        progress=False,
        checkpointer=None,
    )
    one.train()
    four.train()
    assert list(four.validations().index) == [3, 6]
    np.testing.assert_array_equal(one.validations()["val_loss"], four.validations()["val_loss"])
    for a, b in zip(params_of(one), params_of(four), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "3"])
def test_a_bad_val_every_steps_is_refused(bad):
    with pytest.raises(ValueError, match="val_every_steps must be an int >= 1"):
        nitro.Nitro(ToyWithMetrics(), val_every_steps=bad, progress=False)
