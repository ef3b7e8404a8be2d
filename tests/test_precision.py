"""Mixed precision (`precision=`): bfloat16 and float16 compute with float32 master weights,
float16's dynamic loss scaling (skipped steps, the scale in the history, exact resume), and
what it works with: fused dispatch, accumulation, EMA, SAM, checkpoints, export, the cache."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from toys import TinyMLP, X, Y

import nitro
import nitro.bundle
from nitro.data import ArrayLoader
from nitro.examples.digits import Digits

QUIET = dict(progress=False, logger=None)


def digits(epochs: int = 3, **keywords) -> nitro.Nitro:
    keywords = {**QUIET, "learning_rate": 1e-2, **keywords}
    return nitro.Nitro(Digits(max_epochs=epochs, width=64), **keywords)


def leaves(variables) -> list[np.ndarray]:
    return [np.asarray(a) for a in variables]


def assert_same(a, b) -> None:
    """The same arrays, bit for bit."""
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def saved_state(run_dir: str) -> dict:
    """The newest checkpoint's state, read with plain orbax."""
    manager = ocp.CheckpointManager(pathlib.Path(run_dir) / "checkpoints")
    step = manager.latest_step()
    assert step is not None
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    manager.close()
    return state["state"]


def dtypes(tree) -> set[str]:
    import jax

    return {str(np.asarray(x).dtype) for x in jax.tree.leaves(tree)}


# ---------------------------------------------------------------------------------------------
# training


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_mixed_precision_run_trains_digits_and_keeps_float32_master_weights(precision):
    n = digits(precision=precision, checkpointer=nitro.Checkpointer(budget=None))
    n.train().wait()
    history = n.history()
    assert history["loss"].iloc[-1] < 0.6 * history["loss"].iloc[0]
    assert history["val_acc"].iloc[-1] > 0.7
    assert dtypes(n.state.variables.params) == {"float32"}
    assert dtypes(n.state.variables.opt_state) == {"float32", "int32"}  # Adam's count: int32
    saved = saved_state(n.run_dir)
    assert dtypes(saved["params"]) == {"float32"}  # the master weights, as orbax reads them
    assert dtypes(saved["opt_state"]) == {"float32", "int32"}
    assert_same(n.state.variables.params, _flat(saved["params"]))
    x = nitro.datasets.digits_arrays()["test"]["x"][:16]
    assert n.predict({"x": x}).dtype == np.float32  # computed in the policy's dtype, float32 out
    assert 0.7 < n.evaluate("test")["test_acc"] <= 1.0
    if precision == "float16":  # the scale in the history and in the checkpoint
        assert (history["loss_scale"] == 2.0**15).all() and (history["skipped_steps"] == 0).all()
        assert float(saved["loss_scale"]["scale"]) == 2.0**15
    else:
        assert "loss_scale" not in history and "loss_scale" not in saved


def _flat(tree) -> list:
    import jax

    return jax.tree.leaves(tree)


SEEN: list[tuple[str, str]] = []


@nitro.experiment
class Recorded:
    """Says, as it is traced, the dtypes its hooks see."""

    scale: nitro.Device[float] = 1.0
    max_epochs: int = 1

    def build_data(self):
        return {
            "train": ArrayLoader({"x": X, "y": Y}, 16),
            "val": ArrayLoader({"x": X, "y": Y}, 16),
        }

    def build_model(self, rngs):
        return TinyMLP(5, 8, 2, rngs=rngs)

    def forward(self, model, *, x):
        scaled = x * self.scale
        SEEN.append(("forward", f"{x.dtype} {scaled.dtype} {model.hidden.kernel[...].dtype}"))
        return model(scaled)

    def loss(self, logits, *, y):
        SEEN.append(("loss", f"{logits.dtype} {self.scale.dtype}"))
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_forward_computes_in_the_compute_dtype_and_the_loss_in_float32(precision, fresh_cache):
    SEEN.clear()
    n = nitro.Nitro(Recorded(), precision=precision, checkpointer=None, **QUIET)
    n.train()
    # the inputs, a Device field times them, the parameters: all in the compute dtype; the
    # loss gets float32 outputs and the Device field as it is
    assert set(SEEN) == {
        ("forward", f"{precision} {precision} {precision}"),
        ("loss", "float32 float32"),
    }
    assert n.predict({"x": X[:3]}).dtype == np.float32
    SEEN.clear()
    nitro.Nitro(Recorded(), checkpointer=None, **QUIET).train()  # float32: nothing is cast
    assert set(SEEN) == {("forward", "float32 float32 float32"), ("loss", "float32 float32")}


