"""Equinox modules, trained as they are.

When `build_model` returns an `equinox.Module`, Nitro keeps its floating-point arrays
(`eqx.is_inexact_array`) as `nnx.Param`s, its other arrays as plain `nnx.Variable`s, and
everything else (activation functions, static fields) in the model's structure. `forward`
receives the equinox module itself, rebuilt inside the compiled program from the current
parameters with `eqx.combine`, and calls it as equinox code does: one sample at a time, under
`jax.vmap` (an equinox layer has no batch axis).

```python
@nitro.experiment
class Regression:
    def build_model(self, rngs):
        return eqx.nn.MLP(2, 2, 64, 2, activation=jax.nn.softplus, key=rngs.params())
    def forward(self, model, *, x):
        return jax.vmap(model)(x)
```

Parameter paths are the equinox module's own (`layers.0.weight`), for `param_group`,
`decay_mask`, checkpoints and export. In evaluation (`model.eval()`) the module is passed
through `eqx.nn.inference_mode`, so `eqx.nn.Dropout` turns itself off; while training it needs
a key, `model(x, key=rngs.dropout())`. Equinox's state (`eqx.nn.State`, which `BatchNorm`
and `SpectralNorm` keep) is refused by name.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nitro.errors import SetupError

__all__ = ["EquinoxModel", "as_nnx_model", "hook_model", "is_equinox"]

# the wrapper's own attributes: an equinox field of one of these names cannot be a path
_RESERVED = {"equinox", "equinox_def", "equinox_static", "equinox_fields", "deterministic"}


def is_equinox(value: Any) -> bool:
    """Whether `value` is an equinox module (without importing equinox when nobody has)."""
    equinox = sys.modules.get("equinox")
    return equinox is not None and isinstance(value, equinox.Module)


class EquinoxModel(nnx.Module):
    """An equinox module as an NNX module; `model.equinox` is the equinox module, in the
    model's mode (`eqx.nn.inference_mode` after `model.eval()`)."""

    def __init__(self, module: Any):
        import equinox as eqx

        arrays, static = eqx.partition(module, eqx.is_array)
        variables = jax.tree.map(_variable, arrays)
        # one level: the module's fields, each an attribute (paths `layers.0.weight`)
        keyed, self.equinox_def = jax.tree_util.tree_flatten_with_path(
            variables, is_leaf=lambda node: node is not variables
        )
        fields = []
        for path, child in keyed:
            name = jax.tree_util.keystr(path, simple=True, separator=".")
            fields.append(name)
            if not jax.tree.leaves(child):
                continue
            if name in _RESERVED or name.startswith("_") or hasattr(nnx.Module, name):
                raise SetupError(
                    f"build_model returned an equinox {type(module).__name__} with a field "
                    f"{name!r}, a name Nitro's equinox model uses itself; rename the field"
                )
            setattr(self, name, nnx.data(child))
        self.equinox_fields = tuple(fields)
        self.equinox_static = static
        self.deterministic = False  # flipped by model.train() / model.eval()

    @property
    def equinox(self) -> Any:
        import equinox as eqx

        children = [getattr(self, name, None) for name in self.equinox_fields]
        variables = jax.tree.unflatten(self.equinox_def, children)
        arrays = jax.tree.map(
            lambda v: v.get_value(), variables, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        module = eqx.combine(arrays, self.equinox_static)
        return eqx.nn.inference_mode(module, True) if self.deterministic else module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.equinox(*args, **kwargs)


def _variable(array: Any) -> nnx.Variable:
    floating = jnp.issubdtype(array.dtype, jnp.inexact)
    return nnx.Param(array) if floating else nnx.Variable(array)


def as_nnx_model(model: Any) -> Any:
    """`model` as Nitro trains it: an equinox module wrapped (`EquinoxModel`), anything else
    as it is. Equinox's state is refused by name."""
    if isinstance(model, tuple) and any(is_equinox(part) for part in model):
        kinds = ", ".join(type(part).__name__ for part in model)
        raise SetupError(
            f"build_model returned a tuple ({kinds}); with equinox it must return the module "
            f"alone. A tuple of a module and its eqx.nn.State (eqx.nn.make_with_state) is not "
            f"supported: Nitro does not thread equinox's state through forward. Build the "
            f"model without stateful layers (eqx.nn.BatchNorm, eqx.nn.SpectralNorm), e.g. "
            f"eqx.nn.LayerNorm or eqx.nn.GroupNorm instead of BatchNorm, or write it in "
            f"Flax NNX (nnx.BatchNorm keeps its statistics for you)"
        )
    if not is_equinox(model):
        return model
    import equinox as eqx

    stateful = [
        (jax.tree_util.keystr(path, simple=True, separator="."), node)
        for path, node in jax.tree_util.tree_flatten_with_path(
            model, is_leaf=lambda x: isinstance(x, (eqx.nn.StateIndex, eqx.nn.BatchNorm))
        )[0]
        if isinstance(node, (eqx.nn.StateIndex, eqx.nn.BatchNorm))
    ]
    if stateful:
        where = ", ".join(
            f"{path or 'the model'} ({type(node).__name__})" for path, node in stateful
        )
        raise SetupError(
            f"build_model returned an equinox module with state (eqx.nn.State): {where}. "
            f"Nitro does not thread equinox's state through forward; use a layer without "
            f"state (eqx.nn.LayerNorm or eqx.nn.GroupNorm instead of BatchNorm), or write "
            f"the model in Flax NNX (nnx.BatchNorm keeps its statistics for you)"
        )
    return EquinoxModel(model)


def hook_model(model: Any) -> Any:
    """What a hook receives for `model`: the equinox module of an `EquinoxModel`."""
    return model.equinox if isinstance(model, EquinoxModel) else model
