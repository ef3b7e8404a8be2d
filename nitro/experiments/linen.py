"""Flax Linen modules, trained as they are through `flax.nnx.bridge`.

When `build_model` returns a `flax.linen.Module`, Nitro wraps it in `nnx.bridge.ToNNX` and
initializes it lazily from the shapes of the first batch, by calling the experiment's `forward`
hook once on the wrapped model (the `ToNNX.lazy_init` the Flax bridge guide describes). The
wrapper is an NNX module, so everything else (programs, checkpoints, `weights=`, export)
treats it like any other model.

Linen modules take their mode as a call argument. The wrapper follows `model.train()` /
`model.eval()` and passes it for you, when the module's `__call__` takes one and `forward`
does not pass it itself: `train` / `training` get True while training, `deterministic` /
`use_running_average` get False. While training, the collections other than `params` (batch
statistics) are mutable, and their new values are kept like NNX `BatchNorm`'s. Dropout draws
its keys from the seeded `nnx.Rngs` (Linen falls back to the `params` stream).

```python
class MLP(nn.Module):                              # existing Linen code, unchanged
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.Dropout(0.1, deterministic=not train)(x)
        return nn.Dense(10)(x)

@nitro.experiment
class Digits:
    def build_model(self, rngs):
        return MLP()                               # a Linen module
    def forward(self, model, *, x):
        return model(x)                            # train=True in training, False in eval
```
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any, TypeGuard

import jax
from flax import linen, nnx

__all__ = ["LinenModel", "bridge_linen", "is_linen"]

# call parameters that carry the mode, and the value each takes while training
MODE_PARAMETERS = {
    "train": True,
    "training": True,
    "deterministic": False,
    "use_running_average": False,
}


def is_linen(model: Any) -> TypeGuard[linen.Module]:
    return isinstance(model, linen.Module)


class LinenModel(nnx.Module):
    """A Linen module as an NNX module (`model.linen` is the `nnx.bridge.ToNNX` wrapper)."""

    def __init__(self, module: linen.Module, rngs: nnx.Rngs):
        self.linen = nnx.bridge.ToNNX(module, rngs=rngs)
        self.deterministic = False  # flipped by model.train() / model.eval()
        self.mode_parameters = _mode_parameters(module)
        self.mutable_collections: tuple[str, ...] = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        training = not self.deterministic
        for name in self.mode_parameters:
            kwargs.setdefault(name, MODE_PARAMETERS[name] == training)
        if training and self.mutable_collections:
            kwargs.setdefault("mutable", list(self.mutable_collections))
        return self.linen(*args, **kwargs)


def _mode_parameters(module: linen.Module) -> tuple[str, ...]:
    try:
        parameters = inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(name for name in parameters if name in MODE_PARAMETERS)


def bridge_linen(
    module: linen.Module, rngs: nnx.Rngs, call_forward: Callable[[nnx.Module], Any]
) -> LinenModel:
    """Wrap a Linen module and initialize its variables by running `call_forward(model)`
    once (the experiment's `forward` on the first batch)."""
    model = LinenModel(module, rngs)
    # `lazy_init` takes a method of the module it initializes: bind `call_forward` to it
    nnx.bridge.lazy_init(types.MethodType(call_forward, model))
    _, _, _, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    variables = jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
    model.mutable_collections = tuple(
        sorted({nnx.variable_name_from_type(type(v), allow_register=True) for v in variables})
    )
    return model
