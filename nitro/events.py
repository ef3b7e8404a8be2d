"""One path for what a run reports: progress, phases, epoch rows and notes.

The loop and the handle emit events through an `Events` object; it delivers each to every
reporter, isolated: a reporter that raises is switched off for the rest of the run with one
warning naming it, and training goes on. Events also remembers the current phase, which is
what `Nitro.phase` reads.

A reporter implements any of the seven methods of `Reporter` (missing ones are skipped):

```python
class Printer:
    def end_epoch(self, row):
        print(row["epoch"], row.get("loss"))

nitro.Nitro(exp, progress=Printer())
```
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

__all__ = ["EVENT_NAMES", "Events", "Reporter", "current", "using"]


class Reporter(Protocol):
    """What a run reports, in order: `start_run`, then per epoch `start_epoch`, `step` for
    each read-back step and `end_epoch` with the epoch's history row; `phase` on every phase
    change; `note` for short messages (compiles, advice); `end_run` when the run ends."""

    def start_run(self, handle: Any, target_epoch: int) -> None: ...
    def start_epoch(
        self, epoch: int, target_epoch: int, batches: int | None, start: int
    ) -> None: ...
    def step(self, step: int, loss: float) -> None: ...
    def phase(self, phase: str) -> None: ...
    def end_epoch(self, row: Mapping[str, Any]) -> None: ...
    def note(self, message: str, done: bool = False) -> None: ...
    def end_run(self, handle: Any) -> None: ...


EVENT_NAMES = ("start_run", "start_epoch", "step", "phase", "end_epoch", "note", "end_run")


class Events:
    """Delivers events to reporters, each call isolated."""

    def __init__(self, reporters: Iterable[Any] = (), phase: str = "setup"):
        self._reporters: list[Any] = []
        self._disabled: set[int] = set()
        self._phase = phase
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
            f"{type(error).__name__}: {error} in {name}(); it is switched off for the rest of "
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

    def phase(self, phase: str) -> None:
        self._phase = phase
        self._deliver("phase", phase)

    def end_epoch(self, row: Mapping[str, Any]) -> None:
        self._deliver("end_epoch", row)

    def note(self, message: str, done: bool = False) -> None:
        self._deliver("note", message, done)

    def end_run(self, handle: Any) -> None:
        self._deliver("end_run", handle)


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
