"""Loggers that append to one local file: JSON Lines (the default) and CSV.

Both open their file in append mode on first use (so a resumed run extends it), write one
line per record and flush it at once, and close it at `finish`; a later run of the same
handle reopens it and goes on appending. A logger built without a path adopts the run
directory when the framework binds it (`<run_dir>/metrics.jsonl`, `<run_dir>/metrics.csv`).
Writes take a lock, so a logger can be used from several threads.
"""

from __future__ import annotations

import csv
import json
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from nitro.loggers.protocol import BaseLogger, confusion_rows, plain_value

__all__ = ["CSVLogger", "JSONLinesLogger"]


class _FileLogger(BaseLogger):
    filename = ""  # the file a pathless logger writes in the run directory

    def __init__(self, path: str | os.PathLike | None = None):
        self._explicit = path is not None
        self._path = os.fspath(path) if path is not None else None
        self._file: IO[str] | None = None
        self._lock = threading.Lock()

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

    def _open(self) -> IO[str]:
        if self._path is None:
            raise RuntimeError(
                f"{type(self).__name__}() has no file yet: give it a path, "
                f"{type(self).__name__}('{self.filename}'), or let a run bind it to its directory"
            )
        Path(self._path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._path, "a", encoding="utf-8", newline="")  # noqa: SIM115
        return self._file

    def _close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def close(self) -> None:
        """Close the file now (the next record reopens it, appending)."""
        self._close()

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
        line = _ENCODER.encode(record) + "\n"
        with self._lock:
            file = self._file or self._open()
            file.write(line)
            file.flush()

    def log_metrics(self, metrics, *, step, epoch, context) -> None:
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

    def log_metrics(self, metrics, *, step, epoch, context) -> None:
        now = time.time()
        rows = [(now, context, epoch, step, name, _csv_number(v)) for name, v in metrics.items()]
        with self._lock:
            file = self._file or self._open()
            self._writer.writerows(rows)
            file.flush()

    def finish(self, status: str) -> None:
        self._close()


def _csv_number(value: Any) -> Any:
    value = _json_number(value)
    return "" if value is None else value
