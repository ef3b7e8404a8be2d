"""A population's programs: the train step and the eval forward of one member, vmapped over
a leading member axis.

A population trains N variants of one experiment that share every GraphConst value, shape
and setting of the program: what differs between them (their variables, the fed
hyperparameters, the Device fields, the step keys) rides on a leading axis of N, and the
batch is the same for every member. The function traced is the one a single run traces
(`train_step_spec`, `eval_spec`), wrapped in `jax.vmap`: no second train step.
`ProgramSet(setup, members=N)` makes every program of a handle this way.

Arguments, as a single run's with a member axis in front:

- train step: `(variables[N], healthy[N], device fields[N], hyperparameters[N], batch)`;
  K fused steps take `device fields[N, K]`, `hyperparameters[N, K, H]` and K stacked batches;
  with each member's own data order the batches carry the member axis too: `batch[N]` for
  one step, `batch[K, N]` for a stack of K (steps, or micro-batches), so that a stack's
  rows are sliced as a single run's are;
- eval forward: `(variables[N], device fields[N], batch, real samples)`.

Under `spike=` the train step keeps its input (no donation: the loop holds each call's
starting variables until the call is read back), and `take_members` puts a spiking member's
slice of them back (`nitro.engine.member_spikes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from nitro.optim import guard
from nitro.programs.compile_cache import ProgramKind, ProgramSpec

__all__ = ["population_eval_spec", "population_train_spec", "take_members"]


def _masked(fn: Callable) -> Callable:
    """A train step without the guard (`check_divergence=False`), that still leaves a
    stopped member's variables as they were: `healthy` is the member's flag, set False by
    `pop.stop(member)`."""

    def step(variables, healthy, *rest):
        out = fn(variables, healthy, *rest)
        kept = guard.keep(healthy, out.variables, variables)
        return dataclasses.replace(out, variables=kept, healthy=healthy)

    return step


def _vmapped(
    spec: ProgramSpec, kind: ProgramKind, members: int, in_axes: tuple, mask: bool = False
) -> ProgramSpec:
    """`spec`'s program over `members` members: its function under `jax.vmap(in_axes)`;
    `mask`: the train step keeps a stopped member's variables (when the guard does not)."""
    build = spec.build

    def vmapped_build(reads: set[str]) -> Callable:
        fn = build(reads)
        mapped = jax.vmap(_masked(fn) if mask else fn, in_axes=in_axes)

        def program(*args: Any) -> Any:
            return mapped(*args)

        if hasattr(fn, "nitro_traced"):  # its metrics' specs, found as it traces
            program.nitro_traced = fn.nitro_traced  # pyright: ignore[reportFunctionMemberAccess]
        # the name XLA's compile events carry: jit(population_train_step)
        program.__name__ = program.__qualname__ = kind.value.replace(" ", "_")
        return program

    return dataclasses.replace(
        spec,
        kind=kind,
        build=vmapped_build,
        static={**spec.static, "members": members},
        leaf_labels={},
    )


def population_train_spec(
    spec: ProgramSpec,
    members: int,
    *,
    stacked: bool,
    own_batches: bool,
    guarded: bool,
    keep_input: bool = False,
) -> ProgramSpec:
    """A run's train step `spec` (one step or fused ones) for `members` members at once;
    `stacked`: its batch is a stack (of steps or micro-batches); `own_batches`: the batches
    carry a member axis too (each member's own data order), after the stack's; `guarded`:
    the step has the guard (else a stopped member is kept by a select of its own);
    `keep_input` (`spike=`): the variables are not donated, so the call's input lives on for a
    member's roll-back."""
    batch_axis = (1 if stacked else 0) if own_batches else None
    spec = _vmapped(
        spec, ProgramKind.POPULATION_STEP, members, (0, 0, 0, 0, batch_axis), mask=not guarded
    )
    static = {**spec.static, "own batches": own_batches}
    if not keep_input:
        return dataclasses.replace(spec, static=static)
    static["donates its input"] = "no (spike=: kept for a member's roll-back)"
    return dataclasses.replace(spec, static=static, donate_argnums=())


def population_eval_spec(spec: ProgramSpec, members: int) -> ProgramSpec:
    """A run's eval forward or predict `spec` for `members` members at once."""
    return _vmapped(spec, ProgramKind.POPULATION_EVAL, members, (0, 0, None, None))


@jax.jit
def take_members(back: Any, before: Any, now: Any) -> Any:
    """`before`'s slice of each member `back` (bool[N]) flags, `now`'s of the others: a select
    along the member axis, exact (the other members' arrays are `now`'s, bit for bit)."""

    def take(old: Any, new: Any) -> Any:
        return jnp.where(back.reshape((-1,) + (1,) * (new.ndim - 1)), old, new)

    return jax.tree.map(take, before, now)
