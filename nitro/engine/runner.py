"""Running work on a worker thread, so an interrupt never lands inside a donated step.

The caller waits on an Event (never `Thread.join`, which misbehaves under interrupts on
Python 3.11). While a call of the handle runs on the main thread, `signals_request_stop`
replaces the SIGINT handler with one that only sets the stop request, so Ctrl-C, or a
notebook's interrupt, can never land between two bytecodes of the engine's bookkeeping: the
current step finishes, its loss is read back, its batch is freed, and the call returns with
the handle intact. A third Ctrl-C while `train()` waits gives up waiting (the run still stops
cleanly in the background).

Preemption (`preemption=`, `preemption_signals`): while `train()` or `wait()` runs on the main
thread of a script, SIGTERM and SIGUSR1 set the stop request the same way; once the run has
stopped and its save is written, the process exits with `PREEMPTED_EXIT_CODE` (75,
`os.EX_TEMPFAIL`: a temporary failure, run it again). Further signals meanwhile only count,
so nothing cuts the save short.

`RunGuard` says what a handle is doing. Work that needs the handle's state claims it; a second
claim while the first holds answers at once with a `RunningError` that says how to stop or
wait, instead of blocking. `RunControl` is what the loop polls between steps: the stop
request, and requests for a copy of the weights at the next step boundary.
"""

from __future__ import annotations

import concurrent.futures
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from nitro.errors import RunningError

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "PREEMPTION_SIGNALS",
    "Run",
    "RunControl",
    "RunGuard",
    "add_worker_initializer",
    "at_step_boundary",
    "remove_worker_initializer",
    "preemption_signals",
    "signals_request_stop",
    "wait_for",
]

# sysexits.h's EX_TEMPFAIL ("a temporary failure; the user is invited to retry"): the run saved
# the step it was on and continues where it stopped when started again. Apart from a crash (1)
# and a kill (137, 143), so a job script requeues on it and on nothing else.
PREEMPTED_EXIT_CODE = 75
# what a scheduler sends before it takes the machine back: Kubernetes, Docker and SLURM's
# preemption send SIGTERM; SLURM's `--signal=USR1@90` warns ahead of the time limit
PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name)
)

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


def _to_stderr(message: str) -> None:
    import sys

    print(f"nitro: {message}", file=sys.stderr, flush=True)


