"""Mixed precision: the forward and backward passes in bfloat16 or float16, with float32
master parameters, optimizer state, loss and reductions (`precision=`).

`precision="bfloat16"` (or `nitro.Precision("bfloat16")`) runs the train step's forward and
backward in bfloat16: the step casts the float32 parameters and the batch's floating inputs
to bfloat16 before `forward`, and `forward`'s floating outputs back to float32 before
`loss`, following a `jmp` policy (`params=float32,compute=bfloat16,output=float32`). The
gradient of the cast is float32, so the gradients, their accumulation over micro-batches, the
optimizer's update and state, the moving average and the checkpoints stay float32; the model
state (batch statistics) keeps its dtype. Evaluation and prediction compute the same way and
return float32 outputs.

`precision="float16"` does the same in float16, whose range (about 6e-5 to 65504) is too
small for many gradients, with jmp's dynamic loss scaling: the loss is multiplied by a scale
(2**15 to start) before the gradient and the gradient divided by it after. A step whose
gradient overflows is skipped (every variable stays as it was) and halves the scale; after
`growth_interval` finite steps in a row the scale doubles. A skipped step is not a
divergence; a non-finite gradient at the smallest scale (1) is, and so is a non-finite loss.
The scale, its counter and the steps skipped are variables of the run (`Variables.loss_scale`),
checkpointed and resumed exactly; the history's `loss_scale` and `skipped_steps` columns show
them per epoch.

>>> import jax.numpy as jnp
>>> p = Precision.of("bfloat16")
>>> p, p.cast_compute({"w": jnp.ones(2), "ids": jnp.arange(2)})["w"].dtype
(Precision('bfloat16'), dtype(bfloat16))
>>> Precision.of("bf16-mixed")
Traceback (most recent call last):
nitro.errors.SetupError: precision 'bf16-mixed' is Lightning's name for precision='bfloat16'; ...
>>> half = Precision("float16", loss_scale=1024.0)
>>> after = half.adjusted(half.initial_state(), jnp.bool_(False))  # an overflow
>>> float(after[0]), int(after[1]), int(after[2])                   # halved, skipped once
(512.0, 0, 1)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nitro.errors import SetupError

__all__ = ["COMPUTE_DTYPES", "FLOAT32", "Precision", "epoch_columns"]

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")

# other libraries' names for the same settings, and what Nitro calls them
_PEERS = {
    "bf16": ("bfloat16", "a common"),
    "bf16-mixed": ("bfloat16", "Lightning's"),
    "bf16-true": ("bfloat16", "Lightning's"),
    "mixed_bfloat16": ("bfloat16", "Keras's"),
    "16": ("float16", "Lightning's"),
    "16-mixed": ("float16", "Lightning's"),
    "16-true": ("float16", "Lightning's"),
    "fp16": ("float16", "a common"),
    "f16": ("float16", "a common"),
    "half": ("float16", "a common"),
    "mixed_float16": ("float16", "Keras's"),
    "32": ("float32", "Lightning's"),
    "32-true": ("float32", "Lightning's"),
    "fp32": ("float32", "a common"),
    "f32": ("float32", "a common"),
}

DEFAULT_LOSS_SCALE = 2.0**15  # Keras's and jmp's usual start
DEFAULT_GROWTH_INTERVAL = 2000  # finite steps before the scale doubles (Keras, PyTorch)


@dataclasses.dataclass(frozen=True)
class Precision:
    """How the train step computes: `compute` is "float32" (the default), "bfloat16" or
    "float16"; parameters, optimizer state and loss stay float32. Under "float16",
    `loss_scale` is the dynamic loss scale to start from (default 2**15) and
    `growth_interval` the finite steps after which it doubles (default 2000)."""

    compute: str = "float32"
    loss_scale: float | None = None
    growth_interval: int | None = None

    def __post_init__(self) -> None:
        if self.compute not in COMPUTE_DTYPES:
            raise SetupError(_unknown(self.compute))
        if self.compute != "float16":
            for name in ("loss_scale", "growth_interval"):
                if getattr(self, name) is not None:
                    raise SetupError(
                        f"Precision({self.compute!r}, {name}=...): loss scaling is for "
                        f"float16 only ({self.compute} has float32's range); drop {name}, or "
                        f"use nitro.Precision('float16', {name}=...)"
                    )
            return
        scale = self.loss_scale
        if scale is not None and (
            isinstance(scale, bool)
            or not isinstance(scale, numbers.Real)
            or not math.isfinite(scale)
            or not 1 <= scale <= 2.0**64
        ):
            raise SetupError(
                f"Precision('float16', loss_scale={scale!r}): the initial loss scale must be a "
                f"finite number in [1, 2**64], e.g. loss_scale=2**15"
            )
        interval = self.growth_interval
        if interval is not None and (
            isinstance(interval, bool) or not isinstance(interval, int) or interval < 1
        ):
            raise SetupError(
                f"Precision('float16', growth_interval={interval!r}): the finite steps before "
                f"the scale doubles must be an int >= 1, e.g. growth_interval=2000"
            )

    def __repr__(self) -> str:
        extra = "".join(
            f", {name}={value!r}"
            for name, value in (
                ("loss_scale", self.loss_scale),
                ("growth_interval", self.growth_interval),
            )
            if value is not None
        )
        return f"Precision({self.compute!r}{extra})"

    @classmethod
    def of(cls, value: Any) -> Precision:
        """What the `precision` run keyword accepts: "float32", "bfloat16", "float16" (or
        those dtypes, `jnp.bfloat16`), or a `Precision`."""
        if isinstance(value, Precision):
            return value
        if not isinstance(value, str):
            try:
                value = np.dtype(value).name
            except TypeError:
                raise SetupError(_unknown(value)) from None
        return cls(value)

    # -----------------------------------------------------------------------------------------
    # the policy

    @property
    def mixed(self) -> bool:
        """True when the step computes in a lower precision than its float32 parameters."""
        return self.compute != "float32"

    @property
    def scaled(self) -> bool:
        """True when the step scales its loss (float16)."""
        return self.compute == "float16"

    @property
    def initial_scale(self) -> float:
        return float(self.loss_scale) if self.loss_scale is not None else DEFAULT_LOSS_SCALE

    @property
    def interval(self) -> int:
        return self.growth_interval if self.growth_interval is not None else DEFAULT_GROWTH_INTERVAL

    @property
    def policy(self):
        """The jmp policy: float32 parameters and outputs, `compute` in between."""
        import jmp

        return jmp.get_policy(f"params=float32,compute={self.compute},output=float32")

    @property
    def program_key(self) -> str:
        """What keys the programs: the compute dtype, and under float16 the growth interval
        (the initial scale is a variable, not part of the program)."""
        if not self.scaled:
            return self.compute
        return f"float16 (loss scale doubles every {self.interval} finite steps)"

    def cast_compute(self, tree: Any) -> Any:
        """The floating leaves of `tree` in the compute dtype (unchanged under float32)."""
        return self.policy.cast_to_compute(tree) if self.mixed else tree

    def cast_output(self, tree: Any) -> Any:
        """The floating leaves of `tree` in float32 (unchanged under float32)."""
        return self.policy.cast_to_output(tree) if self.mixed else tree

    def like(self, tree: Any, reference: Any) -> Any:
        """`tree`'s leaves in the dtypes of `reference`'s (the model state a forward pass in
        the compute dtype may have moved)."""
        if not self.mixed:
            return tree
        import jax

        return jax.tree.map(
            lambda new, old: new if new.dtype == old.dtype else new.astype(old.dtype),
            tree,
            reference,
        )

    def describe(self) -> str:
        """One line for the binding report."""
        if not self.mixed:
            return "float32 throughout"
        line = (
            f"forward and backward in {self.compute} (parameters and inputs cast by a jmp "
            f"policy); parameters, gradients, optimizer state, loss and outputs float32"
        )
        if self.scaled:
            line += (
                f"; dynamic loss scale from {self.initial_scale:g}, halved and the step "
                f"skipped on overflow, doubled after {self.interval} finite steps"
            )
        return line

    # -----------------------------------------------------------------------------------------
    # dynamic loss scaling (float16)

    def initial_state(self) -> list[np.ndarray]:
        """The loss-scale variables a float16 run starts with: [scale f32, finite steps in a
        row i32, steps skipped i32]."""
        return [
            np.asarray(self.initial_scale, np.float32),
            np.zeros((), np.int32),
            np.zeros((), np.int32),
        ]

    def dynamic(self, state: Sequence[Any]):
        """The `jmp.DynamicLossScale` of the loss-scale variables `state`."""
        import jmp

        return jmp.DynamicLossScale(state[0], state[1], period=self.interval, factor=2)

    def adjusted(self, state: Sequence[Any], finite: Any) -> list[Any]:
        """The loss-scale variables after a step whose gradient was `finite` or not: the
        scale halved (not below 1) on overflow, doubled after `growth_interval` finite steps
        in a row, and the skipped steps counted."""
        import jax.numpy as jnp

        after = self.dynamic(state).adjust(finite)
        skipped = state[2] + jnp.logical_not(finite).astype(jnp.int32)
        return [after.loss_scale, after.counter, skipped]

    def at_floor(self, state: Sequence[Any]) -> Any:
        """Whether the scale is at its smallest (1): a gradient that overflows there is a
        divergence, not a step to skip."""
        return state[0] <= 1.0


FLOAT32 = Precision()


def _unknown(value: Any) -> str:
    peer = _PEERS.get(value) if isinstance(value, str) else None
    if peer is not None:
        name, whose = peer
        return (
            f"precision {value!r} is {whose} name for precision={name!r}; Nitro writes the "
            f"compute dtype: precision={name!r}"
        )
    return (
        f"precision must be 'float32', 'bfloat16' or 'float16' (the dtype the forward and "
        f"backward passes compute in; parameters stay float32), or a nitro.Precision(...); "
        f"got {value!r}"
    )


def _host(x: Any) -> Any:
    if hasattr(x, "is_fully_addressable") and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x).item()


def epoch_columns(
    state: Sequence[Any] | None, history: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The history columns of a float16 run at an epoch's end: `loss_scale` (the scale
    now) and `skipped_steps` (the epoch's steps skipped on overflow); none without loss
    scaling. `state`: the loss-scale variables, `history`: the rows committed before."""
    if state is None:
        return {}
    before = sum(int(row.get("skipped_steps", 0)) for row in history)
    return {
        "loss_scale": float(_host(state[0])),
        "skipped_steps": max(0, int(_host(state[2])) - before),
    }
