"""Progress reporters: what a run shows while it works.

The reporters here implement the protocol of `nitro.events.Reporter`: a tqdm bar on a
terminal, one line per epoch elsewhere, and silence with `progress=False`. Notebook
integrations install their own reporter factory with `set_default_factory`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from nitro.core import events as _events
from nitro.core.events import EVENT_NAMES, Reporter
from nitro.core.train_state import TIMING_COLUMNS

__all__ = [
    "LineReporter",
    "Reporter",
    "SilentReporter",
    "TqdmReporter",
    "make_reporter",
    "note",
    "set_default_factory",
]


def format_row(row: dict[str, Any], max_epochs: int | None = None) -> str:
    """`epoch 3/30  loss 0.2051  val_loss 0.1874  val_acc 0.9611  (0.41 s)`: the epoch's
    scalar results; the data-wait fraction only when it is worth a look."""
    epoch = f"epoch {row.get('epoch')}" + (f"/{max_epochs}" if max_epochs else "")
    parts = [epoch]
    for key, value in row.items():
        if key in {"epoch", "step"} or key in TIMING_COLUMNS:
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
    """Every event ignored: a base class for reporters that handle a few of them."""

    def start_run(self, handle, target_epoch):
        pass

    def start_epoch(self, epoch, target_epoch, batches, start):
        pass

    def step(self, step, loss):
        pass

    def phase(self, phase):
        pass

    def end_epoch(self, row):
        pass

    def validated(self, row):
        pass

    def swapped(self, row):
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

    def start_run(self, handle, target_epoch):
        self.max_epochs = target_epoch

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

    def start_epoch(self, epoch, target_epoch, batches, start):
        from tqdm import tqdm

        self.close()
        self.bar = tqdm(
            total=batches,
            initial=start,
            desc=f"epoch {epoch + 1}/{target_epoch}",
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


def _default_factory() -> Any:
    stream = sys.stderr
    if hasattr(stream, "isatty") and stream.isatty():
        return TqdmReporter()
    return LineReporter()


_FACTORY: list[Callable[[], Any]] = [_default_factory]


def set_default_factory(factory: Callable[[], Any] | None) -> None:
    """Install the factory that builds a reporter for each run (`None` restores the default)."""
    _FACTORY[0] = factory or _default_factory


def make_reporter(setting: Any) -> Any:
    """`True` -> the default reporter, `False`/`None` -> None (silent), `"lines"`/`"bar"`, or
    an object implementing any of the `nitro.events.Reporter` methods."""
    if setting is True:
        return _FACTORY[0]()
    if setting is False or setting is None:
        return None
    if setting == "lines":
        return LineReporter()
    if setting == "bar":
        return TqdmReporter()
    if not isinstance(setting, (str, bool, int, float)) and any(
        callable(getattr(setting, m, None)) for m in EVENT_NAMES
    ):
        return setting
    raise ValueError(
        f"progress={setting!r} is not a progress setting: use True, False, 'lines', 'bar' or a "
        f"reporter, an object with any of the methods {', '.join(EVENT_NAMES)} "
        f"(see nitro.events.Reporter)"
    )


def note(message: str, done: bool = False) -> None:
    """A short progress note ("compiling train step ..."), shown by the current run's
    reporters, or on stderr outside a run."""
    events = _events.current()
    if events is not None:
        events.note(message, done)
    else:
        _NOTE_FALLBACK[0].note(message, done)


_NOTE_FALLBACK: list[Any] = [LineReporter()]
