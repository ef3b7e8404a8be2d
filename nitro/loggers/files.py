"""Loggers that append to one local file: JSON Lines (the default) and CSV.

Both open their file in append mode on first use (so a resumed run extends it) and keep the
records of the hot path in memory: the first record goes to disk at once (a file that cannot
be written is known before the first step), the others every `FLUSH_SECONDS`, checked as a
record comes, and at `flush()`, `close()`, `finish`, `state()` (a checkpoint records what is
on disk), the end of each `train()` or `validate()` and the interpreter's exit. A crash loses
at most the last `FLUSH_SECONDS` of records. A logger built without a path adopts the run
directory when the framework binds it (`<run_dir>/metrics.jsonl`, `<run_dir>/metrics.csv`).
Writes take a lock, so a logger can be used from several threads.

`state()` is the file, its size on disk and the latest step logged; `reattach(state)` (a
resumed run) drops the metrics the crashed run wrote after that size for later steps, which
the resumed run logs again, and keeps everything else, so each step and epoch is in the file
once.
"""

from __future__ import annotations

import atexit
import csv
import json
import math
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from nitro.loggers.protocol import FLUSH_SECONDS, BaseLogger, confusion_rows, plain_value

__all__ = ["CSVLogger", "JSONLinesLogger"]

_LIVE: weakref.WeakSet[_FileLogger] = weakref.WeakSet()  # flushed at the interpreter's exit


@atexit.register
def _flush_all() -> None:
    for logger in list(_LIVE):
        try:
            logger.flush()
        except Exception:  # noqa: BLE001, S110 - the interpreter is exiting: nothing to tell
            pass


class _FileLogger(BaseLogger):
    filename = ""  # the file a pathless logger writes in the run directory

    def __init__(self, path: str | os.PathLike | None = None):
        self._explicit = path is not None
        self._path = os.fspath(path) if path is not None else None
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        self._pending: list[Any] = []  # records not yet on disk
        self._due = 0.0  # monotonic time of the next flush: the first record goes at once
        self._step: int | None = None  # the latest step logged
        self._resume: tuple[str, int, int | None] | None = None  # (path, size, step) reattached
        _LIVE.add(self)

    @property
    def path(self) -> str | None:
        """The file this logger writes (None until a pathless logger is bound to a run)."""
        return self._path

    def bind_run(self, run_dir: str, run_id: str | None) -> None:
        self._run_id = run_id
        if self._explicit:
            return
        path = os.path.join(os.fspath(run_dir), self.filename)
        if path != self._path:
            self._close()
            self._path = path

    def _add(self, records: list[Any]) -> None:
        """Queue records; write the queue when it is due."""
        with self._lock:
            self._pending.extend(records)
            if time.monotonic() >= self._due:
                self._flush()

    def _flush(self) -> None:
        """Write the queued records in one go and flush them (the lock is held)."""
        self._due = time.monotonic() + FLUSH_SECONDS
        if not self._pending:
            return
        records, self._pending = self._pending, []
        file = self._file or self._open()
        self._write_records(file, records)
        file.flush()

    def _write_records(self, file: IO[str], records: list[Any]) -> None:
        file.write("".join(records))

    def flush(self) -> None:
        """Write every record logged so far to the file now."""
        with self._lock:
            self._flush()

    def _open(self) -> IO[str]:
        if self._path is None:
            raise RuntimeError(
                f"{type(self).__name__}() has no file yet: give it a path, "
                f"{type(self).__name__}('{self.filename}'), or let a run bind it to its directory"
            )
        Path(self._path).parent.mkdir(parents=True, exist_ok=True)
        if self._resume is not None:
            self._drop_replayed(*self._resume)
            self._resume = None
        self._file = open(self._path, "a", encoding="utf-8", newline="")  # noqa: SIM115
        return self._file

    def _close(self) -> None:
        with self._lock:
            try:
                self._flush()
            finally:
                if self._file is not None:
                    self._file.close()
                    self._file = None

    def close(self) -> None:
        """Write what is queued and close the file now (the next record reopens it,
        appending)."""
        self._close()

    # resume -------------------------------------------------------------------------------

    def state(self) -> dict[str, Any] | None:
        """The file, its size once everything logged is on disk, and the latest step logged
        (a checkpoint stores it); None before anything was written."""
        with self._lock:
            self._flush()
            if self._path is None or not os.path.exists(self._path):
                return None
            return {
                "path": os.path.abspath(self._path),
                "size": os.path.getsize(self._path),
                "step": self._step,
            }

    def reattach(self, state: Any) -> None:
        """Continue the file of the run that wrote `state`: the metrics that run wrote after
        `state["size"]` for steps after `state["step"]` (the resumed run logs them again) are
        dropped when the file is next opened; the rest is kept. Only the same file is touched:
        the saved path, or, for a logger without a path, its file in the resumed run's
        directory; a file shorter than the saved size (changed since) is left as it is."""
        if not isinstance(state, Mapping) or not {"path", "size"} <= set(state):
            raise TypeError(
                f"{type(self).__name__}.reattach takes the state() of a {type(self).__name__}, "
                f"a dict with 'path' and 'size'; got {state!r}"
            )
        self._close()
        self._step = state.get("step")
        self._resume = (os.fspath(state["path"]), int(state["size"]), self._step)

    def _drop_replayed(self, saved: str, size: int, step: int | None) -> None:
        path = self._path
        assert path is not None
        if self._explicit and os.path.abspath(path) != saved:
            return  # another file: nothing of the crashed run is in it
        if not os.path.exists(path) or os.path.getsize(path) < size:
            return
        with open(path, "r+b") as file:
            file.seek(size)
            lines = file.read().splitlines(keepends=True)
            kept = [
                line
                for line in lines
                if not self._replayed(line.decode("utf-8", errors="replace"), step)
            ]
            file.seek(size)
            file.truncate()
            file.write(b"".join(kept))

    def _replayed(self, line: str, step: int | None) -> bool:
        """Whether a line written after the checkpoint is logged again by the resumed run (a
        line cut short by the crash counts as replayed)."""
        raise NotImplementedError

    @property
    def run_url(self) -> str | None:
        return Path(self._path).resolve().as_uri() if self._path else None

    def info(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "path": self._path}


