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

__all__ = ["MAX_STEPS", "PROBE_STEPS", "TARGET_SECONDS", "DispatchPlan"]

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


@dataclasses.dataclass
class DispatchPlan:
    """The `steps_per_dispatch` setting and, for "auto", what the measurement decided.
    Lives in the `RunSetup` (like the step feed, a mutable part of it): a decision holds for
    every later run of the handle."""

    setting: int | str
    steps: int | None = None  # K; None while "auto" has not measured yet
    reason: str = ""
    checking: bool = False  # "auto" decided K > 1 and is timing the first fused calls
    _single: float | None = dataclasses.field(default=None, repr=False)
    _last: float | None = dataclasses.field(default=None, repr=False)
    _intervals: list[float] = dataclasses.field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.setting, int):
            self.steps = self.setting
            self.reason = "set by steps_per_dispatch"

    @property
    def probing(self) -> bool:
        return self.steps is None

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

    def inherit(self, previous: DispatchPlan) -> None:
        """Continue what `previous` (a plan of an earlier handle of the same experiment)
        measured: its K and reason, and a check of the fused calls still under way."""
        if previous.probing:
            return
        self.setting, self.steps, self.reason = previous.setting, previous.steps, previous.reason
        self.checking, self._single = previous.checking, previous._single
        self._intervals, self._last = [], None

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
        fused = intervals[len(intervals) // 2] / self.steps
        single = self._single or 0.0
        self._intervals, self.checking = [], False
        if fused <= single * CHECK_TOLERANCE:
            self.reason += f"; confirmed: {fused * 1e3:.3f} ms per step fused"
            return self.steps
        self.reason = (
            f"auto: a step took {single * 1e3:.3f} ms alone and {fused * 1e3:.3f} ms inside a "
            f"fused call of {self.steps} (this backend runs the step slower in a loop); one "
            f"step per call"
        )
        self.steps = 1
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
            self.reason = (
                f"undecided: a step took {seconds * 1e3:.3f} ms, and the {remaining} steps "
                f"left to max_epochs were too little work to pay for compiling a fused program"
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
        self.steps, self.reason = steps, f"auto: {why}"
        self._intervals, self._single, self.checking = [], seconds, steps > 1
        return steps

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
