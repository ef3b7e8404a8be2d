"""A population's members as `Nitro` handles (`member`, `best`) and as tables, and the
refusals of axes and values they cannot share (`check_axis`, `check_shared`,
`check_one_program`). See docs/population.md."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nitro.core.progress import ranked_members
from nitro.core.train_state import Variables
from nitro.engine.member_axis import Member, Stacked, shown_settings, unstack
from nitro.engine.population_search import Search
from nitro.engine.run_keywords import RUN_KEYWORDS
from nitro.errors import PopulationError
from nitro.experiments.declaration import FieldKind
from nitro.experiments.presets import replace
from nitro.handle.handle import Nitro
from nitro.handle.run_handle import RunHandle, scalar_frame
from nitro.programs.compile_cache import graphconst_keys
from nitro.programs.train_step import train_step_spec
from nitro.runs.epoch_saves import finite
from nitro.runs.initial_weights import WeightsSource

__all__ = ["PopulationMembers", "check_axis", "check_one_program", "check_shared"]

# Run keywords a member may set for itself: their values are fed to the program (or, for
# the seed, make its initial weights and step keys), never part of it.
MEMBER_KEYWORDS = (
    "seed",
    "learning_rate",
    "schedules",
    "weight_decay",
    "gradient_clip_norm",
    "group_lr",
)

# Run keywords that shape the train-step program: shared by every member.
PROGRAM_KEYWORDS = {
    "optimizer": "it is the optimizer's structure; vary its fed hyperparameters instead "
    "(learning_rate=, weight_decay=, schedules=)",
    "accum": "micro-batches per step are the program's shape",
    "ema": "the moving average is part of the program",
    "sam": "sharpness-aware minimization is part of the program",
    "check_divergence": "the guard is part of the program",
    "freeze_batch_stats": "keeping a frozen group's batch statistics is part of the program",
    "steps_per_dispatch": "steps per call are the program's shape",
    "n_devs": "the mesh is the program's placement",
    "decay_to": "where weight decay pulls is part of the optimizer's structure",
    "decay_mask": "which leaves decay is part of the optimizer's structure",
    "eval_splits": "the population validates one set of splits",
    "compile_options": "XLA's options compile the program",
    "hooks": "the members run one program, from one set of hooks",
    "remat": "what the backward pass recomputes is part of the train step",
}


class PopulationMembers(RunHandle):
    """A population's members as `Nitro` handles and as tables."""

    _members: list[Member]
    _axis: Stacked | None
    _data: Any
    _weights: Any
    _search: Search | None

    def __len__(self) -> int:
        return len(self._members)

    def _table(self, records: str, index: str):
        """Every member's `records` rows, indexed by (member, `index`), its settings first."""
        rows = [
            {"member": m.index, **shown_settings(m.settings), **row}
            for m in self._members
            for row in getattr(m.state, records)
        ]
        return scalar_frame(rows, ["member", index])

    @property
    def last_metrics(self) -> list[dict[str, Any]]:
        """Each member's latest history row (loss, validation metrics, timing; a stopped
        member's last), as `Nitro.last_metrics` is a run's; empty before its first epoch."""
        return [dict(m.state.last_row) for m in self._members]

    def skipped_batches(self, member: int | None = None):
        """The training batches a spike's roll-back left out for a member (`spike=`), a
        DataFrame as `Nitro.skipped_batches()` is a run's: the epoch (counted from 1), the
        batch's index in the source's epoch, and the step (the member's own) and loss of the
        spike. `member=None`: every member's, with a column `member` first."""
        import pandas as pd

        columns = ["epoch", "index", "step", "loss"]
        if member is not None:
            if isinstance(member, bool) or not isinstance(member, int):
                raise TypeError(f"skipped_batches(member) takes a member index, got {member!r}")
            if not 0 <= member < len(self):
                raise IndexError(f"member {member} of a population of {len(self)}")
            rows = [dict(r) for r in self._members[member].state.skipped_batches]
            return pd.DataFrame(rows, columns=pd.Index(columns))
        rows = [{"member": m.index, **r} for m in self._members for r in m.state.skipped_batches]
        return pd.DataFrame(rows, columns=pd.Index(["member", *columns]))

    def rewind(self, step: int) -> Any:
        """Refused: a population keeps no snapshots to go back to."""
        raise PopulationError(
            f"pop.rewind({step!r}): a population keeps no snapshots, so it cannot go back; "
            f"its checkpoints resume it (nitro.Population(..., resume=...)), spike= rolls a "
            f"member back over a loss spike, and pop.member(i) is a run that can rewind"
        )

    def fork(self, step: int | None = None, **changes: Any) -> Any:
        """Refused: a population keeps no snapshots to fork from."""
        raise PopulationError(
            "pop.fork(...): a population keeps no snapshots to fork from; pop.member(i) is a "
            "run that can fork, and nitro.Population(..., weights=...) starts a new population"
        )

    def member(self, index: int, **keywords: Any) -> Nitro:
        """A `Nitro` handle of member `index`: its settings as keywords, its current weights
        via `weights=` (the optimizer state and counters start fresh, as `weights=` does);
        `keywords` are passed on (e.g. `max_epochs=`, `run_dir=`)."""
        if not 0 <= index < len(self):
            raise IndexError(f"member {index} of a population of {len(self)}")
        member = self._members[index]
        epoch, step = self.epoch, member.own_step(self.step)
        if member.stopped is not None:  # its weights are those of its stop
            epoch = member.state.epoch
        with self._guard.hold(f"taking member {index} as a handle"):
            own = member.state.variables  # a member a search left out keeps its own
            variables = jax.tree.map(jnp.asarray, Variables(own.params, own.model_state))
            rows = [m.index for m in self._axis.members] if self._axis is not None else []
            if index in rows:  # its slice of the stacked variables (new arrays)
                assert self._axis is not None
                stacked = self._axis.state.variables
                position = rows.index(index)
                variables = unstack(Variables(stacked.params, stacked.model_state), position)
            where = (
                f"{member.label} of a {self.cls.__name__} population at epoch {epoch}, step {step}"
            )
            changes = self._schedule_text(index)
            weights = WeightsSource.of(member.setup.model, variables, where + changes)
        data = {} if self._data is None else {"data": self._data}
        given = dict(member.setup.given_keywords)
        experiment, now = member.experiment, self._values_now(index)
        fields = {k: v for k, v in now.items() if k in member.runtime.feed.device_dtypes}
        if fields:  # PBT's values now: its Device fields on the experiment, the others keywords
            experiment = replace(experiment, **fields)
        for name, value in now.items():  # a hyperparameter no run keyword sets: a constant
            if name in RUN_KEYWORDS:
                given[name] = value
            elif name not in fields:
                given["schedules"] = {**dict(given.get("schedules") or {}), name: value}
        return Nitro(experiment, weights=weights, **{**data, **given, **keywords})

    # ------------------------------------------------------------------------------------------
    # a search's record (search=nitro.PBT(...), nitro.Halving(...))

    def lineage(self):
        """What the population's search did, a pandas DataFrame (empty without one). PBT: one
        row per exploit: `step`, `epoch`, the `member` that took the state of `copied_from`,
        the `metric` both were ranked by with their `value` and `donor_value`, and each
        perturbed value before (`old_<name>`) and after (`new_<name>`). Halving: one row per
        member ranked at each rung: `step`, `epoch`, `rung`, `member`, `metric`, `value`,
        its `rank` and whether it was `kept`."""
        import pandas as pd

        rows = []
        for row in self._search.lineage if self._search is not None else ():
            shown = {k: v for k, v in row.items() if k not in ("old", "new")}
            shown.update({f"old_{k}": v for k, v in row.get("old", {}).items()})
            shown.update({f"new_{k}": v for k, v in row.get("new", {}).items()})
            rows.append(shown)
        return pd.DataFrame(rows)

    def _values_now(self, index: int) -> dict[str, Any]:
        """The fed values PBT set for member `index`, as they are now (empty: none)."""
        search = self._search
        if search is None or not search.names:
            return {}
        return dict(search.values[index])

    def schedule(self, index: int | None = None) -> dict[str, list[tuple[int, Any]]]:
        """The values member `index`'s weights were trained with (default: the best member's,
        as `best()` ranks), following PBT's lineage back through each member whose state it
        took: fed name -> `[(first step, value), ...]`, each value fed from its step on
        (steps counted from 0). Empty without PBT. `replay()` trains a run on it."""
        search = self._search
        if search is None or not search.names:
            return {}
        index = self._ranked_first() if index is None else index
        if not 0 <= index < len(self):
            raise IndexError(f"member {index} of a population of {len(self)}")
        changes, member, bound = [], index, None
        while True:
            taken = [
                r
                for r in search.lineage
                if r["member"] == member and (bound is None or r["step"] < bound)
            ]
            if not taken:
                changes.append((0, search.initial[member]))
                break
            last = max(taken, key=lambda r: r["step"])
            changes.append((int(last["step"]), last["new"]))
            member, bound = int(last["copied_from"]), int(last["step"])
        schedule: dict[str, list[tuple[int, Any]]] = {}
        for step, values in reversed(changes):
            for name, value in values.items():
                points = schedule.setdefault(name, [])
                if not points or points[-1][1] != value:
                    points.append((step, value))
        return schedule

    def _schedule_text(self, index: int) -> str:
        schedule = self.schedule(index)
        if not any(len(points) > 1 for points in schedule.values()):
            return ""
        return "; trained with " + "; ".join(
            f"{name} " + ", ".join(f"{value:.4g} from step {step}" for step, value in points)
            for name, points in schedule.items()
        )

    def replay(self, index: int | None = None, **keywords: Any) -> Nitro:
        """A `Nitro` handle that trains member `index` (default: the best) from the start,
        its PBT-perturbed values fed as schedules of its steps (`schedule(index)`): the
        population's search, replayed as a plain run (its weights are not copied from other
        members, so it does not reproduce the member bit for bit). `keywords` go to `Nitro`."""
        index = self._ranked_first() if index is None else index
        schedule = self.schedule(index)
        member = self._members[index]
        given = {k: v for k, v in member.setup.given_keywords.items() if k not in schedule}
        schedules = dict(given.pop("schedules", None) or {})
        schedules.update({name: piecewise(points) for name, points in schedule.items()})
        experiment = member.experiment
        data = {} if self._data is None else {"data": self._data}
        weights = {} if self._weights is None else {"weights": self._weights}
        return Nitro(experiment, schedules=schedules, **{**data, **weights, **given, **keywords})

    def _ranked_first(self) -> int:
        _, ranked = self.ranking()
        if not ranked:
            raise PopulationError("no member has a finite metric to choose by: train first")
        return ranked[0][0]

    def ranking(
        self, metric: str | None = None, mode: str | None = None
    ) -> tuple[str, list[tuple[int, float]]]:
        """The metric the members rank by and, best first, (member, value) for each member
        still training whose latest `metric` is finite (default: `val_loss` when their rows
        have it, else `loss`; `mode` "min" for a metric named like a loss, else "max")."""
        latest = zip(self._members, self.last_metrics, strict=True)
        rows = [{"member": m.index, **row} for m, row in latest if m.stopped is None]
        metric, order = ranked_members(rows, metric, mode)
        ranked = [(int(row["member"]), finite(row.get(metric))) for row in order]
        return metric, [(index, value) for index, value in ranked if value is not None]

    def best(self, metric: str = "val_loss", mode: str | None = None, **keywords: Any) -> Nitro:
        """A `Nitro` handle of the member whose latest `metric` is best (`ranking`: `mode`
        "min" or "max"; default "min" for a metric named like a loss, else "max"); members
        that stopped (diverged) are passed over. See `member()` for what the handle holds."""
        _, ranked = self.ranking(metric, mode)
        if not ranked:
            known = sorted({k for row in self.last_metrics for k in row})
            raise PopulationError(
                f"no member has a finite {metric!r} to choose by"
                + (f" (history columns: {', '.join(known)})" if known else ": train first")
            )
        return self.member(ranked[0][0], **keywords)


