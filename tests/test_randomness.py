"""Randomness in hooks: `rngs` in forward, loss and train_step, the train and eval modes Nitro
sets, and what `seed=` seeds. The Flax NNX MNIST tutorial's CNN (written out as the tutorial
has it, on the 8x8 digits) trains unchanged."""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nitro
from nitro.data import ArrayLoader
from nitro.errors import RoutingError, SetupError
from nitro.runs.checkpoints import Checkpointer

# ---------------------------------------------------------------------------------------------
# the tutorial's model, as https://flax.readthedocs.io/en/latest/mnist_tutorial.html has it; the
# one change is the first linear layer's input: 2 * 2 * 64 after two poolings of 8x8 digits
# (the tutorial's 3136 is 7 * 7 * 64, for 28x28 MNIST)


class CNN(nnx.Module):
    """A simple CNN model."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(2 * 2 * 64, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.dropout2(self.conv2(x), rngs=rngs))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        x = self.linear2(x)
        return x


@nitro.experiment
class Tutorial:
    max_epochs: int = 3
    batch_size: int = 64

    def build_data(self):
        return nitro.datasets.digits(batch_size=self.batch_size)

    def build_model(self, rngs):
        return CNN(rngs=rngs)

    def optimizer(self):
        return optax.adamw(0.005, 0.9)  # the tutorial's learning rate and momentum

    def forward(self, model, *, x, rngs):
        return model(x.reshape(-1, 8, 8, 1), rngs)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def metrics(self, logits, *, y):
        return {"acc": (logits.argmax(-1) == y).mean()}


def leaves(n: nitro.Nitro) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(n.model))]


def assert_bitwise(a: nitro.Nitro, b: nitro.Nitro) -> None:
    assert a.history()["loss"].tolist() == b.history()["loss"].tolist()
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_the_nnx_tutorial_cnn_trains_unchanged_and_evaluates_deterministically():
    n = nitro.Nitro(Tutorial(), progress=False, checkpointer=None)
    n.train().wait()
    losses = n.history()["loss"].tolist()
    assert losses[-1] < losses[0] / 2, losses
    first = n.validate()
    assert first["val_acc"] > 0.5, first  # chance is 0.1
    # eval mode: no dropout, BatchNorm's running averages; the same numbers every call
    assert n.validate() == first
    xs = nitro.datasets.digits_arrays()["test"]["x"][:40]
    np.testing.assert_array_equal(n.predict({"x": xs}), n.predict({"x": xs}))


def test_resuming_draws_the_same_dropout_masks_and_data_order_as_an_uninterrupted_run(tmp_path):
    every = Checkpointer(budget=None)
    keywords = dict(seed=3, progress=False, checkpointer=every, logger=None)
    full = nitro.Nitro(Tutorial(), run_dir=str(tmp_path / "full"), **keywords)
    full.train().wait()
    cut = nitro.Nitro(Tutorial(), run_dir=str(tmp_path / "cut"), **keywords)
    cut.train(epochs=1).wait()
    resumed = nitro.Nitro(Tutorial(), run_dir=str(tmp_path / "cut"), resume="auto", **keywords)
    assert resumed.epoch == 1
    resumed.train().wait()
    assert resumed.epoch == full.epoch == 3
    assert_bitwise(full, resumed)


def test_resuming_with_another_seed_goes_on_with_the_runs_seed_and_every_view_says_so(
    tmp_path, capsys
):
    keywords = dict(progress=False, logger=None, checkpointer=Checkpointer(budget=None))
    full = nitro.Nitro(Dropped(), seed=0, run_dir=str(tmp_path / "full"), **keywords)
    full.train().wait()
    cut = nitro.Nitro(Dropped(), seed=0, run_dir=str(tmp_path / "cut"), **keywords)
    cut.train(epochs=1).wait()
    cut.close()
    capsys.readouterr()
    resumed = nitro.Nitro(Dropped(), seed=5, run_dir=cut.run_dir, resume="auto", **keywords)
    said = capsys.readouterr().err  # progress=False: the notes still reach a script
    assert f"nitro: resume='auto' continues run {cut.run_id}: the run run_dir= names" in said
    assert "nitro: the checkpoint's seed 0 replaces seed=5" in said
    assert f"nitro: resumed run {cut.run_id} from its checkpoint at epoch 1, step" in said
    assert resumed.seed == 0 and resumed.state.seed == 0
    seed = resumed.keywords["seed"]
    assert (seed.value, seed.source) == (
        0,
        "the checkpoint's, the run it resumes was trained with it; Nitro keyword gave 5",
    )
    assert "seed = 0  [the checkpoint's" in str(resumed.binding_report())
    assert "<th style='text-align:left'>seed</th><td style='text-align:left'>0</td>" in (
        resumed._repr_html_()
    )
    resumed.train().wait()  # the data order and the dropout keys of seed 0 go on
    assert_bitwise(full, resumed)


class DropoutMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.drop = nnx.Dropout(0.5)
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.out(self.drop(nnx.relu(self.hidden(x)), rngs=rngs))


@nitro.experiment
class Dropped(Tutorial):
    max_epochs: int = 2

    def build_model(self, rngs):
        return DropoutMLP(rngs)

    def forward(self, model, *, x, rngs):
        return model(x, rngs)


def test_fused_steps_draw_what_one_step_at_a_time_draws():
    """K=4 steps in one lax.scan against one step per call: parameters and losses bitwise.
    (An MLP: XLA on CPU compiles a convolution inside a loop to other arithmetic, with or
    without dropout, so the tutorial's CNN differs in the last bits across K.)"""
    one = nitro.Nitro(Dropped(), steps_per_dispatch=1, progress=False, checkpointer=None)
    fused = nitro.Nitro(Dropped(), steps_per_dispatch=4, progress=False, checkpointer=None)
    one.train().wait()
    fused.train().wait()
    assert_bitwise(one, fused)
    other = nitro.Nitro(Dropped(), seed=1, progress=False, checkpointer=None)
    other.train().wait()
    assert other.history()["loss"].tolist() != one.history()["loss"].tolist()


@nitro.experiment
class Draws:
    """forward returns one uniform draw per sample from its rngs; train metrics average it."""

    max_epochs: int = 1

    def build_data(self):
        x = np.zeros((32, 1), np.float32)
        return {
            "train": ArrayLoader({"x": x}, 8, shuffle=False),
            "val": ArrayLoader({"x": x[:8]}, 8, shuffle=False),
        }

    def build_model(self, rngs):
        return nnx.Linear(1, 1, rngs=rngs)

    def forward(self, model, *, x, rngs):
        return {"y": model(x)[:, 0], "draw": jax.random.uniform(rngs(), (x.shape[0],))}

    def loss(self, outputs, rngs):
        return (outputs["y"] ** 2).mean()

    def train_metrics(self, outputs):
        return {"draw": outputs["draw"].mean()}

    def metrics(self, outputs):
        return {"draw": outputs["draw"].mean()}


def test_hook_rngs_are_the_runs_seed_folded_with_the_step_and_fixed_outside_training():
    n = nitro.Nitro(Draws(), seed=5, progress=False, checkpointer=None)
    n.train().wait()
    expected = np.mean(
        [
            jax.random.uniform(nnx.Rngs(jax.random.fold_in(jax.random.key(5), step))(), (8,))
            for step in range(4)
        ]
    )
    assert np.isclose(n.history()["draw"].iloc[-1], expected, rtol=1e-6)
    # validate, evaluate, predict: one fixed key, nnx.Rngs(0), whatever the seed
    fixed = float(jax.random.uniform(nnx.Rngs(0)(), (8,)).mean())
    assert np.isclose(n.validate()["val_draw"], fixed, rtol=1e-6)
    draws = n.predict({"x": np.zeros((8, 1), np.float32)})["draw"]
    np.testing.assert_allclose(draws, jax.random.uniform(nnx.Rngs(0)(), (8,)), rtol=1e-6)


@nitro.experiment
class NoRngs(Dropped):
    def forward(self, model, *, x):
        return model(x)


@nitro.experiment
class DropsThem(Dropped):
    def forward(self, model, *, x, rngs):
        return model(x)


def test_a_model_that_needs_keys_from_a_hook_without_rngs_names_the_hook_and_the_fix():
    with pytest.raises(SetupError, match=r"hook `forward` .* takes no `rngs`.*def forward"):
        nitro.Nitro(NoRngs(), progress=False, checkpointer=None).train()
    with pytest.raises(SetupError, match=r"takes `rngs`, but the model call .* rngs=rngs"):
        nitro.Nitro(DropsThem(), progress=False, checkpointer=None).train()


def test_rngs_in_a_hook_outside_the_train_step_is_refused_with_the_hooks_that_take_them():
    @nitro.experiment
    class NoisyMetrics(Dropped):
        def metrics(self, logits, *, y, rngs):
            return {"acc": (logits.argmax(-1) == y).mean()}

    with pytest.raises(RoutingError, match=r"`metrics.*takes `rngs`, but only forward, loss"):
        nitro.Nitro(NoisyMetrics(), progress=False, checkpointer=None)


def test_seed_seeds_the_loaders_order_unless_a_loader_has_its_own_seed():
    n = nitro.Nitro(Dropped(), seed=7, progress=False, checkpointer=None)
    train = n.splits["train"]
    assert train.seed == 7
    np.testing.assert_array_equal(
        train.begin_epoch(2), np.random.default_rng((7, 2)).permutation(train.num_samples)
    )

    @nitro.experiment
    class OwnSeed(Dropped):
        def build_data(self):
            return nitro.datasets.digits(batch_size=64, seed=1)

    assert nitro.Nitro(OwnSeed(), seed=7, progress=False).splits["train"].seed == 1
    # the loader itself is not changed: it can feed handles of other seeds
    loader = ArrayLoader({"x": np.zeros((8, 1))}, 4)
    nitro.Nitro(Draws(), data={"train": loader}, seed=9, progress=False, checkpointer=None)
    assert loader.seed is None


@nitro.experiment
class GanLike:
    """A train_step hook with rngs: keys drawn in the hook, an nnx.Rngs made inside the
    function step.grad differentiates."""

    max_epochs: int = 1
    inside: nitro.GraphConst[bool] = False

    def build_data(self):
        return {"train": ArrayLoader({"x": np.ones((32, 64), np.float32)}, 8)}

    def build_model(self, rngs):
        return {"model": DropoutMLP(rngs)}

    def forward(self, models, *, x):
        return models["model"](x)

    def train_step(self, step, *, x, rngs):
        key = rngs.dropout()

        def loss(models):
            inner = rngs if self.inside else nnx.Rngs(key)
            return (models["model"](x, rngs=inner) ** 2).mean()

        value, grads = step.grad("model", loss)
        step.apply("model", grads)
        return {"loss": value}


def test_a_train_step_hook_draws_keys_from_its_rngs():
    one = nitro.Nitro(GanLike(), steps_per_dispatch=1, progress=False, checkpointer=None)
    fused = nitro.Nitro(GanLike(), steps_per_dispatch=4, progress=False, checkpointer=None)
    one.train().wait()
    fused.train().wait()
    assert_bitwise(one, fused)
    with pytest.raises(SetupError, match=r"step.grad\('model', \.\.\.\).*key = rngs.dropout"):
        nitro.Nitro(GanLike(inside=True), progress=False, checkpointer=None).train()


@pytest.mark.parametrize("seed", ["1", True, 1.0])
def test_a_loader_seed_that_is_not_an_int_is_refused(seed):
    with pytest.raises(ValueError, match=r"ArrayLoader seed must be an int, or None"):
        ArrayLoader({"x": np.zeros((8, 1))}, 4, seed=seed)


def test_an_export_of_a_forward_with_rngs_is_deterministic_and_matches_predict(tmp_path):
    from nitro.serving.bundle import load

    n = nitro.Nitro(Draws(), seed=5, progress=False, checkpointer=None)
    n.export(str(tmp_path / "draws"), platforms=("cpu",))
    bundle = load(tmp_path / "draws")
    x = np.zeros((8, 1), np.float32)
    first, second = bundle(x=x), bundle(x=x)
    np.testing.assert_array_equal(first["draw"], second["draw"])
    np.testing.assert_allclose(first["draw"], n.predict({"x": x})["draw"], rtol=1e-6)
