"""Run keywords from an agent's JSON: each checked by the engine's own check, with a JSON form
for the keywords whose values are Python objects.

| keyword | JSON | becomes |
|---|---|---|
| `checkpointer` | `true`, `false`/`null` (none), or `{"k": 3, "metric": "val_acc", "mode": "max", "every": 1, "budget": null, "name": "e{epoch}-s{step}"}` (`name`: a format string, or left out for step directories) | `nitro.Checkpointer(...)` or None |
| `early_stop` | `null` or `{"metric": "val_loss", "mode": "min", "patience": 5, "min_delta": 1e-4}` | `nitro.EarlyStopping(...)` |
| `logger` | `null` (no logging), `"jsonl"`, `"csv"`, `"tensorboard"`, or a list of them | the loggers, writing into the run directory |
| `resume` | `"auto"`, `false`, a run directory or checkpoint path, `[run_dir, "best" or "latest"]` | the same, the pair as a tuple |
| `snapshots` | `true`, `false`/`null`, an int (every that many steps) or `{"every": 100, "keep": 8, "max_bytes": ...}` | `nitro.Snapshots(...)` or None |
| `spike` | `null`, `true` or `{"rtol": 1.0, "window": 20, "max_rollbacks": 3}` | `nitro.Spike(...)` or None |

`weights` (a run id, a path or `[run_dir, "best"]`) is resolved by the session, which knows
the runs. `optimizer`, `schedules` and `data` have no JSON form: the experiment defines them.

>>> check_run_keywords({"early_stop": {"metric": "loss", "patience": 2}}, {})["early_stop"]
EarlyStopping(metric='loss', mode='min', patience=2, min_delta=0.0001)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from nitro.engine.run_keywords import KEYWORD_ONLY, RUN_KEYWORDS
from nitro.errors import SetupError
from nitro.mcp.lookup import ToolFailure, close_matches

__all__ = ["LOGGERS", "OBJECT_KEYWORDS", "check_run_keywords", "checkpoint_pair"]

# Run keywords whose values are Python objects with no JSON form.
OBJECT_KEYWORDS = {"optimizer", "schedules", "data"}


def _json_logger() -> Any:
    from nitro.loggers import JSONLinesLogger

    return JSONLinesLogger()


def _csv_logger() -> Any:
    from nitro.loggers import CSVLogger

    return CSVLogger()


def _tensorboard_logger() -> Any:
    from nitro.loggers import TensorBoardLogger

    return TensorBoardLogger()


# Logger names an agent can give, each a logger writing into the run directory.
LOGGERS: dict[str, Callable[[], Any]] = {
    "jsonl": _json_logger,
    "csv": _csv_logger,
    "tensorboard": _tensorboard_logger,
}


def _from_fields(where: str, cls: type, value: Any) -> Any:
    """`cls(**value)` for a JSON object of `cls`'s fields, refusing unknown fields by name."""
    fields = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(value, Mapping):
        raise ToolFailure(
            f"{where}: expected an object of {cls.__name__} fields ({', '.join(fields)}), "
            f"got {value!r}"
        )
    for name in value:
        if name not in fields:
            raise ToolFailure(
                f"{where}: {cls.__name__} has no field {name!r}{close_matches(name, fields)}; "
                f"its fields: {', '.join(fields)}"
            )
    try:
        return cls(**value)
    except SetupError as error:
        raise ToolFailure(f"{where}: {error}") from None


def _checkpointer(where: str, value: Any) -> Any:
    from nitro.runs.checkpoints import Checkpointer

    if value is None or isinstance(value, bool):
        return value is True  # the engine's check: True -> Checkpointer(), False -> none
    return _from_fields(where, Checkpointer, value)


def _early_stop(where: str, value: Any) -> Any:
    from nitro.runs.early_stopping import EarlyStopping

    return None if value is None else _from_fields(where, EarlyStopping, value)


def _snapshots(where: str, value: Any) -> Any:
    from nitro.engine.snapshots import Snapshots

    if value is None or isinstance(value, (bool, int)):
        return value  # the engine's check: True, an int, False or None
    return _from_fields(where, Snapshots, value)


def _spike(where: str, value: Any) -> Any:
    from nitro.engine.spikes import Spike

    if value is None or isinstance(value, bool):
        return value
    return _from_fields(where, Spike, value)


def _logger(where: str, value: Any) -> Any:
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ToolFailure(
            f"{where}: expected a logger name ({', '.join(LOGGERS)}), a list of them, or null "
            f"for no logging; got {value!r}"
        )
    loggers = []
    for name in names:
        make = LOGGERS.get(name)
        if make is None:
            raise ToolFailure(
                f"{where}: no logger named {name!r}{close_matches(name, LOGGERS)}; loggers: "
                f"{', '.join(LOGGERS)}"
            )
        try:
            loggers.append(make())
        except ImportError as error:
            raise ToolFailure(f"{where}: {error}") from None
    return loggers


def checkpoint_pair(where: str, value: Any) -> Any:
    """A JSON `[run_dir, "best" | "latest"]` as the engine's tuple; anything else as it is."""
    if not isinstance(value, list):
        return value
    if len(value) != 2 or not isinstance(value[0], str) or value[1] not in ("best", "latest"):
        raise ToolFailure(
            f'{where}: a checkpoint pair is [run_dir, "best"] or [run_dir, "latest"]; got {value!r}'
        )
    return tuple(value)


_JSON_FORMS: dict[str, Callable[[str, Any], Any]] = {
    "checkpointer": _checkpointer,
    "early_stop": _early_stop,
    "logger": _logger,
    "resume": checkpoint_pair,
    "snapshots": _snapshots,
    "spike": _spike,
}


def check_run_keywords(keywords: Mapping[str, Any], argument: Mapping[str, str]) -> dict[str, Any]:
    """Refuse unknown run keywords and bad values before anything is built; turn the JSON
    forms into the engine's values. `argument` maps a keyword to the tool argument that gave
    it, for the message (default `keywords.<name>`)."""
    known = set(RUN_KEYWORDS) | set(KEYWORD_ONLY)
    checked = {}
    for name, value in keywords.items():
        where = argument.get(name, f"keywords.{name}")
        if name not in known:
            raise ToolFailure(
                f"{where}: this version of nitro has no run keyword {name!r}"
                f"{close_matches(name, known)}; run keywords: "
                f"{', '.join(sorted(known - OBJECT_KEYWORDS))}"
            )
        if name in OBJECT_KEYWORDS:
            raise ToolFailure(
                f"{where}: {name!r} takes a Python object, which cannot be written as JSON; "
                f"define it on the experiment (a method named {name}) instead"
            )
        if name in _JSON_FORMS:
            value = _JSON_FORMS[name](where, value)
        keyword = RUN_KEYWORDS.get(name)
        if keyword is not None:
            try:
                value = keyword.checked(value)
            except ValueError as error:
                raise ToolFailure(f"{where}: {error}") from None
        checked[name] = value
    return checked