class RunControl:
    """What the loop checks between steps: a stop request, and weight-copy requests.

    `request_copy(fn)` asks the loop to call `fn()` at its next step boundary, on its own
    thread, before the next step donates the state; when no loop is running it is served by
    whoever ends the run (`serve_copies`), or by the requester once the handle is free
    (`at_step_boundary`).
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.interrupts = 0  # Ctrl-C presses while a call of the handle ran on the main thread
        self.acknowledged = 0  # presses already answered with a note
        self.preempted: signal.Signals | None = None  # the first preemption signal received
        self.say: Callable[[str], None] = _to_stderr  # notes for the person at the keyboard
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

    def __init__(
        self, describe: Callable[[], str] = lambda: "this handle", name: str = "n"
    ) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified when a claim ends
        self._describe = describe
        self.name = name  # what the messages call the handle: `n.stop()`, `pop.stop()`
        self.activity: str | None = None
        self.background = False
        # called on the releasing thread after each claim ends (the handle takes a live edit
        # that became ready while it was busy)
        self.on_release: Callable[[], None] | None = None

    def claim(self, activity: str, background: bool = False) -> None:
        with self._lock:
            if self.activity is not None:
                raise RunningError(self.busy_message(activity))
            self.activity, self.background = activity, background

    def release(self) -> None:
        with self._lock:
            self.activity, self.background = None, False
            self._changed.notify_all()
        if self.on_release is not None:
            self.on_release()

    def wait_released(self, done: Callable[[], bool], timeout: float | None = None) -> None:
        """Sleep until no claim holds the handle or `done()` holds (whoever makes it true
        calls `notify()`), or at most `timeout` seconds."""
        with self._lock:
            if self.activity is not None and not done():
                self._changed.wait(timeout)

    def notify(self) -> None:
        """Wake the threads in `wait_released`, to check their `done()`."""
        with self._lock:
            self._changed.notify_all()

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
            f"cannot start {wanted}: {self._describe()} is {self.activity}{where}. "
            f"{self.name}.stop() stops it after the current step and {self.name}.wait() waits "
            f"for it to end (in a notebook: %nitro stop or %nitro wait)"
        )


def at_step_boundary(guard: RunGuard, control: RunControl, fn: Callable[[], Any], what: str):
    """`fn()` when no work holds the handle, or at the next step boundary of a training run
    (on its thread, before the next step donates the state); raises `RunningError` while other
    work holds it. When the run ends before serving the request, `fn` runs here instead."""
    try:
        with guard.hold(what):
            return fn()
    except RunningError:
        if guard.activity != "training":
            raise
    future = control.request_copy(fn)
    future.add_done_callback(lambda _: guard.notify())
    while not future.done():
        try:
            with guard.hold(what):
                control.serve_copies()
        except RunningError:
            # the served request or the run's end wakes this at once; bounded, because a
            # Ctrl-C delivered to another thread (or any, on Windows) never wakes a lock wait
            guard.wait_released(future.done, timeout=0.1)
    return future.result()


def preemption_signals(setting: bool | str) -> tuple[signal.Signals, ...]:
    """The signals `train()` here turns into a save and an exit (`preemption=`): none off the
    main thread (Python runs signal handlers there only); with "auto", none in a process a
    person is typing into (IPython or a notebook's kernel, a REPL, `python -i`), and only
    those the program left at their default (a handler of its own, or an ignored signal,
    stays as it is); with True, each that Python can handle."""
    if setting is False or threading.current_thread() is not threading.main_thread():
        return ()
    if setting != "auto":
        return tuple(s for s in PREEMPTION_SIGNALS if signal.getsignal(s) is not None)
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)()
    if shell is not None or hasattr(sys, "ps1") or sys.flags.interactive:
        return ()
    return tuple(s for s in PREEMPTION_SIGNALS if signal.getsignal(s) is signal.SIG_DFL)


@contextmanager
def signals_request_stop(
    control: RunControl,
    preempt_on: tuple[signal.Signals, ...] = (),
    on_preempted: Callable[[signal.Signals], None] | None = None,
) -> Iterator[None]:
    """While active on the main thread, SIGINT sets `control.stop` (and counts the press)
    instead of raising KeyboardInterrupt wherever the main thread happens to be. The signals
    `preempt_on` (`preemption_signals`) set it too, and record the first in
    `control.preempted`; once the body has run, `on_preempted(signal)` is called, still under
    these handlers (it waits for the run's save and exits). Elsewhere, or where Python does
    not own SIGINT, SIGINT is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum, frame):  # runs between two bytecodes of the main thread: flags only
        control.interrupts += 1
        control.stop.set()

    def preempted(signum, frame):
        if control.preempted is None:
            control.preempted = signal.Signals(signum)
        control.stop.set()

    try:
        wanted = [(signum, preempted) for signum in preempt_on]
        if signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, None):
            wanted.append((signal.SIGINT, interrupted))  # else not Python's to handle now
        previous = [(signum, signal.signal(signum, handler)) for signum, handler in wanted]
    except (ValueError, OSError):  # pragma: no cover - no signals here
        yield
        return
    control.interrupts = control.acknowledged = 0
    control.preempted = None
    try:
        yield
        if control.preempted is not None and on_preempted is not None:
            on_preempted(control.preempted)
    finally:
        for signum, handler in previous:
            signal.signal(signum, handler)


def wait_for(run: Run, control: RunControl, note: Callable[[str], None], what: str) -> None:
    """Wait for `run`. Under `signals_request_stop` Ctrl-C arrives as `control.interrupts`;
    elsewhere as KeyboardInterrupt, turned into the same count. The first press asks the run to
    stop after the current step, the second says it is still stopping, the third stops waiting
    (KeyboardInterrupt; the run finishes its stop in the background). A preemption signal
    is said once; it never stops the waiting."""
    seen, preempted = control.interrupts, control.preempted
    while True:
        try:
            # `done` is set when the run ends and wakes this at once; bounded, because the
            # handler of `signals_request_stop` only counts a press (taking a lock in a signal
            # handler can deadlock), so the count is read here within 50 ms
            finished = run.done.wait(0.05)
        except KeyboardInterrupt:  # not on the main thread's handler: count it ourselves
            control.interrupts += 1
            control.stop.set()
            finished = False
        if control.preempted is not preempted:
            preempted = control.preempted
            note(
                f"{getattr(preempted, 'name', preempted)}: stopping {what} after the current "
                f"step; once it is saved, the process exits with code {PREEMPTED_EXIT_CODE}"
            )
        if control.interrupts != seen:
            seen = control.interrupts
            if seen == 1:
                if not control.acknowledged:  # the loop may have said it already
                    control.acknowledged = 1
                    note(f"interrupted; stopping {what} after the current step ...")
            elif seen == 2:
                note(
                    "still stopping (the current step or compile is finishing); interrupt "
                    "again to stop waiting"
                )
            elif not finished:
                raise KeyboardInterrupt(
                    f"stopped waiting; {what} finishes its stop in the background (n.wait() "
                    f"waits for it)"
                )
        if finished:
            return
