"""Fine-tuning a pretrained backbone: fastai's `fine_tune` as per-group learning-rate schedules.

Two phases on existing parameter groups, one program for both: the backbone's learning rate
is 0 for `freeze_epochs` (a frozen group: its update and its decay are zero, so its weights
stay bitwise as they were), while the other groups follow a one-cycle schedule to `base_lr`;
then every group follows a one-cycle schedule to half of `base_lr`, the backbone at
`unfrozen_ratio` times it (discriminative learning rates). The rates are fed to every step,
so switching phases recompiles nothing.

With `freeze_batch_stats=True` (a run keyword) the train step also keeps the batch statistics
(`nnx.BatchStat`: BatchNorm's running mean and variance) of every group whose fed learning
rate is 0 at that step: a frozen backbone keeps its pretrained statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["fine_tune_schedules", "keep_frozen_statistics", "steps_per_epoch"]


def fine_tune_schedules(
    groups: Sequence[str],
    backbone: Sequence[str],
    *,
    start: int,
    steps_per_epoch: int,
    epochs: int,
    freeze_epochs: int,
    base_lr: float,
    unfrozen_ratio: float,
    pct_start: float,
    div: float,
) -> dict[str, Callable[[Any], Any]]:
    """`<group>/learning_rate` -> its schedule (a callable of the optimizer step, counted
    from 0 as optax counts), for training `freeze_epochs + epochs` epochs from step `start`.

    >>> s = fine_tune_schedules(["backbone", "head"], ["backbone"], start=0, steps_per_epoch=10,
    ...     epochs=1, freeze_epochs=1, base_lr=1e-2, unfrozen_ratio=0.1, pct_start=0.3, div=5.0)
    >>> [round(float(s["backbone/learning_rate"](t)), 5) for t in (0, 9, 13)]
    [0.0, 0.0, 0.0005]
    >>> [round(float(s["head/learning_rate"](t)), 5) for t in (0, 9, 13)]
    [0.0004, 0.01, 0.005]
    """
    frozen = freeze_epochs * steps_per_epoch
    unfrozen = epochs * steps_per_epoch
    # fastai: fit_one_cycle(freeze_epochs, base_lr, pct_start=0.99), then base_lr / 2
    warm = _one_cycle(frozen, base_lr, pct_start=0.99, div=25.0)

    def unfrozen_phase(peak: float) -> Callable[[Any], Any]:
        return _one_cycle(unfrozen, peak, pct_start=pct_start, div=div)

    schedules = {}
    for group in groups:
        ratio = unfrozen_ratio if group in backbone else 1.0
        first = _zero if group in backbone else warm
        schedules[f"{group}/learning_rate"] = _phases(
            start, frozen, first, unfrozen_phase(base_lr / 2 * ratio)
        )
    return schedules


def _one_cycle(steps: int, peak: float, *, pct_start: float, div: float):
    if steps == 0 or peak == 0:
        return _zero
    return optax.cosine_onecycle_schedule(
        steps, peak, pct_start=pct_start, div_factor=div, final_div_factor=1e5
    )


def _zero(step: Any) -> Any:
    return jnp.zeros_like(jnp.asarray(step), dtype=jnp.float32)


def _phases(start: int, frozen: int, first, second) -> Callable[[Any], Any]:
    def schedule(step: Any) -> Any:
        step = jnp.asarray(step)
        return jnp.where(step < start + frozen, first(step - start), second(step - start - frozen))

    return schedule


def keep_frozen_statistics(
    frozen: Sequence[tuple[int, str]],
    names: Sequence[str],
    hparams: jax.Array,
    rest: Any,
    new_rest: Any,
) -> Any:
    """Inside the train step: `new_rest` with each leaf `i` of `frozen` (leaf index, fed
    learning-rate name) kept at its value in `rest` while that learning rate is 0."""
    if not frozen:
        return new_rest
    index = {name: i for i, name in enumerate(names)}
    leaves, treedef = jax.tree.flatten(new_rest)
    old = jax.tree.leaves(rest)
    for leaf, name in frozen:
        leaves[leaf] = jnp.where(hparams[index[name]] == 0, old[leaf], leaves[leaf])
    return jax.tree.unflatten(treedef, leaves)


def steps_per_epoch(batches: int, accum: int) -> int:
    """Optimizer steps an epoch of `batches` takes (the last update takes what is left)."""
    return math.ceil(batches / accum)