def check_axis(cls: type, specs: Mapping[str, Any], name: str) -> None:
    """Refuse an axis that would change the program, or that members cannot hold apart."""
    spec = specs.get(name)
    if spec is not None and name not in MEMBER_KEYWORDS:
        if spec.kind is FieldKind.DEVICE:
            return
        if spec.kind is FieldKind.GRAPHCONST:
            raise PopulationError(
                f"{name} cannot vary across a population: it is a GraphConst field of "
                f"{cls.__qualname__}, which bakes into the program, and a population's "
                f"members share one program. Build one population per value of {name}, or "
                f"declare it Device[...] if it is a traced value."
            )
        raise PopulationError(
            f"{name} cannot vary across a population: it is a Host field of "
            f"{cls.__qualname__}, read by build_data or build_model, so it can change the "
            f"data or the shapes every member shares. Build one population per value of {name}."
        )
    if name in MEMBER_KEYWORDS:
        return
    if name in PROGRAM_KEYWORDS:
        raise PopulationError(
            f"{name} cannot vary across a population: {PROGRAM_KEYWORDS[name]}, and a "
            f"population's members share one program. Pass one value (not a list), or build "
            f"one population per value."
        )
    if name in RUN_KEYWORDS:
        raise PopulationError(
            f"{name} cannot vary across a population: it is the population's run keyword, "
            f"the same for every member that trains beside the others. Pass one value (not a "
            f"list)."
        )
    device = [s.name for s in specs.values() if s.kind is FieldKind.DEVICE]
    raise PopulationError(
        f"{name} is neither a run keyword nor a field of {cls.__qualname__}. A population's "
        f"axes: the run keywords {', '.join(MEMBER_KEYWORDS)}, and the Device fields "
        f"({', '.join(device) or 'none'})"
    )


