"""The Nitro handle: setup, train, validate, evaluate, predict, history, set_device, weights."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from toys import Toy, ToyWithMetrics, X, Y, loaders

import nitro


def params_of(n):
    return [np.asarray(a) for a in n.state.variables.params]


def test_setup_compiles_nothing(fresh_cache):
    n = nitro.Nitro(Toy(), progress=False)
    stats = nitro.cache_stats()
    assert (stats.misses, stats.entries, stats.hits) == (0, 0, 0)
    assert (n.step, n.epoch, n.phase, n.stop_reason) == (0, 0, "ready", None)
    assert n.param_count == 5 * 8 + 8 + 8 * 2 + 2


def test_train_runs_to_max_epochs_and_records_history():
    n = nitro.Nitro(ToyWithMetrics(max_epochs=3), progress=False)
    assert n.train() is n
    assert (n.epoch, n.step, n.stop_reason, n.phase) == (3, 12, "completed", "done")
    history = n.history()
    assert list(history.index) == [1, 2, 3]
    assert {"step", "loss", "val_loss", "val_acc", "data_wait_frac"} <= set(history.columns)
    assert history["step"].tolist() == [4, 8, 12]
    assert history["loss"].iloc[-1] < history["loss"].iloc[0]
    assert 0.0 <= history["val_acc"].iloc[-1] <= 1.0


def test_train_again_continues_and_epochs_trains_more():
    n = nitro.Nitro(Toy(max_epochs=1), progress=False)
    n.train()
    before = params_of(n)
    n.train()  # already at max_epochs: nothing to do
    assert (n.epoch, n.step) == (1, 4)
    assert all(np.array_equal(a, b) for a, b in zip(before, params_of(n), strict=True))
    n.train(epochs=2)
    assert (n.epoch, n.step) == (3, 12)
    assert len(n.history()) == 3


def test_validate_and_evaluate_work_on_a_handle_that_never_trained():
    n = nitro.Nitro(ToyWithMetrics(), progress=False)
    val = n.validate()
    assert set(val) == {"val_loss", "val_acc"}
    test = n.evaluate(split="test")
    assert set(test) == {"test_loss", "test_acc"}
    assert n.step == 0


def test_unknown_split_lists_the_available_ones():
    n = nitro.Nitro(Toy(), progress=False)
    with pytest.raises(
        KeyError, match="no split 'holdout': this handle has 'train', 'val', 'test'"
    ):
        n.evaluate(split="holdout")


def test_val_loss_and_metrics_never_see_padding():
    """val has 20 samples in batches of 16: the last batch is padded to 16 and sliced back."""

    @nitro.experiment
    class Counting(Toy):
        def metrics(self, logits, *, y):
            return {
                "seen": (np.asarray(y, dtype=np.float32), "concat"),
                "n": (np.float32(len(y)), "sum"),
            }

    n = nitro.Nitro(Counting(), progress=False)
    result = n.validate()
    assert result["val_n"] == 20
    assert np.array_equal(result["val_seen"], Y[:20].astype(np.float32))
    logits = n.predict({"x": X[:20]})
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, Y[:20]).mean()
    assert result["val_loss"] == pytest.approx(float(expected), rel=1e-5)


def test_predict_returns_host_outputs_for_any_batch_size():
    n = nitro.Nitro(Toy(), progress=False)
    one = n.predict({"x": X[:3]})
    assert isinstance(one, np.ndarray) and one.shape == (3, 2)
    many = n.predict({"x": X[:40]})  # wider than the compiled width of 16: chunked
    assert many.shape == (40, 2)
    np.testing.assert_allclose(many[:3], one, rtol=1e-6)
    outputs = list(n.predict([{"x": X[:5]}, {"x": X[5:9]}]))
    assert [o.shape for o in outputs] == [(5, 2), (4, 2)]
    labelled = n.predict({"x": X[:3], "y": Y[:3]})  # extra fields are ignored
    np.testing.assert_allclose(labelled, one)


def test_predict_refuses_a_bare_array_or_a_string_and_names_forward_fields():
    n = nitro.Nitro(Toy(), progress=False)
    with pytest.raises(TypeError, match=r"forward needs: x.*n\.predict\(\{'x': xs\}\)"):
        n.predict(X[:3])
    with pytest.raises(
        TypeError, match=r"forward needs: x\) or an iterable of such dicts; got str"
    ):
        n.predict("abc")
    with pytest.raises(
        nitro.RoutingError, match=r"hook `forward` needs batch field 'x'.*yields \['image'\]"
    ):
        n.predict({"image": X[:3]})


def test_set_device_changes_outputs_and_refuses_other_fields():
    n = nitro.Nitro(Toy(), progress=False)
    base = n.predict({"x": X[:4]})
    n.set_device(scale=0.0)
    assert n.device_value("scale") == 0.0
    zeroed = n.predict({"x": X[:4]})
    assert not np.allclose(base, zeroed)
    np.testing.assert_allclose(zeroed, np.broadcast_to(zeroed[0], zeroed.shape), rtol=1e-6)
    n.set_device(scale=np.float64(1.0))  # coerced to float32
    np.testing.assert_allclose(n.predict({"x": X[:4]}), base, rtol=1e-6)
    with pytest.raises(TypeError, match=r"'width' is graphconst .*build a new handle"):
        n.set_device(width=4)
    with pytest.raises(TypeError, match="'batch_size' is host"):
        n.set_device(batch_size=4)
    with pytest.raises(AttributeError, match="no field 'nope'; Device fields: scale"):
        n.set_device(nope=1.0)
    with pytest.raises(ValueError, match=r"shape \(\); the new value has shape \(2,\)"):
        n.set_device(scale=[1.0, 2.0])


def test_weights_start_a_new_run_from_another_handle():
    n = nitro.Nitro(Toy(max_epochs=2), progress=False)
    n.train()
    warm = nitro.Nitro(Toy(max_epochs=1), weights=n, progress=False)
    np.testing.assert_allclose(warm.predict({"x": X[:5]}), n.predict({"x": X[:5]}), rtol=1e-6)
    assert warm.step == 0
    warm.train()
    assert n.step == 8  # the source handle is untouched
    with pytest.raises(
        nitro.SetupError,
        match=r"(?s)weights= does not fit.*hidden\.kernel: this model f32\[5,4\], weights f32\[5,8\]",
    ):
        nitro.Nitro(Toy(width=4), weights=n, progress=False)


def test_optimizer_method_replaces_the_default_and_learning_rate_reaches_it():
    @nitro.experiment
    class WithSgd(Toy):
        def optimizer(self):
            return optax.sgd

    adam = nitro.Nitro(Toy(max_epochs=1), progress=False)
    sgd = nitro.Nitro(WithSgd(max_epochs=1), learning_rate=0.5, progress=False)
    assert "optax.sgd(learning_rate=0.5)" in str(sgd.binding_report())
    assert "optax.adam(learning_rate=0.001)" in str(adam.binding_report())
    adam.train()
    sgd.train()
    assert not np.allclose(params_of(adam)[0], params_of(sgd)[0])

    @nitro.experiment
    class Baked(Toy):
        def optimizer(self):
            return optax.sgd(0.1)

    baked = nitro.Nitro(Baked(max_epochs=1), progress=False)
    baked.train()
    assert baked.step == 4
    with pytest.raises(TypeError, match="learning_rate was given, but the optimizer"):
        nitro.Nitro(Baked(), learning_rate=0.3, progress=False)


def test_a_non_finite_loss_stops_and_keeps_the_last_good_weights():
    poisoned = X.copy()
    poisoned[32:48] = np.nan  # batch 3 of an unshuffled epoch

    @nitro.experiment
    class Poisoned(Toy):
        samples: int = 64

        def build_data(self):
            return {
                "train": nitro.data.ArrayLoader(
                    {"x": poisoned[: self.samples], "y": Y[: self.samples]}, 16, shuffle=False
                )
            }

    n = nitro.Nitro(Poisoned(max_epochs=2), progress=False)
    with pytest.raises(nitro.DivergenceError, match=r"loss is nan at step 3 \(epoch 1, batch 3\)"):
        n.train()
    assert (n.step, n.phase, n.stop_reason) == (2, "failed", "error")
    clean = nitro.Nitro(Poisoned(samples=32, max_epochs=1), progress=False)
    clean.train()
    for a, b in zip(params_of(n), params_of(clean), strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(n.predict({"x": X[:4]})).all()

    tolerant = nitro.Nitro(Poisoned(max_epochs=1), check_divergence=False, progress=False)
    tolerant.train()
    assert tolerant.step == 4 and tolerant.stop_reason == "completed"


def test_batch_fields_must_be_keyword_only():
    @nitro.experiment
    class Positional(Toy):
        def forward(self, model, x):
            return model(x)

    with pytest.raises(
        nitro.RoutingError, match=r"keyword-only.*def forward\(self, model, \*, x\)"
    ):
        nitro.Nitro(Positional(), progress=False)


def test_a_missing_batch_field_names_hook_field_and_loader_fields():
    @nitro.experiment
    class WantsLabels(Toy):
        def loss(self, logits, *, label):
            return logits.mean()

    with pytest.raises(
        nitro.RoutingError,
        match=r"hook `loss` needs batch field 'label', but the 'train' loader yields \['x', 'y'\]",
    ):
        nitro.Nitro(WantsLabels(), progress=False)


def test_unknown_keyword_suggests_the_closest():
    with pytest.raises(TypeError, match=r"unknown keyword 'max_epoch'.*Did you mean 'max_epochs'"):
        nitro.Nitro(Toy(), max_epoch=3)


def test_build_data_must_return_splits():
    @nitro.experiment
    class ListData(Toy):
        def build_data(self):
            return [1, 2]

    with pytest.raises(nitro.SetupError, match="build_data must return a dict of split name"):
        nitro.Nitro(ListData(), progress=False)


def test_build_model_must_return_an_nnx_module():
    @nitro.experiment
    class NotAModule(Toy):
        def build_model(self, rngs):
            return lambda x: x

    with pytest.raises(
        nitro.SetupError,
        match="flax.nnx.Module, a flax.linen.Module or an equinox.Module; got function",
    ):
        nitro.Nitro(NotAModule(), progress=False)


def test_a_loss_that_is_not_a_scalar_is_named():
    @nitro.experiment
    class VectorLoss(Toy):
        def loss(self, logits, *, y):
            return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    n = nitro.Nitro(VectorLoss(), progress=False)
    with pytest.raises(TypeError, match=r"hook `loss` must return a scalar.*shape \(16,\)"):
        n.train()


def test_an_eval_only_handle_refuses_to_train():
    n = nitro.Nitro(Toy(), data={"val": loaders()["val"]}, progress=False)
    assert n.optimizer is None
    assert "val_loss" in n.validate()
    with pytest.raises(nitro.SetupError, match="no 'train' split"):
        n.train()


def test_training_in_the_background_can_be_stopped_and_resumed():
    n = nitro.Nitro(Toy(max_epochs=10_000, with_val=False), progress=False)
    n.train(background=True)
    assert n.running
    with pytest.raises(RuntimeError, match="in the background"):
        n.validate()
    while n.step < 20:
        pass
    n.stop().wait()
    assert (n.running, n.stop_reason, n.phase) == (False, "requested", "stopped")
    reached = n.step
    assert reached >= 20 and n.epoch < 10_000
    n.train(epochs=1)
    assert n.stop_reason == "completed" and n.step > reached


def test_stop_returns_at_once_and_wait_leaves_the_state_the_stop_saved():
    import orbax.checkpoint as ocp

    n = nitro.Nitro(Toy(max_epochs=10_000, with_val=False), progress=False)
    n.train(background=True)
    while n.step < 6:
        pass
    assert n.stop() is n  # asked; the run finishes its step and its save on its own thread
    n.wait()
    assert (n.running, n.stop_reason, n.phase) == (False, "requested", "stopped")
    stopped = n.step
    assert n.state.step == stopped and n.step == stopped  # nothing moves any more
    manager = ocp.CheckpointManager(os.path.join(n.run_dir, "checkpoints"))
    assert manager.latest_step() == stopped  # the step it stopped on is the one saved
    manager.close()
    if n.epoch:
        assert n.history()["step"].iloc[-1] <= stopped


def test_a_stopped_run_resumes_to_the_epoch_it_was_training_to():
    n = nitro.Nitro(Toy(max_epochs=2, with_val=False), progress=False)
    assert n.target_epoch == 2
    n.train(epochs=10_000, background=True)  # past max_epochs
    while n.step < 20:
        pass
    n.stop().wait()
    assert n.target_epoch == 10_000 and 2 <= n.epoch < 10_000
    assert f"/{n.target_epoch}," in repr(n)  # the handle counts against the same target
    n.train(background=True)  # no epochs: resumes the stopped run, to the same target
    assert n.running and n.target_epoch == 10_000
    n.stop().wait()
    n.train(epochs=1)
    assert n.target_epoch == n.epoch and n.stop_reason == "completed"
    n.train()  # its target reached and past max_epochs: nothing to do
    assert n.target_epoch == n.epoch


INTERRUPT_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    sys.path.insert(0, {tests!r})
    import nitro
    from toys import Toy

    n = nitro.Nitro(Toy(max_epochs=100_000, with_val=False), progress=False)

    def interrupt_once_running():
        while n.step < 10:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_running, daemon=True).start()
    n.train()
    print("stopped", n.step, n.stop_reason, n.phase, flush=True)
    reached = n.step
    n.train(epochs=1)
    print("resumed", n.step - reached, n.stop_reason, n.phase, flush=True)
    """
)


