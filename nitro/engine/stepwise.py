"""A fused call's steps run one at a time, and the check behind "auto"'s fused sizes.

"auto" times fused calls against single steps, and keeps one or the other; its timings
depend on the machine's load, so the steps they train must be the ones either choice would
train. A fused size's first call (the one that compiles it) is therefore run on a copy of the
variables and thrown away, while its steps train one at a time on the run's own variables, by
the single-step program; the two results are compared bit for bit (`identical`). Where they
match, the later calls of that size train for real: they compute what single steps would.
Where they differ (XLA's CPU backend, for one, compiles a convolution inside a loop's body
otherwise than alone, and rounds differently), the run keeps one step per call, and a call of
that size still in a stream that cannot change its sizes is run one step at a time here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from nitro.core.train_state import StepOutput

__all__ = ["identical", "one_at_a_time"]


def _bits(x: Any) -> Any:
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def identical(a: Any, b: Any) -> bool:
    """Whether two trees of arrays hold the same values, bit for bit (NaNs alike)."""
    left, right = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(left) != len(right):
        return False
    return all(
        x.shape == y.shape
        and x.dtype == y.dtype
        and bool(jnp.array_equal(_bits(x), _bits(y), equal_nan=True))
        for x, y in zip(left, right, strict=True)
    )


def one_at_a_time(
    single: Callable[..., Any],
    feed: Any,
    index: int,
    args: tuple,
    count: int,
    micro: int,
    restore: bool,
    fused: Any = None,
    members: bool = False,
) -> tuple[StepOutput, bool, float]:
    """The `count` steps of a fused call (its `args`, from step `index`), one at a time by the
    single-step program (`single(args=)`, given the first step's arguments): their output stacked as the fused call's would be. With
    `fused` (the fused program), that runs first on a copy of the variables (the input
    itself where `restore`: nothing is donated) and is thrown away; returns (the output,
    whether the fused call's variables and reports matched the single steps' bit for bit,
    the seconds the copy's call took). `members`: a population's call, whose reports and
    metrics have the member axis before the steps'."""
    variables, healthy, _, _, batches = args
    shadow, seconds = None, 0.0
    if fused is not None:
        begin = time.perf_counter()
        copy = variables if restore else jax.tree.map(jnp.copy, variables)
        shadow = fused(copy, *args[1:])
        jax.block_until_ready(shadow.report)
        seconds = time.perf_counter() - begin
    outputs = []
    for offset in range(count):
        rows = slice(offset * micro, (offset + 1) * micro) if micro > 1 else offset
        batch = {name: array[rows] for name, array in batches.items()}
        step = index + offset
        one = (variables, healthy, feed.device(step), feed.hparams(step), batch)
        out = single(args=one)(*one)
        variables, healthy = out.variables, out.healthy
        outputs.append(out)
    axis = 1 if members else 0
    stacked = StepOutput(
        variables,
        healthy,
        jnp.stack([o.report for o in outputs], axis),
        jax.tree.map(lambda *xs: jnp.stack(xs, axis), *[o.metrics for o in outputs]),
    )
    same = True
    if shadow is not None:
        same = identical((shadow.variables, shadow.report), (stacked.variables, stacked.report))
    return stacked, same, seconds
