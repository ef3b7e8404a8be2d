"""Populations over the tools: how `nitro_population`'s JSON arguments are checked
(`PopulationPlan`), which argument a `PopulationError` is about, and what `nitro_status` and
`nitro_runs` say about a population.

A population (`nitro.Population`, docs/population.md) is one run of many members trained by
one program. The tools read it through its public API and a `MemberSteps` reporter, its
progress reporter: each member's latest loss, the epoch it trains to, its latest notes.

>>> import nitro
>>> from nitro.examples.digits import Digits
>>> recorder = MemberSteps()
>>> pop = nitro.Population(Digits(max_epochs=1), learning_rate=[1e-3, 1e-2], progress=recorder)
>>> row = describe_population("p", None, pop.train(), names=["pop"], brief=True)
>>> row["kind"], row["members"], row["axes"], row["status"], row["epoch"]
('notebook', 2, {'learning_rate': [0.001, 0.01]}, 'done', 1)
>>> len(row["losses"]) == 2 and recorder.target_epoch
1
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nitro.engine.population import shown_settings
from nitro.engine.run_keywords import RUN_KEYWORDS
from nitro.errors import PopulationError
from nitro.handle.population import Population
from nitro.mcp.convert import jsonable
from nitro.mcp.describe import identity, tool_outcome
from nitro.mcp.json_keywords import check_run_keywords
from nitro.mcp.lookup import ToolFailure, build_experiment, find_experiment
from nitro.mcp.registry import RunRecord

__all__ = [
    "MemberSteps",
    "PopulationPlan",
    "axes_of",
    "best_member",
    "describe_population",
    "member_steps",
    "population_failure",
]


class MemberSteps:
    """A population's reporter keeping what its history does not hold yet: each member's
    latest loss (the history has whole epochs only), the epoch it trains to, its notes (a
    member stopped, a diverged step)."""

    def __init__(self, notes: int = 10) -> None:
        self.target_epoch: int | None = None
        self.latest_step: int | None = None
        self.losses: list[float | None] = []
        self.notes: collections.deque[str] = collections.deque(maxlen=notes)

    def start_run(self, population: Any, target_epoch: int) -> None:
        self.target_epoch = target_epoch

    def member_steps(self, first: int, losses: Any) -> None:
        values = np.asarray(losses, dtype=np.float64)
        latest = list(self.losses) + [None] * (values.shape[0] - len(self.losses))
        for i, row in enumerate(values):
            finite = row[np.isfinite(row)]  # NaN: the member had stopped
            if finite.size:
                latest[i] = float(finite[-1])
        self.losses, self.latest_step = latest, first + values.shape[1] - 1

    def note(self, message: str, done: bool = False) -> None:
        self.notes.append(message)


def member_steps(population: Population) -> MemberSteps | None:
    reporter = population.reporter
    return reporter if isinstance(reporter, MemberSteps) else None


def axes_of(settings: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Each setting's name -> its distinct values, in member order (a cartesian product's
    axes; for a list of members, the values they take)."""
    axes: dict[str, list[Any]] = {}
    for setting in settings:
        for name, value in shown_settings(setting).items():
            values = axes.setdefault(name, [])
            if jsonable(value) not in values:
                values.append(jsonable(value))
    return axes


def _latest_rows(population: Population) -> dict[int, dict[str, Any]]:
    """Member -> its latest history row (without its settings, counters and `stopped`)."""
    frame = population.history()
    if frame.empty:
        return {}
    left_out = {k for s in population.members for k in s} | {"member", "epoch", "step", "stopped"}
    latest: dict[int, dict[str, Any]] = {}
    for row in frame.reset_index().to_dict("records"):
        latest[int(row["member"])] = {str(k): v for k, v in row.items() if k not in left_out}
    return latest


def best_member(
    population: Population, metric: str, mode: str | None
) -> tuple[int | None, float | None, list[str]]:
    """(member, value) whose latest `metric` is best among the members still training
    (`mode` "min" or "max"; default "min" for a metric named like a loss, as `pop.best()`
    has it), or (None, None) when none has a finite one; and the history's columns."""
    mode = mode or ("min" if "loss" in metric else "max")
    rows = _latest_rows(population)
    stopped = population.stopped
    scored = []
    for index, row in rows.items():
        value = row.get(metric)
        if index in stopped or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        scored.append((value if mode == "min" else -value, index, float(value)))
    columns = sorted({k for row in rows.values() for k in row})
    if not scored:
        return None, None, columns
    _, index, value = min(scored)
    return index, value, columns


def describe_population(
    run_id: str,
    record: RunRecord | None,
    population: Population | None,
    names: list[str],
    brief: bool = False,
) -> dict[str, Any]:
    """The population's row: identity, status, members and axes, progress; unless `brief`,
    each member's settings, latest loss and metrics, the stopped members, notes and the
    tool run's result and error. `population` is None while a tool run sets it up."""
    row: dict[str, Any] = {"run_id": run_id, **identity(record, population), "population": True}
    if population is None:
        row.update(members=None, axes=None, phase="setup", epoch=0, step=0, losses=None)
    else:
        row.update(_progress(population))
        if not brief:
            row.update(_members(population, row["losses"]), names=names)
    if brief:
        return row
    if record is not None:
        row.update(tool_outcome(record))
    return row


