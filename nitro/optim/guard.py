"""The divergence guard: one rule for every train step (`check_divergence=True`).

A step is skipped when something it computed is non-finite, and so is every later step in
flight (the rest of a fused block, or a step dispatched before the host read the verdict). A
skipped step leaves every variable exactly as it was: the parameters, the model state (batch
statistics, RNG counts), the optimizer state (Adam's count and moments) and the moving
average, as `optax.apply_if_finite` keeps its inner state. So a run that stops on divergence
holds the state of its last good step, bit for bit.

The checks are named by `Failure`, the code each step reports (`0`: finite) and the loop
turns into the `DivergenceError` message: the default step checks the loss, the gradients and
the fed hyperparameters; a `train_step` hook's step checks its loss and the weights it
produced.

>>> import jax.numpy as jnp
>>> verdict = check(jnp.bool_(True), (Failure.LOSS, jnp.isfinite(jnp.nan)))
>>> bool(verdict.healthy), Failure(int(verdict.code)).name
(False, 'LOSS')
>>> keep(verdict.healthy, {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"].tolist()
[0.0, 0.0]
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp

__all__ = ["Failure", "Verdict", "all_finite", "check", "keep"]

Tree = TypeVar("Tree")


class Failure(enum.IntEnum):
    """What made a step non-finite: the code its report carries (0 when it was finite)."""

    LOSS = 1
    GRADIENT = 2
    HYPERPARAMETER = 3  # a fed hyperparameter (a NaN learning rate from a schedule)
    EARLIER = 4  # an earlier step in flight was already non-finite
    WEIGHTS = 5  # the weights a `train_step` hook produced


class Verdict(NamedTuple):
    """Whether a step (and every step before it in flight) was finite, and if not, why."""

    healthy: jax.Array  # bool[]
    code: jax.Array  # int32[]: 0, or the `Failure` of the first check that failed


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every leaf is finite (one reduction per leaf)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def check(healthy: jax.Array, *checks: tuple[Failure, jax.Array]) -> Verdict:
    """The verdict on a step: `healthy` (every earlier step in flight was finite) and each
    `(failure, ok)` check, the first that fails naming the code."""
    code = jnp.int32(0)
    for failure, ok in reversed(checks):
        code = jnp.where(ok, code, jnp.int32(failure))
    code = jnp.where(healthy, code, jnp.int32(Failure.EARLIER))
    for _, ok in checks:
        healthy = healthy & ok
    return Verdict(healthy, code)


def keep(healthy: jax.Array, new: Tree, old: Tree) -> Tree:
    """`new` after a healthy step, `old` after a skipped one, leaf by leaf (a select that
    fuses into the kernels computing `new`)."""
    return jax.tree.map(lambda n, o: jnp.where(healthy, n, o), new, old)
