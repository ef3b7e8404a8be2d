"""What only a population has, over the tools: its members' rows in `nitro_status`, and
`nitro_population`'s axes or members checked (`MemberPlan`), with the argument a
`PopulationError` is about (the best member is `Population.ranking`'s first).

A population (`nitro.Population`, docs/population.md) is one run of many members trained by
one program; everything else the tools say or do about it is what they say or do about a run
(`describe`, `session`).

>>> import nitro
>>> from nitro.examples.digits import Digits
>>> pop = nitro.Population(Digits(max_epochs=1), learning_rate=[1e-3, 1e-2], progress=False)
>>> rows = member_rows(pop.train(), [None, None])
>>> [(r["member"], r["settings"], r["epoch"], r["step"]) for r in rows]
[(0, {'learning_rate': 0.001}, 1, 9), (1, {'learning_rate': 0.01}, 1, 9)]
>>> axes_of(pop.members)
{'learning_rate': [0.001, 0.01]}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nitro.engine.member_axis import shown_settings
from nitro.engine.run_keywords import RUN_KEYWORDS
from nitro.errors import PopulationError
from nitro.handle.population import Population
from nitro.mcp.convert import jsonable
from nitro.mcp.json_keywords import check_run_keywords
from nitro.mcp.lookup import ToolFailure

__all__ = [
    "MemberPlan",
    "axes_of",
    "check_member",
    "latest_rows",
    "member_files",
    "member_rows",
    "population_failure",
]


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


def latest_rows(population: Population) -> dict[int, dict[str, Any]]:
    """Member -> its latest history row (without its settings, counters and `stopped`)."""
    frame = population.history()
    if frame.empty:
        return {}
    left_out = {k for s in population.members for k in s} | {"member", "epoch", "step", "stopped"}
    latest: dict[int, dict[str, Any]] = {}
    for row in frame.reset_index().to_dict("records"):
        latest[int(row["member"])] = {str(k): v for k, v in row.items() if k not in left_out}
    return latest


def member_rows(population: Population, losses: Sequence[Any]) -> list[dict[str, Any]]:
    """Each member's settings, why it stopped, its own epoch and step (a stopped member's
    stay where it stopped), its latest loss (`losses`) and latest epoch's metrics."""
    stopped, stopped_at = population.stopped, population.stopped_at
    frame = population.history()
    epochs: dict[int, int] = {}
    if not frame.empty:
        for member, epoch in frame.index:
            epochs[int(member)] = max(int(epoch), epochs.get(int(member), 0))
    rows = latest_rows(population)
    return [
        {
            "member": m,
            "settings": jsonable(shown_settings(setting)),
            "stopped": stopped.get(m),
            "epoch": epochs.get(m, 0) if m in stopped else population.epoch,
            "step": stopped_at.get(m, population.step) if m in stopped else population.step,
            "loss": jsonable(losses[m]),
            "metrics": jsonable(rows.get(m, {})),
        }
        for m, setting in enumerate(population.members)
    ]


def check_member(run_id: str, count: int | None, member: int | None) -> None:
    """Refuse a member index the population `run_id` of `count` members does not have."""
    if count is not None and member is not None and member >= count:
        raise ToolFailure(
            f"member: population {run_id} has {count} members (0 to {count - 1}); got {member}"
        )


def member_files(population: Population) -> dict[str, Any]:
    """What `nitro_logger` says about a population: each member logs into a directory of its
    own in the population's run directory, and the files there."""
    root = Path(population.run_dir)
    members = []
    for m in range(len(population)):
        directory = root / f"member-{m}"
        files = sorted(f.name for f in directory.iterdir()) if directory.is_dir() else []
        members.append({"member": m, "dir": str(directory), "files": files})
    return {
        "logger": "per member",
        "members": members,
        "run_url": root.as_uri(),
        "note": "each member logs into member-<i>/ of the run directory (metrics.jsonl by "
        "default; none before the population first trains); nitro_status with history=true "
        "reads every member's epochs",
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
class MemberPlan:
    """What varies across a population's members, checked: the axes or each member's
    values, which argument gave each name (for a `PopulationError`), and the argument that
    gave them (`axes` or `members`). The shared part is a run's (`nitro_train`'s checks)."""

    axes: dict[str, list[Any]]
    members: list[dict[str, Any]] | None
    where: dict[str, str]
    argument: str

    @property
    def count(self) -> int:
        """How many members the population has: one per member, or per axes' combination."""
        if self.members is not None:
            return len(self.members)
        return math.prod(len(values) for values in self.axes.values())

    @classmethod
    def check(
        cls,
        axes: Mapping[str, list[Any]] | None,
        members: list[Mapping[str, Any]] | None,
        shared: Mapping[str, str],
        overrides: Mapping[str, Any] | None,
    ) -> MemberPlan:
        """`shared`: the run keywords every member shares -> the argument that gave each."""
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
        varied = {name: f"axes.{name}" for name in axes or {}}
        for i, setting in enumerate(members or []):
            for name in setting:
                varied.setdefault(name, f"members[{i}].{name}")
        for name, argument in varied.items():
            if name in shared:
                raise ToolFailure(
                    f"{argument}: {name!r} varies across the members, and {shared[name]} gives "
                    f"every member one value; give it once"
                )
            if name in (overrides or {}):
                raise ToolFailure(
                    f"{argument}: {name!r} varies across the members, and overrides.{name} "
                    f"gives every member one value; give it once"
                )
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
        argument = "axes" if axes is not None else "members"
        return cls(checked_axes, checked_members, {**shared, **varied}, argument)


def _member_value(name: str, value: Any, where: str) -> Any:
    """One member's value of a run keyword, checked as `nitro_train` checks it (a field's
    value is the population's to check)."""
    if name not in RUN_KEYWORDS:
        return value
    return check_run_keywords({name: value}, {name: where})[name]
