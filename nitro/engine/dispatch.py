"""Steps per dispatch: how many training steps one program call runs.

On small models a step is dominated by dispatch: Python and the runtime take longer to
launch the program than the program computes. Nitro owns the loop, so it can run K steps in
one compiled program (`lax.scan` over K stacked batches). `steps_per_dispatch=K` fixes K;
`"auto"` (the default) runs the first steps one at a time, measures them, and picks K so
that one call does at least `TARGET_SECONDS` of work (K=1 where steps are already long),
capped by the epoch length and `MAX_STEPS`, then times the first fused calls and goes back to
one step per call if fusing did not make a step faster (XLA's CPU backend, for one, runs
convolutions inside a loop body about ten times slower than alone). A stop takes effect at the
next dispatch boundary, so it waits at most K steps.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

__all__ = ["MAX_STEPS", "PROBE_STEPS", "TARGET_SECONDS", "DispatchChoice", "DispatchPlan"]

TARGET_SECONDS = 0.004  # of work per program call, for "auto"
MAX_STEPS = 64
PROBE_STEPS = 8  # single steps timed, after the first (which compiles)
WORTH_SECONDS = 2.0  # a run with less work than this left keeps one step per call
CHECK_CALLS = 5  # fused calls timed to confirm that fusing pays (after two settle)
CHECK_SETTLE = 2
# A fused step may time up to this much slower than a step alone and still be kept: the first
# fused calls run slower than they will (medium MLPs: 1.08x here, then faster than single
# steps), while the case the check exists for is 7-12x slower.
CHECK_TOLERANCE = 1.15


@dataclasses.dataclass(frozen=True)
class DispatchChoice:
    """Steps per program call as decided so far, as a value: the `steps_per_dispatch`
    setting, K (None while "auto" has not measured), why, and whether the first fused calls
    are still being timed. `n.dispatch` is the current one; passed as `steps_per_dispatch=`
    (or through `weights=n`) a later handle continues it instead of measuring again."""

    setting: int | str  # what steps_per_dispatch said: K or "auto"
    steps: int | None = None
    reason: str = ""
    checking: bool = False  # "auto" decided K > 1 and is timing the first fused calls
    single_seconds: float | None = None  # a step alone, as measured (what the check compares)

    @classmethod
    def of(cls, setting: int | str) -> DispatchChoice:
        """The choice a `steps_per_dispatch` setting starts from."""
        if isinstance(setting, int):
            return cls(setting, setting, "set by steps_per_dispatch")
        return cls(setting)

    @property
    def probing(self) -> bool:
        return self.steps is None

    def describe(self) -> str:
        if self.steps is None and self.reason:
            return f"auto, 1 so far ({self.reason})"
        if self.steps is None:
            return (
                f"auto (the first {PROBE_STEPS + 1} steps run one at a time and are timed; "
                f"then K steps per call, about {TARGET_SECONDS * 1e3:.0f} ms of work each)"
            )
        if self.checking:
            return f"{self.steps} ({self.reason}; checking that the fused calls are faster)"
        return f"{self.steps} ({self.reason})"

    def __repr__(self) -> str:
        return f"DispatchChoice({self.describe()})"


class DispatchPlan:
    """The measurement behind "auto": timed steps, then a `DispatchChoice` that holds for
    every later run of the handle. Part of the handle's run-time record; it starts from the
    setting, or from an earlier handle's choice."""

    def __init__(self, start: DispatchChoice):
        self.choice = start
        self._last: float | None = None
        self._intervals: list[float] = []

    @property
    def steps(self) -> int | None:
        return self.choice.steps

    @property
    def reason(self) -> str:
        return self.choice.reason

    @property
    def checking(self) -> bool:
        return self.choice.checking

    @property
    def probing(self) -> bool:
        return self.choice.probing

    def describe(self) -> str:
        return self.choice.describe()

    def _decided(self, **changes: Any) -> None:
        self.choice = dataclasses.replace(self.choice, **changes)

    def block(self, batches: int | None) -> int:
        """Steps per call in an epoch of `batches` (1 while measuring)."""
        steps = self.steps or 1
        return max(1, min(steps, batches)) if batches else steps

    def start_stream(self) -> None:
        """A new stream of steps begins (an epoch, after validation): the time until its
        first step completes is not a step's."""
        self._last = None

    def observe(self, batches: int | None) -> bool:
        """A single step completed; True once enough steps were timed to decide (fewer in
        short epochs: at most all but the first two of one)."""
        now = time.perf_counter()
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last = now
        needed = PROBE_STEPS if not batches else max(1, min(PROBE_STEPS, batches - 2))
        return len(self._intervals) >= needed

    def observe_fused(self, count: int) -> bool:
        """A call of `count` steps completed while checking; True once `CHECK_CALLS` full
        calls were timed (the first `CHECK_SETTLE` intervals, still warming up, are not)."""
        now = time.perf_counter()
        if count != self.steps:  # a remainder: not comparable, and breaks the interval
            self._last = None
            return False
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last = now
        return len(self._intervals) >= CHECK_SETTLE + CHECK_CALLS

    def confirm(self) -> int:
        """Keep K unless a fused call's steps were clearly slower than single steps (by more
        than `CHECK_TOLERANCE`); then go back to 1."""
        intervals = sorted(self._intervals[CHECK_SETTLE:])
        steps = self.steps or 1
        fused = intervals[len(intervals) // 2] / steps
        single = self.choice.single_seconds or 0.0
        self._intervals = []
        if fused <= single * CHECK_TOLERANCE:
            reason = f"{self.reason}; confirmed: {fused * 1e3:.3f} ms per step fused"
            self._decided(reason=reason, checking=False)
            return steps
        reason = (
            f"auto: a step took {single * 1e3:.3f} ms alone and {fused * 1e3:.3f} ms inside a "
            f"fused call of {steps} (this backend runs the step slower in a loop); one "
            f"step per call"
        )
        self._decided(steps=1, reason=reason, checking=False)
        return 1

    def decide(self, batches: int | None, remaining: int | None = None) -> int:
        """Pick K from the timed steps (the median interval between completions): enough
        steps for `TARGET_SECONDS` of work per call, a divisor of the epoch's batches when one
        is near (no remainder), 1 when the `remaining` steps of the run are too little work
        to pay for compiling a fused program."""
        intervals = sorted(self._intervals)
        seconds = intervals[len(intervals) // 2]
        wanted = math.ceil(TARGET_SECONDS / seconds) if seconds > 0 else MAX_STEPS
        cap = min(MAX_STEPS, batches) if batches else MAX_STEPS
        steps = max(1, min(wanted, cap))
        if batches and steps > 1 and batches % steps:
            near = [
                d for d in range(max(2, steps // 2), min(2 * steps, cap) + 1) if not batches % d
            ]
            if near:
                steps = min(near, key=lambda d: (abs(d - steps), -d))
        short = remaining is not None and remaining * seconds < WORTH_SECONDS
        if short and steps > 1:
            # not worth it for this run; a longer run of the same handle decides again
            self._decided(
                reason=f"undecided: a step took {seconds * 1e3:.3f} ms, and the {remaining} "
                f"steps left to max_epochs were too little work to pay for compiling a fused "
                f"program"
            )
            self._intervals = []
            return 1
        if steps == 1:
            why = f"a step took {seconds * 1e3:.2f} ms, already a call's worth of work"
        else:
            why = (
                f"a step took {seconds * 1e3:.3f} ms; {steps} steps make one call about "
                f"{steps * seconds * 1e3:.1f} ms of work"
            )
            if steps == cap and steps < wanted:
                why += f" (capped by {'the epoch length' if cap == batches else MAX_STEPS})"
        self._decided(
            steps=steps, reason=f"auto: {why}", checking=steps > 1, single_seconds=seconds
        )
        self._intervals = []
        return steps
