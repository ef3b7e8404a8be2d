"""One path for what a run reports: progress, phases, epoch rows and notes; phase monitors.

The loop and the handle emit events through an `Events` object; it delivers each to every
reporter, isolated: a reporter that raises is switched off for the rest of the run with one
warning naming it, and training goes on. Events also remembers the current phase, which is
what `Nitro.phase` reads.

A reporter implements any of the methods of `Reporter` (missing ones are skipped):

```python
class Printer:
    def end_epoch(self, row):
        print(row["epoch"], row.get("loss"))

nitro.Nitro(exp, progress=Printer())
```
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

__all__ = [
    "EVENT_NAMES",
    "PHASES",
    "Events",
    "PhaseChange",
    "Reporter",
    "current",
    "on_phase",
    "remove_monitor",
    "using",
]

# The phases a handle goes through, from "setup" (before its setup starts) on. "compiling
# <program>" names the program kind ("compiling train step"); "evaluating <split>" the split.
# predict and export leave the phase as it is.
PHASES = (
    "setup",
    "building data",
    "building model",
    "routing",
    "ready",
    "compiling <program>",
    "training",
    "validating",
    "checkpointing",
    "evaluating <split>",
    "done",
    "stopped",
    "failed",
)


@dataclasses.dataclass(frozen=True)
class PhaseChange:
    """What a phase monitor receives on each transition."""

    phase: str
    previous: str
    step: int | None
    epoch: int | None
    metrics: Mapping[str, Any] | None  # the epoch's history row, on the first change after it
    handle: Any  # the Nitro handle; None while it is being built (setup phases)


_MONITORS: list[Callable[[PhaseChange], Any]] = []


def on_phase(fn: Callable[[PhaseChange], Any]) -> Callable[[PhaseChange], Any]:
    """Call `fn(change)` on every phase transition of every handle (also a decorator).
    `Nitro.on_phase(fn)` watches one handle. A monitor that raises is warned about once and
    switched off; the run goes on."""
    if fn not in _MONITORS:
        _MONITORS.append(fn)
    return fn


def remove_monitor(fn: Callable[[PhaseChange], Any]) -> None:
    if fn in _MONITORS:
        _MONITORS.remove(fn)


class Reporter(Protocol):
    """What a run reports, in order: `start_run`, then per epoch `start_epoch`, `step` for
            each read-back step (a reporter may take a call's steps at once instead, with
    `steps(first, losses)`) and `end_epoch` with the epoch's history row; `phase` on every phase
            change; `validated` for an evaluation within an epoch; `swapped` when a live edit's code
        is swapped in (or rolled back); `rewound` when the run goes back to an earlier step (a
        rewind, a spike's roll-back); `note` for short messages (compiles, advice); `end_run` when
        the run ends. A population (`nitro.Population`) reports `start_run`, `start_epoch`, `phase`,
    `note` and `end_run` as a run does, and its members' steps and rows with `member_steps` and
    `member_rows`."""

    def start_run(self, handle: Any, target_epoch: int) -> None: ...
    def start_epoch(
        self, epoch: int, target_epoch: int, batches: int | None, start: int
    ) -> None: ...
    def step(self, step: int, loss: float) -> None: ...
    def phase(self, phase: str) -> None: ...
    def end_epoch(self, row: Mapping[str, Any]) -> None: ...
    def validated(self, row: Mapping[str, Any]) -> None: ...
    def swapped(self, row: Mapping[str, Any]) -> None: ...
    def rewound(self, row: Mapping[str, Any]) -> None: ...
    def note(self, message: str, done: bool = False) -> None: ...
    def end_run(self, handle: Any) -> None: ...
    def member_steps(self, first: int, losses: Any) -> None: ...
    def member_rows(self, rows: Sequence[Mapping[str, Any]]) -> None: ...
    def member_validated(self, rows: Sequence[Mapping[str, Any]]) -> None: ...
    def val_samples(self, samples: Any) -> None: ...


EVENT_NAMES = (
    "start_run",
    "start_epoch",
    "step",
    "phase",
    "end_epoch",
    "validated",
    "swapped",
    "rewound",
    "note",
    "end_run",
    "member_steps",
    "member_rows",
    "member_validated",
    "val_samples",
)


class Events:
    """Delivers events to reporters, each call isolated."""

    def __init__(
        self,
        reporters: Iterable[Any] = (),
        phase: str = "setup",
        context: Callable[[], tuple[Any, int | None, int | None]] | None = None,
    ):
        self._reporters: list[Any] = []
        self._disabled: set[int] = set()
        self._phase = phase
        self._context = context  # () -> (handle, step, epoch), for phase monitors
        self._monitors: list[Callable[[PhaseChange], Any]] = []
        self._metrics: Mapping[str, Any] | None = None
        self._bound: dict[str, tuple] = {}
        for reporter in reporters:
            self.add(reporter)
        self._rebind()

    @property
    def reporters(self) -> tuple[Any, ...]:
        return tuple(self._reporters)

    @property
    def current_phase(self) -> str:
        return self._phase

    def add(self, reporter: Any) -> None:
        if reporter is not None and reporter not in self._reporters:
            self._reporters.append(reporter)
            self._rebind()

    def remove(self, reporter: Any) -> None:
        if reporter in self._reporters:
            self._reporters.remove(reporter)
            self._rebind()

    def reset(self) -> None:
        """Switch every reporter back on (a new run)."""
        self._disabled.clear()
        self._rebind()

    def _rebind(self) -> None:
        live = [r for r in self._reporters if id(r) not in self._disabled]
        self._bound = {
            name: tuple((r, getattr(r, name)) for r in live if callable(getattr(r, name, None)))
            for name in EVENT_NAMES
        }
        # a reporter with `steps(first, losses)` takes a call's steps at once; others, `step`
        self._bound_steps = tuple(
            (r, getattr(r, "steps", None) if callable(getattr(r, "steps", None)) else None)
            for r, _ in self._bound["step"]
        )

    def _deliver(self, name: str, *args: Any) -> None:
        for reporter, method in self._bound[name]:
            try:
                method(*args)
            except Exception as error:  # noqa: BLE001 - a display must never break a run
                self._disable(reporter, name, error)

    def _disable(self, reporter: Any, name: str, error: Exception) -> None:
        if id(reporter) in self._disabled:
            return
        self._disabled.add(id(reporter))
        self._rebind()
        warnings.warn(
            f"progress reporter {type(reporter).__qualname__} raised "
            f"{type(error).__name__} in {name}(): {error}; it is switched off for the rest of "
            f"this run, which goes on",
            RuntimeWarning,
            stacklevel=3,
        )

    # events ------------------------------------------------------------------------------

    def start_run(self, handle: Any, target_epoch: int) -> None:
        self.reset()
        self._deliver("start_run", handle, target_epoch)

    def start_epoch(self, epoch: int, target_epoch: int, batches: int | None, start: int) -> None:
        self._deliver("start_epoch", epoch, target_epoch, batches, start)

    def step(self, step: int, loss: float) -> None:
        for reporter, method in self._bound["step"]:
            try:
                method(step, loss)
            except Exception as error:  # noqa: BLE001
                self._disable(reporter, "step", error)

    def steps(self, first: int, losses: Sequence[float]) -> None:
        """The steps `first`, `first + 1`, ... read back together (a fused call): the `step`
        event of each, or one `steps(first, losses)` call to a reporter that has it."""
        for reporter, batched in self._bound_steps:
            try:
                if batched is not None:
                    batched(first, losses)
                else:
                    method = reporter.step
                    for offset, loss in enumerate(losses):
                        method(first + offset, loss)
            except Exception as error:  # noqa: BLE001
                self._disable(reporter, "step", error)

    def phase(self, phase: str) -> None:
        previous, self._phase = self._phase, phase
        self._deliver("phase", phase)
        if phase != previous and (self._monitors or _MONITORS):
            self._notify(phase, previous)

    def add_monitor(self, fn: Callable[[PhaseChange], Any]) -> None:
        if fn not in self._monitors:
            self._monitors.append(fn)

    def _notify(self, phase: str, previous: str) -> None:
        handle, step, epoch = self._context() if self._context else (None, None, None)
        metrics, self._metrics = self._metrics, None
        change = PhaseChange(phase, previous, step, epoch, metrics, handle)
        for monitor in [*_MONITORS, *self._monitors]:
            try:
                monitor(change)
            except Exception as error:  # noqa: BLE001 - a monitor must never break a run
                # switched off by removing it (a module-level one from every handle)
                if monitor in self._monitors:
                    self._monitors.remove(monitor)
                remove_monitor(monitor)
                warnings.warn(
                    f"phase monitor {getattr(monitor, '__qualname__', monitor)!s} raised "
                    f"{type(error).__name__} on {previous!r} -> {phase!r}: {error}; it is "
                    f"switched off, and the run goes on",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def end_epoch(self, row: Mapping[str, Any]) -> None:
        self._metrics = row  # the next phase change carries it to monitors
        self._deliver("end_epoch", row)

    def validated(self, row: Mapping[str, Any]) -> None:
        """An evaluation within an epoch (`val_every_steps=`): its step, the epoch under way
        and the eval splits' metrics."""
        self._deliver("validated", row)

    def swapped(self, row: Mapping[str, Any]) -> None:
        """A live edit swapped in (or rolled back) at `row["step"]`: what changed, the code's
        digest, what compiled (`nitro.engine.live_edit.swap_row`)."""
        self._deliver("swapped", row)

    def rewound(self, row: Mapping[str, Any]) -> None:
        """The run went back from step `row["from_step"]` to `row["step"]` (`row["reason"]`:
        "rewind" or "spike"); the steps between are an abandoned branch
        (`TrainState.rewinds`)."""
        self._deliver("rewound", row)

    def note(self, message: str, done: bool = False) -> None:
        self._deliver("note", message, done)

    def end_run(self, handle: Any) -> None:
        self._deliver("end_run", handle)

    def member_steps(self, first: int, losses: Any) -> None:
        """A population's steps `first`, `first + 1`, ... (counted from 1, as `steps`) read
        back together: `losses` is a float array [members, steps], NaN where a member had
        stopped."""
        self._deliver("member_steps", first, losses)

    def member_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """A population's epoch ended: one history row per member, each with its `member`
        index and settings (`Population.history()` rows)."""
        self._metrics = {"members": list(rows)}
        self._deliver("member_rows", rows)

    def member_validated(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """A population evaluated within an epoch (`val_every_steps`): one row per member
        that trains, each with its `member` index, `step`, `epoch` and metrics (its
        `validations()` row)."""
        self._deliver("member_validated", rows)

    def wants(self, name: str) -> bool:
        """Whether a reporter takes event `name` (what costs to gather is gathered only then)."""
        return bool(self._bound[name])

    def val_samples(self, samples: Any) -> None:
        """A validation's first call (`nitro.engine.sample_rows.ValSamples`: its split and
        `rows()`, read during the call), for reporters that draw samples; a run's alone."""
        self._deliver("val_samples", samples)


_LOCAL = threading.local()


class using:
    """Context manager: make `events` the current thread's destination for `progress.note`."""

    def __init__(self, events: Events):
        self.events = events

    def __enter__(self) -> Events:
        self.previous = getattr(_LOCAL, "events", None)
        _LOCAL.events = self.events
        return self.events

    def __exit__(self, *exc: Any) -> None:
        _LOCAL.events = self.previous


def current() -> Events | None:
    """The events of the run on this thread, if any."""
    return getattr(_LOCAL, "events", None)
