"""The optimizer: an optax GradientTransformation whose numeric hyperparameters are injected.

The default is `optax.adam(learning_rate)` wrapped in `optax.inject_hyperparams`, so every
numeric hyperparameter lives in the optimizer state and is fed per step as an argument: a
schedule or a new constant never recompiles. An `optimizer(self)` method (or the `optimizer`
keyword) may return

- an optax factory such as `optax.adamw` or `functools.partial(optax.sgd, momentum=0.9)`:
  Nitro injects it with the resolved `learning_rate`;
- any GradientTransformation, used as given. Hyperparameters baked into it key the compile
  cache; only an `inject_hyperparams` transformation exposes them to schedules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from .errors import OptimizerError

__all__ = ["OptimizerSetup", "build_optimizer", "OptimizerError"]


@dataclasses.dataclass
class OptimizerSetup:
    tx: optax.GradientTransformation
    description: str
    hyperparams: dict[str, Any]  # name -> initial value (numeric, injected)
    dtypes: dict[str, Any]
    uses_learning_rate: bool

    @property
    def names(self) -> tuple[str, ...]:
        """The fed hyperparameters, in the order of the vector the train step receives."""
        return tuple(sorted(self.hyperparams))

    def inject(self, opt_state: Any, hparams: Any) -> Any:
        """Inside the trace: put this step's hyperparameters (`hparams[i]` is `names[i]`)
        into the optimizer state the update reads."""
        if not self.names:
            return opt_state
        injected = {name: hparams[i].astype(self.dtypes[name]) for i, name in enumerate(self.names)}
        return opt_state._replace(hyperparams=injected)

    def strip(self, opt_state: Any) -> Any:
        """Inside the trace: drop the injected hyperparameters from the new state (they are
        fed again next step; carrying them would only add outputs to every step)."""
        if not self.names:
            return opt_state
        return opt_state._replace(hyperparams={})


def _describe_factory(factory: Callable) -> str:
    import functools

    if isinstance(factory, functools.partial):
        kwargs = ", ".join(f"{k}={v!r}" for k, v in factory.keywords.items())
        return (
            f"{_describe_factory(factory.func)}({kwargs})"
            if kwargs
            else _describe_factory(factory.func)
        )
    module = getattr(factory, "__module__", "") or ""
    prefix = "optax." if module.startswith("optax") else ""
    return prefix + getattr(factory, "__qualname__", repr(factory))


def injected_hyperparams(opt_state: Any) -> dict[str, Any]:
    """Numeric hyperparameters of a top-level `inject_hyperparams` state."""
    hyperparams = getattr(opt_state, "hyperparams", None)
    if not isinstance(hyperparams, dict):
        return {}
    return {
        name: value
        for name, value in hyperparams.items()
        if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.number)
    }


def build_optimizer(spec: Any, learning_rate: float, learning_rate_explicit: bool, params):
    """Returns (OptimizerSetup, opt_state)."""
    if spec is None:
        factory, description = optax.adam, "optax.adam"
    elif isinstance(spec, optax.GradientTransformation):
        factory, description = None, type(spec).__name__
    elif callable(spec):
        factory, description = spec, _describe_factory(spec)
    else:
        raise OptimizerError(
            f"optimizer must be an optax GradientTransformation or an optax factory such as "
            f"optax.adamw; got {type(spec).__name__}"
        )
    if factory is not None:
        try:
            tx = optax.inject_hyperparams(factory)(learning_rate=learning_rate)
        except TypeError as error:
            raise OptimizerError(
                f"optimizer factory {description} cannot be called with learning_rate: {error}"
            ) from None
        if not isinstance(tx, optax.GradientTransformation):
            raise OptimizerError(
                f"optimizer factory {description} returned {type(tx).__name__}, not an optax "
                f"GradientTransformation"
            )
        uses_lr = True
        description = f"{description}(learning_rate={learning_rate:g})"
    else:
        tx = spec
        uses_lr = False
    opt_state = tx.init(params)
    hyperparams = injected_hyperparams(opt_state)
    if factory is None:
        if learning_rate_explicit and "learning_rate" not in hyperparams:
            raise OptimizerError(
                "learning_rate was given, but the optimizer is a GradientTransformation with its "
                "own baked-in rate. Return the factory instead (e.g. `return optax.adamw`) so "
                "Nitro injects the rate, or wrap it in optax.inject_hyperparams."
            )
        if learning_rate_explicit:
            uses_lr = True
        if hyperparams:
            description = f"inject_hyperparams({', '.join(sorted(hyperparams))})"
    return (
        OptimizerSetup(
            tx=tx,
            description=description,
            hyperparams={k: np.asarray(v).item() for k, v in hyperparams.items()},
            dtypes={k: v.dtype for k, v in hyperparams.items()},
            uses_learning_rate=uses_lr,
        ),
        opt_state,
    )