def test_ctrl_c_stops_after_the_current_step_and_training_continues():
    script = INTERRUPT_SCRIPT.format(tests=os.path.dirname(__file__))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    step, reason, phase = lines["stopped"].split()
    assert int(step) >= 10 and (reason, phase) == ("requested", "stopped")
    more, reason, phase = lines["resumed"].split()
    assert int(more) >= 1 and (reason, phase) == ("completed", "done")
    assert "interrupted; stopping training after the current step" in done.stderr


def test_the_demo_reaches_095_test_accuracy_and_writes_a_plot(tmp_path, capsys):
    import gc

    from nitro.examples import digits

    gc.collect()
    before = len(jax.live_arrays())  # what earlier tests left alive
    result = digits.main(["--plot", str(tmp_path / "history.png")])
    assert result["test"]["test_acc"] >= 0.95
    assert (tmp_path / "history.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "history:" in out and "test:" in out and "predicted" in out
    gc.collect()
    assert len(jax.live_arrays()) - before < 50  # the demo's handle went with its arrays


def test_batchnorm_statistics_and_dropout_rngs_advance_in_training_only():
    from flax import nnx

    class DropNorm(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(5, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.out = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.out(self.drop(self.norm(self.hidden(x))))

    @nitro.experiment
    class Regularized(Toy):
        def build_model(self, rngs):
            return DropNorm(rngs)

    n = nitro.Nitro(Regularized(max_epochs=1), progress=False)
    before = n.model
    first = n.predict({"x": X[:8]})
    np.testing.assert_array_equal(first, n.predict({"x": X[:8]}))  # eval: deterministic
    n.train()
    after = n.model
    assert not np.allclose(before.norm.mean[...], after.norm.mean[...])  # running stats moved
    assert int(after.drop.rngs.count[...]) == int(before.drop.rngs.count[...]) + 4
    n.validate()
    assert np.array_equal(n.model.norm.mean[...], after.norm.mean[...])  # eval leaves them


def test_a_handle_without_data_serves_predictions_of_any_size(fresh_cache):
    n = nitro.Nitro(Toy(), data={}, progress=False)
    assert n.splits == {} and n.optimizer is None
    first = n.predict({"x": X[:10]})
    assert first.shape == (10, 2)
    assert [o.shape for o in n.predict([{"x": X[:3]}, {"x": X[:25]}])] == [(3, 2), (25, 2)]
    assert nitro.cache_stats().misses == 3  # padded to the buckets 16, 4 and 32


ROWS = np.random.default_rng(7).normal(size=(3000, 5)).astype(np.float32)


def predict_calls() -> tuple[int, int]:
    """The predict programs' device calls so far, and how many predict programs exist."""
    programs = [p for p in nitro.cache_stats().programs if p["program"] == "predict"]
    return sum(p["calls"] for p in programs), len(programs)


def test_the_first_prediction_does_not_fix_the_chunk_width_of_later_ones(fresh_cache):
    trained = nitro.Nitro(Toy(max_epochs=1), progress=False).train()
    fresh = nitro.Nitro(Toy(), data={}, weights=trained, progress=False)
    expected = fresh.predict({"x": ROWS[:300]})
    calls, programs = predict_calls()
    assert (calls, programs) == (1, 1)  # 300 rows: one call at the 512 bucket

    n = nitro.Nitro(Toy(), data={}, weights=trained, progress=False)
    np.testing.assert_allclose(n.predict({"x": ROWS[:7]}), expected[:7], rtol=1e-6, atol=1e-6)
    assert predict_calls() == (2, 2)  # 7 rows: the 8 bucket, a program of its own
    np.testing.assert_allclose(n.predict({"x": ROWS[:300]}), expected, rtol=1e-6, atol=1e-6)
    assert predict_calls() == (3, 2)  # one call, as on the fresh handle, and no new program
    np.testing.assert_allclose(n.predict({"x": ROWS[:7]}), expected[:7], rtol=1e-6, atol=1e-6)
    assert predict_calls() == (4, 2)


def test_many_prediction_sizes_compile_one_program_per_power_of_two_bucket(fresh_cache):
    n = nitro.Nitro(Toy(), data={}, progress=False)
    sizes = [1, 2, 3, 5, 6, 7, 9, 12, 15, 16, 100, 120, 128, 0]
    for rows in sizes:
        assert n.predict({"x": ROWS[:rows]}).shape == (rows, 2)
    calls, programs = predict_calls()
    assert calls == len(sizes)  # each at most one bucket wide: one call each
    assert programs == 6  # the buckets 1, 2, 4, 8, 16 and 128; the empty batch runs at 1
    before = nitro.cache_stats().misses
    for rows in (4, 11, 127):
        n.predict({"x": ROWS[:rows]})
    assert nitro.cache_stats().misses == before  # buckets compiled before are reused


def test_a_prediction_wider_than_the_largest_bucket_runs_in_chunks_of_it(fresh_cache):
    n = nitro.Nitro(Toy(), data={}, progress=False)
    whole = n.predict({"x": ROWS})
    assert predict_calls() == (3, 1)  # 3000 rows: 1024 + 1024 + 952 padded to 1024
    parts = np.concatenate([n.predict({"x": ROWS[i : i + 500]}) for i in range(0, 3000, 500)])
    np.testing.assert_allclose(whole, parts, rtol=1e-6, atol=1e-6)
    assert predict_calls()[1] == 2  # the 512 bucket


MESH_PREDICT_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    import nitro
    from toys import Toy

    n = nitro.Nitro(Toy(), data={{}}, n_devs=3, progress=False)
    one = nitro.Nitro(Toy(), data={{}}, n_devs=1, weights=n, progress=False)
    rows = np.random.default_rng(0).normal(size=(300, 5)).astype(np.float32)
    for k in (7, 300, 1, 0):
        np.testing.assert_allclose(
            n.predict({{"x": rows[:k]}}), one.predict({{"x": rows[:k]}}), rtol=1e-5, atol=1e-5
        )
    print("ok")
    """
)


def test_a_handle_without_splits_predicts_any_size_over_a_mesh_of_three():
    # the buckets 8, 512 and 1 are rounded up to 9, 513 and 3 rows: a multiple of the devices
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=3",
        "JAX_PLATFORMS": "cpu",
    }
    script = MESH_PREDICT_SCRIPT.format(tests=os.path.dirname(__file__))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["ok"]


def test_a_handle_with_splits_predicts_at_its_evaluation_width(fresh_cache):
    n = nitro.Nitro(Toy(), progress=False)
    for rows in (3, 300, 7):
        assert n.predict({"x": ROWS[:rows]}).shape == (rows, 2)
    width = n.batch_specs["val"]["x"][0][0]
    assert predict_calls() == (1 + -(-300 // width) + 1, 1)  # one width, whatever the size
