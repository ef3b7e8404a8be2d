"""Equinox modules from `build_model`, trained as they are: parameters, checkpoints, export,
parameter groups, evaluation mode, and the errors that name what to change."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nitro
import nitro.bundle
from nitro.data import ArrayLoader

# a linear vector field, dy/dt = A y, sampled at random states
A = np.array([[-0.1, 1.0], [-1.0, -0.1]], np.float32)
Y = np.random.default_rng(0).normal(size=(160, 2)).astype(np.float32)
DY = Y @ A.T


class Func(eqx.Module):
    """The vector field of diffrax's Neural ODE example, as it is written there."""

    mlp: eqx.nn.MLP

    def __init__(self, data_size, width_size, depth, *, key):
        self.mlp = eqx.nn.MLP(
            in_size=data_size,
            out_size=data_size,
            width_size=width_size,
            depth=depth,
            activation=jax.nn.softplus,
            key=key,
        )

    def __call__(self, t, y, args):
        return self.mlp(y)


@nitro.experiment
class VectorField:
    max_epochs: int = 4
    batch_size: int = 32
    dropout: float = 0.0

    def build_data(self):
        return {
            "train": ArrayLoader({"y": Y[:128], "dy": DY[:128]}, self.batch_size, shuffle=True),
            "val": ArrayLoader(
                {"y": Y[128:], "dy": DY[128:]}, self.batch_size, shuffle=False, drop_last=False
            ),
        }

    def build_model(self, rngs):
        return Func(2, 32, 2, key=rngs.params())

    def forward(self, model, *, y):
        return jax.vmap(lambda y: model(0.0, y, None))(y)

    def loss(self, outputs, *, dy):
        return jnp.mean((outputs - dy) ** 2)


def test_a_diffrax_style_equinox_model_trains_checkpoints_and_exports(tmp_path):
    n = nitro.Nitro(VectorField(max_epochs=8), learning_rate=1e-2, progress=False)
    n.train()
    losses = n.history()["loss"].tolist()
    assert losses[-1] < losses[0] / 2, losses
    assert n.setup.model.leaf_paths["parameter"] == (
        "mlp.layers.0.bias",
        "mlp.layers.0.weight",
        "mlp.layers.1.bias",
        "mlp.layers.1.weight",
        "mlp.layers.2.bias",
        "mlp.layers.2.weight",
    )
    # the trained equinox module, called as equinox code calls it, predicts what Nitro does
    module = n.model.equinox  # pyright: ignore[reportAttributeAccessIssue]
    assert isinstance(module, Func)
    expected = jax.vmap(lambda y: module(0.0, y, None))(Y[:8])
    predicted = np.asarray(n.predict({"y": Y[:8]}))
    np.testing.assert_allclose(predicted, expected, rtol=1e-5, atol=1e-6)
    # a checkpoint read back into a new handle predicts the same
    step = int(n.checkpoints()["step"].iloc[-1])
    back = nitro.Nitro(VectorField(), weights=f"{n.run_dir}/checkpoints/{step}", progress=False)
    np.testing.assert_array_equal(np.asarray(back.predict({"y": Y[:8]})), predicted)
    # the export bundle loads without Nitro's model code and predicts the same
    n.export(str(tmp_path / "field"))
    bundle = nitro.bundle.load(str(tmp_path / "field"))
    np.testing.assert_allclose(
        np.asarray(bundle(y=Y[:8])["output"]), predicted, rtol=1e-5, atol=1e-6
    )


def test_parameter_groups_name_equinox_paths_and_a_zero_ratio_freezes_one():
    @nitro.experiment
    class Grouped(VectorField):
        def param_group(self, path):
            return "head" if path.startswith("mlp.layers.2") else "body"

    n = nitro.Nitro(Grouped(max_epochs=1), group_lr={"body": 0.0}, progress=False)
    before = [np.asarray(x) for x in n.state.variables.params]
    n.train()
    after = [np.asarray(x) for x in n.state.variables.params]
    paths = n.setup.model.leaf_paths["parameter"]
    for path, old, new in zip(paths, before, after, strict=True):
        if path.startswith("mlp.layers.2"):
            assert not np.array_equal(old, new), path
        else:
            np.testing.assert_array_equal(old, new)


