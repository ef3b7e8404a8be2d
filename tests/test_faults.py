"""Faults and bad input in the loop, the data and the handle: each ends in a clear error or a
documented behaviour, and the run stays consistent (values, counters, history, threads)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from toys import TinyMLP, Toy, ToyWithMetrics, X, Y

import nitro
from nitro.data import ArrayLoader

X80, Y80 = np.resize(X, (80, 5)), np.resize(Y, 80)  # 5 batches of 16


def params_of(n):
    return [np.asarray(a) for a in n.state.variables.params]


def nitro_threads():
    return [t for t in threading.enumerate() if t.name.startswith("nitro-")]


@nitro.experiment
class Gated:
    """A loss that is finite when `gate` is 0, but whose gradient is not: sqrt at 0."""

    gate: nitro.Device[float] = 1.0
    max_epochs: int = 1
    batch_size: int = 16

    def build_data(self):
        return {"train": ArrayLoader({"x": X80, "y": Y80}, self.batch_size, shuffle=False)}

    def build_model(self, rngs):
        return TinyMLP(5, 8, 2, rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + 0.0 * jnp.sqrt(self.gate * jnp.sum(logits**2))


# ---------------------------------------------------------------------------------------------
# silent wrong results


def test_a_finite_loss_with_a_non_finite_gradient_stops_and_keeps_the_weights_before_it():
    reference = nitro.Nitro(Gated(), progress=False).train()  # the 5 steps of epoch 1
    n = nitro.Nitro(
        Gated(max_epochs=2),
        schedules={"gate": lambda step: 0.0 if step == 5 else 1.0},
        progress=False,
    )
    with pytest.raises(nitro.DivergenceError) as raised:
        n.train()
    message = str(raised.value)
    assert "a gradient is non-finite" in message and "at step 6 (epoch 2, batch 1)" in message
    assert "sqrt, log, division" in message
    assert (n.step, n.epoch, n.stop_reason, n.phase) == (5, 1, "error", "failed")
    assert all(np.isfinite(p).all() for p in params_of(n))
    for got, want in zip(params_of(n), params_of(reference), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_nan_learning_rate_at_one_step_stops_naming_it_and_keeps_the_weights():
    nan_at_5 = lambda step: np.where(step == 5, np.nan, 1e-2)  # noqa: E731
    reference = nitro.Nitro(Gated(), learning_rate=1e-2, progress=False).train()
    n = nitro.Nitro(Gated(max_epochs=2), schedules={"learning_rate": nan_at_5}, progress=False)
    with pytest.raises(nitro.DivergenceError) as raised:
        n.train()
    message = str(raised.value)
    assert "a scheduled hyperparameter is non-finite" in message and "at step 6" in message
    assert "learning_rate = nan at step 6" in message
    assert n.step == 5
    for got, want in zip(params_of(n), params_of(reference), strict=True):
        np.testing.assert_array_equal(got, want)


@nitro.experiment
class NaNBatch(Gated):
    """The second batch's loss is NaN with finite gradients (the NaN enters through
    stop_gradient), so check_divergence=False trains through it."""

    def build_data(self):
        poison = np.zeros(80, np.float32)
        poison[16:32] = np.nan
        data = {"x": X80, "y": Y80, "poison": poison}
        return {"train": ArrayLoader(data, self.batch_size, shuffle=False)}

    def loss(self, logits, *, y, poison):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + jax.lax.stop_gradient(poison.mean())


def test_with_check_divergence_off_an_epoch_with_non_finite_steps_reports_nan_and_counts_them():
    n = nitro.Nitro(NaNBatch(max_epochs=2), check_divergence=False, progress="lines")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n.train()
    history = n.history()
    assert np.isnan(history["loss"]).all()  # not the mean of the finite steps
    assert history["nonfinite_steps"].tolist() == [1, 1]
    mine = [str(w.message) for w in caught if "non-finite loss" in str(w.message)]
    assert len(mine) == 1  # once a run
    assert "epoch 1: 1 of 5 training steps had a non-finite loss" in mine[0]
    assert "'nonfinite_steps'" in mine[0]


def optimizer_state(n):
    """The optimizer state by leaf path: Adam's count is `inner_state.0.count`, its moments
    `inner_state.0.mu.*` and `inner_state.0.nu.*` (`count` is the injected hyperparameters')."""
    leaves = [np.asarray(a) for a in n.state.variables.opt_state]
    return dict(zip(n.setup.model.leaf_paths["optimizer state"], leaves, strict=True))


def assert_same_state(n, reference):
    """Parameters, optimizer state and moving average, bit for bit."""
    for got, want in zip(params_of(n), params_of(reference), strict=True):
        np.testing.assert_array_equal(got, want)
    got, want = optimizer_state(n), optimizer_state(reference)
    assert list(got) == list(want)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
    variables, expected = n.state.variables, reference.state.variables
    if expected.ema is not None:
        assert int(variables.ema_steps) == int(expected.ema_steps)
        for got, want in zip(variables.ema, expected.ema, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


SWITCHES = {  # the keywords of each stage a step may run, and the batch size that fits them
    "adam": ({}, 16),
    "accumulation": ({"accum": 2}, 8),  # 2 micro-batches of 8 per update: 5 updates an epoch
    "sam": ({"sam": 0.05}, 16),
    "everything": ({"accum": 2, "sam": nitro.ASAM(), "ema": 0.9}, 8),
}


@pytest.mark.parametrize("switches", SWITCHES)
@pytest.mark.parametrize("fault", ["gradient", "learning rate"])
def test_a_skipped_step_leaves_the_optimizer_state_as_it_was_before_it(switches, fault):
    keywords, batch_size = SWITCHES[switches]
    reference = nitro.Nitro(Gated(batch_size=batch_size), progress=False, **keywords)
    reference.train()  # the 5 updates of epoch 1
    schedules = {
        "gradient": {"gate": lambda step: 0.0 if step == 5 else 1.0},
        "learning rate": {"learning_rate": lambda step: np.where(step == 5, np.nan, 1e-3)},
    }[fault]
    n = nitro.Nitro(
        Gated(max_epochs=2, batch_size=batch_size),
        schedules=schedules,
        steps_per_dispatch=1,
        progress=False,
        **keywords,
    )
    with pytest.raises(nitro.DivergenceError, match="at step 6 "):
        n.train()
    # the bad step and the one dispatched behind it were skipped: Adam counted neither
    assert n.step == 5
    assert optimizer_state(n)["inner_state.0.count"] == 5 == optimizer_state(n)["count"]
    assert_same_state(n, reference)


@pytest.mark.parametrize("switches", SWITCHES)
def test_a_skipped_step_inside_a_fused_block_leaves_the_rest_of_the_block_unapplied(switches):
    keywords, batch_size = SWITCHES[switches]
    # epoch 2 runs as blocks of updates [5, 6, 7] and [8, 9]: update 6 fails in the middle of
    # the first, after update 5 was applied and before update 7
    n = nitro.Nitro(
        Gated(max_epochs=2, batch_size=batch_size),
        schedules={"gate": lambda step: 0.0 if step == 6 else 1.0},
        steps_per_dispatch=3,
        progress=False,
        **keywords,
    )
    with pytest.raises(nitro.DivergenceError, match="at step 7 "):
        n.train()
    assert n.step == 6 and optimizer_state(n)["inner_state.0.count"] == 6
    # the same 6 updates without a fault: epoch 1's batches, then epoch 2's first
    x96, y96 = np.concatenate([X80, X80[:16]]), np.concatenate([Y80, Y80[:16]])
    reference = nitro.Nitro(
        Gated(batch_size=batch_size),
        data={"train": ArrayLoader({"x": x96, "y": y96}, batch_size, shuffle=False)},
        steps_per_dispatch=3,
        progress=False,
        **keywords,
    )
    reference.train()
    assert reference.step == 6
    assert_same_state(n, reference)


class SlowVal(ArrayLoader):
    def batch_at(self, index, plan=None):
        time.sleep(0.02)
        return super().batch_at(index, plan)


def slow_val_splits():
    return {
        "train": ArrayLoader({"x": X, "y": Y}, 16),
        "val": SlowVal({"x": X, "y": Y}, 8, shuffle=False, drop_last=False),
    }


class StopWhenValidating:
    def __init__(self):
        self.handle = None

    def phase(self, phase):
        if phase == "validating" and self.handle is not None:
            self.handle.stop()


def test_a_stop_during_validation_records_nothing_and_the_next_validate_commits_the_epoch():
    reporter = StopWhenValidating()
    n = nitro.Nitro(ToyWithMetrics(max_epochs=3), data=slow_val_splits(), progress=reporter)
    reporter.handle = n
    n.train()
    assert (n.stop_reason, n.step, n.epoch, len(n.history())) == ("requested", 4, 0, 0)
    reporter.handle = None
    val = n.validate()  # validates the trained epoch and commits its row
    assert (n.epoch, len(n.history())) == (1, 1)
    row = n.history().iloc[0]
    assert row["val_acc"] == val["val_acc"] and row["step"] == 4 and row["loss"] > 0
    assert n.validate() == val  # same weights, same numbers: the first one was whole


def test_the_next_train_validates_an_epoch_left_unvalidated_before_anything_else():
    reporter = StopWhenValidating()
    n = nitro.Nitro(ToyWithMetrics(max_epochs=2), data=slow_val_splits(), progress=reporter)
    reporter.handle = n
    n.train()
    assert (n.epoch, n.step, len(n.history())) == (0, 4, 0)
    reporter.handle = None
    n.train()
    history = n.history()
    assert list(history.index) == [1, 2] and history["step"].tolist() == [4, 8]
    assert history["val_acc"].notna().all()


def test_an_error_during_validation_keeps_the_epoch_trained_and_unrecorded():
    calls = {"n": 0}

    @nitro.experiment
    class FailsOnce(ToyWithMetrics):
        def metrics(self, logits, *, y):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("metrics broke once")
            return {"acc": (logits.argmax(-1) == y).mean()}

    n = nitro.Nitro(FailsOnce(max_epochs=2), progress=False)
    with pytest.raises(RuntimeError, match="metrics broke once"):
        n.train()
    assert (n.epoch, n.step, len(n.history()), n.phase) == (0, 4, 0, "failed")
    n.train()
    assert list(n.history().index) == [1, 2] and n.step == 8


def test_a_generator_object_as_a_split_is_refused_naming_the_split_and_the_fixes():
    def batches():
        for i in range(4):
            yield {"x": X[i * 16 : (i + 1) * 16], "y": Y[i * 16 : (i + 1) * 16]}

    for one_shot in (batches(), iter(list(batches()))):
        with pytest.raises(nitro.SetupError) as raised:
            nitro.Nitro(Toy(), data={"train": one_shot}, progress=False)
        message = str(raised.value)
        assert "split 'train' is a one-shot iterator" in message
        assert "a list of batches, a nitro.data.ArrayLoader, or a function" in message
    n = nitro.Nitro(Toy(max_epochs=2), data={"train": batches}, progress=False)  # the function
    n.train()
    assert (n.epoch, n.step) == (2, 8)


class Overstated:
    """Says 10 batches, yields 7."""

    def __len__(self):
        return 10

    def __iter__(self):
        for i in range(7):
            rows = slice((i % 4) * 16, (i % 4 + 1) * 16)
            yield {"x": X[rows], "y": Y[rows]}


def test_a_source_whose_len_overstates_ends_the_epoch_when_it_ends_with_a_warning():
    n = nitro.Nitro(Toy(max_epochs=2), data={"train": Overstated()}, progress=False)
    with pytest.warns(
        RuntimeWarning, match=r"len\(\) says 10 batches, but its iterator ended after 7"
    ):
        n.train()
    assert (n.epoch, n.step, n.stop_reason) == (2, 14, "completed")
    assert n.history()["step"].tolist() == [7, 14]


# ---------------------------------------------------------------------------------------------
# errors that name the field, key or hook


@pytest.mark.parametrize(
    "schedule, expected",
    [
        (lambda step: "fast", "gives 'fast' at step 0; a schedule returns a number"),
        (lambda step: None, "gives None at step 0; a schedule returns a number"),
        (lambda step: np.ones(3), "(shape (3,)); an optimizer hyperparameter is one number"),
        (lambda step: 1e-3 + 1j, "(a complex number); a schedule returns a real number"),
        (lambda step: 1e-3 - step * 1e-3, "at step 7; learning_rate must be a finite number >= 0"),
    ],
    ids=["string", "none", "array", "complex", "negative-at-horizon"],
)
def test_a_bad_schedule_is_refused_at_setup_naming_the_key(schedule, expected):
    with pytest.raises(nitro.ScheduleError) as raised:
        nitro.Nitro(Toy(), schedules={"learning_rate": schedule}, progress=False)
    assert "schedule 'learning_rate' gives" in str(raised.value)
    assert expected in str(raised.value)


def test_a_device_schedule_of_the_wrong_shape_is_refused():
    with pytest.raises(nitro.ScheduleError, match="Device field 'scale' has shape"):
        nitro.Nitro(Toy(), schedules={"scale": lambda step: np.ones(2)}, progress=False)


def test_string_labels_are_refused_naming_the_field_and_its_dtype():
    labels = np.array(["cat", "dog"])[Y]
    with pytest.raises(nitro.SetupError) as raised:
        nitro.Nitro(Toy(), data={"train": ArrayLoader({"x": X, "y": labels}, 16)}, progress=False)
    message = str(raised.value)
    assert "field 'y' of the 'train' split has dtype <U3 (strings)" in message
    assert "loss runs on the device" in message and "np.unique" in message


@nitro.experiment
class Pooled(ToyWithMetrics):
    def forward(self, model, *, x):
        return model(x).mean(0)  # drops the batch axis


def test_forward_without_the_batch_axis_fails_at_the_first_trace_naming_forward():
    n = nitro.Nitro(Pooled(), progress=False)
    with pytest.raises(nitro.SetupError) as raised:
        n.validate()
    message = str(raised.value)
    assert "hook `forward` must return outputs with the batch axis first" in message
    assert "has shape (2,) for a batch of 16 (x: (16, 5))" in message
    with pytest.raises(nitro.SetupError, match="batch axis first"):
        n.predict({"x": X[:3]})
    assert n.step == 0 and n.phase == "ready"


class DtypeChange(ArrayLoader):
    def batch_at(self, index, plan=None):
        batch = super().batch_at(index, plan)
        if index == 2:
            batch["x"] = batch["x"].astype(np.float64).astype(np.float16)
        return batch


def test_a_batch_whose_dtype_changes_mid_epoch_says_what_changed():
    source = DtypeChange({"x": X, "y": Y}, 16, shuffle=False)
    n = nitro.Nitro(Toy(), data={"train": source}, progress=False)
    with pytest.raises(nitro.SetupError) as raised:
        n.train()
    message = str(raised.value)
    assert "train batch 2 differs from the first batch" in message
    assert "'x' f32[16,5] -> f16[16,5]" in message
    assert message.endswith(
        "Every training batch must match; make the loader yield the same shapes and dtypes on "
        "every batch (cast in the loader, e.g. x.astype(np.float32))."
    )
    assert n.step == 2 and n.epoch == 0


def test_a_short_final_training_batch_is_named_as_one_with_the_fix():
    source = ArrayLoader({"x": X[:40], "y": Y[:40]}, 16, shuffle=False, drop_last=False)
    n = nitro.Nitro(Toy(), data={"train": source}, progress=False)
    with pytest.raises(nitro.SetupError) as raised:
        n.train()
    assert str(raised.value) == (
        "train batch 2 differs from the first batch, whose shapes and dtypes the train step was "
        "compiled for: 'x' f32[16,5] -> f32[8,5]; 'y' i32[16] -> i32[8]. Every training batch "
        "must match; this looks like a partial final batch: drop it "
        "(ArrayLoader(..., drop_last=True))."
    )


class EmptyThird(ArrayLoader):
    def batch_at(self, index, plan=None):
        batch = super().batch_at(index, plan)
        return {k: v[:0] for k, v in batch.items()} if index == 2 else batch


def test_a_batch_with_zero_rows_is_refused_naming_the_split():
    n = nitro.Nitro(Toy(), data={"train": EmptyThird({"x": X, "y": Y}, 16)}, progress=False)
    with pytest.raises(nitro.SetupError, match="the 'train' split yielded a batch with 0 rows"):
        n.train()
    assert n.step == 2 and all(np.isfinite(p).all() for p in params_of(n))
    empty_first = [{"x": X[:0], "y": Y[:0]}]
    with pytest.raises(nitro.SetupError, match="the first batch of the 'train' split has 0 rows"):
        nitro.Nitro(Toy(), data={"train": empty_first}, progress=False)


def test_predict_with_zero_rows_returns_an_empty_result_with_the_trailing_shape():
    n = nitro.Nitro(Toy(), progress=False)
    out = n.predict({"x": X[:0]})
    assert out.shape == (0, 2) and out.dtype == np.float32


@nitro.experiment
class FirstFive(Toy):
    def forward(self, model, *, x):
        return model(x[:, :5])


def test_predict_refuses_inputs_that_do_not_fit_forward_naming_the_field_and_the_fix():
    n = nitro.Nitro(Toy(), progress=False)
    want = r"batch\['x'\] must be float32\[batch, 5\], the batch axis first, as the 'val' split"
    cases = [
        (np.zeros((3, 4), np.float32), rf"{want}'s batches give it; got float32\[3, 4\], and forward fails on it "
         r"\(TypeError: .*\)\. Each example must be \[5\], not \[4\]: give the features the "
         r"model was trained on"),
        (X[0], rf"{want}.*got float32\[5\]\. For a single example, add the batch axis: "
         r"\{'x': x\[None\]\}"),
        (X[:3, :, None], rf"{want}.*got float32\[3, 5, 1\]\. Reshape it to \[rows, 5\]"),
        (np.float32(1.0), rf"{want}.*got float32\[\]\. Give an array, with the batch axis first"),
        ("abc", r"batch\['x'\] holds strings \(<U3\[\]\), but forward runs on the device, which "
         r"takes numbers and booleans only; give float32\[batch, 5\]"),
        ([[1.0, 2.0], [3.0]], r"batch\['x'\] cannot be read as an array"),
    ]  # fmt: skip
    for value, message in cases:
        with pytest.raises(nitro.SetupError, match=message):
            n.predict({"x": value})
    np.testing.assert_allclose(n.predict({"x": X[:1]}), n.predict({"x": X[:3]})[:1], atol=1e-6)

    # a forward that takes other trailing shapes than the training batches' still may
    sliced = nitro.Nitro(FirstFive(), weights=n, progress=False)
    np.testing.assert_allclose(
        sliced.predict({"x": np.concatenate([X[:3], X[:3]], axis=1)}), n.predict({"x": X[:3]})
    )

    bare = nitro.Nitro(Toy(), weights=n, data={}, progress=False)  # no split to say the shape
    with pytest.raises(nitro.SetupError, match=r"batch\['x'\] holds strings .*encode it as"):
        bare.predict({"x": np.array([["a"] * 5])})
    assert bare.predict({"x": X[:2]}).shape == (2, 2)


# ---------------------------------------------------------------------------------------------
# interrupts

SWEEP = textwrap.dedent(
    """
    import os, random, signal, sys, threading, time
    sys.path.insert(0, {tests!r})
    import numpy as np
    import nitro
    from nitro.data import ArrayLoader
    from toys import ToyWithMetrics, X, Y

    xs, ys = np.resize(X, (3200, 5)), np.resize(Y, 3200)
    data = {{
        "train": ArrayLoader({{"x": xs, "y": ys}}, 16),
        "val": ArrayLoader({{"x": xs, "y": ys}}, 16, shuffle=False, drop_last=False),
    }}
    n = nitro.Nitro(ToyWithMetrics(max_epochs=1), data=data, progress=False)
    n.validate(); n.predict({{"x": xs[:16]}}); n.train(epochs=1)  # compile first
    random.seed({seed})
    calls = {{
        "train": lambda: n.train(epochs=1),
        "validate": n.validate,
        "evaluate": lambda: n.evaluate(split="val"),
        "predict": lambda: n.predict({{"x": xs}}),
    }}
    outcomes = {{}}
    for i in range({tries}):
        name = random.choice(sorted(calls))
        delay = random.uniform(0.0, 0.05)
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        outcome, returned = "returned", False
        try:
            timer.start()
            calls[name]()
            returned = True
            timer.join()
        except KeyboardInterrupt as error:  # Interrupted, or raw before/after the call ran
            outcome = "after return" if returned else type(error).__name__
        while timer.is_alive():  # the signal may still be on its way
            try:
                timer.join()
            except KeyboardInterrupt:
                pass
        outcomes[(name, outcome)] = outcomes.get((name, outcome), 0) + 1
        deadline = time.monotonic() + 300
        while n.running:
            assert time.monotonic() < deadline, "a run was left behind"
            time.sleep(0.01)
        assert n.phase in ("ready", "done", "stopped"), (name, n.phase)
        assert n.epoch == len(n.history()), (n.epoch, len(n.history()))
        assert n.history()["val_loss"].notna().all()
    out = n.predict({{"x": xs[:4]}})
    assert out.shape == (4, 2) and np.isfinite(out).all()
    n.train(epochs=1).wait()  # the run, then its save written in the background
    assert n.stop_reason == "completed"
    left = [t.name for t in threading.enumerate() if t.name.startswith("nitro-")]
    print("outcomes", sorted(outcomes.items()))
    print("threads", left)
    print("ok", n.epoch, n.step)
    """
)


def test_interrupts_at_random_moments_always_end_cleanly():
    script = SWEEP.format(tests=os.path.dirname(__file__), seed=7, tries=100)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines["ok"].split()[0].isdigit()
    assert lines["threads"] == "[]"
    outcomes = eval(lines["outcomes"])  # noqa: S307 - our own printout
    names = {name for (name, _), _ in outcomes}
    assert names == {"train", "validate", "evaluate", "predict"}
    assert any(outcome == "Interrupted" for (_, outcome), _ in outcomes)


def test_a_checkpoint_that_cannot_be_saved_warns_once_and_training_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("a file where the checkpoints directory should be")
    n = nitro.Nitro(
        ToyWithMetrics(max_epochs=3),
        run_dir=str(run_dir),
        checkpointer=nitro.Checkpointer(budget=None),
        progress=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n.train().wait()  # and its last save, written in the background
    mine = [w for w in caught if "a checkpoint could not be saved" in str(w.message)]
    assert len(mine) == 1 and str(run_dir / "checkpoints") in str(mine[0].message)
    assert (n.epoch, n.stop_reason) == (3, "completed")
    assert len(n.history()) == 3
