"""A population's programs: the train step and the eval forward of one member, over a leading
member axis: vmapped, or unrolled (each member's step one after another in the program).

A population trains N variants of one experiment that share every GraphConst value, shape
and setting of the program: what differs between them (their variables, the fed
hyperparameters, the Device fields, the step keys) rides on a leading axis of N, and the
batch is the same for every member. The function traced is the one a single run traces
(`train_step_spec`, `eval_spec`), wrapped in `jax.vmap`, or (`vectorize=False`) traced once
per member on its slice of the arguments, the outputs stacked: no second train step.
XLA's CPU backend runs a vmapped convolution as a grouped one, several times slower than the
members' convolutions one after another, which the unrolled program keeps.
`ProgramSet(setup, members=N, vectorize=...)` makes every program of a handle this way.

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
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

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


def _slice(x: Any, i: int, axis: int) -> Any:
    return lax.index_in_dim(x, i, axis, keepdims=False)


def _unrolled(fn: Callable, in_axes: tuple, members: int) -> Callable:
    """`fn` over `members` members as `jax.vmap(fn, in_axes)` computes it, one member after
    another: each argument with an axis is sliced at it, the outputs stacked on a leading
    axis."""

    def each(args: tuple, i: int) -> list:
        return [
            a if axis is None else jax.tree.map(functools.partial(_slice, i=i, axis=axis), a)
            for a, axis in zip(args, in_axes, strict=True)
        ]

    def program(*args: Any) -> Any:
        outs = [fn(*each(args, i)) for i in range(members)]
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *outs)

    return program


def _over_members(
    spec: ProgramSpec,
    kind: ProgramKind,
    members: int,
    in_axes: tuple,
    mask: bool = False,
    vectorize: bool = True,
) -> ProgramSpec:
    """`spec`'s program over `members` members: its function under `jax.vmap(in_axes)`, or
    unrolled (`vectorize=False`); `mask`: the train step keeps a stopped member's variables
    (when the guard does not)."""
    build = spec.build

    def vmapped_build(reads: set[str]) -> Callable:
        fn = build(reads)
        step = _masked(fn) if mask else fn
        mapped = jax.vmap(step, in_axes=in_axes) if vectorize else _unrolled(step, in_axes, members)

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
        static={**spec.static, "members": members, "vectorized": vectorize},
        leaf_labels={},
    )


def population_train_spec(
    spec: ProgramSpec,
    members: int,
    *,
    stacked: bool,
    own_batches: bool,
    guarded: bool,
    vectorize: bool = True,
    keep_input: bool = False,
) -> ProgramSpec:
    """A run's train step `spec` (one step or fused ones) for `members` members at once;
    `stacked`: its batch is a stack (of steps or micro-batches); `own_batches`: the batches
    carry a member axis too (each member's own data order), after the stack's; `guarded`:
    the step has the guard (else a stopped member is kept by a select of its own);
    `vectorize`: vmapped (else unrolled); `keep_input` (`spike=`): the variables are not
    donated, so the call's input lives on for a member's roll-back."""
    batch_axis = (1 if stacked else 0) if own_batches else None
    spec = _over_members(
        spec,
        ProgramKind.POPULATION_STEP,
        members,
        (0, 0, 0, 0, batch_axis),
        mask=not guarded,
        vectorize=vectorize,
    )
    static = {**spec.static, "own batches": own_batches}
    if not keep_input:
        return dataclasses.replace(spec, static=static)
    static["donates its input"] = "no (spike=: kept for a member's roll-back)"
    return dataclasses.replace(spec, static=static, donate_argnums=())


def population_eval_spec(spec: ProgramSpec, members: int, vectorize: bool = True) -> ProgramSpec:
    """A run's eval forward or predict `spec` for `members` members at once."""
    return _over_members(
        spec, ProgramKind.POPULATION_EVAL, members, (0, 0, None, None), vectorize=vectorize
    )


@jax.jit
def take_members(back: Any, before: Any, now: Any) -> Any:
    """`before`'s slice of each member `back` (bool[N]) flags, `now`'s of the others: a select
    along the member axis, exact (the other members' arrays are `now`'s, bit for bit)."""

    def take(old: Any, new: Any) -> Any:
        return jnp.where(back.reshape((-1,) + (1,) * (new.ndim - 1)), old, new)

    return jax.tree.map(take, before, now)
