"""`nitro.ReduceOnPlateau`: a fed value that drops when a monitored metric stops improving.

Keras's and Lightning's `ReduceLROnPlateau` in Nitro's terms: a schedule
(`schedules={"learning_rate": nitro.ReduceOnPlateau(patience=2)}`) for any optimizer
hyperparameter or Device field, fed to the step as every schedule is, so a reduction never
recompiles. Its value is its start (the keyword's or the Device field's value, or a schedule
given as `start=`) times a scale; the scale is decided from the committed history after each
epoch's validation (a function of the history, as early stopping is), so a resumed run reduces
exactly where the uninterrupted one did.

>>> plateau = ReduceOnPlateau("val_loss", factor=0.5, patience=1).bound(0.1)
>>> plateau.react([{"epoch": 1, "step": 4, "val_loss": 1.0}, {"epoch": 2, "step": 8, "val_loss": 1.2}])
True
>>> float(plateau(8)), plateau.reductions
(0.05, ((2, 8, 0.05),))
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from nitro.errors import SetupError
from nitro.optim import ranges

__all__ = ["ReduceOnPlateau"]


class ReduceOnPlateau:
    """Multiply a fed value by `factor` when `metric` has not improved by more than
    `min_delta` for `patience` validations, then wait `cooldown` validations before counting
    again; never below `min_value`. `mode`: "min" or "max" (default: "min" for a metric named
    like a loss, else "max"). `start`: the value (a number or a schedule of the step) it
    scales; default the keyword's or Device field's own value."""

    def __init__(
        self,
        metric: str = "val_loss",
        *,
        factor: float = 0.1,
        patience: int = 10,
        cooldown: int = 0,
        min_value: float = 0.0,
        min_delta: float = 1e-4,
        mode: str | None = None,
        start: float | Callable[[Any], Any] | None = None,
    ):
        if not isinstance(metric, str) or not metric:
            raise SetupError(f"ReduceOnPlateau(metric={metric!r}): name a history column")
        mode = mode or ("min" if "loss" in metric else "max")
        if mode not in ("min", "max"):
            raise SetupError(f"ReduceOnPlateau(mode={mode!r}): mode must be 'min' or 'max'")
        for name, value, least in (("patience", patience, 1), ("cooldown", cooldown, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise SetupError(
                    f"ReduceOnPlateau({name}={value!r}): {name} counts validations, an int "
                    f">= {least}"
                )
        self.factor = ranges.check(
            "ReduceOnPlateau's factor",
            factor,
            ranges.OPEN_FRACTION.with_example(0.1),
            fix="nitro.ReduceOnPlateau(factor=0.1)",
        )
        self.min_value = ranges.check("ReduceOnPlateau's min_value", min_value, ranges.NON_NEGATIVE)
        self.min_delta = ranges.check("ReduceOnPlateau's min_delta", min_delta, ranges.NON_NEGATIVE)
        if start is not None and not callable(start):
            start = ranges.check("ReduceOnPlateau's start", start, ranges.FINITE)
        self.metric, self.mode, self.patience, self.cooldown = metric, mode, patience, cooldown
        self.start = start
        self.scale = 1.0
        # (epoch, step, value at that step) of each reduction: where the value dropped
        self.reductions: tuple[tuple[int, int, float], ...] = ()

    def __repr__(self) -> str:
        return (
            f"ReduceOnPlateau({self.metric!r}, factor={self.factor}, patience={self.patience}, "
            f"cooldown={self.cooldown}, min_value={self.min_value}, mode={self.mode!r})"
        )

    def bound(self, base: Any) -> ReduceOnPlateau:
        """A copy of its own for one run (or member), starting from `start` or `base`."""
        own = copy.copy(self)
        if own.start is None:
            own.start = float(np.asarray(base)) if np.ndim(base) == 0 else np.asarray(base)
        own.scale, own.reductions = 1.0, ()
        return own

    def _base(self, step: Any) -> Any:
        start = self.start
        return start(step) if callable(start) else start

    def __call__(self, step: Any) -> Any:
        """The value at `step` (an int, or an array of steps: an array of values)."""
        base = np.asarray(self._base(step), dtype=np.float64)
        value = base if self.scale == 1.0 else np.maximum(base * self.scale, self.min_value)
        if np.ndim(step) and np.shape(value) != np.shape(step):
            value = np.broadcast_to(value, np.shape(step)).copy()
        return value

    def react(self, history: Sequence[Mapping[str, Any]]) -> bool:
        """Decide the scale from the committed `history` (its rows in order); True when it
        changed. Keras's rule: an improvement resets the wait; a cooldown after a reduction
        counts validations without waiting; `patience` validations without improvement reduce
        by `factor` while the value is above `min_value`."""
        scale, reductions = 1.0, []
        best, wait, cooling = None, 0, 0
        for row in history:
            value = row.get(self.metric)
            if value is None:  # an epoch without this column (not validated): not counted
                continue
            value = float(value)
            if cooling > 0:
                cooling -= 1
                wait = 0
            if math.isfinite(value) and (best is None or self._better(value, best)):
                best, wait = value, 0
            elif cooling == 0:
                wait += 1
                step = int(row.get("step", 0))
                now = float(np.max(np.asarray(self._base(step)))) * scale
                if wait >= self.patience and now > self.min_value:
                    scale *= self.factor
                    dropped = max(now * self.factor, self.min_value)
                    reductions.append((int(row.get("epoch", 0)), step, dropped))
                    cooling, wait = self.cooldown, 0
        changed = scale != self.scale
        self.scale, self.reductions = scale, tuple(reductions)
        return changed

    def _better(self, value: float, best: float) -> bool:
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta

    def check(self, key: str, names: set[str] | None, splits: Sequence[str], evaluated) -> None:
        """Refuse at setup a metric the run never records: one of a split not evaluated at
        the epochs' ends, or a column the run does not produce (`names`, when known)."""
        prefix = self.metric.split("_", 1)[0]
        if prefix in ("val", *splits) and prefix != "train" and prefix not in evaluated:
            raise SetupError(
                f"schedules[{key!r}]: ReduceOnPlateau watches {self.metric!r}, but the "
                f"{prefix!r} split is not evaluated at the epochs' ends (eval_splits="
                f"{tuple(evaluated)!r}); watch a metric of an evaluated split, or 'loss'"
            )
        if names is not None and self.metric not in names:
            raise SetupError(
                f"schedules[{key!r}]: ReduceOnPlateau watches {self.metric!r}, which this run "
                f"does not produce; its metrics are {', '.join(sorted(names))}"
            )
