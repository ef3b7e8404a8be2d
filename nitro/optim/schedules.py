"""Schedules: values that change with the optimizer step, bound by name.

A schedule is a constant, an optax schedule, any callable of the step (counting optimizer
steps from 0, as optax does), or a factory called once with the total number of optimizer
steps that returns one of those. A key binds to an optimizer hyperparameter (by its real optax
name: `learning_rate`, `b1`, `weight_decay`, ...; with parameter groups, `<group>/<name>` for
one group's, and the bare name for every group's) or to a Device field. Values are computed on
the host and cross to the device once per step as arguments of the train step, so switching
between a constant and a schedule, or between schedules, never recompiles.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from nitro.errors import ScheduleError
from nitro.optim import ranges
from nitro.optim.plateau import ReduceOnPlateau

__all__ = [
    "BoundSchedule",
    "ScheduleError",
    "bind_schedules",
    "check_schedule_values",
    "normalize_schedule",
    "optimizer_keys",
]


@dataclasses.dataclass(frozen=True)
class BoundSchedule:
    key: str
    target: str  # "opt" or "device"
    name: str
    fn: Callable[[int], Any]
    form: str  # "constant", "schedule" or "factory"

    @property
    def qualified(self) -> str:
        return f"{self.target}.{self.name}"


def normalize_schedule(key: str, value: Any, total_steps: int | None) -> tuple[Callable, str]:
    if isinstance(value, ReduceOnPlateau):
        return value, "plateau"
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        constant = float(value)
        return (lambda step, _c=constant: _c), "constant"
    if not callable(value):
        raise ScheduleError(
            f"schedule {key!r} must be a number, a callable of the step, or a factory of the "
            f"total step count; got {type(value).__name__}"
        )
    if total_steps is None:
        probe = value(0)
        if callable(probe):
            raise ScheduleError(
                f"schedule {key!r} is a factory of the total step count, but the train split "
                f"has no len(): give it one, or pass a schedule of the step instead"
            )
        return value, "schedule"
    # A factory returns a schedule when called with the horizon; a schedule returns a number.
    result = value(total_steps)
    if callable(result):
        return result, "factory"
    return value, "schedule"


def _flatten(spec: Mapping[str, Any]) -> list[tuple[str | None, str, Any]]:
    """(namespace or None, name, schedule) for bare and qualified keys."""
    items = []
    for key, value in spec.items():
        if key in ("opt", "device") and isinstance(value, Mapping):
            for name, inner in value.items():
                if isinstance(inner, Mapping):
                    raise ScheduleError(
                        f"schedule {key}.{name} is a nested mapping; a parameter group's "
                        f"hyperparameter is scheduled as '<group>/<name>' (e.g. "
                        f"'head/learning_rate')"
                    )
                items.append((key, name, inner))
        else:
            items.append((None, key, value))
    return items


def optimizer_keys(spec: Mapping[str, Any]) -> frozenset[str]:
    """The keys of a `schedules=` mapping that may bind to an optimizer hyperparameter (every
    key but those qualified `device`): their constants are never fed."""
    return frozenset(name for namespace, name, _ in _flatten(spec) if namespace != "device")


def bind_schedules(
    spec: Mapping[str, Any],
    *,
    hyperparams: Mapping[str, Any],
    device_fields: Mapping[str, Any],
    other_fields: Mapping[str, str],
    total_steps: int | None,
    device_values: Mapping[str, Any] | None = None,
    device_sets: tuple[str, ...] = (),
) -> list[BoundSchedule]:
    """Bind each key to `opt.<hyperparameter>` or `device.<field>`.

    `other_fields` maps GraphConst/Host field names to their kind, for the error that says they
    cannot be scheduled. A `ReduceOnPlateau` gets a copy of its own, starting from its
    `start=` or the value it schedules (`hyperparams`' constant, `device_values`' value).
    """
    bound: dict[str, BoundSchedule] = {}
    for namespace, name, value in _flatten(spec):
        label = f"{namespace}.{name}" if namespace else name
        in_opt = name in hyperparams
        in_device = name in device_fields
        if namespace is None and in_opt and in_device:
            raise ScheduleError(
                f"schedule key {name!r} matches both the optimizer hyperparameter and the "
                f"Device field {name!r}. Qualify it: schedules={{'opt': {{{name!r}: ...}}}} or "
                f"schedules={{'device': {{{name!r}: ...}}}}"
            )
        if namespace == "opt" or (namespace is None and in_opt):
            target = "opt"
            if not in_opt:
                raise ScheduleError(_no_target(label, "optimizer hyperparameter", hyperparams))
        elif namespace == "device" or (namespace is None and in_device):
            target = "device"
            if not in_device:
                raise ScheduleError(_no_target(label, "Device field", device_fields))
            if name in device_sets:
                raise ScheduleError(
                    f"schedule key {label!r} names the Device field {name!r}, a buffer set (a "
                    f"dict or tuple of arrays): a schedule gives one value a step. Change the "
                    f"set with n.set_device({name}=...), or schedule a Device field of its own"
                )
        elif name in other_fields:
            raise ScheduleError(
                f"schedule key {name!r} names a {other_fields[name]} field; only Device fields "
                f"and optimizer hyperparameters can be scheduled. Mark it Device[...] to "
                f"schedule it."
            )
        else:
            candidates = sorted(set(hyperparams) | set(device_fields))
            close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            hint += _switch_hint(name)
            raise ScheduleError(
                f"schedule key {name!r} matches no optimizer hyperparameter "
                f"({', '.join(sorted(hyperparams)) or 'none: the optimizer injects none'}) and "
                f"no Device field ({', '.join(sorted(device_fields)) or 'none'}).{hint}"
            )
        if isinstance(value, ReduceOnPlateau):
            base = hyperparams[name] if target == "opt" else (device_values or {}).get(name)
            if base is None and value.start is None:
                raise ScheduleError(
                    f"schedule {label!r}: ReduceOnPlateau needs the value it scales: give "
                    f"ReduceOnPlateau(..., start=<value or schedule>)"
                )
            value = value.bound(base)
            if callable(value.start):  # a schedule, or a factory of the total step count
                value.start, _ = normalize_schedule(label, value.start, total_steps)
        fn, form = normalize_schedule(label, value, total_steps)
        schedule = BoundSchedule(label, target, name, fn, form)
        if schedule.qualified in bound:
            raise ScheduleError(f"{schedule.qualified} is scheduled twice")
        bound[schedule.qualified] = schedule
    return list(bound.values())


# Hyperparameters a run keyword adds to the optimizer, for the hint when they are off.
_SWITCHED = {
    "weight_decay": "weight_decay= turns on decoupled weight decay",
    "gradient_clip_norm": "gradient_clip_norm= turns on global-norm clipping",
}


def _switch_hint(name: str) -> str:
    key = name.rpartition("/")[2]
    return f" ({_SWITCHED[key]}, then schedule it)" if key in _SWITCHED else ""


def _no_target(label: str, what: str, names: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(label.rpartition(".")[2], sorted(names), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    if what == "optimizer hyperparameter":
        hint += _switch_hint(label.rpartition(".")[2])
    return f"schedule key {label!r} names no {what} (have: {', '.join(sorted(names)) or 'none'}).{hint}"


# What a value out of range means, where it is not plain.
_RANGE_HINTS = {
    "learning_rate": " (a negative one climbs the loss)",
    "gradient_clip_norm": " (to stop clipping, build the run with gradient_clip_norm=None)",
}


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_schedule_values(
    schedules: list[BoundSchedule],
    *,
    total_steps: int | None,
    device_shapes: Mapping[str, tuple[int, ...]],
    device_dtypes: Mapping[str, Any],
) -> None:
    """Evaluate every schedule at step 0 and at the horizon's last step, and refuse values a
    step cannot use, naming the key: not a real number, an optimizer hyperparameter out of its
    range (`nitro.optim.ranges`: not finite, a negative learning rate, a `b1` of 1 or more),
    or a Device value of the wrong shape or kind."""
    steps = [0] if not total_steps else sorted({0, total_steps - 1})
    for schedule in schedules:
        for step in steps:
            try:
                value = schedule.fn(step)
            except Exception as error:  # noqa: BLE001 - reported with the key
                raise ScheduleError(
                    f"schedule {schedule.key!r} raised {type(error).__name__} at step {step}: "
                    f"{error}"
                ) from error
            where = f"schedule {schedule.key!r} gives {_describe(value)} at step {step}"
            if isinstance(value, (str, bytes)) or value is None:
                raise ScheduleError(f"{where}; a schedule returns a number")
            array = np.asarray(value)
            if array.dtype.kind not in "biuf":
                kind = "a complex number" if array.dtype.kind == "c" else f"dtype {array.dtype}"
                raise ScheduleError(f"{where} ({kind}); a schedule returns a real number")
            if schedule.target == "opt":
                if array.ndim:
                    raise ScheduleError(
                        f"{where} (shape {array.shape}); an optimizer hyperparameter is one "
                        f"number per step"
                    )
                key = schedule.name.rpartition("/")[2]
                bound = ranges.of(key)
                if not bound.admits(float(array)):
                    usual = "" if bound.example is None else f", e.g. {ranges.show(bound.example)}"
                    raise ScheduleError(
                        f"{where}; {key} must be {bound}{_RANGE_HINTS.get(key, '')}{usual}"
                    )
            else:
                shape = tuple(device_shapes.get(schedule.name, ()))
                if array.shape != shape:
                    raise ScheduleError(
                        f"{where} (shape {array.shape}); Device field {schedule.name!r} has "
                        f"shape {shape}, and a schedule cannot change it"
                    )
                if array.dtype.kind == "f" and np.dtype(device_dtypes[schedule.name]).kind in "iub":
                    if not np.all(np.equal(np.mod(array, 1), 0)):
                        raise ScheduleError(
                            f"{where}; Device field {schedule.name!r} holds "
                            f"{np.dtype(device_dtypes[schedule.name]).name}"
                        )
