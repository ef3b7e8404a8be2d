"""A population's programs: the train step and the eval forward of one member, vmapped over
a leading member axis.

A population trains N variants of one experiment that share every GraphConst value, shape
and setting of the program: what differs between them (their variables, the fed
hyperparameters, the Device fields, the step keys) rides on a leading axis of N, and the
batch is the same for every member. The function traced is the one a single run traces
(`train_step_spec`, `eval_spec`), wrapped in `jax.vmap`: no second train step.

Arguments, as a single run's with a member axis in front:

- train step: `(variables[N], healthy[N], device fields[N], hyperparameters[N], batch)`;
  K fused steps take `device fields[N, K]`, `hyperparameters[N, K, H]` and K stacked batches;
  with each member's own data order the batches carry the member axis too (`batch[N]`);
- eval forward: `(variables[N], device fields[N], batch, real samples)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from nitro.core.run_setup import RunSetup
from nitro.optim import guard
from nitro.programs.compile_cache import ProgramKind, ProgramSpec
from nitro.programs.specs import eval_spec
from nitro.programs.train_step import train_step_spec

__all__ = ["population_eval_spec", "population_train_spec"]

# the member axis of each argument (None: shared by every member)
TRAIN_AXES = (0, 0, 0, 0, None)
EVAL_AXES = (0, 0, None, None)


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
    setup: RunSetup,
    fields: Mapping[str, tuple[str, ...]],
    members: int,
    steps: int = 1,
    micro: int = 1,
    *,
    own_batches: bool = False,
) -> ProgramSpec:
    """The train step (`steps == 1`) or `steps` fused steps of `setup` (each of `micro`
    accumulated micro-batches), for `members` members at once; `own_batches`: the batches
    carry a leading member axis too (each member's own data order)."""
    spec = _vmapped(
        train_step_spec(setup, fields, steps, micro),
        ProgramKind.POPULATION_STEP,
        members,
        (*TRAIN_AXES[:-1], 0) if own_batches else TRAIN_AXES,
        mask=not setup.check_divergence,
    )
    return dataclasses.replace(spec, static={**spec.static, "own batches": own_batches})


def population_eval_spec(
    setup: RunSetup,
    fields: Mapping[str, tuple[str, ...]],
    members: int,
    *,
    with_loss: bool,
    return_outputs: bool,
) -> ProgramSpec:
    """Eval forward (with the loss) of one batch, for `members` members at once."""
    spec = eval_spec(setup, fields, with_loss=with_loss, return_outputs=return_outputs)
    return _vmapped(spec, ProgramKind.POPULATION_EVAL, members, EVAL_AXES)
