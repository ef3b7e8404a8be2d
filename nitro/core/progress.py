"""Progress reporters: what a run shows while it works.

The reporters here implement the protocol of `nitro.events.Reporter`: a tqdm bar on a
terminal, one line per epoch elsewhere, and silence with `progress=False`. Notebook
integrations install their own reporter factory with `set_default_factory`.

A population (`nitro.Population`) reports to the same reporters: one line per epoch naming its
best member (by `val_loss`, else `loss`) and how many members still train, and on a terminal a
bar over each epoch's steps with the best member's latest step loss.

What reporters (and the notebook's panel) show: `format_bytes`, `format_flops`, and
`TIMING_COLUMNS`, the history's columns that time an epoch rather than measure the model.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nitro.core import events as _events
from nitro.core.events import EVENT_NAMES, Reporter
from nitro.core.train_state import TIMING_COLUMNS

__all__ = [
    "LineReporter",
    "Reporter",
    "SilentReporter",
    "TIMING_COLUMNS",
    "TqdmReporter",
    "format_bytes",
    "format_flops",
    "make_reporter",
    "member_metrics",
    "note",
    "ranked_members",
    "set_default_factory",
    "settings_label",
]


def format_flops(flops: float | None) -> str:
    """FLOPs as a reader takes them in.

    >>> format_flops(63.3e6)
    '63.3 MFLOP'
    """
    return _scaled(flops, "FLOP", 1000.0)


def format_bytes(size: float | None) -> str:
    """A size in bytes as a reader takes it in.

    >>> format_bytes(1 << 20)
    '1.0 MiB'
    """
    if size is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _scaled(value: float | None, unit: str, base: float) -> str:
    if value is None:
        return "-"
    for prefix in ("", "K", "M", "G", "T", "P"):
        if abs(value) < base or prefix == "P":
            return f"{value:.3g} {prefix}{unit}"
        value /= base
    raise AssertionError("unreachable")


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


# The columns of a population's rows that are not a member's results.
_MEMBER_BOOKKEEPING = {"member", "epoch", "step", "stopped", "nonfinite_steps", *TIMING_COLUMNS}


def settings_label(settings: Mapping[str, Any]) -> str:
    """`learning_rate=0.001 seed=1`: a population member's settings, each value short."""
    return " ".join(f"{k}={_short_value(v)}" for k, v in settings.items())


def _short_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (int, str, bool, type(None))):
        text = str(value)
    else:
        text = getattr(value, "__qualname__", None) or repr(value)
    return text if len(text) <= 30 else text[:27] + "..."


def member_metrics(row: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, float]:
    """A population row's results (loss, metrics), without its member, settings and counters."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in _MEMBER_BOOKKEEPING
        and k not in settings
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
    }


def ranked_members(
    rows: Sequence[Mapping[str, Any]], metric: str | None = None, mode: str | None = None
) -> tuple[str, list[Mapping[str, Any]]]:
    """A population's rows, best first by `metric` (default: `val_loss` when the rows have
    it, else `loss`; `mode` "min" for a metric named like a loss, else "max"), members without
    a finite value last, in member order; returns the metric with them."""
    if metric is None:
        metric = "val_loss" if any("val_loss" in r for r in rows) else "loss"
    mode = mode or ("min" if "loss" in metric else "max")
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    sign = 1.0 if mode == "min" else -1.0

    def key(row: Mapping[str, Any]) -> tuple[int, float, int]:
        value = row.get(metric)
        number = float(value) if isinstance(value, (int, float)) else math.nan
        finite = math.isfinite(number)
        return (0 if finite else 1, sign * number if finite else 0.0, int(row.get("member", 0)))

    return metric, sorted(rows, key=key)


def format_members(
    rows: Sequence[Mapping[str, Any]],
    members: Sequence[Mapping[str, Any]],
    max_epochs: int | None = None,
) -> str:
    """`epoch 2/3  best member 2 (learning_rate=0.01): loss 0.41  val_loss 0.367  val_acc 0.75
    4 of 4 members training  (0.31 s)`: a population's epoch in one line."""
    epoch = rows[0].get("epoch") if rows else "?"
    parts = [f"epoch {epoch}" + (f"/{max_epochs}" if max_epochs else "")]
    training = [r for r in rows if "stopped" not in r]
    metric, order = ranked_members(training or rows)
    best = order[0] if order else None
    if best is not None:
        index = int(best.get("member", 0))
        settings = members[index] if index < len(members) else {}
        label = settings_label(settings)
        results = "  ".join(f"{k} {v:.4g}" for k, v in member_metrics(best, settings).items())
        parts.append(f"best member {index}" + (f" ({label})" if label else "") + f": {results}")
    # a stopped member's record has ended: it has no row, but counts among the members
    parts.append(f"{len(training)} of {max(len(members), len(rows))} members training")
    seconds = rows[0].get("epoch_seconds") if rows else None
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

    def member_steps(self, first, losses):
        pass

    def member_rows(self, rows):
        pass

    def member_validated(self, rows):
        pass


