"""Manual training: a `train_step` hook with several models and optimizers (a toy GAN),
compiled, cached, guarded, interruptible and logged like the default step."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from gan_toys import DATA, GAN, NOISE, critic_loss, generator_loss

import nitro


def gen_params(n):
    setup = n.setup
    import jax

    params = jax.tree.unflatten(setup.model.params_def, n.state.variables.params)
    return {
        name: [np.asarray(x) for x in jax.tree.leaves(params[name])] for name in ("gen", "disc")
    }


def test_a_toy_gan_trains_its_generator_toward_the_data(fresh_cache):
    n = nitro.Nitro(GAN(max_epochs=30), learning_rate=3e-3, steps_per_dispatch=1, progress=False)
    start = np.linalg.norm(n.predict({"z": NOISE[:256]}).mean(0) - DATA.mean(0))
    n.train()
    end = np.linalg.norm(n.predict({"z": NOISE[:256]}).mean(0) - DATA.mean(0))
    assert end < 0.5 * start
    history = n.history()
    assert {"loss", "d_loss", "g_loss"} <= set(history.columns) and len(history) == 30
    np.testing.assert_allclose(history["loss"], history["d_loss"] + history["g_loss"], rtol=1e-5)
    programs = sorted(p["program"] for p in nitro.cache_stats().programs)
    assert programs == ["predict", "train step"]
    again = nitro.Nitro(GAN(max_epochs=2), progress=False, steps_per_dispatch=1)
    before = nitro.cache_stats().misses
    again.train()
    assert nitro.cache_stats().misses == before  # the same code: the cached program


def test_each_model_has_its_own_optimizer_and_scheduled_hyperparameters():
    n = nitro.Nitro(
        GAN(max_epochs=2),
        schedules={"gen/learning_rate": 0.0},
        progress=False,
    )
    before = gen_params(n)
    n.train()
    after = gen_params(n)
    assert all(np.array_equal(a, b) for a, b in zip(before["gen"], after["gen"], strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(before["disc"], after["disc"], strict=True))
    report = str(n.binding_report())
    assert "gen/learning_rate = 0 at step" in report and "disc/learning_rate = 0.001" in report


def test_fused_manual_steps_are_identical_to_one_at_a_time():
    one = nitro.Nitro(GAN(max_epochs=2), steps_per_dispatch=1, progress=False)
    four = nitro.Nitro(GAN(max_epochs=2), steps_per_dispatch=4, progress=False)
    one.train()
    four.train()
    for name in ("gen", "disc"):
        for a, b in zip(gen_params(one)[name], gen_params(four)[name], strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_manual_run_stops_cleanly_and_resumes():
    class StopAt:
        handle = None

        def step(self, step, loss):
            if step == 5 and self.handle is not None:
                self.handle.stop()

    reporter = StopAt()
    n = nitro.Nitro(GAN(max_epochs=2), steps_per_dispatch=1, progress=reporter)
    reporter.handle = n
    n.train()
    assert n.stop_reason == "requested" and 5 <= n.step < 16
    reporter.handle = None
    n.train()
    assert (n.step, n.epoch, n.stop_reason) == (16, 2, "completed")


@nitro.experiment
class Exploding(GAN):
    def train_step(self, step, *, x, z):
        d_loss, grads = step.grad("disc", lambda m: ((m["disc"](x)) ** 2).mean())
        step.apply("disc", jax_tree_scale(grads, jnp.where(d_loss > -1, jnp.inf, 1.0)))
        return {"loss": d_loss}


def jax_tree_scale(tree, factor):
    import jax

    return jax.tree.map(lambda g: g * factor, tree)


def test_a_non_finite_manual_step_stops_and_keeps_the_models():
    n = nitro.Nitro(Exploding(max_epochs=1), optimizer=optax.sgd, progress=False)
    before = gen_params(n)
    with pytest.raises(
        nitro.DivergenceError, match="the weights after the step are non-finite .* at step 1"
    ):
        n.train()
    after = gen_params(n)
    for name in ("gen", "disc"):
        for a, b in zip(before[name], after[name], strict=True):
            np.testing.assert_array_equal(a, b)


@nitro.experiment
class BlowsUp(GAN):
    """The generator's update is non-finite at the step where `gate` is 0, after the critic's
    finite one."""

    gate: nitro.Device[float] = 1.0

    def train_step(self, step, *, x, z):
        d_loss, grads = step.grad("disc", lambda m: critic_loss(m, x, z))
        step.apply("disc", grads)
        g_loss, grads = step.grad("gen", lambda m: generator_loss(m, z))
        step.apply("gen", jax_tree_scale(grads, 1.0 / self.gate))
        return {"loss": d_loss + g_loss}


def optimizer_state(n):
    """The optimizer states by leaf path (`gen.inner_state.0.count` is the generator's Adam
    count)."""
    leaves = [np.asarray(a) for a in n.state.variables.opt_state]
    return dict(zip(n.setup.model.leaf_paths["optimizer state"], leaves, strict=True))


@pytest.mark.parametrize("steps_per_dispatch", [1, 4])
def test_a_skipped_manual_step_leaves_every_optimizer_state_as_it_was(steps_per_dispatch):
    reference = nitro.Nitro(BlowsUp(max_epochs=1), progress=False)
    reference.train()  # the 8 steps of epoch 1
    n = nitro.Nitro(
        BlowsUp(max_epochs=2),
        schedules={"gate": lambda step: 0.0 if step == 8 else 1.0},
        steps_per_dispatch=steps_per_dispatch,
        progress=False,
    )
    with pytest.raises(nitro.DivergenceError, match="the weights after the step .* at step 9 "):
        n.train()
    assert n.step == 8
    got, want = optimizer_state(n), optimizer_state(reference)
    # the critic's finite update of the bad step is dropped with the generator's
    assert got["disc.inner_state.0.count"] == got["gen.inner_state.0.count"] == 8
    assert list(got) == list(want)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
    for name in ("gen", "disc"):
        for a, b in zip(gen_params(n)[name], gen_params(reference)[name], strict=True):
            np.testing.assert_array_equal(a, b)


def test_manual_mode_mistakes_are_named():
    @nitro.experiment
    class OneModel(GAN):
        def build_model(self, rngs):
            return super().build_model(rngs)["gen"]

    with pytest.raises(nitro.SetupError, match="build_model must return a dict of them"):
        nitro.Nitro(OneModel(), progress=False)

    @nitro.experiment
    class MissingOptimizer(GAN):
        def optimizer(self):
            return {"gen": optax.adam}

    with pytest.raises(nitro.SetupError, match=r"none for \['disc'\]"):
        nitro.Nitro(MissingOptimizer(), progress=False)

    with pytest.raises(nitro.SetupError, match="accum= does not combine with a train_step"):
        nitro.Nitro(GAN(), accum=2, progress=False)

    @nitro.experiment
    class NoLoss(GAN):
        def train_step(self, step, *, x, z):
            return {"d_loss": step.grad("disc", lambda m: m["disc"](x).mean())[0]}

    with pytest.raises(TypeError, match="must return a dict with a scalar 'loss'"):
        nitro.Nitro(NoLoss(max_epochs=1), progress=False).train()

    @nitro.experiment
    class WrongName(GAN):
        def train_step(self, step, *, x, z):
            return {"loss": step.grad("critic", lambda m: m["disc"](x).mean())[0]}

    with pytest.raises(KeyError, match="no model 'critic'; the models are 'disc', 'gen'"):
        nitro.Nitro(WrongName(max_epochs=1), progress=False).train()


def test_a_manual_run_checkpoints_and_resumes_exactly():
    whole = nitro.Nitro(GAN(max_epochs=4), checkpointer=None, progress=False)
    whole.train()
    first = nitro.Nitro(
        GAN(max_epochs=2), checkpointer=nitro.Checkpointer(budget=None), progress=False
    )
    first.train()
    resumed = nitro.Nitro(GAN(max_epochs=4), resume=first.run_dir, progress=False)
    assert (resumed.epoch, resumed.step) == (2, 16)
    resumed.train()
    for name in ("gen", "disc"):
        for a, b in zip(gen_params(resumed)[name], gen_params(whole)[name], strict=True):
            np.testing.assert_array_equal(a, b)
    assert resumed.history()["d_loss"].tolist() == whole.history()["d_loss"].tolist()
