"""Progress reporting: what a run shows while it works.

A reporter receives a handful of events from the loop (run start, epoch start, each read-back
step, epoch end with the history row, notes such as compiles, run end). The default is a tqdm
bar on a terminal and one line per epoch elsewhere; `progress=False` silences a run, and
notebook integrations install their own reporter factory with `set_default_factory`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

__all__ = [
    "LineReporter",
    "Reporter",
    "SilentReporter",
    "TqdmReporter",
    "make_reporter",
    "note",
    "set_default_factory",
    "using",
]


class Reporter(Protocol):
    def start_run(self, handle: Any, epochs: int) -> None: ...
    def start_epoch(self, epoch: int, max_epochs: int, batches: int, start: int) -> None: ...
    def step(self, step: int, loss: float) -> None: ...
    def phase(self, phase: str) -> None: ...
    def end_epoch(self, row: Mapping[str, Any]) -> None: ...
    def note(self, message: str, done: bool = False) -> None: ...
    def end_run(self, handle: Any) -> None: ...


def format_row(row: Mapping[str, Any], max_epochs: int | None = None) -> str:
    """`epoch 3/30  loss 0.2051  val_loss 0.1874  val_acc 0.9611  (0.41 s)`: the epoch's
    scalar results; the data-wait fraction only when it is worth a look."""
    epoch = f"epoch {row.get('epoch')}" + (f"/{max_epochs}" if max_epochs else "")
    parts = [epoch]
    for key, value in row.items():
        if key in {"epoch", "step", "epoch_seconds", "data_wait_frac"}:
            continue
        if isinstance(value, float):
            parts.append(f"{key} {value:.4g}")
        elif isinstance(value, int):
            parts.append(f"{key} {value}")
    wait = row.get("data_wait_frac")
    if isinstance(wait, float) and wait > 0.25:
        parts.append(f"data_wait_frac {wait:.2f}")
    seconds = row.get("epoch_seconds")
    if isinstance(seconds, float):
        parts.append(f"({seconds:.2f} s)")
    return "  ".join(parts)


class SilentReporter:
    def start_run(self, handle, epochs):
        pass

    def start_epoch(self, epoch, max_epochs, batches, start):
        pass

    def step(self, step, loss):
        pass

    def phase(self, phase):
        pass

    def end_epoch(self, row):
        pass

    def note(self, message, done=False):
        pass

    def end_run(self, handle):
        pass


class LineReporter(SilentReporter):
    """One line per epoch and per note: readable in logs, CI and captured output."""

    def __init__(self, stream=None):
        self.stream = stream
        self.max_epochs = None

    def start_run(self, handle, epochs):
        self.max_epochs = epochs

    def _write(self, text: str, end: str = "\n") -> None:
        stream = self.stream or sys.stderr
        stream.write(text + end)
        stream.flush()

    def end_epoch(self, row):
        self._write(format_row(row, self.max_epochs))

    def note(self, message, done=False):
        self._write(f"nitro: {message}")


class TqdmReporter(LineReporter):
    """A tqdm bar per epoch with the running loss; epoch summaries print above it."""

    def __init__(self, stream=None, min_interval: float = 0.1):
        super().__init__(stream)
        self.bar = None
        self.min_interval = min_interval
        self._last = 0.0

    def start_epoch(self, epoch, max_epochs, batches, start):
        from tqdm import tqdm

        self.close()
        self.bar = tqdm(
            total=batches,
            initial=start,
            desc=f"epoch {epoch + 1}/{max_epochs}",
            unit="step",
            file=self.stream or sys.stderr,
            leave=False,
            dynamic_ncols=True,
        )
        self._done = start

    def step(self, step, loss):
        if self.bar is None:
            return
        self._done += 1
        now = time.monotonic()
        if now - self._last >= self.min_interval:
            self._last = now
            self.bar.n = self._done
            self.bar.set_postfix_str(f"loss {loss:.4g}", refresh=True)

    def end_epoch(self, row):
        self.close()
        super().end_epoch(row)

    def note(self, message, done=False):
        if self.bar is not None:
            self.bar.write(f"nitro: {message}", file=self.stream or sys.stderr)
        else:
            super().note(message, done)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def end_run(self, handle):
        self.close()


def _default_factory() -> Reporter:
    stream = sys.stderr
    if hasattr(stream, "isatty") and stream.isatty():
        return TqdmReporter()
    return LineReporter()


_FACTORY: list[Callable[[], Reporter]] = [_default_factory]
_LOCAL = threading.local()


def set_default_factory(factory: Callable[[], Reporter] | None) -> None:
    """Install the factory that builds a reporter for each run (`None` restores the default)."""
    _FACTORY[0] = factory or _default_factory


def make_reporter(setting: Any) -> Reporter:
    """`True` -> the default reporter, `False`/`None` -> silent, `"lines"`/`"bar"`, or a reporter."""
    if setting is True:
        return _FACTORY[0]()
    if setting is False or setting is None:
        return SilentReporter()
    if setting == "lines":
        return LineReporter()
    if setting == "bar":
        return TqdmReporter()
    if all(hasattr(setting, m) for m in ("start_epoch", "step", "end_epoch", "note")):
        return setting
    raise ValueError(
        f"progress={setting!r} is not a progress setting: use True, False, 'lines', 'bar' "
        f"or an object with start_epoch/step/end_epoch/note methods"
    )


class using:
    """Context manager: make `reporter` the current thread's reporter."""

    def __init__(self, reporter: Reporter):
        self.reporter = reporter

    def __enter__(self):
        self.previous = getattr(_LOCAL, "reporter", None)
        _LOCAL.reporter = self.reporter
        return self.reporter

    def __exit__(self, *exc):
        _LOCAL.reporter = self.previous


def current() -> Reporter | None:
    return getattr(_LOCAL, "reporter", None)


def note(message: str, done: bool = False) -> None:
    """A short progress note ("compiling train step ..."), shown by the current reporter."""
    reporter = current()
    if reporter is None:
        reporter = _NOTE_FALLBACK[0]
    reporter.note(message, done)


_NOTE_FALLBACK: list[Reporter] = [LineReporter()]
