"""What a compiled program costs, as XLA reports it: its FLOPs and bytes accessed (XLA's cost
analysis) and its memory (XLA's memory analysis), with its arguments' bytes by what they hold.

Read from the compiled executable the first time it is asked for (`Program.cost()`, which
`nitro.cache_stats()`, `%nitro cache` and `n.profile()` call) and kept: a few milliseconds a
program, once.

XLA's cost analysis counts a loop's body once, whatever its trip count (`HloCostAnalysis`
cannot always know it). Nitro's programs loop over the steps of a fused call (`lax.scan` over
K steps), the micro-batches of an accumulated step (over M) and the batches of a fused
evaluation: XLA's figure for such a program is one trip's. `ProgramCost` keeps XLA's figure as
it is (`xla_flops`, `xla_bytes`) and gives a call's (`flops`: XLA's times the trips Nitro
knows it runs) and a step's (`flops_per_step`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from nitro.core.progress import format_bytes, format_flops

__all__ = ["ProgramCost", "program_cost"]

# what the variables' leaves hold, by the field of `Variables` their path starts with
_VARIABLE_PARTS = {
    "params": "parameters",
    "model_state": "model state",
    "opt_state": "optimizer state",
    "ema": "EMA",
    "ema_steps": "EMA",
}


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """A compiled program's cost, read from the executable.

    `xla_flops`, `xla_bytes`: XLA's cost analysis (one trip of each loop); `trips`: the loop
    trips of one call (steps x micro-batches, or batches), `steps`: the steps (or batches) a
    call runs. Memory, in bytes, from XLA's memory analysis (per device): `argument_bytes`,
    `output_bytes`, `alias_bytes` (outputs written over donated arguments), `temp_bytes`
    (the program's scratch), `code_bytes`. `arguments`: the arguments' bytes by what they hold
    (parameters, optimizer state, model state, the batch ...; global shapes), from the shapes
    the program was compiled for. None where the backend does not say."""

    steps: int
    trips: int
    xla_flops: float | None
    xla_bytes: float | None
    transcendentals: float | None
    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    code_bytes: int | None
    arguments: Mapping[str, int]

    @property
    def flops(self) -> float | None:
        """FLOPs of one call (XLA's figure for one trip of its loops, times the trips)."""
        return None if self.xla_flops is None else self.xla_flops * self.trips

    @property
    def flops_per_step(self) -> float | None:
        return None if self.flops is None else self.flops / self.steps

    @property
    def bytes_accessed(self) -> float | None:
        """Bytes one call reads and writes (as `flops`: XLA's one trip, times the trips)."""
        return None if self.xla_bytes is None else self.xla_bytes * self.trips

    @property
    def memory_bytes(self) -> int | None:
        """What the program holds at once on a device: its arguments, its outputs not written
        over donated arguments, and its scratch."""
        parts = (self.argument_bytes, self.output_bytes, self.alias_bytes, self.temp_bytes)
        if any(p is None for p in parts):
            return None
        arguments, outputs, aliased, temp = parts
        assert arguments is not None and outputs is not None  # checked above
        assert aliased is not None and temp is not None
        return arguments + outputs - aliased + temp

    def describe(self) -> str:
        """`63.3 MFLOP a step, memory 3.0 MiB (arguments 1.0 MiB, scratch 1.0 MiB)`."""
        parts = []
        if self.flops_per_step is not None:
            parts.append(f"{format_flops(self.flops_per_step)} a step")
        if self.memory_bytes is not None:
            parts.append(
                f"memory {format_bytes(self.memory_bytes)} (arguments "
                f"{format_bytes(self.argument_bytes)}, scratch {format_bytes(self.temp_bytes)})"
            )
        return ", ".join(parts) or "no cost analysis on this backend"

    def as_dict(self) -> dict[str, Any]:
        return {
            "flops": self.flops,
            "flops_per_step": self.flops_per_step,
            "bytes_accessed": self.bytes_accessed,
            "memory_bytes": self.memory_bytes,
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "alias_bytes": self.alias_bytes,
            "temp_bytes": self.temp_bytes,
            "arguments": dict(self.arguments),
        }


def program_cost(compiled: Any, static: Mapping[str, Any], signature: tuple) -> ProgramCost:
    """The cost of `compiled` (a `jax.stages.Compiled`), a program with settings `static` and
    argument signature `signature` (as the compile cache keys them)."""
    steps = int(static.get("steps per program") or static.get("batches per call") or 1)
    trips = steps * int(static.get("micro-batches per step") or 1)
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without a cost model
        analysis = None
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per computation
        analysis = analysis[0] if analysis else None
    analysis = analysis if isinstance(analysis, Mapping) else {}
    try:
        memory = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without one
        memory = None

    def figure(name: str) -> float | None:
        value = analysis.get(name)
        return float(value) if value is not None and math.isfinite(value) else None

    def size(name: str) -> int | None:
        value = getattr(memory, name, None)
        return int(value) if value is not None else None

    return ProgramCost(
        steps=steps,
        trips=trips,
        xla_flops=figure("flops"),
        xla_bytes=figure("bytes accessed"),
        transcendentals=figure("transcendentals"),
        argument_bytes=size("argument_size_in_bytes"),
        output_bytes=size("output_size_in_bytes"),
        alias_bytes=size("alias_size_in_bytes"),
        temp_bytes=size("temp_size_in_bytes"),
        code_bytes=size("generated_code_size_in_bytes"),
        arguments=argument_bytes(signature),
    )


def argument_bytes(signature: tuple) -> dict[str, int]:
    """A program's arguments' bytes by what they hold: the variables by their field
    (parameters, model state, optimizer state, EMA), the others by their name."""
    parts: dict[str, int] = {}
    for name, _, leaves in signature:
        for path, shape, dtype, _, _ in leaves:
            part = name
            if name == "variables":
                field = path.lstrip(".").split("[", 1)[0]
                part = _VARIABLE_PARTS.get(field, field or name)
            parts[part] = parts.get(part, 0) + math.prod(shape) * _itemsize(dtype)
    return parts


def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        import jax.numpy as jnp

        try:
            return jnp.dtype(dtype).itemsize  # bfloat16 and the other ml_dtypes
        except TypeError:
            return 0  # a key type: a few words, not worth a guess
