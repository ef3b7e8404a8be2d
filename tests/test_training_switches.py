"""Gradient accumulation, the moving average of the weights, and SAM/ASAM: each against a
reference computed with optax or by hand, with schedules and fused dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from toys import TinyMLP, ToyWithMetrics, X, Y

import nitro
import nitro.bundle
from nitro.data import ArrayLoader


@nitro.experiment
class Plain(ToyWithMetrics):
    """Unshuffled batches of `batch_size`, so runs with different batch sizes see the same
    samples in the same order."""

    batch_size: int = 4

    def build_data(self):
        return {"train": ArrayLoader({"x": X, "y": Y}, self.batch_size, shuffle=False)}


def params_of(n):
    return [np.asarray(a) for a in n.state.variables.params]


# ---------------------------------------------------------------------------------------------
# accumulation


def test_accumulating_4_micro_batches_equals_one_step_on_the_merged_batch():
    # 64 samples: 16 micro-batches of 4 -> 4 updates per epoch; 10 updates over 3 epochs
    micro = nitro.Nitro(Plain(batch_size=4, max_epochs=3), accum=4, progress=False)
    merged = nitro.Nitro(Plain(batch_size=16, max_epochs=3), progress=False)
    micro.train()
    merged.train()
    assert micro.step == merged.step == 12
    for a, b in zip(params_of(micro), params_of(merged), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(micro.history()["loss"], merged.history()["loss"], rtol=1e-5)


def test_accumulation_with_fused_steps_is_identical_and_compiles_what_it_says(fresh_cache):
    base = nitro.Nitro(Plain(max_epochs=2), accum=4, steps_per_dispatch=1, progress=False)
    base.train()
    # Plain has no validation split: one program, one update of 4 micro-batches per call
    assert [(p["program"], p["calls"]) for p in nitro.cache_stats().programs] == [("train step", 8)]
    fused = nitro.Nitro(Plain(max_epochs=2), accum=4, steps_per_dispatch=4, progress=False)
    fused.train()
    for a, b in zip(params_of(base), params_of(fused), strict=True):
        np.testing.assert_array_equal(a, b)
    programs = {p["program"]: p["calls"] for p in nitro.cache_stats().programs}
    assert programs["multi-step train"] == 2  # 4 updates of 4 micro-batches per call


def test_schedules_count_optimizer_updates_and_the_horizon_is_in_updates():
    seen = []

    def rate(step):
        seen.append(step)
        return 1e-2

    n = nitro.Nitro(
        Plain(max_epochs=2),
        accum=4,
        steps_per_dispatch=1,
        schedules={"learning_rate": rate},
        progress=False,
    )
    assert n.total_steps == 8  # 2 epochs x 16 batches / 4
    n.train()
    assert n.step == 8 and max(s for s in seen if isinstance(s, int)) <= 8


def test_a_non_finite_micro_batch_is_guarded_like_a_step():
    x = X.copy()
    x[5 * 4] = np.nan  # micro-batch 5 (the second update's second micro-batch)
    n = nitro.Nitro(
        Plain(max_epochs=1),
        data={"train": ArrayLoader({"x": x, "y": Y}, 4, shuffle=False)},
        accum=4,
        progress=False,
    )
    with pytest.raises(nitro.DivergenceError, match="at step 2"):
        n.train()
    assert n.step == 1 and all(np.isfinite(p).all() for p in params_of(n))


# ---------------------------------------------------------------------------------------------
# EMA


@nitro.experiment
class OneBatch(ToyWithMetrics):
    """One batch per epoch: train(epochs=1) is one step, so each step's weights can be read."""

    def build_data(self):
        return {
            "train": ArrayLoader({"x": X[:16], "y": Y[:16]}, 16, shuffle=False),
            "val": ArrayLoader({"x": X[16:], "y": Y[16:]}, 16, shuffle=False, drop_last=False),
        }


