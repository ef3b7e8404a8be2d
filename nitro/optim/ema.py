"""An exponential moving average of the weights, kept in the train state.

`ema=0.999` (or `nitro.EMA(decay=0.999, warmup=True, evaluate=True)`) keeps, next to the
parameters, their average `ema = d * ema + (1 - d) * params` updated after every optimizer
step (skipped steps leave it alone). With `warmup` (the default), the decay starts low and
rises as `min(decay, (1 + t) / (10 + t))` over the first steps (t: the steps averaged so far),
so the initial weights fade fast and the average of a short run is close to the weights; with
`warmup=False` it is `decay` from the first step, and after n steps the initial weights still
weigh `decay ** n` (0.999 after 100 steps: 0.9). It is
checkpointed with the rest of the state; `validate`, `evaluate`, `predict` and `export` take
`weights="ema"`, and `evaluate=True` makes the average what validation reports.
"""

from __future__ import annotations

import dataclasses
import numbers

from nitro.errors import SetupError
from nitro.optim import ranges

__all__ = ["EMA"]


@dataclasses.dataclass(frozen=True)
class EMA:
    """Average the weights: `decay` in (0, 1); `warmup` (on by default) ramps it up over the
    first steps as `min(decay, (1 + t) / (10 + t))`; `evaluate` makes validation (and
    evaluate/predict/export by default) use the average.

    >>> round(float(EMA(0.999).decay_at(0)), 3), EMA(0.999, warmup=False).decay_at(0)
    (0.1, 0.999)
    """

    decay: float = 0.999
    warmup: bool = True
    evaluate: bool = False

    def __post_init__(self) -> None:
        ranges.check("ema decay", self.decay, ranges.OPEN_FRACTION, fix="ema=0.999")
        for name in ("warmup", "evaluate"):
            if not isinstance(getattr(self, name), bool):
                raise SetupError(
                    f"EMA({name}=) must be True or False, got {getattr(self, name)!r}; e.g. "
                    f"ema=nitro.EMA(0.999, {name}=True)"
                )

    def decay_at(self, step):
        """The decay used by optimizer step `step` (0-based); works on traced values too."""
        if not self.warmup:
            return self.decay
        import jax.numpy as jnp

        return jnp.minimum(self.decay, (1.0 + step) / (10.0 + step))

    @classmethod
    def of(cls, value) -> EMA | None:
        """What the `ema` run keyword accepts: None, a decay in (0, 1), or an EMA."""
        if value is None or isinstance(value, EMA):
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise SetupError(
                f"ema must be a decay in (0, 1) such as 0.999, a nitro.EMA(...), or None; got "
                f"{value!r}"
            )
        return cls(float(value))
