"""The stages of a train step, each a small function the step composes: the gradient (of one
batch, accumulated over micro-batches, SAM's second one), the optimizer update and the
moving average of the weights. The divergence guard is `nitro.optim.guard`.

A gradient stage wraps a gradient function `gradients(params, state, batch) -> Gradients`
(`state`: the model's other variables, which a forward pass may move) and returns another, so
each run keyword adds one line to the step:

```
gradients = batch_gradients                                  # jax.value_and_grad of the loss
gradients = accumulate(gradients, micro=4)                   # accum=4
gradients = sharpness_aware(gradients, SAM(0.05))            # sam=0.05
params, opt_state = apply_update(tx, grads, opt_state, params)
average, steps = moving_average(EMA(0.999), average, steps, params)   # ema=0.999
```

>>> import jax.numpy as jnp
>>> def batch_gradients(params, state, batch):
...     return Gradients(jnp.mean(batch * params), state, jnp.mean(batch), None)
>>> stacked = jnp.arange(4.0).reshape(2, 2)                  # 2 micro-batches of 2
>>> float(accumulate(batch_gradients, 2)(1.0, (), stacked).grads)   # mean of 0.5 and 2.5
1.5
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from nitro.optim.ema import EMA
from nitro.optim.sam import SAM

__all__ = [
    "GradientFn",
    "Gradients",
    "accumulate",
    "apply_update",
    "moving_average",
    "sharpness_aware",
]


class Gradients(NamedTuple):
    """What a gradient function returns."""

    loss: Any
    state: Any  # the model's other variables after the forward pass
    grads: Any  # the gradient with respect to the parameters
    report: Any  # what the step reports besides its loss (train metrics, outputs)


GradientFn = Callable[[Any, Any, Any], Gradients]


def accumulate(gradients: GradientFn, micro: int) -> GradientFn:
    """The mean gradient over `micro` micro-batches stacked on the batch's leading axis, taken
    in a scan (the memory of one micro-batch): for a loss that is a mean over its batch,
    exactly the gradient of the merged batch. The model state threads through the
    micro-batches; the loss is their mean and their reports come back stacked."""

    def accumulated(params: Any, state: Any, batches: Any) -> Gradients:
        def add(carry, batch):
            state, grad_sum, loss_sum = carry
            loss, state, grads, report = gradients(params, state, batch)
            return (state, jax.tree.map(jnp.add, grad_sum, grads), loss_sum + loss), report

        start = (state, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
        (state, grad_sum, loss_sum), reports = jax.lax.scan(add, start, batches)
        grads = jax.tree.map(lambda g: g / micro, grad_sum)
        return Gradients(loss_sum / micro, state, grads, reports)

    return accumulated


def sharpness_aware(gradients: GradientFn, sam: SAM) -> GradientFn:
    """SAM's (or ASAM's) gradient: the gradient again, at the weights nudged uphill by
    `sam.perturbation`. The loss, the model state and the report stay the first pass's."""

    def perturbed(params: Any, state: Any, batch: Any) -> Gradients:
        first = gradients(params, state, batch)
        nudged = jax.tree.map(jnp.add, params, sam.perturbation(params, first.grads))
        return first._replace(grads=gradients(nudged, state, batch).grads)

    return perturbed


def apply_update(
    tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any
) -> tuple[Any, Any]:
    """One optimizer step: (the new parameters, the new optimizer state)."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def moving_average(ema: EMA, average: Any, steps: jax.Array, params: Any) -> tuple[Any, Any]:
    """The moving average after one more step, `d * average + (1 - d) * params` with
    `d = ema.decay_at(steps)`, and the steps it has averaged."""
    decay = ema.decay_at(steps)
    moved = jax.tree.map(
        lambda a, p: (decay * a + (1 - decay) * p).astype(a.dtype), average, params
    )
    return moved, steps + 1