@pytest.mark.parametrize("warmup", [False, True])
def test_the_moving_average_follows_its_formula(warmup):
    decay = 0.8
    averaged = nitro.Nitro(OneBatch(), ema=nitro.EMA(decay, warmup=warmup), progress=False)
    plain = nitro.Nitro(OneBatch(), progress=False)
    expected = params_of(plain)
    for t in range(5):
        plain.train(epochs=1)
        d = min(decay, (1 + t) / (10 + t)) if warmup else decay
        expected = [d * e + (1 - d) * p for e, p in zip(expected, params_of(plain), strict=True)]
    averaged.train(epochs=5)
    ema = [np.asarray(a) for a in averaged.state.variables.ema]
    for a, b in zip(ema, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(params_of(averaged), params_of(plain), strict=True):
        np.testing.assert_array_equal(a, b)  # the average does not touch training


def test_after_a_short_run_the_warmed_up_average_scores_about_what_the_weights_do():
    # 4 epochs of digits, 9 steps each: 36 optimizer steps at ema=0.999
    from nitro.examples.digits import Digits

    n = nitro.Nitro(Digits(width=64, max_epochs=4), ema=0.999, checkpointer=None, logger=None)
    n.train()
    raw, ema = n.validate()["val_acc"], n.validate(weights="ema")["val_acc"]
    assert raw > 0.5
    assert abs(ema - raw) < 0.1
    # without the warm-up the average is still mostly the random initial weights
    cold = nitro.Nitro(
        Digits(width=64, max_epochs=4),
        ema=nitro.EMA(0.999, warmup=False),
        checkpointer=None,
        logger=None,
    )
    cold.train()
    assert cold.validate(weights="ema")["val_acc"] < raw - 0.3


def test_ema_weights_evaluate_predict_and_export_without_recompiling(fresh_cache, tmp_path):
    n = nitro.Nitro(ToyWithMetrics(max_epochs=2), ema=0.5, progress=False)
    n.train()
    n.predict({"x": X[:3]})
    before = nitro.cache_stats().misses
    current, averaged = n.validate(), n.validate(weights="ema")
    assert current != averaged
    assert not np.allclose(n.predict({"x": X[:3]}), n.predict({"x": X[:3]}, weights="ema"))
    assert nitro.cache_stats().misses == before  # same programs, other weights
    n.export(str(tmp_path / "ema"), weights="ema")
    bundle = nitro.bundle.load(tmp_path / "ema")
    np.testing.assert_allclose(
        bundle(x=X[:3])["output"], n.predict({"x": X[:3]}, weights="ema"), atol=1e-6
    )
    chosen = nitro.Nitro(ToyWithMetrics(max_epochs=2), ema=nitro.EMA(0.5, evaluate=True))
    chosen.train()
    assert chosen.history()["val_loss"].iloc[-1] == pytest.approx(
        chosen.validate(weights="ema")["val_loss"]
    )


def test_ema_and_sam_values_are_checked_naming_the_keyword():
    with pytest.raises(ValueError, match=r"ema decay must be a finite number in \(0, 1\).*1.5"):
        nitro.Nitro(ToyWithMetrics(), ema=1.5, progress=False)
    with pytest.raises(ValueError, match="sam must be a finite number > 0, got -0.1"):
        nitro.Nitro(ToyWithMetrics(), sam=-0.1, progress=False)
    plain = nitro.Nitro(ToyWithMetrics(), progress=False)
    with pytest.raises(nitro.SetupError, match="weights='ema' needs a moving average"):
        plain.validate(weights="ema")


# ---------------------------------------------------------------------------------------------
# SAM and ASAM


def _reference_loop(opt_update, params, batches, graphdef, rest):
    def loss_fn(p, batch):
        logits = nnx.merge(graphdef, p, rest)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    for batch in batches:
        params = opt_update(params, lambda p, b=batch: jax.grad(loss_fn)(p, b))
    return params


def _batches(n=8):
    return [{"x": X[i * 16 : (i + 1) * 16], "y": Y[i * 16 : (i + 1) * 16]} for i in range(n)]


def _model():
    graphdef, params, rest = nnx.split(TinyMLP(5, 8, 2, rngs=nnx.Rngs(0)), nnx.Param, ...)
    return graphdef, params, rest


def test_sam_matches_optax_contrib_sam():
    rho, rate = 0.05, 0.1
    graphdef, params, rest = _model()
    sam_opt = optax.contrib.sam(
        optax.sgd(rate),
        optax.chain(optax.contrib.normalize(), optax.sgd(rho)),
        opaque_mode=True,
    )
    state = sam_opt.init(params)

    def update(params, grad):
        nonlocal state
        grads = grad(params)
        updates, state = sam_opt.update(grads, state, params, grad_fn=lambda p, _: grad(p))
        return optax.apply_updates(params, updates)

    expected = _reference_loop(update, params, _batches(4) * 2, graphdef, rest)
    n = nitro.Nitro(
        Plain(batch_size=16, max_epochs=2, with_val=False),
        sam=rho,
        optimizer=optax.sgd,
        learning_rate=rate,
        progress=False,
    )
    n.train()
    for a, b in zip(params_of(n), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6)


def test_asam_follows_its_formula_and_sam_accumulates_every_micro_batch():
    rho, eta, rate = 0.5, 0.01, 0.1
    graphdef, params, rest = _model()

    def update(params, grad):
        g = grad(params)
        t = jax.tree.map(lambda w: jnp.abs(w) + eta, params)
        norm = optax.tree.norm(jax.tree.map(lambda ti, gi: ti * gi, t, g))
        nudged = jax.tree.map(lambda w, ti, gi: w + rho * ti**2 * gi / (norm + 1e-12), params, t, g)
        g2 = grad(nudged)
        return jax.tree.map(lambda w, gi: w - rate * gi, params, g2)

    expected = _reference_loop(update, params, _batches(4) * 2, graphdef, rest)
    merged = nitro.Nitro(
        Plain(batch_size=16, max_epochs=2, with_val=False),
        sam=nitro.ASAM(rho=rho, eta=eta),
        optimizer=optax.sgd,
        learning_rate=rate,
        progress=False,
    )
    merged.train()
    for a, b in zip(params_of(merged), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6)
    accumulated = nitro.Nitro(
        Plain(batch_size=4, max_epochs=2, with_val=False),
        sam=nitro.ASAM(rho=rho, eta=eta),
        accum=4,
        optimizer=optax.sgd,
        learning_rate=rate,
        progress=False,
    )
    accumulated.train()
    for a, b in zip(params_of(accumulated), params_of(merged), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_moving_average_is_checkpointed_and_resumed_exactly():
    every_epoch = nitro.Checkpointer(budget=None)
    whole = nitro.Nitro(ToyWithMetrics(max_epochs=4), ema=0.9, checkpointer=None, progress=False)
    whole.train()
    first = nitro.Nitro(
        ToyWithMetrics(max_epochs=2), ema=0.9, checkpointer=every_epoch, progress=False
    )
    first.train()
    resumed = nitro.Nitro(
        ToyWithMetrics(max_epochs=4),
        ema=0.9,
        checkpointer=every_epoch,
        resume=first.run_dir,
        progress=False,
    )
    assert resumed.epoch == 2
    resumed.train()
    for a, b in zip(resumed.state.variables.ema, whole.state.variables.ema, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(resumed.state.variables.ema_steps) == 16


def test_accumulation_and_sam_resume_exactly():
    """A run of accum=2 and SAM stopped after 2 epochs and resumed from its checkpoint ends
    bitwise equal to the same run trained straight through."""
    keywords = dict(accum=2, sam=0.05, progress=False)
    every_epoch = nitro.Checkpointer(budget=None)
    whole = nitro.Nitro(ToyWithMetrics(max_epochs=4), checkpointer=None, **keywords)
    whole.train()
    first = nitro.Nitro(ToyWithMetrics(max_epochs=2), checkpointer=every_epoch, **keywords)
    first.train()
    resumed = nitro.Nitro(
        ToyWithMetrics(max_epochs=4), checkpointer=every_epoch, resume=first.run_dir, **keywords
    )
    assert (resumed.epoch, resumed.step) == (2, 4)  # 4 batches an epoch, 2 per update
    resumed.train()
    for a, b in zip(params_of(resumed), params_of(whole), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(resumed.history()["loss"], whole.history()["loss"])