def _jsonable(value: Any) -> Any:
    """Any value as JSON data: containers element by element, arrays as nested lists,
    non-finite floats as null, other objects as `plain_value` gives them."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    return _json_number(value)


def _json_number(value: Any) -> Any:
    """A metric value for JSON: numbers as they are, non-finite floats as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, int) or value is None:
        return value
    value = plain_value(value)
    return None if isinstance(value, float) and not math.isfinite(value) else value


_ENCODER = json.JSONEncoder(allow_nan=False)  # one encoder: building one per line costs more


_NAMES: dict[str, str] = {}  # metric and context names, JSON-encoded once each


def _name(name: str) -> str:
    encoded = _NAMES.get(name)
    if encoded is None:
        encoded = _NAMES[name] = _ENCODER.encode(name) if len(_NAMES) < 10_000 else ""
        if not encoded:
            return _ENCODER.encode(name)
    return encoded


def _metrics_line(metrics: Mapping[str, Any], step, epoch, context) -> str | None:
    """The JSON line of a metrics record whose values are finite Python floats and ints and
    whose step and epoch are ints or None, formatted directly (`json` writes floats with
    `repr` too); None for any other record, which goes through the encoder."""
    parts = []
    for name, value in metrics.items():
        kind = type(value)
        if (kind is not float or not math.isfinite(value)) and kind is not int:
            return None
        if not isinstance(name, str):
            return None
        parts.append(f"{_name(name)}: {value!r}")
    if not all(v is None or type(v) is int for v in (step, epoch)):
        return None
    return (
        f'{{"type": "metrics", "time": {time.time()!r}, "context": {_name(context)}, '
        f'"epoch": {"null" if epoch is None else epoch}, '
        f'"step": {"null" if step is None else step}, "metrics": {{{", ".join(parts)}}}}}\n'
    )