def test_bfloat16_tracks_float32_closely_on_the_same_run():
    full, half = digits(epochs=2), digits(epochs=2, precision="bfloat16")
    full.train()
    half.train()
    np.testing.assert_allclose(full.history()["loss"], half.history()["loss"], rtol=0.02)
    x = nitro.datasets.digits_arrays()["test"]["x"][:64]
    agree = (full.predict({"x": x}).argmax(-1) == half.predict({"x": x}).argmax(-1)).mean()
    assert agree > 0.9


def test_float16_overflow_skips_the_step_and_halves_the_scale():
    n = digits(precision=nitro.Precision("float16", loss_scale=2.0**30), checkpointer=None)
    params, opt_state = leaves(n.state.variables.params), leaves(n.state.variables.opt_state)
    n.train(steps=1)  # 2**30 times the loss overflows float16's backward: skipped
    assert n.step == 1
    assert_same(n.state.variables.params, params)
    assert_same(n.state.variables.opt_state, opt_state)  # Adam's count did not move either
    n.train()  # no DivergenceError: the scale comes down until the steps are finite
    history = n.history()
    assert history["skipped_steps"].iloc[0] >= 1
    assert history["loss_scale"].iloc[0] == 2.0**30 / 2 ** history["skipped_steps"].iloc[0]
    assert history["loss"].iloc[-1] < history["loss"].iloc[0]
    assert "steps skipped on overflow so far" in str(n.binding_report())


def test_the_loss_scale_doubles_after_growth_interval_finite_steps():
    n = digits(
        epochs=1,
        precision=nitro.Precision("float16", loss_scale=2.0**8, growth_interval=2),
        checkpointer=None,
    )
    n.train()  # 9 finite steps: the scale doubles after steps 2, 4, 6 and 8
    assert (n.step, n.history()["loss_scale"].iloc[0]) == (9, 2.0**12)
    assert n.history()["skipped_steps"].iloc[0] == 0


