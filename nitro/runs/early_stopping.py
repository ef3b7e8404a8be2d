"""Early stopping: end a run when a validation metric stops improving.

The decision is a function of the committed history, so a resumed run decides exactly as the
uninterrupted one would have. It runs after validation and the checkpoint, so the stop is
graceful: the run ends with `stop_reason == "early_stop"` and its best checkpoint on disk.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from nitro.errors import SetupError
from nitro.optim import ranges

__all__ = ["EarlyStopping"]


@dataclasses.dataclass(frozen=True)
class EarlyStopping:
    """Stop when `metric` has not improved by more than `min_delta` for `patience` epochs.

    >>> stop = EarlyStopping(metric="val_loss", patience=2)
    >>> stop.should_stop([{"val_loss": 1.0}, {"val_loss": 0.9}, {"val_loss": 0.95}])
    False
    >>> stop.should_stop([{"val_loss": 1.0}, {"val_loss": 0.9}, {"val_loss": 0.95}, {"val_loss": 0.91}])
    True
    """

    metric: str = "val_loss"
    mode: str = "min"
    patience: int = 5
    min_delta: float = 1e-4

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise SetupError(f"EarlyStopping(mode={self.mode!r}): mode must be 'min' or 'max'")
        if (
            isinstance(self.patience, bool)
            or not isinstance(self.patience, int)
            or self.patience < 1
        ):
            raise SetupError(
                f"EarlyStopping(patience={self.patience!r}): patience counts epochs without "
                f"improvement, an int >= 1"
            )
        ranges.check(
            "EarlyStopping's min_delta",
            self.min_delta,
            ranges.NON_NEGATIVE,
            fix="nitro.EarlyStopping(min_delta=1e-4)",
        )
        if not isinstance(self.metric, str) or not self.metric:
            raise SetupError(f"EarlyStopping(metric={self.metric!r}): name a history column")

    def check(
        self,
        splits: Sequence[str],
        metrics: Collection[str] | None,
        evaluated: Sequence[str] | None = None,
    ) -> None:
        """Refuse at setup what could never stop: a metric of a split the run does not evaluate
        at its epochs' ends (no 'val' split for `val_loss`; `test_loss` without 'test' in
        `eval_splits`), or a metric the run does not produce (`metrics`: the names it does,
        when known). `evaluated`: the splits evaluated each epoch (default: 'val' if present)."""
        if evaluated is None:
            evaluated = tuple(s for s in splits if s == "val")
        prefix = self.metric.split("_", 1)[0]
        if self.metric.startswith("val_") and "val" not in splits:
            raise SetupError(
                f"early_stop watches {self.metric!r}, but this run has no 'val' split "
                f"(splits: {', '.join(splits) or 'none'}); add one in build_data, or watch a "
                f"train metric such as 'loss'"
            )
        if prefix in splits and prefix != "train" and prefix not in evaluated:
            raise SetupError(
                f"early_stop watches {self.metric!r}, but the {prefix!r} split is not evaluated "
                f"at the epochs' ends (eval_splits={tuple(evaluated)!r}); pass "
                f"eval_splits={(*evaluated, prefix)!r}"
            )
        if metrics is not None and self.metric not in metrics:
            raise SetupError(
                f"early_stop watches {self.metric!r}, which this run does not produce; its "
                f"metrics are {', '.join(sorted(metrics))}"
            )

    def _better(self, value: float, best: float) -> bool:
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta

    def should_stop(self, history: Sequence[Mapping[str, Any]]) -> bool:
        """True when the last `patience` epochs brought no improvement over the best before."""
        best, since = None, 0
        for row in history:
            value = row.get(self.metric)
            if value is None or not math.isfinite(value):
                since += 1
                continue
            if best is None or self._better(value, best):
                best, since = value, 0
            else:
                since += 1
        return best is not None and since >= self.patience