def check_shared(specs: Mapping[str, Any], name: str, value: Any) -> None:
    if name not in RUN_KEYWORDS and name not in specs:
        raise PopulationError(f"{name} is neither a run keyword nor a field of the experiment")
    if name == "restore_best" and value:
        raise PopulationError(
            "restore_best=True is a single run's: a population saves its members together, "
            "ranked by their best member; pop.best() is a handle of the best member's weights"
        )


def check_one_program(members: Sequence[Member]) -> None:
    """Refuse members whose train steps would not be one program (what the axis checks let
    through but the setup decided differently: a weight decay of None beside 1e-4, say)."""
    lead = members[0]
    expected = _program_identity(lead)
    for member in members[1:]:
        found = _program_identity(member)
        for what in expected:
            if expected[what] != found[what]:
                raise PopulationError(
                    f"{member.label} cannot train in one program with {lead.label}: its "
                    f"{what} differs. A population's members share one program: give every "
                    f"member values of the same kind (a weight_decay of None and of 1e-4 "
                    f"are two optimizers, say)."
                )


def _program_identity(member: Member) -> dict[str, Any]:
    setup, state, feed = member.setup, member.state, member.runtime.feed
    spec = train_step_spec(setup, setup.splits["train"].hook_fields)
    leaves, tree = jax.tree.flatten(state.variables)
    return {
        "code (hooks, model, optimizer)": spec.code.digest,
        "program settings": tuple(sorted((k, str(v)) for k, v in spec.static.items())),
        "GraphConst values": graphconst_keys(setup.experiment.graphconst),
        "variables (parameters, model and optimizer state)": (
            tree,
            tuple((x.shape, str(x.dtype)) for x in leaves),
        ),
        "fed hyperparameters": feed.hyper_names,
        "Device fields": tuple((k, str(v)) for k, v in feed.device_dtypes.items()),
        "batches": tuple(sorted((k, str(v.batch_spec)) for k, v in setup.splits.items())),
    }


def piecewise(points: Sequence[tuple[int, Any]]) -> Callable[[Any], Any]:
    """A schedule of steps that feeds each value from its first step on (`points`: `(step,
    value)` pairs, the first at step 0); it takes an array of steps too."""
    starts = np.asarray([step for step, _ in points])
    values = np.asarray([value for _, value in points])

    def schedule(step: Any) -> Any:
        return values[np.searchsorted(starts, step, side="right") - 1]

    return schedule