def _progress(population: Population) -> dict[str, Any]:
    """Members, axes, phase, counters, and each member's latest loss: the latest step's, read
    back by the reporter, else the latest epoch's."""
    recorder = member_steps(population)
    read = [] if recorder is None else recorder.losses
    rows = _latest_rows(population)
    losses = [
        read[m] if m < len(read) else rows.get(m, {}).get("loss") for m in range(len(population))
    ]
    return {
        "members": len(population),
        "axes": axes_of(population.members),
        "phase": population.phase,
        "epoch": population.epoch,
        "target_epoch": None if recorder is None else recorder.target_epoch,
        "step": population.step,
        "losses": jsonable(losses),
    }


def _members(population: Population, losses: list[Any]) -> dict[str, Any]:
    """Each member's settings, why it stopped, latest loss (`losses`) and metrics; the best
    member by val_loss."""
    recorder = member_steps(population)
    stopped = population.stopped
    rows = _latest_rows(population)
    best, value, _ = best_member(population, "val_loss", "min")
    return {
        "running": population.running,
        "stop_reason": population.stop_reason,
        "stopped": sorted(stopped),
        "best": {"metric": "val_loss", "member": best, "value": value},
        "steps_per_call": population.steps_per_call,
        "member_status": [
            {
                "member": m,
                "settings": jsonable(shown_settings(setting)),
                "stopped": stopped.get(m),
                "loss": losses[m],
                "metrics": jsonable(rows.get(m, {})),
            }
            for m, setting in enumerate(population.members)
        ],
        "notes": [] if recorder is None else list(recorder.notes),
    }


def population_failure(
    error: PopulationError, where: Mapping[str, str], default: str
) -> ToolFailure:
    """`error`'s message as a tool error, led by the argument it is about: `where` maps the
    names the population was given (axes, member settings, shared keywords) to the argument
    that gave each (`axes.width`, `keywords.logger`)."""
    message = str(error)
    for name, argument in where.items():
        if message.startswith((f"{name} ", f"axis {name}=")) or f"does not take {name}=" in message:
            return ToolFailure(f"{argument}: {message}")
    return ToolFailure(f"{default}: {message}")


@dataclasses.dataclass
class PopulationPlan:
    """A population's checked arguments: the experiment instance, the axes or members, the
    shared run keywords, and which argument gave each name (for a `PopulationError`)."""

    instance: Any
    axes: dict[str, list[Any]]
    members: list[dict[str, Any]] | None
    shared: dict[str, Any]
    where: dict[str, str]
    argument: str  # "axes" or "members"

    @property
    def count(self) -> int:
        """How many members the population has: one per member, or per axes' combination."""
        if self.members is not None:
            return len(self.members)
        return math.prod(len(values) for values in self.axes.values())

    @classmethod
    def check(
        cls,
        namespace: Mapping[str, Any],
        experiment: str | None,
        overrides: Mapping[str, Any] | None,
        keywords: Mapping[str, Any] | None,
        axes: Mapping[str, list[Any]] | None,
        members: list[Mapping[str, Any]] | None,
    ) -> PopulationPlan:
        if axes is not None and members is not None:
            raise ToolFailure(
                "members: give axes ({name: [values]}: every combination is a member) or "
                "members ([{...}, ...]: one object per member), not both"
            )
        if axes is None and members is None:
            raise ToolFailure(
                'axes: give what varies across the members: axes {"learning_rate": [0.001, '
                '0.01]} (every combination is a member) or members [{"learning_rate": 0.001}, '
                "...]"
            )
        if experiment is None:
            raise ToolFailure(
                "experiment: required: an experiment class name ('Digits' in a notebook) or a "
                "module-qualified one ('nitro.examples.digits.Digits'); or run_id for a "
                "population that exists"
            )
        shared = dict(keywords or {})
        if "weights" in shared:
            raise ToolFailure(
                "keywords.weights: a population's members start from their own initialization "
                "(each member's seed); weights are for a single run (nitro_train)"
            )
        if "progress" in shared:
            raise ToolFailure(
                "keywords.progress: a population the tools start reports its progress to "
                "nitro_status (each member's loss, the notes); leave progress out"
            )
        where = {name: f"keywords.{name}" for name in shared}
        varied = {name: f"axes.{name}" for name in axes or {}}
        for i, setting in enumerate(members or []):
            for name in setting:
                varied.setdefault(name, f"members[{i}].{name}")
        for name, argument in varied.items():
            if name in shared:
                raise ToolFailure(
                    f"{argument}: {name!r} varies across the members, and {where[name]} gives "
                    f"every member one value; give it once"
                )
            if name in (overrides or {}):
                raise ToolFailure(
                    f"{argument}: {name!r} varies across the members, and overrides.{name} "
                    f"gives every member one value; give it once"
                )
        target = find_experiment(experiment, namespace)
        checked = check_run_keywords(shared, where)
        # a list would be an axis: a shared value that is a list (eval_splits) goes as a tuple
        checked = {k: tuple(v) if isinstance(v, list) else v for k, v in checked.items()}
        checked_axes = {
            name: [_member_value(name, v, f"axes.{name}[{i}]") for i, v in enumerate(values)]
            for name, values in (axes or {}).items()
        }
        checked_members = None
        if members is not None:
            checked_members = [
                {k: _member_value(k, v, f"members[{i}].{k}") for k, v in setting.items()}
                for i, setting in enumerate(members)
            ]
        return cls(
            build_experiment(target, overrides),
            checked_axes,
            checked_members,
            checked,
            {**where, **varied},
            "axes" if axes is not None else "members",
        )


def _member_value(name: str, value: Any, where: str) -> Any:
    """One member's value of a run keyword, checked as `nitro_train` checks it (a field's
    value is the population's to check)."""
    if name not in RUN_KEYWORDS:
        return value
    return check_run_keywords({name: value}, {name: where})[name]
