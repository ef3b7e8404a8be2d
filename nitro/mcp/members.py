"""What only a population has, over the tools: its members' rows in `nitro_status`, and
the argument a `PopulationError` is about (what a population may vary is the population's own
refusal; the best member is `Population.ranking`'s first).

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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nitro.engine.member_axis import shown_settings
from nitro.errors import PopulationError
from nitro.handle.population import Population
from nitro.mcp.convert import jsonable
from nitro.mcp.lookup import ToolFailure

__all__ = [
    "axes_of",
    "check_member",
    "member_files",
    "member_rows",
    "population_failure",
    "varied_by",
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


def member_rows(population: Population, losses: Sequence[Any]) -> list[dict[str, Any]]:
    """Each member's settings, why it stopped, its own epoch and step (a stopped member's
    stay where it stopped), its latest loss (`losses`) and latest epoch's metrics."""
    stopped, latest, steps = population.stopped, population.last_metrics, population.member_steps
    answer = []
    for m, setting in enumerate(population.members):
        metrics = {k: v for k, v in latest[m].items() if k not in ("step", "stopped")}
        epoch = int(metrics.pop("epoch", 0)) if m in stopped else population.epoch
        step = steps[m]  # its own: less the batches a spike's roll-back left out for it
        answer.append(
            {
                "member": m,
                "settings": jsonable(shown_settings(setting)),
                "stopped": stopped.get(m),
                "epoch": epoch,
                "step": step,
                "loss": jsonable(losses[m]),
                "metrics": jsonable(metrics),
            }
        )
    return answer


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
    directories = [root / f"member-{m}" for m in range(len(population))]
    return {
        "logger": "per member",
        "members": [
            {"member": m, "dir": str(d), "files": sorted(f.name for f in d.glob("*"))}
            for m, d in enumerate(directories)
        ],
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
    message = str(error)  # a member's value: "member 1 (seed=...): <what it is about>"
    about = message.split("): ", 1)[-1] if message.startswith("member ") else message
    for name, argument in where.items():
        if (
            about.startswith((f"{name} ", f"{name}=", f"axis {name}="))
            or f"does not take {name}=" in about
        ):
            return ToolFailure(f"{argument}: {message}")
    return ToolFailure(f"{default}: {message}")


def varied_by(
    axes: Mapping[str, Any] | None,
    members: Sequence[Mapping[str, Any]] | None,
    shared: Mapping[str, str],
) -> dict[str, str]:
    """Each name the members vary -> the argument that gave it (`axes.lr`, `members[1].seed`),
    refusing none, and a name `shared` (name -> its argument) gives every member once. The
    rest is the population's to refuse (`population_failure` names the argument)."""
    if axes is None and members is None:
        raise ToolFailure(
            'axes: give what varies across the members: axes {"learning_rate": [0.001, 0.01]} '
            '(every combination is a member) or members [{"learning_rate": 0.001}, ...]'
        )
    varied = {name: f"axes.{name}" for name in axes or {}}
    for i, setting in enumerate(members or []):
        varied |= {name: f"members[{i}].{name}" for name in setting if name not in varied}
    for name in sorted(varied.keys() & shared.keys()):
        raise ToolFailure(
            f"{varied[name]}: {name!r} varies across the members, and {shared[name]} gives "
            f"every member one value; give it once"
        )
    return varied
