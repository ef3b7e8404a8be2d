"""`Sender`: one daemon thread that runs a network logger's calls in order, off the training
thread, so a tracking server that is slow or down never holds up a step or a stop.

A call that raises marks the sender failed: the calls queued after it are dropped, and the
logger's next verb raises the failure on the caller's thread (where `LoggerGroup` switches the
logger off with one warning). `wait(timeout)` bounds how long a flush, a checkpoint or the end
of a run waits for the calls under way; one that does not return in time fails the sender too.
The thread is a daemon: a call stuck in a server's retries never holds up the interpreter's
exit.

>>> sender = Sender("example")
>>> sender.submit(lambda: 6 * 7).result(timeout=60)
42
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

__all__ = ["Sender"]


class Sender:
    """Runs the submitted calls one at a time, in order, on a daemon thread named `name`."""

    def __init__(self, name: str):
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Future, Callable[[], Any], bool]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._last: Future | None = None
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    def submit(self, call: Callable[[], Any], *, fatal: bool = True) -> Future:
        """Queue `call`; its future holds its result or error. A `fatal` call that raises
        fails the sender; another one only hands its error to whoever reads the future."""
        future: Future = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._last = future
            self._queue.put((future, call, fatal))
        return future

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the calls queued so far; False (and the sender
        failed with a `TimeoutError`) when they are still under way."""
        with self._lock:
            last = self._last
        if last is None or self.failure is not None:
            return self.failure is None
        try:
            last.exception(timeout=timeout)
        except CancelledError:
            return False
        except TimeoutError:
            if self.failure is None:
                self.failure = TimeoutError(f"no answer within {timeout:g} s")
            return False
        return self.failure is None

    def _work(self) -> None:
        while True:
            future, call, fatal = self._queue.get()
            if self.failure is not None and fatal:
                future.cancel()
                future.set_running_or_notify_cancel()
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as error:  # noqa: BLE001 - handed to the logger's caller
                if fatal and self.failure is None:
                    self.failure = error
                future.set_exception(error)
