"""Loss spikes: `Spike(rtol=, window=, max_rollbacks=)` (the `spike=` run keyword) and the
loop's watch over each call's losses.

A step's loss spikes when it is not finite (or the guard found a gradient that is not), or
when it exceeds the mean of the `window` finite losses before it by more than `rtol` times
that mean. The loop then drains the call in flight and raises `SpikeRollback`, naming the
call's batches by epoch and index in the source's epoch; the handle rolls the run back to
its newest snapshot before the call, records the batches in `skipped_batches` (the loop's
streams leave them out from then on, in the run's checkpoints too) and trains on. Past
`max_rollbacks` roll-backs in a run, it stops with a `nitro.SpikeError` naming them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import numpy as np

from nitro.errors import SetupError

__all__ = ["Spike", "SpikeRollback", "SpikeWatch", "check_spike"]


@dataclasses.dataclass(frozen=True)
class Spike:
    """Roll a run back over a loss spike (the `spike=` run keyword).

    Args:
      rtol: a finite loss spikes when it exceeds the mean of the `window` losses before it
        by more than `rtol` times that mean (1.0: twice the mean). Non-finite losses (and
        gradients, under `check_divergence=True`) always spike.
      window: the finite losses the mean is taken over; a finite spike is judged only once
        that many are seen since the run started, resumed or rolled back.
      max_rollbacks: the roll-backs a run may take; the next spike stops it with a
        `nitro.SpikeError` naming the batches left out.

    >>> Spike(rtol=0.5, window=10)
    Spike(rtol=0.5, window=10, max_rollbacks=3)
    """

    rtol: float = 1.0
    window: int = 20
    max_rollbacks: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.rtol, bool) or not isinstance(self.rtol, (int, float)):
            raise SetupError(f"Spike(rtol={self.rtol!r}): rtol must be a number > 0")
        if not (math.isfinite(self.rtol) and self.rtol > 0):
            raise SetupError(
                f"Spike(rtol={self.rtol!r}): rtol must be a finite number > 0 (1.0: a loss "
                f"twice the recent mean spikes)"
            )
        for name, least in (("window", 1), ("max_rollbacks", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise SetupError(f"Spike({name}={value!r}): {name} must be an int >= {least}")


def check_spike(value: Any) -> Spike | None:
    """The `spike=` run keyword: a `Spike`, True (the default `Spike()`), or False / None."""
    if value is None or value is False:
        return None
    if value is True:
        return Spike()
    if isinstance(value, Spike):
        return value
    raise ValueError(
        f"spike must be a nitro.Spike(rtol=, window=, max_rollbacks=), True (nitro.Spike()) or "
        f"None; got {value!r}"
    )


class SpikeRollback(Exception):
    """A call's loss spiked: the loop stopped there (the call in flight drained, nothing of
    the spiking call counted). `first`: the steps before the call; `step`, `loss`: the
    spiking step and its loss; `why`: what made it a spike; `epoch` (counted from 0) and
    `batches`: the call's batches, as indices in the source's epoch."""

    def __init__(
        self, *, first: int, step: int, loss: float, why: str, epoch: int, batches: list[int]
    ):
        super().__init__(f"step {step}: {why}")
        self.first, self.step, self.loss, self.why = first, step, loss, why
        self.epoch, self.batches = epoch, batches


class SpikeWatch:
    """The recent finite losses of a run (step, loss), and the spike test of a call's."""

    def __init__(self, policy: Spike):
        self.policy = policy
        self.recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=policy.window)

    def first_spike(self, first: int, reports: np.ndarray) -> tuple[int, str] | None:
        """The offset in the call of its first spiking step and why it spikes, or None (then
        its losses join the window). `first`: the steps before the call; `reports`: its
        steps' (loss, guard code) rows."""
        policy = self.policy
        window = list(self.recent)
        for offset, (loss, code) in enumerate(reports.tolist()):
            if code or not math.isfinite(loss):
                why = "a non-finite loss" if not math.isfinite(loss) else "a non-finite step"
                return offset, f"{why} ({loss})"
            if len(window) >= policy.window:
                mean = sum(value for _, value in window) / len(window)
                if loss - mean > policy.rtol * abs(mean):
                    return offset, (
                        f"loss {loss:.6g} over the mean {mean:.6g} of the {len(window)} steps "
                        f"before it by more than rtol={policy.rtol:g} times it"
                    )
            window.append((first + offset + 1, loss))
            del window[: -policy.window]
        self.recent.clear()
        self.recent.extend(window)
        return None

    def forget_after(self, step: int) -> None:
        """Drop the losses of steps after `step` (a roll-back, a rewind)."""
        kept = [(s, v) for s, v in self.recent if s <= step]
        self.recent.clear()
        self.recent.extend(kept)
