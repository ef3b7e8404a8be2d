"""Steps per dispatch: how many training steps one program call runs.

On small models a step is dominated by dispatch: Python and the runtime take longer to
launch the program than the program computes. Nitro owns the loop, so it can run K steps in
one compiled program (`lax.scan` over K stacked batches). `steps_per_dispatch=K` fixes K;
`"auto"` (the default) decides by measuring:

1. The first steps run one at a time and are timed (`PROBE_STEPS`, after the first, which
   compiles). The fast end of their times (the second fastest: a neighbour only slows
   steps) gives a step's time `s` and the candidate K: enough steps for
   `TARGET_SECONDS` of work per call, at least `MIN_STEPS`, at most `MAX_STEPS`, what keeps a
   stop waiting no longer than `MAX_CALL_SECONDS` for a call to end, and what lets a timing
   round fit in an epoch. A run with less than `WORTH_SECONDS` of work left keeps one step
   per call for now (a fused program would not pay for its compile); a longer run of the
   same handle decides again.
2. Then K steps per call are timed against one step per call, in alternation: each round
   runs two fused calls and `SINGLES` + 2 single steps next to each other (which side goes
   first alternates), so a busy neighbour slows both sides of a round alike; a round's ratio
   is the fused pair's time a step over the median of the round's single steps less the two
   at the ends (a call's interval holds its neighbours' bookkeeping and staging). After
   `ROUNDS` rounds of which `AGREE` agree (`MIN_ROUNDS` when every round agrees by far,
   `MAX_ROUNDS` at most) the middle round decides: K where fused steps were faster (by
   `KEEP_BELOW`), else one step per call. "auto" never keeps a K that measured slower than
   one step per call: XLA's CPU backend, for one, runs convolutions inside a loop body
   several times slower than alone, and some long steps run faster in a loop.

The reason in the binding report gives the figures. A stop takes effect at the next dispatch
boundary, so it waits at most K steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "KEEP_BELOW",
    "MAX_CALL_SECONDS",
    "MAX_STEPS",
    "MIN_STEPS",
    "PROBE_STEPS",
    "ROUNDS",
    "SINGLES",
    "TARGET_SECONDS",
    "DispatchChoice",
    "DispatchPlan",
]

TARGET_SECONDS = 0.004  # of work per program call, for "auto"
MAX_STEPS = 64
MIN_STEPS = 4  # the smallest K "auto" times against one step per call
MAX_CALL_SECONDS = 0.5  # the longest a fused call may keep a stop waiting
PROBE_STEPS = 8  # single steps timed, after the first (which compiles)
WORTH_SECONDS = 2.0  # a run with less work than this left keeps one step per call
SINGLES = 8  # single steps per timing round (fewer when K is smaller)
ROUNDS = 5  # timing rounds, each single steps and one fused call side by side
MIN_ROUNDS = 3  # enough rounds when each one's ratio is past `CLEAR` either way
CLEAR = 0.25  # a ratio this far from 1 in every round settles it early
AGREE = 0.75  # after ROUNDS, the share of rounds on one side that settles it
MAX_ROUNDS = 11  # the most rounds timed: the median of these decides
KEEP_BELOW = 0.97  # a fused step must take at most this share of a single step's time


@dataclasses.dataclass(frozen=True)
class DispatchChoice:
    """Steps per program call as decided so far, as a value: the `steps_per_dispatch`
    setting, K (None while "auto" has not measured), why, and whether K is still being timed
    against one step per call. `n.dispatch` is the current one; passed as
    `steps_per_dispatch=` (or through `weights=n`) a later handle continues it instead of
    measuring again."""

    setting: int | str  # what steps_per_dispatch said: K or "auto"
    steps: int | None = None
    reason: str = ""
    checking: bool = False  # "auto" is timing `steps` per call against one (`steps` not kept yet)
    single_seconds: float | None = None  # a step alone, as the first steps measured

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
                f"then K steps per call, about {TARGET_SECONDS * 1e3:.0f} ms of work each, are "
                f"timed against one step per call, side by side, and the faster is kept)"
            )
        if self.checking:
            return f"auto, timing {self.steps} steps per call against 1 ({self.reason})"
        return f"{self.steps} ({self.reason})"

    def __repr__(self) -> str:
        return f"DispatchChoice({self.describe()})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


class DispatchPlan:
    """The measurement behind "auto": timed steps, then a `DispatchChoice` that holds for
    every later run of the handle. Part of the handle's run-time record; it starts from the
    setting, or from an earlier handle's choice.

    `agree(values)`: in a run of several processes, the values process 0 measured (every
    process must run the same programs); None in a single process."""

    def __init__(
        self,
        start: DispatchChoice,
        agree: Callable[[Sequence[float]], Sequence[float]] | None = None,
    ):
        self.choice = start
        self.agree = agree
        self._last: float | None = None
        self._intervals: list[float] = []  # single steps timed by the probe
        # the round under way: single steps timed, those before a fused pair, the first
        # fused call's interval, a fused step's time waiting for its singles
        self._singles: list[float] = []
        self._before: list[float] | None = None
        self._first: float | None = None
        self._fused: float | None = None
        self._rounds: list[tuple[float, float]] = []  # (fused, single) seconds a step
        self._fused_seen = False  # the first fused call compiles: never timed
        self._waiting = False  # this run was too short to decide: the next one measures

    def start_run(self) -> None:
        """A `train()` call begins: an "undecided" verdict (too little work left) is
        reconsidered, with the new run's work."""
        self._waiting = False

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

    @property
    def measuring(self) -> bool:
        """Whether completed calls are still being timed."""
        return (self.probing and not self._waiting) or self.checking

    def describe(self) -> str:
        return self.choice.describe()

    def _decided(self, **changes: Any) -> None:
        self.choice = dataclasses.replace(self.choice, **changes)

    def _singles_per_round(self) -> int:
        return min(SINGLES, self.steps or 1)

    def block(self, batches: int | None) -> int:
        """Steps per call in an epoch of `batches` once decided (1 while measuring)."""
        if self.measuring:
            return 1
        steps = self.steps or 1
        return max(1, min(steps, batches)) if batches else steps

    def layout(self, batches: int | None) -> tuple[str, int]:
        """What a stream of steps is opened with, as a comparable value."""
        if self.checking:
            return ("timing", self.steps or 1)
        return ("steps", self.block(batches))

    def blocks(self, batches: int | None) -> int | Iterable[int]:
        """Steps per call, call after call, for a stream opened now: K (1 while probing),
        or, while timing K, rounds of single steps and two fused calls."""
        kind, steps = self.layout(batches)
        if kind == "steps":
            return steps
        first = steps if not self._fused_seen else 1  # compile it first, or an untimed call
        # A call's interval (from the completion before it to its own) also holds the
        # bookkeeping of the call before it and the staging of the call after it. So fused
        # calls are timed in pairs, and single steps in a run less its two ends, where those
        # belong to the other side. Rounds alternate which side comes first (an epoch with
        # room for one round: the next epoch's begins the other way).
        singles = [1] * (self._singles_per_round() + 2)
        rounds = [*singles, steps, steps]
        if len(self._rounds) % 2:
            rounds = [steps, steps, *singles]
        return itertools.chain([first], itertools.cycle(rounds))

    def start_stream(self) -> None:
        """A new stream of steps begins (an epoch, after validation): the time until its
        first call completes is not a call's."""
        self._last = None
        self._forget()

    def _forget(self) -> None:
        """Start the round under way again (a break in the calls: untimed, a remainder)."""
        self._singles, self._before, self._first, self._fused = [], None, None, None

    def completed(
        self, count: int, batches: int | None, remaining: Callable[[], int | None]
    ) -> bool:
        """A call of `count` steps completed while measuring. True when the stream's call
        sizes change from here (K to time, or the decision made)."""
        now = time.perf_counter()
        interval = None if self._last is None else now - self._last
        self._last = now
        if self.probing:
            if interval is None or self._waiting:
                return False
            self._intervals.append(interval)
            needed = PROBE_STEPS if not batches else max(1, min(PROBE_STEPS, batches - 2))
            if len(self._intervals) < needed:
                return False
            before = self.layout(batches)
            self._decide(batches, remaining())
            return self.layout(batches) != before
        if not self.checking:
            return False
        steps, wanted = self.steps or 1, self._singles_per_round()
        compiled = count == steps and not self._fused_seen
        self._fused_seen = self._fused_seen or count == steps
        if interval is None or compiled or count not in (1, steps):
            self._forget()
            return False
        if count == steps:
            if self._first is None:  # the first of a pair: timed once the second follows
                self._first = interval
                self._before, self._singles = self._singles, []
                return False
            fused = (self._first + interval) / (2 * steps)
            before, self._first = self._before or [], None
            if len(before) >= wanted + 2:
                self._before = None
                return self._round(fused, before[-wanted - 1 : -1])
            self._fused = fused  # the singles come next
            return False
        if self._first is not None:  # a single after one fused call: not the pattern
            self._forget()
        self._singles.append(interval)
        if self._fused is not None and len(self._singles) >= wanted + 2:
            fused, singles = self._fused, self._singles[1 : wanted + 1]
            self._forget()
            return self._round(fused, singles)
        return False

    def _round(self, fused: float, singles: list[float]) -> bool:
        """A round timed: a fused call's seconds a step, and the single steps beside it
        (their median: one a busy neighbour delayed does not count)."""
        self._rounds.append((fused, statistics.median(singles)))
        return self._conclude()

    def _decide(self, batches: int | None, remaining: int | None) -> None:
        """From the probe's median single step: the K to time against one step per call
        (or one step per call where no K > 1 is allowed, or the run is too short to tell)."""
        # the fast end of the timed steps (the second fastest): a busy neighbour only ever
        # slows steps, and a K picked from slowed steps would be too small just when fusing
        # gains most
        seconds = sorted(self._intervals)[min(1, len(self._intervals) - 1)]
        if self.agree is not None:
            (seconds,) = self.agree([seconds])
        self._intervals = []
        wanted = max(MIN_STEPS, math.ceil(TARGET_SECONDS / seconds) if seconds > 0 else 1)
        caps = {MAX_STEPS: f"K is at most {MAX_STEPS}"}
        held = int(MAX_CALL_SECONDS / seconds) if seconds > 0 else MAX_STEPS
        caps.setdefault(
            held, f"a call of more steps would keep a stop waiting over {MAX_CALL_SECONDS:g} s"
        )
        if batches:
            # a timing round (an untimed call, single steps, two fused calls) fits in an epoch
            room = [k for k in range(1, batches) if 3 + min(SINGLES, k) + 2 * k <= batches]
            fits = max(room or [1])
            caps.setdefault(fits, f"a timing round must fit in the epoch of {batches} batches")
        cap = min(caps)
        steps = max(1, min(wanted, cap))
        if batches and steps > 1 and batches % steps:
            near = [d for d in range(max(2, steps // 2), steps + 1) if not batches % d]
            if near:
                steps = max(near)  # a divisor of the epoch: no remainder
        if steps == 1:
            self._decided(
                steps=1,
                single_seconds=seconds,
                reason=f"auto: a step took {_ms(seconds)}; one step per call ({caps[cap]})",
            )
            return
        if remaining is not None and remaining * seconds < WORTH_SECONDS:
            # not worth a fused program's compile for this run; a longer run decides again
            self._waiting = True
            self._decided(
                reason=f"undecided: a step took {_ms(seconds)}, and the {remaining} steps "
                f"left to max_epochs were too little work to pay for compiling a fused program"
            )
            return
        why = f"a step took {_ms(seconds)}"
        if cap < wanted:
            why += f" ({caps[cap]})"
        self._decided(steps=steps, checking=True, single_seconds=seconds, reason=f"auto: {why}")

    def _conclude(self) -> bool:
        """Decide once enough rounds were timed; True when decided."""
        ratios = [fused / single for fused, single in self._rounds]
        n = len(ratios)
        faster = sum(r < 1 for r in ratios)
        clear = all(r < 1 - CLEAR for r in ratios) or all(r > 1 + CLEAR for r in ratios)
        # enough rounds: a few that all agree by far, or most rounds on one side, or the most
        # there may be; processes decide at the same call, so they time every round
        agreed = max(faster, n - faster) >= AGREE * n
        if self.agree is not None:
            if n < MAX_ROUNDS:
                return False
        elif not ((clear and n >= MIN_ROUNDS) or (agreed and n >= ROUNDS) or n >= MAX_ROUNDS):
            return False
        ratio = statistics.median_low(ratios)  # the middle round's own figures
        fused, single = self._rounds[ratios.index(ratio)]
        if self.agree is not None:
            ratio, fused, single = self.agree([ratio, fused, single])
        self._rounds = []
        steps = self.steps or 1
        figures = (
            f"{_ms(fused)} a step in fused calls of {steps} against {_ms(single)} one at a "
            f"time, in the middle one of {n} rounds side by side"
        )
        if ratio <= KEEP_BELOW:
            reason = f"auto: {steps} steps per call ran {1 / ratio:.2f}x as fast: {figures}"
            self._decided(reason=reason, checking=False)
        else:
            reason = (
                f"auto: one step per call, as a step in a fused call took {ratio:.2f}x as "
                f"long as one alone: {figures}"
            )
            self._decided(steps=1, reason=reason, checking=False)
        return True