class Dropped(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, *, key):
        self.linear = eqx.nn.Linear(2, 2, key=key)
        self.dropout = eqx.nn.Dropout(0.5)

    def __call__(self, y, *, key=None):
        return self.linear(self.dropout(y, key=key))


def test_equinox_dropout_draws_keys_in_training_and_is_off_in_evaluation():
    @nitro.experiment
    class WithDropout(VectorField):
        def build_model(self, rngs):
            return Dropped(key=rngs.params())

        def forward(self, model, *, y, rngs):
            keys = jax.random.split(rngs.dropout(), len(y))
            return jax.vmap(lambda y, k: model(y, key=k))(y, keys)

    n = nitro.Nitro(WithDropout(max_epochs=1), progress=False)
    n.train()
    module = eqx.nn.inference_mode(n.model.equinox)  # pyright: ignore[reportAttributeAccessIssue]
    first, again = n.predict({"y": Y[:8]}), n.predict({"y": Y[:8]})
    np.testing.assert_array_equal(first, again)
    np.testing.assert_allclose(first, jax.vmap(module)(Y[:8]), rtol=1e-5, atol=1e-6)


def test_an_equinox_model_called_on_the_whole_batch_is_an_error_naming_the_hook():
    @nitro.experiment
    class Unmapped(VectorField):
        def build_model(self, rngs):
            return eqx.nn.MLP(2, 2, 8, 1, key=rngs.params())

        def forward(self, model, *, y):
            return model(y)  # equinox layers take one sample

    n = nitro.Nitro(Unmapped(), progress=False)
    with pytest.raises(
        nitro.SetupError, match=r"hook `forward` raised TypeError with an equinox model"
    ):
        n.predict({"y": Y[:8]})
    with pytest.raises(nitro.SetupError, match=r"return jax.vmap\(model\)\(x\)"):
        n.train()


def test_equinox_state_is_refused_by_name():
    @nitro.experiment
    class Normed(VectorField):
        def build_model(self, rngs):
            return eqx.nn.Sequential(
                [eqx.nn.Linear(2, 8, key=rngs.params()), eqx.nn.BatchNorm(8, "batch", mode="batch")]
            )

    with pytest.raises(
        nitro.SetupError,
        match=r"equinox module with state \(eqx.nn.State\): layers.1 \(BatchNorm\)",
    ):
        nitro.Nitro(Normed(), progress=False)

    @nitro.experiment
    class WithState(VectorField):
        def build_model(self, rngs):
            return eqx.nn.make_with_state(eqx.nn.BatchNorm)(2, "batch", mode="batch")

    with pytest.raises(nitro.SetupError, match=r"returned a tuple \(BatchNorm, State\)"):
        nitro.Nitro(WithState(), progress=False)


EDITED = """
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import nitro
from nitro.data import ArrayLoader

Y = np.random.default_rng(0).normal(size=(160, 2)).astype(np.float32)
ARRAYS = {"train": {"x": Y, "y": Y[:, ::-1].copy()}, "val": {"x": Y[:32], "y": Y[:32, ::-1].copy()}}


class Field(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(2, 2, 16, 1, activation=jax.nn.softplus, key=key)

    def __call__(self, y):
        return self.mlp(y)


@nitro.experiment
class Live:
    def build_data(self):
        return {"train": ArrayLoader(ARRAYS["train"], 16, shuffle=True)}

    def build_model(self, rngs):
        return Field(rngs.params())

    def forward(self, model, *, x):
        return jax.vmap(model)(x) * 1.0

    def loss(self, outputs, *, y):
        return jnp.mean((outputs - y) ** 2)
"""


def test_live_edits_of_forward_and_of_the_equinox_class_swap_into_a_running_run(tmp_path):
    from test_live_edits import Module, apply, start

    module = Module(tmp_path, EDITED)
    n, _ = start(module)
    assert apply(n, module, "* 1.0", "* 2.0").status == "swapped"
    assert apply(n, module, "jax.nn.softplus", "jax.nn.tanh").status == "swapped"
    n.stop().wait()
    field = n.model.equinox  # pyright: ignore[reportAttributeAccessIssue]
    assert field.mlp.activation is jax.nn.tanh
    x = module.module.ARRAYS["val"]["x"][:8]
    expected = 2.0 * jax.vmap(field)(x)
    np.testing.assert_allclose(n.predict({"x": x}), expected, rtol=1e-5, atol=1e-6)
