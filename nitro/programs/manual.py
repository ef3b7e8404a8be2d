"""Manual training: a `train_step` hook for GANs and other multi-model, multi-optimizer
algorithms, still compiled, cached, guarded, interruptible and logged like the default step.

```python
@nitro.experiment
class GAN:
    def build_model(self, rngs):                  # several models: a dict
        return {"gen": Generator(rngs=rngs), "disc": Critic(rngs=rngs)}

    def optimizer(self):                          # one optimizer per model (or one for all)
        return {"gen": optax.adam, "disc": optax.adam}

    def forward(self, models, *, z):              # what predict and export run
        return models["gen"](z)

    def train_step(self, step, *, x, z):          # one training step, traced
        d_loss, grads = step.grad("disc", lambda m: critic_loss(m, x, z))
        step.apply("disc", grads)
        g_loss, grads = step.grad("gen", lambda m: generator_loss(m, z))
        step.apply("gen", grads)
        return {"loss": d_loss + g_loss, "d_loss": d_loss, "g_loss": g_loss}
```

`step.grad(name, fn)` differentiates `fn(models)` with respect to the parameters of
`models[name]` (the other models are constants), after every earlier `apply` of this step;
`step.apply(name, grads)` runs that model's optimizer. The dict the hook returns must hold a
scalar `"loss"` (the step's loss in the history, the divergence guard and the progress); its
other scalars are averaged over the epoch like train metrics. Each model's optimizer has its
own hyperparameters, fed and scheduled by name (`"gen/learning_rate"`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import flax.errors
import jax
import numpy as np
import optax
from flax import nnx

from nitro.errors import SetupError
from nitro.optim.optimizer import FedHyperparameter, FedValues, OptimizerSetup
from nitro.optim.stages import apply_update

__all__ = ["ModelOptimizers", "Step"]


class Step:
    """What a `train_step` hook works with, inside the trace: the models, gradients with
    respect to one model, and each model's optimizer."""

    def __init__(
        self,
        graphdef: Any,
        params: Mapping[str, Any],
        rest: Any,
        opt_states: dict[str, Any],
        optimizers: Mapping[str, optax.GradientTransformation],
    ):
        self._graphdef = graphdef
        self.params = dict(params)  # model name -> parameter tree (updated by apply)
        self.rest = rest  # the models' other variables (batch statistics, RNG counts)
        self.opt_states = opt_states
        self._optimizers = optimizers

    def _merge(self, params: Mapping[str, Any]):
        state = nnx.State({**params})
        module = nnx.merge(self._graphdef, state, self.rest, copy=True)
        return module

    @property
    def models(self):
        """The models at their current weights (train mode), by name."""
        return self._merge(self.params)

    def value(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(models)` at the current weights, without gradients."""
        module = self._merge(self.params)
        out = fn(module)
        self.rest = nnx.split(module, nnx.Param, ...)[2]
        return out

    def grad(self, name: str, fn: Callable[[Any], Any], has_aux: bool = False):
        """(value, gradient) of `fn(models)` with respect to the parameters of `models[name]`;
        with `has_aux`, `fn` returns (value, aux) and the result is ((value, aux), gradient).
        The models' other variables advance as `fn`'s forward passes move them."""
        if name not in self.params:
            raise KeyError(
                f"step.grad({name!r}, ...): no model {name!r}; the models are "
                f"{', '.join(map(repr, self.params))}"
            )

        def objective(own):
            module = self._merge({**self.params, name: own})
            out = fn(module)
            value, aux = out if has_aux else (out, None)
            return value, (aux, nnx.split(module, nnx.Param, ...)[2])

        with _outer_rngs(f"step.grad({name!r}, ...)"):
            (value, (aux, rest)), grads = jax.value_and_grad(objective, has_aux=True)(
                self.params[name]
            )
        self.rest = rest
        return ((value, aux), grads) if has_aux else (value, grads)

    def apply(self, name: str, grads: Any) -> None:
        """One update of `models[name]` by its optimizer."""
        if name not in self._optimizers:
            raise KeyError(
                f"step.apply({name!r}, ...): no optimizer for {name!r}; the optimizers are "
                f"{', '.join(map(repr, self._optimizers))}"
            )
        self.params[name], self.opt_states[name] = apply_update(
            self._optimizers[name], grads, self.opt_states[name], self.params[name]
        )


@contextlib.contextmanager
def _outer_rngs(where: str):
    """Name the fix when the function differentiated draws from the step's `rngs`, which
    lives outside the differentiation (Flax refuses the mutation across trace levels)."""
    try:
        yield
    except flax.errors.TraceContextError as error:
        raise SetupError(
            f"the function given to {where} changed a Flax variable made outside it: most "
            f"likely it drew from the `rngs` of train_step. Draw the keys in train_step and "
            f"make an nnx.Rngs inside the function: `key = rngs.dropout()`, then "
            f"`step.grad('gen', lambda m: loss(m['gen'](z, rngs=nnx.Rngs(key))))`. "
            f"({error})"
        ) from error


class ModelOptimizers(FedValues):
    """One `OptimizerSetup` per model, a `FedOptimizer` to the rest of the engine:
    hyperparameters named `model/name` fed as one vector, the state a dict of the models'
    optimizer states, each model's transformation applied by the `train_step` hook."""

    def __init__(self, setups: Mapping[str, OptimizerSetup]):
        self.setups = dict(setups)
        self.fed = tuple(
            sorted(
                (
                    FedHyperparameter(
                        name=f"{model}/{f.name}",
                        key=f.key,
                        group=None,
                        constant=f.constant,
                        scale=1.0,
                        dtype=f.dtype,
                    )
                    for model, setup in self.setups.items()
                    for f in setup.fed
                ),
                key=lambda f: f.name,
            )
        )
        self.uses_learning_rate = any(s.uses_learning_rate for s in self.setups.values())
        self.description = "; ".join(f"{m}: {s.description}" for m, s in self.setups.items())
        self.groups, self.decayed, self.decay_to, self.gradient_clip_norm = (), (), None, None

    @property
    def schedulable(self) -> dict[str, float]:
        return self.hyperparams

    def sources(self) -> dict[str, tuple[str, float]]:
        return {}

    def check_schedules(self, keys) -> None:
        pass

    def transformations(self) -> dict[str, optax.GradientTransformation]:
        """Each model's transformation, by model name (what `step.apply` runs)."""
        return {model: setup.tx for model, setup in self.setups.items()}

    def updates(self) -> dict[str, Callable[..., Any]]:
        return {f"optimizer update of {m}": s.tx.update for m, s in self.setups.items()}

    def inject(self, opt_state: Mapping[str, Any], hparams: Any) -> dict[str, Any]:
        position = {name: i for i, name in enumerate(self.names)}
        out = {}
        for model, setup in self.setups.items():
            index = [position[f"{model}/{name}"] for name in setup.names]
            sub = hparams[np.asarray(index, dtype=np.int32)] if index else hparams
            out[model] = setup.inject(opt_state[model], sub)
        return out

    def strip(self, opt_state: Mapping[str, Any]) -> dict[str, Any]:
        return {model: setup.strip(opt_state[model]) for model, setup in self.setups.items()}
