"""The ranges of the numeric hyperparameters Nitro accepts, checked in one place.

Every number that reaches a step as a hyperparameter is checked here the moment it is known,
so a NaN radius or a `b1` of 1.5 is refused at setup, naming where it came from, instead of
stopping the run at its first step: a run keyword when `Nitro(...)` resolves it
(`learning_rate`, `weight_decay`, `gradient_clip_norm`, `group_lr`), the fields of
`nitro.SAM`, `nitro.ASAM` and `nitro.EMA` when they are built, the optimizer's own injected
hyperparameters (`functools.partial(optax.adam, b1=0.9)`) when setup builds the optimizer, and
a schedule's values at its first and last step.

Each value must be a finite real number, and within its range: `OPTAX` gives the range of
optax's usual names (`b1` in [0, 1), `eps` >= 0, ...); any other name needs only be finite.

>>> check("b1", 0.9, FRACTION)
0.9
>>> check("b1", 1.5, FRACTION, fix="optimizer=functools.partial(optax.adam, b1=0.9)")
Traceback (most recent call last):
nitro.errors.SetupError: b1 must be a finite number in [0, 1), got 1.5; e.g. optimizer=functools.partial(optax.adam, b1=0.9)
>>> str(of("head/b2")), str(of("trust_ratio"))
('a finite number in [0, 1)', 'a finite number')
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from nitro.errors import SetupError

__all__ = [
    "FINITE",
    "FRACTION",
    "NON_NEGATIVE",
    "OPEN_FRACTION",
    "OPTAX",
    "POSITIVE",
    "Range",
    "check",
    "of",
    "show",
]


@dataclasses.dataclass(frozen=True)
class Range:
    """Finite numbers from `low` to `high` (None: unbounded); `low_in`, `high_in`: whether
    the bounds themselves belong. `example` is a usual value, for the fix a message shows."""

    low: float | None = None
    high: float | None = None
    low_in: bool = True
    high_in: bool = False
    example: float | None = None

    def with_example(self, example: float) -> Range:
        return dataclasses.replace(self, example=example)

    def admits(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (value == self.low and not self.low_in)):
            return False
        return self.high is None or value < self.high or (value == self.high and self.high_in)

    def __str__(self) -> str:
        low, high = self.low, self.high
        if low is not None and high is not None:
            brackets = ("[" if self.low_in else "(", "]" if self.high_in else ")")
            return f"a finite number in {brackets[0]}{low:g}, {high:g}{brackets[1]}"
        if low is not None:
            return f"a finite number {'>=' if self.low_in else '>'} {low:g}"
        if high is not None:
            return f"a finite number {'<=' if self.high_in else '<'} {high:g}"
        return "a finite number"


FINITE = Range()
POSITIVE = Range(0.0, low_in=False)
NON_NEGATIVE = Range(0.0)
FRACTION = Range(0.0, 1.0)  # [0, 1): a moment's decay, a momentum
OPEN_FRACTION = Range(0.0, 1.0, low_in=False)  # (0, 1): the moving average's decay

# The usual optax names. A learning rate may be 0 once fed (a group frozen by group_lr, a
# warmup from 0); the learning_rate keyword itself must be > 0.
OPTAX: dict[str, Range] = {
    "learning_rate": NON_NEGATIVE.with_example(1e-3),
    "weight_decay": NON_NEGATIVE.with_example(1e-4),
    "gradient_clip_norm": POSITIVE.with_example(1.0),
    "b1": FRACTION.with_example(0.9),
    "b2": FRACTION.with_example(0.999),
    "b3": FRACTION.with_example(0.9999),
    "momentum": FRACTION.with_example(0.9),
    "decay": FRACTION.with_example(0.9),
    "eps": NON_NEGATIVE.with_example(1e-8),
    "eps_root": NON_NEGATIVE.with_example(0.0),
}


def show(value: Any) -> str:
    """A number as a message shows it: a float to float32 precision (what a step is fed),
    with its point (`1.0`, `0.9`, `1e-08`, `nan`); anything else as its repr.

    >>> show(1.0), show(0.8999999761581421), show(float("inf")), show(3), show("big")
    ('1.0', '0.9', 'inf', '3', "'big'")
    """
    if not isinstance(value, float):
        return repr(value)
    text = f"{value:.7g}"
    return text + ".0" if text.lstrip("-").isdigit() else text


def of(name: str) -> Range:
    """The range of a fed hyperparameter, by its optax name (`head/b1` is `b1`'s)."""
    return OPTAX.get(name.rpartition("/")[2], FINITE)


def check(
    label: str,
    value: Any,
    bound: Range,
    *,
    fix: str | None = None,
    note: str = "",
    error: type[Exception] = SetupError,
) -> float:
    """`value` as a float, or `error` naming `label` (the keyword, field or argument), the
    value, the range and the fix (default `label=<the range's example>`); `note` says more
    (what None does)."""
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if is_number and bound.admits(float(value)):
        return float(value)
    if fix is None and bound.example is not None:
        fix = f"{label}={show(bound.example)}"
    more = f" ({note})" if note else ""
    got = show(value)
    raise error(f"{label} must be {bound}, got {got}{more}" + (f"; e.g. {fix}" if fix else ""))