class LineReporter(SilentReporter):
    """One line per epoch and per note: readable in logs, CI and captured output."""

    def __init__(self, stream=None):
        self.stream = stream
        self.max_epochs = None
        self.members: list[Mapping[str, Any]] = []  # a population's members' settings

    def start_run(self, handle, target_epoch):
        self.max_epochs = target_epoch
        members = getattr(handle, "members", None)
        self.members = list(members) if isinstance(members, list) else []

    def _write(self, text: str, end: str = "\n") -> None:
        stream = self.stream or sys.stderr
        stream.write(text + end)
        stream.flush()

    def end_epoch(self, row):
        self._write(format_row(row, self.max_epochs))

    def note(self, message, done=False):
        self._write(f"nitro: {message}")

    def member_rows(self, rows):
        self._write(format_members(rows, self.members, self.max_epochs))


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

    def member_steps(self, first, losses):
        """A population's call: its steps on the bar, the best member's latest step loss."""
        if self.bar is None:
            return
        self._done += len(losses[0]) if len(losses) else 0
        now = time.monotonic()
        if now - self._last >= self.min_interval:
            self._last = now
            self.bar.n = self._done
            latest = [float(row[-1]) for row in losses if len(row) and math.isfinite(row[-1])]
            if latest:
                self.bar.set_postfix_str(f"best loss {min(latest):.4g}", refresh=True)
            else:
                self.bar.refresh()

    def member_rows(self, rows):
        self.close()
        super().member_rows(rows)

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
_POPULATION_FACTORY: list[Callable[[], Any]] = [_default_factory]


def set_default_factory(factory: Callable[[], Any] | None, *, population: bool = False) -> None:
    """Install the factory that builds a reporter for each run (`None` restores the default);
    `population=True`: the one for each `nitro.Population`."""
    (_POPULATION_FACTORY if population else _FACTORY)[0] = factory or _default_factory


def make_reporter(setting: Any, *, population: bool = False) -> Any:
    """`True` -> the default reporter (a population's, with `population=True`),
    `False`/`None` -> None (silent), `"lines"`/`"bar"`, or an object implementing any of the
    `nitro.events.Reporter` methods. In a run of several processes the others than process 0
    show nothing (a silent reporter, which takes the notes a run without one would print);
    a reporter object reports in every process."""
    built_in = setting is True or setting is False or setting is None
    built_in = built_in or (isinstance(setting, str) and setting in ("lines", "bar"))
    if built_in and _later_process():
        return SilentReporter()
    if setting is True:
        return (_POPULATION_FACTORY if population else _FACTORY)[0]()
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


def _later_process() -> bool:
    import jax

    return jax.process_index() > 0


def note(message: str, done: bool = False) -> None:
    """A short progress note ("compiling train step ..."), shown by the current run's
    reporters, or on stderr outside a run."""
    events = _events.current()
    if events is not None:
        events.note(message, done)
    else:
        _NOTE_FALLBACK[0].note(message, done)


_NOTE_FALLBACK: list[Any] = [LineReporter()]
