"""Steps per dispatch: how many training steps one program call runs.

On small models a step is dominated by dispatch: Python and the runtime take longer to
launch the program than the program computes. Nitro owns the loop, so it can run K steps in
one compiled program (`lax.scan` over K stacked batches). `steps_per_dispatch=K` fixes K;
`"auto"` (the default) decides by measuring:

1. The first steps run one at a time and are timed (`PROBE_STEPS`, after the first, which
   compiles). The fast end of their times (the second fastest: a neighbour only slows
   steps) gives a step's time `s`, and from it the candidate K: the target (enough steps
   for `TARGET_SECONDS` of work per call, at least `MIN_STEPS`) and the largest the rules
   allow (at most `MAX_STEPS`, what keeps a stop waiting no longer than `MAX_CALL_SECONDS`
   for a call to end at `HEADROOM` times a single step's pace (a fused step is often faster
   than one alone, and a larger size is dropped once a smaller one's fused step reads too
   slow for it: in one pair where a call would take over twice the limit, else in the
   faster of two), and what lets a pair of fused calls fit in an epoch), with a geometric
   middle one where the largest is over `SPREAD` times the target; each a
   divisor of the epoch where one is near, else the epoch split evenly into calls. The probe may cost `PROBE_SHARE` of the work
   left in the run (each candidate's compile, reckoned at `COMPILE_RATIO` times the single
   step's, and its first call): a run too short for one keeps one step per call for now, a
   longer run of the same handle decides again; one too short for every candidate times
   fewer (the target first, then the largest).
2. Then every candidate is timed against one step per call, side by side: each round runs,
   for each candidate in turn (the order rotating from round to round), a pair of its fused
   calls followed by single steps, so a busy neighbour slows both sides of a round alike. A
   call's interval holds its neighbours' bookkeeping and staging, so fused calls are timed
   in pairs, and each run of single steps less its two ends (those belong to the fused calls
   beside it). A candidate's ratio in a round is its pair's time a step over the mean of
   the round's single steps (a mean, as a pair's is: a busy neighbour delays a few short
   single steps and every long fused call a little, and a median would drop the first).
   After `ROUNDS` rounds where every candidate's ratios agree on a side of 1 by `AGREE`
   (`MIN_ROUNDS` where every round agrees: each candidate on one side of 1, by `CLEAR` for
   a single one, and the same candidate fastest; `MAX_ROUNDS` at most), the candidates whose
   median ratio is at most `KEEP_BELOW` pay; of those, the one of the fastest median fused
   step is kept (those long calls are steadier than the short single steps the ratios
   divide by), or the largest within `TIE` of it (rounds on a shared machine scatter by about
   that much, and more steps a call share more of the bookkeeping the pairs leave out). Where
   none pays, one step per call. A size whose calls measure over `MAX_CALL_SECONDS` is
   dropped. A population's call trains all N members, so its limit is N times a run's
   (`for_members`): its members' calls trained one after another would keep a stop as long.
   "auto" never keeps a K that measured slower than one step
   per call: XLA's CPU backend, for one, runs convolutions inside a loop body several times
   slower than alone, and some long steps run faster in a loop.

A round's pieces need not share an epoch: the pairs are packed into what is left of each
epoch, and a call with none in flight before it (an epoch's first) is timed from its own
dispatch, so a pair of calls of K fits an epoch of 2K batches. The reason in the binding
report gives the figures of every candidate. A stop takes effect at the next dispatch
boundary, so it waits at most K steps.

A candidate's first call (it compiles) runs on a copy of the variables and is thrown away,
its steps trained one at a time (`nitro.engine.stepwise`); the two are compared bit for bit
(`checked`). One that differs ends the measurement at one step per call, so the steps the
measurement trains are always those of the path it keeps, and a run's result never depends
on the machine's load. What the timed calls lose against single steps counts to the probe's
cost; once it passes `PROBE_SHARE`, the rounds timed so far decide. A decided choice is kept
for the process by its single-step program (`recall`): a later handle of the same program
takes it instead of measuring again.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "HEADROOM",
    "KEEP_BELOW",
    "MAX_CALL_SECONDS",
    "MAX_CANDIDATES",
    "MAX_STEPS",
    "MIN_STEPS",
    "COMPILE_RATIO",
    "PROBE_SHARE",
    "PROBE_STEPS",
    "ROUNDS",
    "SINGLES",
    "TARGET_SECONDS",
    "TIE",
    "DispatchChoice",
    "DispatchPlan",
]

TARGET_SECONDS = 0.004  # of work per program call: the smallest candidate K
MAX_STEPS = 64
MIN_STEPS = 4  # the smallest target K "auto" times against one step per call
MAX_CALL_SECONDS = 0.5  # the longest a fused call may keep a stop waiting
# sizes are tried up to this many times the stop limit at a single step's pace: a fused step
# is often faster than one alone (and a size is dropped once a smaller one's pairs read too slow)
HEADROOM = 1.5
PROBE_STEPS = 8  # single steps timed, after the first (which compiles)
# the most the probe may cost, as a share of the work left in the run it measures: the compile
# of each fused size timed, its first call (run on a copy and thrown away) and the time its
# timed calls lose against single steps
PROBE_SHARE = 0.05
COMPILE_RATIO = 2.0  # a fused program's compile over the single step's (1.0 s to 0.47 s, measured)
MAX_CANDIDATES = 3  # fused sizes timed at most (each one compiles a program)
SPREAD = 4  # a largest K over this many times the target adds a middle candidate
SINGLES = 8  # single steps timed beside a candidate's pair (fewer when K is smaller)
ROUNDS = 5  # timing rounds, each single steps and every candidate's pair side by side
MIN_ROUNDS = 3  # enough rounds when they all agree (one candidate: past `CLEAR`)
CLEAR = 0.25  # a ratio this far from 1 in every round settles it early
AGREE = 0.75  # after ROUNDS, the share of rounds on one side that settles it
MAX_ROUNDS = 11  # the most rounds timed: their medians decide
KEEP_BELOW = 0.97  # a fused step must take at most this share of a single step's time
TIE = 0.05  # paying sizes whose median fused step is this close to the fastest count as tied


@dataclasses.dataclass(frozen=True)
class DispatchChoice:
    """Steps per program call as decided so far, as a value: the `steps_per_dispatch`
    setting, K (None while "auto" has not measured), why, and whether fused sizes are still
    being timed against one step per call (`candidates`). `n.dispatch` is the current one;
    passed as `steps_per_dispatch=` (or through `weights=n`) a later handle continues it
    instead of measuring again."""

    setting: int | str  # what steps_per_dispatch said: K or "auto"
    steps: int | None = None
    reason: str = ""
    checking: bool = False  # "auto" is timing `candidates` against one step per call
    single_seconds: float | None = None  # a step alone, as the first steps measured
    candidates: tuple[int, ...] = ()  # the fused sizes timed (`steps` is the smallest)

    @classmethod
    def of(cls, setting: int | str) -> DispatchChoice:
        """The choice a `steps_per_dispatch` setting starts from."""
        if isinstance(setting, int):
            return cls(setting, setting, "set by steps_per_dispatch")
        return cls(setting)

    @property
    def probing(self) -> bool:
        return self.steps is None

    @property
    def timed(self) -> tuple[int, ...]:
        """The fused sizes being (or last) timed against one step per call."""
        return self.candidates or ((self.steps,) if self.steps and self.steps > 1 else ())

    def describe(self) -> str:
        if self.steps is None and self.reason:
            return f"auto, 1 so far ({self.reason})"
        if self.steps is None:
            return (
                f"auto (the first {PROBE_STEPS + 1} steps run one at a time and are timed; "
                f"then up to {MAX_CANDIDATES} sizes of fused calls, from about "
                f"{TARGET_SECONDS * 1e3:.0f} ms of work each to the most the limits allow, are "
                f"timed against one step per call, side by side, and the fastest is kept)"
            )
        if self.checking:
            sizes = ", ".join(map(str, self.timed))
            return f"auto, timing {sizes} steps per call against 1 ({self.reason})"
        return f"{self.steps} ({self.reason})"

    def __repr__(self) -> str:
        return f"DispatchChoice({self.describe()})"


# Choices measured in this process, by the single-step program they were measured on (its
# compile cache key, and the epoch's length): a later handle of the same program takes its
# choice instead of timing again. The program's identity is kept beside it, so a choice is
# forgotten with the compile cache (`nitro.cache_reset()`).
_CHOICES: dict[tuple, tuple[int, DispatchChoice]] = {}
_CHOICES_LOCK = threading.Lock()


def _program_key(program: Any) -> tuple:
    """The compile cache's key of a program, less its owner's handle: what makes two programs
    the same one."""
    return (
        str(program.kind),
        program.owner,
        program.code.digest,
        tuple(sorted(program.static.items())),
        program.signature,
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _near_divisor(steps: int, batches: int | None) -> int:
    """`steps`, or the largest divisor of the epoch's `batches` down to half of it (no
    remainder of single steps), else the epoch split evenly into as many calls as `steps`
    makes (fewer single steps left over than calls: 157 batches at up to 64 a call are 3
    calls of 52 and 1 step, not 2 of 64 and 29 single steps)."""
    if not batches or steps <= 1 or steps >= batches or not batches % steps:
        return steps
    near = [d for d in range(max(2, steps // 2), steps + 1) if not batches % d]
    return max(near) if near else batches // -(-batches // steps)


def _singles_after(steps: int) -> int:
    """Single steps timed after a pair of fused calls of `steps` (two more run, untimed)."""
    return min(SINGLES, steps)


def _rotated(candidates: Sequence[int], round_index: int) -> list[int]:
    """The order a round times the candidates in: rotating from round to round."""
    shift = round_index % len(candidates)
    return [*candidates[shift:], *candidates[:shift]]


def _round_calls(candidates: Sequence[int], round_index: int) -> list[int]:
    """A whole round's call sizes: each candidate's pair, then single steps."""
    calls: list[int] = []
    for k in _rotated(candidates, round_index):
        calls += [k, k] + [1] * (_singles_after(k) + 2)
    return calls


class DispatchPlan:
    """The measurement behind "auto": timed steps, then a `DispatchChoice` that holds for
    every later run of the handle. Part of the handle's run-time record; it starts from the
    setting, or from an earlier handle's choice.

    `agree(values)`: in a run of several processes, the values process 0 measured (every
    process must run the same programs); None in a single process. Every other step of the
    measurement (which calls are timed, when a round ends) follows from the call sizes
    alone, which all processes share."""

    def __init__(
        self,
        start: DispatchChoice,
        agree: Callable[[Sequence[float]], Sequence[float]] | None = None,
    ):
        self.choice = start
        self.agree = agree
        # the longest a call may keep a stop waiting: a population's call trains every member,
        # so it may last as long as one call of each member's run would (`for_members`)
        self.call_seconds = MAX_CALL_SECONDS
        self._last: float | None = None
        self._intervals: list[float] = []  # single steps timed by the probe
        self._seen: set[int] = set()  # fused sizes run once (their first call compiles)
        # the round under way: the single steps in a row so far, the first fused call of a
        # pair waiting for its second, the round's single steps (each run less its two
        # ends) and its candidates' fused seconds a step
        self._run: list[float] = []
        self._first: tuple[int, float] | None = None
        self._singles: list[float] = []
        self._pairs: dict[int, float] = {}
        self._rounds: list[tuple[float, dict[int, float]]] = []  # (single, {K: fused})
        self._waiting = False  # this run was too short to decide: the next one measures
        self._dropped = ""  # the sizes no longer timed, and why
        self._key: tuple | None = None  # the memo's key (`recall`)
        self._program = 0  # the identity of the single-step program measured on
        self._compile = 0.0  # a fused program's compile, reckoned from the single step's
        self._checked: set[int] = set()  # fused sizes whose first call was compared
        self._differs = False  # one differed: a fused call still in a stream runs stepwise
        self._budget = math.inf  # what the probe may cost (`PROBE_SHARE` of the run)
        self._spent = 0.0  # and what it cost so far

    def for_members(self, count: int) -> None:
        """The plan of a population of `count` members: a call trains all of them, and keeps a
        stop waiting at most `count` times a run's limit (what the members' calls would take
        trained one after another)."""
        self.call_seconds = MAX_CALL_SECONDS * max(1, count)

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
        choice = self.choice
        final = choice.steps is not None and not choice.checking and choice.setting == "auto"
        if final and self._key is not None and self.agree is None:
            with _CHOICES_LOCK:
                _CHOICES[self._key] = (self._program, choice)

    def recall(self, program: Any, batches: int | None) -> bool:
        """The single-step program the run calls, told while probing: a choice measured on
        the same program by an earlier handle of this process is taken as it is (True when
        that changes the call sizes), else the program's compile time is what a fused size's
        compile is reckoned at. (In a run of several processes every handle measures.)"""
        if self._key is not None or not self.probing:
            return False
        self._key = (_program_key(program), batches)
        self._program = id(program)
        self._compile = COMPILE_RATIO * float(program.compile_seconds or 0.0)
        if self.agree is not None:
            return False
        with _CHOICES_LOCK:
            found = _CHOICES.get(self._key)
        if found is None or found[0] != self._program:
            return False
        before = self.layout(batches)
        self._waiting = False
        self.choice = dataclasses.replace(
            found[1],
            reason=f"{found[1].reason}; reused: measured by an earlier handle of the same "
            f"train program in this process, nothing timed again",
        )
        return self.layout(batches) != before

    def unchecked(self, steps: int) -> bool:
        """Whether a call of `steps` is the first of a fused size being timed: the loop runs it
        on a copy of the variables and trains its steps one at a time (`checked`)."""
        return self.checking and steps in self.choice.timed and steps not in self._checked

    def calls(self, steps: int, batches: int | None) -> bool:
        """Whether the run calls the train program of `steps` steps per call (1: the single
        step) from here, in epochs of `batches`: what a live edit compiles beside the run
        (a program it did not foresee, a stop's single steps say, compiles when first
        called)."""
        if self.checking:
            return steps == 1 or steps in self.choice.timed
        if self.probing:
            return steps == 1
        block = self.block(batches)
        remainder = bool(batches) and batches % block != 0
        return steps == block or (steps == 1 and remainder)

    def one_at_a_time(self) -> bool:
        """Whether fused calls (those a stream that cannot change its call sizes still holds)
        run one step at a time: a fused size computed otherwise than single steps."""
        return self._differs

    def checked(
        self, steps: int, identical: bool, seconds: float, call: float | None = None
    ) -> bool:
        """The first call of fused size `steps` ran on a copy of the variables, its steps one
        at a time on the run's, and `identical` says whether both came out bit for bit alike
        (`seconds`: its compile and the copy's call, what the check cost; `call`: the copy's
        call alone). Where they differ the run keeps one step per call (True: the call sizes
        change): a run's result never depends on what a timing chose. A size whose rounds
        would cost more than the probe has left, at the copy's pace, is not timed."""
        self._checked.add(steps)
        if self.agree is not None:
            (agreed,) = self.agree([1.0 if identical else 0.0])
            identical = agreed > 0.5
        self._spent += seconds
        if identical:
            single = self.choice.single_seconds
            if self.agree is not None or call is None or not single:
                return self._over_budget()
            lost = MIN_ROUNDS * max(0.0, 2 * call - 2 * steps * single)
            if self._spent + lost <= self._budget:
                return self._over_budget()
            kept = tuple(k for k in self.choice.timed if k != steps)
            why = (
                f"a call of {steps} took {_ms(call)} ({call / (steps * single):.2f}x as long "
                f"as its steps alone) and timing it would cost over {PROBE_SHARE:.0%} of the "
                f"run's work"
            )
            if not kept:
                self._decided(steps=1, checking=False, reason=f"auto: one step per call, as {why}")
                return True
            self._pairs.pop(steps, None)
            self._dropped += f"; {steps} dropped, as {why}"
            self._decided(candidates=kept, steps=kept[0], reason=f"{self.reason}; {steps} dropped")
            self._round_done()  # the round under way may have every other size's pair
            return True
        return self._one_step_per_call(
            f"a fused call of {steps} steps did not compute bit for bit as {steps} single "
            f"steps (XLA compiles a loop's body otherwise here), and a run's result must not "
            f"depend on what a timing chose (steps_per_dispatch={steps} fuses anyway)"
        )

    def too_large(self, steps: int, size: int) -> bool:
        """The variables (`size` bytes) are too large to copy for the check of a fused size's
        first call: the run keeps one step per call (True), as it does where a check fails."""
        return self._one_step_per_call(
            f"the variables ({size / 2**30:.1f} GiB) are too large to check a fused call of "
            f"{steps} on a copy against single steps, and a run's result must not depend on "
            f"what a timing chose (steps_per_dispatch={steps} fuses unchecked)"
        )

    def _one_step_per_call(self, why: str) -> bool:
        """Fused calls are given up for this run: one step per call, timing ended (True: the
        call sizes change)."""
        self._differs = True
        self._rounds, self._singles, self._pairs, self._run, self._first = [], [], {}, [], None
        self._decided(steps=1, checking=False, reason=f"auto: one step per call, as {why}")
        return True

    def _over_budget(self) -> bool:
        """While timing: once the probe cost more than its share of the run (`PROBE_SHARE`),
        decide on the rounds timed so far; True when that decided. (In a run of several
        processes, whose costs differ, only the sizes chosen up front bound it.)"""
        if not self.checking or self.agree is not None or self._spent <= self._budget:
            return False
        return self._conclude(force=True)

    def block(self, batches: int | None) -> int:
        """Steps per call in an epoch of `batches` once decided (1 while measuring)."""
        if self.measuring:
            return 1
        steps = self.steps or 1
        return max(1, min(steps, batches)) if batches else steps

    def layout(self, batches: int | None) -> tuple[str, Any]:
        """What a stream of steps is opened with, as a comparable value."""
        if self.checking:
            return ("timing", self.choice.timed)
        return ("steps", self.block(batches))

    def blocks(self, batches: int | None, start: int = 0) -> int | Iterable[int]:
        """Steps per call, call after call, for a stream opened now at step `start` of an
        epoch of `batches`: K (1 while probing), or, while timing, the first call of each
        candidate not run yet (it compiles), then the rounds' pairs of fused calls, each
        followed by single steps, packed into what is left of the epoch."""
        kind, _ = self.layout(batches)
        if kind == "steps":
            return self.block(batches)
        candidates = self.choice.timed
        if not candidates:  # nothing to time (a choice made by hand): single steps
            return 1
        left = None if batches is None else max(0, batches - start)
        calls: list[int] = []
        # what the round under way has: its open run of single steps counts less its ends
        pairs, singles = set(self._pairs), len(self._singles) + max(0, len(self._run) - 2)
        need, index, seen = sum(map(_singles_after, candidates)), len(self._rounds), set(self._seen)
        while left is None or left > 0:
            missing = [k for k in _rotated(candidates, index) if k not in pairs]
            if not missing and singles >= need:
                if left is None:  # an epoch of unknown length: whole rounds from here on
                    after = itertools.cycle(_round_calls(candidates, index + 1))
                    return itertools.chain(calls, after)
                index, pairs, singles = index + 1, set(), 0
                continue
            # a size's first call compiles (untimed): it goes right before its first pair
            size = {k: (2 if k in seen else 3) * k for k in missing}
            fits = [k for k in missing if left is None or size[k] <= left]
            compiles = [k for k in missing if k not in seen and left is not None and k <= left]
            if fits:
                k = fits[0]
                pairs.add(k)
                seen.add(k)
                calls += [k] * (size[k] // k)
                left = None if left is None else left - size[k]
                count = _singles_after(k) + 2
            elif compiles:  # its pair fits in no epoch's end with it: compiled alone
                seen.add(compiles[0])
                calls.append(compiles[0])
                left = None if left is None else left - compiles[0]
                continue
            elif missing:  # no pair fits in the epoch's end: single steps, for the round's
                count = left or 0
            else:  # every pair timed: the single steps the round still lacks
                count = need - singles + 2
            if left is not None:
                count = min(count, left)
                left -= count
            calls += [1] * count
            singles += max(0, count - 2)
        return calls + [1]  # (the last size repeats: the epoch ends here)

    def start_stream(self) -> None:
        """A new stream of steps begins (an epoch, after validation): the time until its
        first call completes is not a call's, unless `began()` is told of its dispatch."""
        self._last = None
        self._break()

    def began(self) -> None:
        """A call was dispatched with none in flight (a stream's first): while timing, its
        interval starts now. A later call's starts at the completion before it, which also
        comes right after its own dispatch: the two hold the same work (the next call's
        staging and dispatch, then its own wait and bookkeeping)."""
        if self.checking and self._last is None:
            self._last = time.perf_counter()

    def _break(self) -> None:
        """A break in the calls (a stream's end, an untimed call): the run of single steps
        ends, and a pair's first call waits in vain."""
        self._close_run()
        self._first = None

    def _close_run(self) -> None:
        """A run of single steps ended: the round keeps it less its two ends (the first holds
        the bookkeeping of the call before it, the last the staging of the call after)."""
        if len(self._run) >= 3:
            self._singles += self._run[1:-1]
        self._run = []

    def completed(
        self, count: int, batches: int | None, remaining: Callable[[], int | None]
    ) -> bool:
        """A call of `count` steps completed while measuring. True when the stream's call
        sizes change from here (the sizes to time, or the decision made)."""
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
        compiled = count > 1 and count not in self._seen
        if count > 1:
            self._seen.add(count)
        if interval is None or compiled or (count > 1 and count not in self.choice.timed):
            self._break()
            return False
        if count == 1:
            self._first = None  # after a lone fused call (a pair cut short): not timed
            self._run.append(interval)
            return self._round_done()
        self._close_run()
        if self._first is None or self._first[0] != count:
            self._first = (count, interval)  # timed once the second of the pair follows
            return False
        pair = self._first[1] + interval
        self._pairs[count] = pair / (2 * count)
        self._first = None
        # what the pair lost against single steps counts to the probe's cost
        self._spent += max(0.0, pair - 2 * count * (self.choice.single_seconds or 0.0))
        return self._too_long(count) or self._round_done() or self._over_budget()

    def _too_long(self, steps: int) -> bool:
        """Drop the larger sizes a call of which would keep a stop waiting over
        `MAX_CALL_SECONDS` at the fused step's time measured (a step in a loop can take many
        times as long as alone); True when that changed the sizes timed. One pair decides
        only where it reads over twice that (a neighbour, or a checkpoint write, slows one
        pair, not several); else the faster of two pairs does."""
        larger = [k for k in self.choice.timed if k > steps]
        if not larger:
            return False
        timed = [pairs[steps] for _, pairs in self._rounds if steps in pairs]
        timed.append(self._pairs[steps])
        seconds = min(timed)
        if self.agree is not None:
            (seconds,) = self.agree([seconds])
        limit = self.call_seconds if len(timed) > 1 else 2 * self.call_seconds
        dropped = [k for k in larger if k * seconds > limit]
        if not dropped:
            return False
        kept = tuple(k for k in self.choice.timed if k not in dropped)
        for _, pairs in self._rounds:
            for k in dropped:
                pairs.pop(k, None)
        for k in dropped:
            self._pairs.pop(k, None)
        note = (
            f"; {', '.join(map(str, dropped))} dropped, as a fused step of {steps} took "
            f"{_ms(seconds)}{f' (the faster of {len(timed)} pairs)' if len(timed) > 1 else ''} "
            f"and a call of them would keep a stop waiting over {self.call_seconds:g} s"
        )
        self._dropped += note
        self._decided(candidates=kept, steps=kept[0], reason=self.reason + note)
        self._round_done()
        return True

    def _round_done(self) -> bool:
        """Close the round under way once it has every candidate's pair and enough single
        steps (its open run less its last, which the next fused call's staging may hold);
        True when that decided."""
        candidates = self.choice.timed
        if any(k not in self._pairs for k in candidates):
            return False
        need = sum(map(_singles_after, candidates))
        if len(self._singles) + max(0, len(self._run) - 2) < need:
            return False
        self._singles += self._run[1:-1]
        self._run = self._run[-1:]
        # their mean, as the pairs': a busy neighbour delays a few short single steps and
        # every long fused call a little; a median would drop the first and keep the second
        self._rounds.append((statistics.fmean(self._singles), dict(self._pairs)))
        self._singles, self._pairs = [], {}
        return self._conclude()

    def _decide(self, batches: int | None, remaining: int | None) -> None:
        """From the probe's fast end: the candidate K to time against one step per call (or
        one step per call where no K > 1 is allowed, or the run is too short to tell)."""
        # the fast end of the timed steps (the second fastest): a busy neighbour only ever
        # slows steps, and a K picked from slowed steps would be too small just when fusing
        # gains most
        seconds = sorted(self._intervals)[min(1, len(self._intervals) - 1)]
        compile_seconds = self._compile
        if self.agree is not None:
            seconds, compile_seconds = self.agree([seconds, compile_seconds])
        self._intervals = []
        wanted = max(MIN_STEPS, math.ceil(TARGET_SECONDS / seconds) if seconds > 0 else 1)
        caps = {MAX_STEPS: f"K is at most {MAX_STEPS}"}
        held = int(HEADROOM * self.call_seconds / seconds) if seconds > 0 else MAX_STEPS
        caps.setdefault(
            held,
            f"a call of more steps would keep a stop waiting over {self.call_seconds:g} s unless "
            f"a fused step took under {1 / HEADROOM:.2g} of a step alone",
        )
        if batches:
            caps.setdefault(
                batches // 2, f"a pair of fused calls must fit in the epoch of {batches} batches"
            )
        cap = min(caps)
        if cap < 2:
            self._decided(
                steps=1,
                single_seconds=seconds,
                reason=f"auto: a step took {_ms(seconds)}; one step per call ({caps[cap]})",
            )
            return
        target = _near_divisor(min(wanted, cap), batches)
        largest = _near_divisor(cap, batches)
        ranked = [target, largest]  # the order they are given up in, last first
        if largest > SPREAD * target:
            ranked.append(_near_divisor(round(math.sqrt(target * largest)), batches))
        ranked = list(dict.fromkeys(ranked))[:MAX_CANDIDATES]
        # each size costs its compile (reckoned from the single step's) and its first call,
        # run on a copy; together within `PROBE_SHARE` of the work left (a run to no end, a
        # stream, pays for every one)
        affordable, self._budget = len(ranked), math.inf
        if remaining is not None and math.isfinite(PROBE_SHARE):
            self._budget = PROBE_SHARE * remaining * seconds
            costs = itertools.accumulate(compile_seconds + k * seconds for k in ranked)
            affordable = sum(cost <= self._budget for cost in costs)
        share = f"{PROBE_SHARE:.0%} of"
        if affordable < 1:
            # not worth a fused program's compile for this run; a longer run decides again
            self._waiting = True
            self._decided(
                reason=f"undecided: a step took {_ms(seconds)}, and timing a fused size (its "
                f"compile about {compile_seconds:.2f} s) would cost over {share} the "
                f"{remaining} steps left to max_epochs"
            )
            return
        candidates = tuple(sorted(ranked[:affordable]))
        why = f"a step took {_ms(seconds)}; K up to {cap} ({caps[cap]})"
        if affordable < len(ranked):
            why += (
                f"; {affordable} of {len(ranked)} sizes timed, as more would cost over "
                f"{share} the {remaining} steps left"
            )
        self._decided(
            steps=candidates[0],
            checking=True,
            single_seconds=seconds,
            candidates=candidates,
            reason=f"auto: {why}",
        )

    def _conclude(self, force: bool = False) -> bool:
        """Decide once enough rounds were timed (`force`: on those timed so far, the probe's
        share of the run spent); True when decided."""
        candidates = self.choice.timed
        n = len(self._rounds)
        if force and not n:
            self._rounds, self._singles, self._pairs, self._run = [], [], {}, []
            self._decided(
                steps=1,
                checking=False,
                reason=f"auto: one step per call, as timing fused calls of "
                f"{', '.join(map(str, candidates))} cost over {PROBE_SHARE:.0%} of the run's "
                f"work before a round was complete",
            )
            return True
        ratios = {k: [pairs[k] / single for single, pairs in self._rounds] for k in candidates}
        # enough rounds: most rounds on one side for every candidate, a few that all agree
        # by far for a single one, or the most there may be; processes decide at the same
        # call, so they time every round
        agreed = all(
            max(sum(r < 1 for r in rs), sum(r >= 1 for r in rs)) >= AGREE * n
            for rs in ratios.values()
        )
        clear = all(
            all(r < 1 - CLEAR for r in rs) or all(r > 1 + CLEAR for r in rs)
            for rs in ratios.values()
        )
        # several candidates, each faster (or slower) than one step per call in every round,
        # and in every round the same one fastest: nothing more rounds would change
        fastest = {min(candidates, key=lambda k, p=pairs: p[k]) for _, pairs in self._rounds}
        unanimous = len(fastest) == 1 and all(
            all(r < 1 for r in rs) or all(r >= 1 for r in rs) for rs in ratios.values()
        )
        if self.agree is not None:
            if n < MAX_ROUNDS:
                return False
        elif not force and not (
            ((clear if len(candidates) == 1 else unanimous) and n >= MIN_ROUNDS)
            or (agreed and n >= ROUNDS)
            or n >= MAX_ROUNDS
        ):
            return False
        medians = [statistics.median(ratios[k]) for k in candidates]
        fused = [statistics.median(pairs[k] for _, pairs in self._rounds) for k in candidates]
        single = statistics.median(s for s, _ in self._rounds)
        if self.agree is not None:
            agreed_values = self.agree([single, *medians, *fused])
            single = agreed_values[0]
            medians = list(agreed_values[1 : 1 + len(candidates)])
            fused = list(agreed_values[1 + len(candidates) :])
        self._rounds = []
        # whether fusing pays: each size's ratio to the single steps of its rounds; which size:
        # their own fused times, each round's pairs side by side (long calls both, steadier
        # than the round's short single steps). A larger size within `TIE` of the fastest is
        # as fast as rounds can tell, and makes fewer calls: it is kept
        paying = [i for i in range(len(candidates)) if medians[i] <= KEEP_BELOW]
        best = min(range(len(candidates)), key=lambda i: (medians[i], candidates[i]))
        tie = ""
        if paying:
            best = min(paying, key=lambda i: (fused[i], candidates[i]))
            kept = max(
                (i for i in paying if fused[i] <= fused[best] * (1 + TIE)),
                key=lambda i: candidates[i],
            )
            if kept != best:
                tie = (
                    f"; within {TIE:.0%} of {candidates[best]} steps per call, the fastest "
                    f"timed, and the largest so"
                )
                best = kept
        steps, ratio = candidates[best], medians[best]
        figures = ", ".join(
            [f"1: {single * 1e3:.3f}"]
            + [f"{k}: {f * 1e3:.3f}" for k, f in zip(candidates, fused, strict=True)]
        )
        stopped = f"; timing stopped at {PROBE_SHARE:.0%} of the run's work" if force else ""
        figures = (
            f"ms a step: {figures}; medians of {n} rounds side by side{stopped}{self._dropped}{tie}"
        )
        if ratio <= KEEP_BELOW:
            reason = f"auto: {steps} steps per call ran {1 / ratio:.2f}x as fast ({figures})"
            self._decided(steps=steps, reason=reason, checking=False)
        else:
            reason = (
                f"auto: one step per call, as a step in fused calls of {steps} took "
                f"{ratio:.2f}x as long as one alone, the least of the sizes timed ({figures})"
            )
            self._decided(steps=1, reason=reason, checking=False)
        return True
