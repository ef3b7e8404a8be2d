"""Running work on a worker thread, so an interrupt never lands inside a donated step.

The caller waits on an Event (never `Thread.join`, which misbehaves under interrupts on
Python 3.11). Ctrl-C, or a notebook's interrupt, raises KeyboardInterrupt in the waiting
thread; it becomes a stop request: the current step finishes, its loss is read back, its batch
is freed, and the call returns with the handle intact.

`RunGuard` says what a handle is doing. Work that needs the handle's state claims it; a second
claim while the first holds answers at once with a `RunningError` that says how to stop or
wait, instead of blocking. `RunControl` is what the loop polls between steps: the stop
request, and requests for a copy of the weights at the next step boundary.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .errors import RunningError

__all__ = [
    "Run",
    "RunControl",
    "RunGuard",
    "add_worker_initializer",
    "remove_worker_initializer",
    "wait_interruptibly",
]

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


class RunControl:
    """What the loop checks between steps: a stop request, and weight-copy requests.

    `request_copy(fn)` asks the loop to call `fn()` at its next step boundary, on its own
    thread, before the next step donates the state; when no loop is running it is served by
    whoever ends the run (`serve_copies`).
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.copies_pending = False  # read once per step by the loop: a plain attribute
        self._copies: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._lock = threading.Lock()

    def request_copy(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._copies.append((fn, future))
            self.copies_pending = True
        return future

    def serve_copies(self) -> None:
        with self._lock:
            copies, self._copies = self._copies, []
            self.copies_pending = False
        for fn, future in copies:
            try:
                future.set_result(fn())
            except BaseException as error:  # noqa: BLE001 - handed to the requester
                future.set_exception(error)


class RunGuard:
    """What the handle is doing now ("training", "validating", ...), or None when idle.

    `hold(activity)` claims the handle for work on the calling thread; `claim`/`release`
    span work handed to a worker thread. A claim while another holds raises `RunningError`
    at once, naming what runs and how to stop or wait for it.
    """

    def __init__(self, describe: Callable[[], str] = lambda: "this handle") -> None:
        self._lock = threading.Lock()
        self._describe = describe
        self.activity: str | None = None
        self.background = False

    def claim(self, activity: str, background: bool = False) -> None:
        with self._lock:
            if self.activity is not None:
                raise RunningError(self.busy_message(activity))
            self.activity, self.background = activity, background

    def release(self) -> None:
        with self._lock:
            self.activity, self.background = None, False

    @contextmanager
    def hold(self, activity: str) -> Iterator[None]:
        self.claim(activity)
        try:
            yield
        finally:
            self.release()

    def busy_message(self, wanted: str) -> str:
        where = " in the background" if self.background else ""
        return (
            f"cannot {wanted}: {self._describe()} is {self.activity}{where}. n.stop() stops it "
            f"after the current step and n.wait() waits for it to end (in a notebook: %nitro "
            f"stop or %nitro wait)"
        )


def wait_interruptibly(run: Run, request_stop: Callable[[], None], what: str = "training") -> None:
    """Wait for `run`; turn Ctrl-C into `request_stop()`. A third Ctrl-C gives up waiting (the
    run still stops cleanly in the background)."""
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
                    print(
                        f"nitro: interrupted; stopping {what} after the current step ...",
                        file=sys.stderr,
                        flush=True,
                    )
                elif interrupts == 2:
                    print(
                        "nitro: still stopping (the current step or compile is finishing); "
                        "interrupt again to stop waiting",
                        file=sys.stderr,
                        flush=True,
                    )
            except KeyboardInterrupt:
                interrupts += 1
            if interrupts >= 3:
                raise KeyboardInterrupt(
                    f"stopped waiting; {what} finishes its stop in the background"
                ) from None
