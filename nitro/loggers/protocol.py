"""The logger protocol: ten verbs a metrics backend implements, and a group that fans out.

A logger is any object with the ten verbs of `Logger` (subclass `BaseLogger` for no-op
defaults and implement only what the backend stores). The framework calls them through
`LoggingReporter`, which drops non-finite values first (`finite_metrics`), so a backend only
ever sees finite numbers. `LoggerGroup` (or a plain list given as `logger=`) sends every call
to several loggers, each isolated: one that raises is switched off with one warning and the
others go on.

```python
class PrintLogger(nitro.loggers.BaseLogger):
    def log_metrics(self, metrics, *, step, epoch, context):
        print(context, step, metrics)
```
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "CONTEXTS",
    "FINISH_STATUSES",
    "FLUSH_SECONDS",
    "LOGGER_VERBS",
    "MEDIA_VERBS",
    "BaseLogger",
    "Logger",
    "LoggerGroup",
    "as_logger",
    "confusion_rows",
    "finite_metrics",
    "logger_info",
    "plain_value",
]

CONTEXTS = ("train", "validate", "data")
FINISH_STATUSES = ("completed", "early_stop", "requested", "error")
# how long the file backends keep records in memory at most (checked as a record comes); a
# crash loses at most this much of the log
FLUSH_SECONDS = 2.0

# the ten verbs; `bind_run`, `flush` and `info` are optional extras (BaseLogger has defaults)
LOGGER_VERBS = (
    "log_metrics",
    "log_params",
    "log_tags",
    "log_other",
    "log_confusion",
    "finish",
    "run_id",
    "run_url",
    "state",
    "reattach",
)
# optional verbs for your code (a hook, a reporter) to call: BaseLogger's defaults do nothing,
# so a backend that cannot store images ignores them
MEDIA_VERBS = ("log_figure", "log_image")
# the verbs a run calls, guarded in a group: a failure switches that logger off
_GUARDED = (
    "bind_run",
    "log_metrics",
    "log_params",
    "log_tags",
    "log_other",
    "log_confusion",
    "log_figure",
    "log_image",
    "flush",
)


@runtime_checkable
class Logger(Protocol):
    """What a run tells a metrics backend, in order: `bind_run` once, `log_params` (before the
    first compile), `log_tags`, `log_other("binding_report", text)`, then `log_metrics` per
    optimizer step (context "train") and per epoch ("validate", "data"), and `finish`.

    `state()` returns plain JSON-serializable data (or None) that a checkpoint stores; on
    resume the framework calls `reattach(state)` on a logger of the same type (required
    when `state()` is not None)."""

    def log_metrics(
        self, metrics: Mapping[str, float], *, step: int | None, epoch: int | None, context: str
    ) -> None: ...
    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_tags(self, tags: Mapping[str, str]) -> None: ...
    def log_other(self, key: str, value: Any) -> None: ...
    def log_confusion(self, matrix: Any, labels: Sequence[Any], *, epoch: int | None) -> None: ...
    def finish(self, status: str) -> None: ...
    @property
    def run_id(self) -> str | None: ...
    @property
    def run_url(self) -> str | None: ...
    def state(self) -> Any: ...
    def reattach(self, state: Any) -> None: ...


class BaseLogger:
    """No-op defaults for every verb: subclass it and implement what your backend stores."""

    _run_id: str | None = None

    def bind_run(self, run_dir: str, run_id: str | None) -> None:
        """Called by the framework before anything is logged; a pathless backend adopts
        `run_dir` here."""
        self._run_id = run_id

    def log_metrics(
        self, metrics: Mapping[str, float], *, step: int | None, epoch: int | None, context: str
    ) -> None:
        pass

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_tags(self, tags: Mapping[str, str]) -> None:
        pass

    def log_other(self, key: str, value: Any) -> None:
        pass

    def log_confusion(self, matrix: Any, labels: Sequence[Any], *, epoch: int | None) -> None:
        pass

    def log_figure(self, name: str, figure: Any, *, step: int | None = None) -> None:
        """A matplotlib figure at `step`; by default ignored (a backend that stores images
        overrides it: TensorBoard, MLflow, W&B)."""

    def log_image(self, name: str, image: Any, *, step: int | None = None) -> None:
        """An image array (H, W[, C]; uint8 or floats in 0-1) at `step`; by default ignored."""

    def finish(self, status: str) -> None:
        pass

    def flush(self) -> None:
        """Write what the backend holds in memory; called at the end of each `train()` and
        `validate()` and before a checkpoint records `state()`."""

    @property
    def run_id(self) -> str | None:
        return self._run_id

    @property
    def run_url(self) -> str | None:
        return None

    def state(self) -> Any:
        return None

    def reattach(self, state: Any) -> None:
        if state is not None:
            raise TypeError(
                f"{type(self).__qualname__} keeps no state to resume, but was given {state!r}; "
                f"a checkpoint written with another logger type cannot reattach to this one"
            )

    def info(self) -> dict[str, Any]:
        """Identifying parameters (type, path, ...) for displays."""
        return {"type": type(self).__name__}

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.info().items() if k != "type")
        return f"{type(self).__name__}({shown})"


def logger_info(logger: Any) -> dict[str, Any]:
    """`logger.info()`, or its type name when it has no `info`."""
    info: Callable[[], Mapping[str, Any]] | None = getattr(logger, "info", None)
    return dict(info()) if callable(info) else {"type": type(logger).__name__}


def finite_metrics(metrics: Mapping[str, Any]) -> dict[str, int | float]:
    """The finite real scalars of `metrics`, as Python numbers; NaN, infinities and anything
    that is not a real scalar (arrays, strings) are dropped.

    >>> finite_metrics({"loss": 0.5, "bad": float("nan"), "n": np.int64(3)})
    {'loss': 0.5, 'n': 3}
    """
    kept: dict[str, int | float] = {}
    for name, value in metrics.items():
        if isinstance(value, np.generic | np.ndarray) and np.ndim(value) == 0:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        if isinstance(value, int) or math.isfinite(value):
            kept[name] = value if isinstance(value, int) else float(value)
    return kept


def plain_value(value: Any) -> bool | int | float | str | None:
    """A value for a flat table: bools, numbers, strings and None as they are (numpy scalars
    as Python numbers); callables by their name; anything else as a short repr."""
    if isinstance(value, np.floating) and value.dtype.itemsize < 8:
        return float(str(value))  # float32 0.001 as 0.001, not 0.0010000000474974513
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__qualname__", None) or type(value).__name__
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def confusion_rows(matrix: Any, labels: Sequence[Any]) -> tuple[list[list[int]], list[str]]:
    """A square count matrix as row-major nested lists (rows: true class, columns: predicted)
    and its labels as strings; a clear error when the shapes do not agree."""
    array = np.asarray(matrix)
    labels = [str(label) for label in labels]
    if array.ndim != 2 or array.shape[0] != array.shape[1]:
        raise ValueError(f"log_confusion takes a square matrix; got shape {array.shape}")
    if len(labels) != array.shape[0]:
        raise ValueError(
            f"log_confusion got {len(labels)} labels for a {array.shape[0]}x{array.shape[1]} "
            f"matrix; give one label per row"
        )
    return array.tolist(), labels


def _missing_verbs(logger: Any) -> list[str]:
    missing = []
    for verb in LOGGER_VERBS:
        if verb in ("run_id", "run_url"):
            if not hasattr(logger, verb):
                missing.append(verb)
        elif not callable(getattr(logger, verb, None)):
            missing.append(verb)
    return missing


def as_logger(value: Any) -> Any:
    """What `logger=` accepts: None (no logging), a logger, or a list or tuple of loggers (a
    `LoggerGroup`). Anything else, or an object missing some of the ten verbs, is refused
    naming what is missing.

    >>> as_logger(None) is None
    True
    """
    if value is None:
        return None
    if isinstance(value, list | tuple):
        return LoggerGroup(value)
    missing = _missing_verbs(value)
    if missing:
        raise TypeError(
            f"logger= takes a logger, a list of loggers or None; {type(value).__qualname__} "
            f"lacks {', '.join(missing)}. A logger implements the ten verbs "
            f"{', '.join(LOGGER_VERBS)}: subclass nitro.loggers.BaseLogger for no-op defaults, "
            f"or use nitro.loggers.JSONLinesLogger(), TensorBoardLogger() or CSVLogger()"
        )
    return value


class LoggerGroup(BaseLogger):
    """Several loggers as one: every call goes to each, isolated. A logger that raises is
    switched off for the rest of the run with one warning naming it; the others go on.
    `reset()` (the start of a run) switches them back on.

    >>> from nitro.loggers import CSVLogger, JSONLinesLogger
    >>> group = LoggerGroup([JSONLinesLogger("a.jsonl"), CSVLogger("a.csv")])
    >>> group.log_metrics({"loss": 0.5}, step=1, epoch=1, context="train")  # to both files
    >>> group.finish("done")
    """

    def __init__(self, loggers: Iterable[Any]):
        members = []
        for logger in loggers:
            if logger is None:
                continue
            if isinstance(logger, LoggerGroup):
                members.extend(logger.loggers)
            else:
                members.append(as_logger(logger))
        self._loggers = tuple(members)
        self._off: set[int] = set()
        self._stateless: set[int] = set()  # state() raised: checkpoints record none for it
        self._rebind()

    @property
    def loggers(self) -> tuple[Any, ...]:
        return self._loggers

    def reset(self) -> None:
        self._off.clear()
        self._stateless.clear()
        self._rebind()

    def _rebind(self) -> None:
        live = [lg for lg in self._loggers if id(lg) not in self._off]
        self._bound = {
            verb: tuple((lg, getattr(lg, verb)) for lg in live if hasattr(lg, verb))
            for verb in (*_GUARDED, "finish")
        }

    def _switch_off(self, logger: Any, verb: str, error: Exception) -> None:
        if id(logger) in self._off:
            return
        self._off.add(id(logger))
        self._rebind()
        warnings.warn(
            f"logger {type(logger).__qualname__} raised {type(error).__name__} in {verb}(): "
            f"{error}; it is switched off for the rest of this run, which goes on",
            RuntimeWarning,
            stacklevel=3,
        )

    def _each(self, verb: str, *args: Any, **kwargs: Any) -> None:
        for logger, method in self._bound[verb]:
            try:
                method(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - a logger must never break a run
                self._switch_off(logger, verb, error)

    def bind_run(self, run_dir: str, run_id: str | None) -> None:
        self._run_id = run_id
        self._each("bind_run", run_dir, run_id)

    def log_metrics(self, metrics, *, step, epoch, context) -> None:
        for logger, method in self._bound["log_metrics"]:
            try:
                method(metrics, step=step, epoch=epoch, context=context)
            except Exception as error:  # noqa: BLE001
                self._switch_off(logger, "log_metrics", error)

    def log_steps(
        self, name: str, steps: Sequence[int], values: Sequence[float], *, epoch, context
    ) -> None:
        """One metric at several steps (a fused call's losses): through a logger's own
        `log_steps` when it has one (JSON Lines writes them in one go), else one
        `log_metrics` call per step."""
        for logger, method in self._bound["log_metrics"]:
            try:
                batched = getattr(logger, "log_steps", None)
                if batched is not None:
                    batched(name, steps, values, epoch=epoch, context=context)
                    continue
                for step, value in zip(steps, values, strict=True):
                    method({name: value}, step=step, epoch=epoch, context=context)
            except Exception as error:  # noqa: BLE001
                self._switch_off(logger, "log_metrics", error)

    def log_params(self, params) -> None:
        self._each("log_params", params)

    def log_tags(self, tags) -> None:
        self._each("log_tags", tags)

    def log_other(self, key, value) -> None:
        self._each("log_other", key, value)

    def log_confusion(self, matrix, labels, *, epoch) -> None:
        self._each("log_confusion", matrix, labels, epoch=epoch)

    def log_figure(self, name: str, figure: Any, *, step: int | None = None) -> None:
        """The figure to each logger that stores images (the others ignore it). Something
        that is not a figure is refused here, in the caller, before any logger sees it."""
        from nitro.loggers.media import check_figure

        check_figure(figure, name)
        self._each("log_figure", name, figure, step=step)

    def log_image(self, name: str, image: Any, *, step: int | None = None) -> None:
        """The image to each logger that stores images (the others ignore it), checked and
        brought to uint8 pixels first: a bad image is refused here, in the caller."""
        from nitro.loggers.media import image_pixels

        self._each("log_image", name, image_pixels(image, name), step=step)

    def finish(self, status: str) -> None:
        self._each("finish", status)

    def flush(self) -> None:
        self._each("flush")

    @property
    def run_id(self) -> str | None:
        return next((lg.run_id for lg in self._loggers if lg.run_id is not None), self._run_id)

    @property
    def run_url(self) -> str | None:
        return next((lg.run_url for lg in self._loggers if lg.run_url is not None), None)

    def state(self) -> list[dict[str, Any]] | None:
        """One `{"type": ..., "state": ...}` per logger, or None when none keeps state. A
        logger whose `state()` raises is switched off like one whose other verbs raise, and
        the checkpoint records no state for it."""
        states = [self._state_of(lg) for lg in self._loggers]
        if all(s is None for s in states):
            return None
        return [
            {"type": type(lg).__qualname__, "state": s}
            for lg, s in zip(self._loggers, states, strict=True)
        ]

    def _state_of(self, logger: Any) -> Any:
        state = getattr(logger, "state", None)
        if state is None or id(logger) in self._stateless:
            return None
        try:
            return state()
        except Exception as error:  # noqa: BLE001 - a logger must never break a run
            self._stateless.add(id(logger))
            self._switch_off(logger, "state", error)
            return None

    def reattach(self, state: Any) -> None:
        """Each saved entry reattaches the group's next logger of the same type, in order; a
        logger with no saved entry starts fresh (one added since, say), and the state of a
        logger type the group no longer has is left unused."""
        if state is None:
            return
        entries = state if isinstance(state, list) else None
        if entries is None or not all(isinstance(e, Mapping) and "type" in e for e in entries):
            raise TypeError(
                f"cannot reattach this LoggerGroup to {state!r}: a LoggerGroup reattaches the "
                f"state() of a LoggerGroup, a list of {{'type': ..., 'state': ...}}"
            )
        unused = list(self._loggers)
        for entry in entries:
            logger = next((lg for lg in unused if type(lg).__qualname__ == entry["type"]), None)
            if logger is None:
                continue
            unused.remove(logger)
            if entry.get("state") is not None:
                logger.reattach(entry["state"])

    def info(self) -> dict[str, Any]:
        return {"type": "LoggerGroup", "loggers": [logger_info(lg) for lg in self._loggers]}
