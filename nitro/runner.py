"""Running work on a worker thread, so an interrupt never lands inside a donated step.

The caller waits on an Event (never `Thread.join`, which misbehaves under interrupts on
Python 3.11). Ctrl-C, or a notebook's interrupt, raises KeyboardInterrupt in the waiting
thread; it becomes a stop request: the current step finishes, its loss is read back, its batch
is freed, and the call returns with the handle intact.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Run", "add_worker_initializer", "wait_interruptibly"]

# Each initializer runs on the starting thread with the run's handle and returns a callable
# run first on the worker (notebook integrations route the worker's output this way).
_INITIALIZERS: list[Callable[[Any], Callable[[], None] | None]] = []


def add_worker_initializer(initializer: Callable[[Any], Callable[[], None] | None]) -> None:
    if initializer not in _INITIALIZERS:
        _INITIALIZERS.append(initializer)


def remove_worker_initializer(initializer) -> None:
    if initializer in _INITIALIZERS:
        _INITIALIZERS.remove(initializer)


class Run:
    """One piece of work on a worker thread; `done` is set when it ends, `error` holds what it
    raised."""

    def __init__(self, target: Callable[[], None], name: str, context: Any = None):
        self.target = target
        self.done = threading.Event()
        self.error: BaseException | None = None
        worker_setup = [init(context) for init in list(_INITIALIZERS)]
        self.thread = threading.Thread(
            target=self._main, args=(worker_setup,), name=name, daemon=True
        )

    def _main(self, worker_setup) -> None:
        try:
            for setup in worker_setup:
                if setup is not None:
                    setup()
            self.target()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            self.error = error
        finally:
            self.done.set()

    def start(self) -> Run:
        self.thread.start()
        return self

    @property
    def running(self) -> bool:
        return not self.done.is_set()


def _note_to_stderr(message: str) -> None:
    print(f"nitro: {message}", file=sys.stderr, flush=True)


def wait_interruptibly(
    run: Run,
    request_stop: Callable[[], None],
    what: str = "training",
    note: Callable[[str], None] | None = None,
) -> None:
    """Wait for `run`; turn Ctrl-C into `request_stop()`. A third Ctrl-C gives up waiting (the
    run still stops cleanly in the background). `note` shows what happens (a reporter's
    `note`, so a notebook shows it as progress, not as an error); stderr by default."""
    note = note or _note_to_stderr
    interrupts = 0
    while True:
        try:
            while not run.done.wait(0.1):
                pass
            return
        except KeyboardInterrupt:
            interrupts += 1
            request_stop()
            try:
                if interrupts == 1:
                    note(f"interrupted; stopping {what} after the current step ...")
                elif interrupts == 2:
                    note(
                        "still stopping (the current step or compile is finishing); "
                        "interrupt again to stop waiting"
                    )
            except KeyboardInterrupt:
                interrupts += 1
            if interrupts >= 3:
                raise KeyboardInterrupt(
                    f"stopped waiting; {what} finishes its stop in the background"
                ) from None