class JSONLinesLogger(_FileLogger):
    """JSON Lines, one record per line, each with a `type`: "params", "metrics" (with
    `context`, `epoch`, `step`), "tags", "other" (`key`, `value`), "confusion" (`epoch`,
    `labels`, `matrix`, rows true, columns predicted) or "finish" (`status`), and a Unix
    `time`. Non-finite numbers are written as null.

    >>> lg = JSONLinesLogger("metrics.jsonl")
    >>> lg.log_metrics({"loss": 0.25}, step=1, epoch=1, context="train")
    >>> lg.close()
    >>> print(open("metrics.jsonl").read(), end="")
    {"type": "metrics", "time": ..., "context": "train", "epoch": 1, "step": 1, "metrics": {"loss": 0.25}}
    """

    filename = "metrics.jsonl"

    def _write(self, record: dict[str, Any]) -> None:
        self._add([_ENCODER.encode(record) + "\n"])

    def _replayed(self, line: str, step: int | None) -> bool:
        if not line.endswith("\n"):
            return True
        try:
            record = json.loads(line)
        except ValueError:
            return True
        later = step is None or (record.get("step") or 0) > step
        return record.get("type") == "metrics" and later

    def log_metrics(self, metrics, *, step, epoch, context) -> None:
        if step is not None:
            self._step = step
        line = _metrics_line(metrics, step, epoch, context)
        if line is not None:  # the common record, formatted directly (once per step)
            self._add([line])
            return
        values = {name: _json_number(value) for name, value in metrics.items()}
        self._write(
            {
                "type": "metrics",
                "time": time.time(),
                "context": context,
                "epoch": epoch,
                "step": step,
                "metrics": values,
            }
        )

    def log_steps(
        self, name: str, steps: Sequence[int], values: Sequence[float], *, epoch, context
    ) -> None:
        """One metric at several steps (a fused call's losses), the lines of `log_metrics`
        formatted in one go."""
        simple = type(epoch) is int or epoch is None
        if not simple or not all(type(v) is float and math.isfinite(v) for v in values):
            for step, value in zip(steps, values, strict=True):
                self.log_metrics({name: value}, step=step, epoch=epoch, context=context)
            return
        head = (
            f'{{"type": "metrics", "time": {time.time()!r}, "context": {_name(context)}, '
            f'"epoch": {"null" if epoch is None else epoch}, "step": '
        )
        tail = f', "metrics": {{{_name(name)}: '
        self._add(
            [
                f"{head}{step}{tail}{value!r}}}}}\n"
                for step, value in zip(steps, values, strict=True)
            ]
        )
        if steps:
            self._step = steps[-1]

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._write({"type": "params", "time": time.time(), "params": _jsonable(params)})

    def log_tags(self, tags: Mapping[str, str]) -> None:
        self._write({"type": "tags", "time": time.time(), "tags": _jsonable(tags)})

    def log_other(self, key: str, value: Any) -> None:
        self._write({"type": "other", "time": time.time(), "key": key, "value": _jsonable(value)})

    def log_confusion(self, matrix: Any, labels: Sequence[Any], *, epoch: int | None) -> None:
        rows, names = confusion_rows(matrix, labels)
        self._write(
            {
                "type": "confusion",
                "time": time.time(),
                "epoch": epoch,
                "labels": names,
                "matrix": rows,
            }
        )

    def finish(self, status: str) -> None:
        self._write({"type": "finish", "time": time.time(), "status": status})
        self._close()


class CSVLogger(_FileLogger):
    """Metrics in long format: one row per value, columns `time, context, epoch, step, name,
    value` (non-finite values as empty cells). The columns never change, so a resumed run
    appends to the same file and a metric that first appears late (validation, a new train
    metric) needs no rewrite; `pandas.pivot_table` gives the wide view. Parameters, tags,
    other values and confusion matrices are not written (use JSON Lines alongside).

    >>> lg = CSVLogger("metrics.csv")
    >>> lg.log_metrics({"loss": 0.5, "acc": 0.75}, step=1, epoch=1, context="train")
    >>> lg.log_metrics({"loss": 0.25, "acc": 0.875}, step=2, epoch=1, context="train")
    >>> lg.close()
    >>> import pandas
    >>> frame = pandas.read_csv("metrics.csv")
    >>> frame[frame.context == "train"].pivot_table(index="step", columns="name", values="value")
    name    acc  loss
    step
    1     0.750  0.50
    2     0.875  0.25
    """

    filename = "metrics.csv"
    columns = ("time", "context", "epoch", "step", "name", "value")

    def _open(self) -> IO[str]:
        path = self._path
        fresh = not (path and os.path.exists(path) and os.path.getsize(path))
        if path and not fresh:
            with open(path, encoding="utf-8", newline="") as existing:
                header = next(csv.reader(existing), [])
            if tuple(header) != self.columns:
                raise ValueError(
                    f"{self._path} is not a metrics CSV of this logger (its header is "
                    f"{','.join(header)!r}, expected {','.join(self.columns)!r}); give "
                    f"CSVLogger a new path"
                )
        file = super()._open()
        self._writer = csv.writer(file)
        if fresh:
            self._writer.writerow(self.columns)
        return file

    def _write_records(self, file: IO[str], records: list[Any]) -> None:
        self._writer.writerows(records)

    def _replayed(self, line: str, step: int | None) -> bool:
        row = next(csv.reader([line]), [])
        if not line.endswith("\n") or len(row) != len(self.columns):
            return True
        try:
            return step is None or int(row[3] or 0) > step
        except ValueError:
            return True

    def log_metrics(self, metrics, *, step, epoch, context) -> None:
        now = time.time()
        if step is not None:
            self._step = step
        self._add(
            [(now, context, epoch, step, name, _csv_number(v)) for name, v in metrics.items()]
        )

    def finish(self, status: str) -> None:
        self._close()


def _csv_number(value: Any) -> Any:
    value = _json_number(value)
    return "" if value is None else value