@nitro.experiment
class RootOfZero:
    """A finite loss whose gradient is infinite (sqrt at 0): no loss scale makes it finite."""

    max_epochs: int = 1

    def build_data(self):
        return {"train": ArrayLoader({"x": X, "y": Y}, 8, shuffle=False)}

    def build_model(self, rngs):
        return TinyMLP(5, 8, 2, rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + 0.0 * jnp.sqrt(jnp.sum(logits**2) * 0.0)


def test_a_gradient_that_overflows_at_the_smallest_scale_is_a_divergence():
    n = nitro.Nitro(
        RootOfZero(),
        precision=nitro.Precision("float16", loss_scale=4.0),
        checkpointer=None,
        steps_per_dispatch=1,
        **QUIET,
    )
    with pytest.raises(nitro.DivergenceError, match="smallest loss scale") as caught:
        n.train()
    # steps 1 and 2 skipped (scale 4 -> 2 -> 1); step 3, at scale 1, stops the run
    assert "at step 3" in str(caught.value) and "precision='bfloat16'" in str(caught.value)
    assert n.step == 2


# ---------------------------------------------------------------------------------------------
# with the other switches


def test_float16_with_accumulation_ema_and_sam_fuses_steps_exactly():
    keywords = dict(
        precision=nitro.Precision("float16", loss_scale=2.0**28, growth_interval=3),
        accum=2,
        ema=0.9,
        sam=0.05,
        checkpointer=None,
    )
    single = digits(epochs=2, steps_per_dispatch=1, **keywords)
    fused = digits(epochs=2, steps_per_dispatch=4, **keywords)
    single.train()
    fused.train()
    assert_same(single.state.variables.params, fused.state.variables.params)
    assert_same(single.state.variables.ema, fused.state.variables.ema)
    assert dtypes(fused.state.variables.ema) == {"float32"}
    columns = ["loss", "loss_scale", "skipped_steps"]
    assert single.history()[columns].equals(fused.history()[columns])
    assert fused.history()["skipped_steps"].sum() >= 1  # the overflows were skipped, fused too


def test_float16_resumes_exactly_with_its_loss_scale():
    """Stopped after 2 epochs and resumed from its checkpoint, a float16 run whose scale
    fell and grew ends bitwise equal to the same run trained straight through."""
    keywords = dict(
        precision=nitro.Precision("float16", loss_scale=2.0**30, growth_interval=3),
        accum=2,
        steps_per_dispatch=1,
    )
    every_epoch = nitro.Checkpointer(budget=None)
    whole = digits(epochs=4, checkpointer=None, **keywords)
    whole.train()
    first = digits(epochs=2, checkpointer=every_epoch, **keywords)
    first.train().wait()
    resumed = digits(epochs=4, checkpointer=every_epoch, resume=first.run_dir, **keywords)
    assert resumed.epoch == 2
    resumed.train()
    assert_same(resumed.state.variables.params, whole.state.variables.params)
    assert_same(resumed.state.variables.loss_scale, whole.state.variables.loss_scale)
    columns = ["loss", "loss_scale", "skipped_steps"]
    assert resumed.history()[columns].equals(whole.history()[columns])
    assert whole.history()["skipped_steps"].sum() >= 1


def test_resuming_with_another_precision_warns_and_starts_a_loss_scale():
    first = digits(epochs=1, checkpointer=nitro.Checkpointer(budget=None))
    first.train().wait()
    with pytest.warns(
        RuntimeWarning, match="precision: the checkpoint's float32, this run's float16"
    ):
        resumed = digits(epochs=2, precision="float16", resume=first.run_dir)
    assert leaves(resumed.state.variables.loss_scale)[0] == 2.0**15
    resumed.train()
    assert resumed.history()["loss_scale"].iloc[-1] == 2.0**15


def test_switching_precision_recompiles_and_the_explanation_names_it(fresh_cache):
    digits(checkpointer=None).train(steps=1)
    digits(checkpointer=None, precision="bfloat16").train(steps=1)
    reason = next(r.reason for r in nitro.explain_compiles()[::-1] if r.program == "train step")
    assert "setting precision: 'float32' -> 'bfloat16'" in reason
    compiled = len(nitro.explain_compiles())
    digits(checkpointer=None, precision="bfloat16").train(steps=1)  # the same policy: a hit
    assert len(nitro.explain_compiles()) == compiled


def test_export_writes_float32_by_default_or_the_compute_dtype(tmp_path):
    n = digits(epochs=1, precision="bfloat16", checkpointer=None)
    n.train()
    x = nitro.datasets.digits_arrays()["test"]["x"][:16]
    full = n.export(str(tmp_path / "full"))
    half = n.export(str(tmp_path / "half"), dtype="compute")
    assert (full["provenance"]["dtype"], half["provenance"]["dtype"]) == ("float32", "bfloat16")
    weights = {
        name: nitro.bundle.read_weights(str(tmp_path / name / "weights.safetensors"))
        for name in ("full", "half")
    }
    assert {str(w.dtype) for w in weights["full"].values()} == {"float32"}
    assert {str(w.dtype) for w in weights["half"].values()} == {"bfloat16"}
    predicted = n.predict({"x": x})
    served = nitro.bundle.load(str(tmp_path / "half"))(x=x)["output"]
    assert served.dtype == np.float32  # the wire keeps its dtypes
    np.testing.assert_allclose(served, predicted, rtol=1e-5, atol=1e-5)  # the same computation
    with pytest.raises(ValueError, match=r"dtype='int8'.*'bfloat16', 'float16', or 'compute'"):
        n.export(str(tmp_path / "bad"), dtype="int8")


# ---------------------------------------------------------------------------------------------
# bad values


@pytest.mark.parametrize(
    "value, words",
    [
        ("bf16-mixed", "precision 'bf16-mixed' is Lightning's name for precision='bfloat16'"),
        ("mixed_float16", "precision 'mixed_float16' is Keras's name for precision='float16'"),
        ("int8", "precision must be 'float32', 'bfloat16' or 'float16'"),
        (16, "precision must be 'float32', 'bfloat16' or 'float16'"),
    ],
)
def test_a_bad_precision_is_refused_naming_the_keyword(value, words):
    with pytest.raises(nitro.SetupError, match="precision") as caught:
        digits(precision=value)
    assert words in str(caught.value) and "[Nitro keyword]" in str(caught.value)


def test_bad_loss_scale_settings_are_refused():
    with pytest.raises(nitro.SetupError, match="loss scaling is for float16 only"):
        nitro.Precision("bfloat16", loss_scale=1024.0)
    with pytest.raises(nitro.SetupError, match=r"loss_scale=0.*\[1, 2\*\*64\]"):
        nitro.Precision("float16", loss_scale=0)
    with pytest.raises(nitro.SetupError, match="growth_interval=0"):
        nitro.Precision("float16", growth_interval=0)


def test_mixed_precision_with_a_train_step_hook_is_refused():
    from gan_toys import GAN

    with pytest.raises(nitro.SetupError, match="precision='bfloat16' does not combine with a"):
        nitro.Nitro(GAN(), precision="bfloat16", **QUIET)
