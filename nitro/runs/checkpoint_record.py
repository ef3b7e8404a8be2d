"""What a checkpoint records besides its arrays: one frozen, typed `CheckpointRecord`, the JSON
item `meta` of every saved step, for a run and a population alike (a run is a population of
one member). `to_json` writes it and `from_json` reads it back; a record of an earlier release
(keys missing, or others not known here) reads with defaults for what it lacks.

A run's record keeps its member's fields at the top level (`saved["meta"]["history"]`), as
Nitro has always written them; a population's lists them under `members`, with the shared
counters (position in the epoch, pruning asked for) beside them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from nitro._version import __version__
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import EpochTotals, HistoryRows, TrainState, Variables
from nitro.experiments.fingerprint import code_digest
from nitro.optim.fed_optimizer import describe_optimizer
from nitro.runs.checkpoint_trees import json_safe
from nitro.runs.training_config import training_config

__all__ = [
    "FORMAT",
    "POPULATION",
    "RUN",
    "CheckpointRecord",
    "MemberRecord",
    "PartialEpoch",
    "config_of",
    "config_token",
    "setting_differences",
    "setting_token",
    "shown_setting",
]

FORMAT = 1
RUN, POPULATION = "run", "population"


def config_token(value: Any) -> Any:
    """A JSON value standing for a GraphConst value; functions stand for their code."""
    if callable(value) and not isinstance(value, type) and hasattr(value, "__code__"):
        return f"<code {code_digest(value)}>"
    return json_safe(value)


def config_of(setup: RunSetup) -> dict[str, Any]:
    """The GraphConst values of a run, as its records keep them."""
    return {name: config_token(v) for name, v in setup.experiment.graphconst.items()}


@dataclasses.dataclass(frozen=True)
class PartialEpoch:
    """The epoch under way of a run stopped in its middle: the batches it completed, whether
    it trained them all (its validation not done), its running sums and the training
    source's iterator state, so a resume continues at the next batch."""

    position: int
    sums: Mapping[str, float | int]  # `EpochTotals.to_json`
    trained: bool = False
    data_state: Any = None

    @classmethod
    def of(cls, position: int, totals: EpochTotals, **fields: Any) -> PartialEpoch:
        return cls(position, totals.to_json(), **fields)

    def totals(self) -> EpochTotals:
        """The epoch's running sums, a new `EpochTotals` (its train metrics start afresh)."""
        return EpochTotals.from_json(self.sums)

    def to_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "trained": self.trained,
            **self.sums,
            "data_state": self.data_state,
        }

    @classmethod
    def from_json(cls, data: Any) -> PartialEpoch | None:
        if not isinstance(data, Mapping) or not data:
            return None
        return cls(
            position=int(data.get("position", 0)),
            sums=EpochTotals.from_json(data).to_json(),
            trained=bool(data.get("trained", False)),
            data_state=data.get("data_state"),
        )


# the fields of a population's member that a run's record has not
_MEMBER_ONLY = ("index", "run_id", "settings", "healthy", "stopped", "stopped_at")


@dataclasses.dataclass(frozen=True)
class MemberRecord:
    """One member's part of a checkpoint: its history, validations within epochs, the
    metrics of its newest epoch, its epoch under way, its Device values, its loggers'
    state, the batches a spike's roll-back left out and its rewinds; in a population also its index, run id, settings, whether its steps are finite
    and why and at which step it stopped."""

    seed: int | None = None
    history: tuple[Mapping[str, Any], ...] = ()
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    validations: tuple[Mapping[str, Any], ...] = ()
    partial_epoch: PartialEpoch | None = None
    device: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    logger: Any = None
    index: int = 0
    run_id: str | None = None
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    healthy: bool = True
    stopped: str | None = None
    stopped_at: int | None = None
    skipped_batches: tuple[Mapping[str, Any], ...] = ()
    rewinds: tuple[Mapping[str, Any], ...] = ()

    def to_json(self, in_population: bool) -> dict[str, Any]:
        """Its JSON fields (made JSON-safe by `CheckpointRecord.to_json`); a run's lack the
        fields only a population's member has."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["partial_epoch"] = self.partial_epoch.to_json() if self.partial_epoch else None
        if in_population:
            return {"member": data.pop("index"), **data}
        return {k: v for k, v in data.items() if k not in _MEMBER_ONLY}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], index: int = 0) -> MemberRecord:
        seed, stopped_at = data.get("seed"), data.get("stopped_at")
        return cls(
            seed=int(seed) if seed is not None else None,
            history=tuple(HistoryRows.from_json(data.get("history"))),
            metrics=dict(data.get("metrics") or {}),
            validations=tuple(HistoryRows.from_json(data.get("validations"))),
            partial_epoch=PartialEpoch.from_json(data.get("partial_epoch")),
            device=dict(data.get("device") or {}),
            logger=data.get("logger"),
            index=int(data.get("member", index)),
            run_id=data.get("run_id"),
            settings=dict(data.get("settings") or {}),
            healthy=bool(data.get("healthy", True)),
            stopped=data.get("stopped"),
            stopped_at=int(stopped_at) if stopped_at is not None else None,
            skipped_batches=tuple(HistoryRows.from_json(data.get("skipped_batches"))),
            rewinds=tuple(HistoryRows.from_json(data.get("rewinds"))),
        )


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    """The JSON record of one saved step (orbax item `meta`).

    Attributes:
      kind: "run" or "population".
      run_id, experiment: the run (or population) and its experiment's owner.
      step, epoch: the counters it was saved at.
      members: one `MemberRecord` (a run: `member`), or one per member of a population.
      metrics: a run's newest epoch's metrics; a population's best value of the
        checkpointer's metric among its healthy members.
      stop_reason: why the run ended at this step (None: it went on).
      swaps: the live edits swapped in while training (a run's).
      position, batches, prune: a population's position in the epoch under way, whether
        its members share batches, and the members it was asked to prune.
      search: a population's search (`PBT`, `Halving`) as it stood: its boundaries applied,
        its lineage, each member's fed values, the members that train.
      graphconst, code, optimizer, training, checkpointer: what a resume compares.
      preset: the preset the experiment was built from (None: none, or an earlier release).
      format, nitro, jax: the record's format and the versions that wrote it.
    """

    run_id: str
    step: int
    epoch: int
    members: tuple[MemberRecord, ...]
    kind: str = RUN
    experiment: str | None = None
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    stop_reason: str | None = None
    swaps: tuple[Mapping[str, Any], ...] = ()
    position: int = 0
    batches: str = "shared"
    prune: Mapping[int, str] = dataclasses.field(default_factory=dict)
    search: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    graphconst: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    code: Mapping[str, str] = dataclasses.field(default_factory=dict)
    optimizer: str | None = None
    training: Mapping[str, Any] | None = None
    checkpointer: Mapping[str, Any] | None = None
    preset: str | None = None
    format: int = FORMAT
    nitro: str | None = __version__
    jax: str | None = jax.__version__

    @classmethod
    def of(
        cls,
        setup: RunSetup,
        *,
        run_id: str,
        step: int,
        epoch: int,
        members: tuple[MemberRecord, ...],
        **fields: Any,
    ) -> CheckpointRecord:
        """A record of a run (or a population whose members share `setup`'s program): what
        a resume compares is taken from `setup`."""
        checkpointer = setup.checkpointer
        return cls(
            run_id=run_id,
            step=step,
            epoch=epoch,
            members=members,
            experiment=setup.owner,
            graphconst=config_of(setup),
            code={unit: fp.digest for unit, fp in setup.experiment.code.items()},
            optimizer=describe_optimizer(setup.optimizer) if setup.optimizer is not None else None,
            training=training_config(setup),
            checkpointer=_checkpointer_json(checkpointer),
            preset=setup.experiment.preset,
            **fields,
        )

    def graphconst_differences(self, setup: RunSetup, saved_as: str, now_as: str) -> list[str]:
        """One line per GraphConst value that differs between this record and `setup`."""
        saved, now = self.graphconst, config_of(setup)
        return [
            f"  {name}: {saved_as} {saved.get(name, '<unset>')!r}, "
            f"{now_as} {now.get(name, '<unset>')!r}"
            for name in sorted(set(saved) | set(now))
            if saved.get(name) != now.get(name)
        ]

    @property
    def member(self) -> MemberRecord:
        """A run's own record (a population's first member)."""
        return self.members[0]

    def to_json(self) -> dict[str, Any]:
        """The record as JSON: a run's member fields at the top level, a population's under
        `members` (with the fields only a population has)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.kind == POPULATION:
            data["members"] = [m.to_json(in_population=True) for m in self.members]
            del data["swaps"]
        else:
            del data["members"], data["position"], data["batches"], data["prune"]
            del data["search"]
            data.update(self.member.to_json(in_population=False))
        return json_safe(data)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckpointRecord:
        """The record `to_json` wrote, or an earlier release did (what it lacks takes its
        default; keys not known here are left out)."""
        kind = data.get("kind") or RUN
        if kind == POPULATION:
            members = tuple(
                MemberRecord.from_json(m, i)
                for i, m in enumerate(data.get("members") or ())
                if isinstance(m, Mapping)
            )
        else:
            members = (MemberRecord.from_json(data),)
        return cls(
            run_id=str(data.get("run_id") or ""),
            step=int(data.get("step") or 0),
            epoch=int(data.get("epoch") or 0),
            members=members,
            kind=kind,
            experiment=data.get("experiment"),
            metrics=dict(data.get("metrics") or {}),
            stop_reason=data.get("stop_reason"),
            swaps=tuple(HistoryRows.from_json(data.get("swaps"))),
            position=int(data.get("position") or 0),
            batches=data.get("batches") or "shared",
            prune={int(k): str(v) for k, v in (data.get("prune") or {}).items()},
            search=dict(data.get("search") or {}),
            graphconst=dict(data.get("graphconst") or {}),
            code=dict(data.get("code") or {}),
            optimizer=data.get("optimizer"),
            training=data.get("training"),
            checkpointer=data.get("checkpointer"),
            preset=data.get("preset"),
            format=int(data.get("format") or FORMAT),
            nitro=data.get("nitro"),
            jax=data.get("jax"),
        )

    def train_state(
        self, variables: Variables, *, seed: int, member: MemberRecord | None = None
    ) -> TrainState:
        """The state a run's checkpoint saved (or a population's `member`): `variables` (its
        arrays, read and placed) and the counters, seed and history recorded here (`seed`:
        where it records none). It resumes at the start of the epoch after its last committed
        one, or, for a run stopped in the middle of an epoch, at the next batch of that epoch
        with its running sums."""
        member = member or self.member
        partial = member.partial_epoch
        return TrainState(
            variables=variables,
            step=self.step,
            epoch=self.epoch,
            position=partial.position if partial else 0,
            seed=member.seed if member.seed is not None else seed,
            history=list(member.history),
            validations=list(member.validations),
            swaps=[dict(row) for row in self.swaps],
            totals=partial.totals() if partial else None,
            epoch_trained=partial.trained if partial else False,
            data_state=partial.data_state if partial else None,
            skipped_batches=[dict(row) for row in member.skipped_batches],
            rewinds=[dict(row) for row in member.rewinds],
        )


def _checkpointer_json(checkpointer: Any) -> dict[str, Any] | None:
    """A run's `Checkpointer` as its records keep it: its fields, a naming hook by its
    qualified name."""
    if checkpointer is None:
        return None
    fields = {f.name: getattr(checkpointer, f.name) for f in dataclasses.fields(checkpointer)}
    name = fields.get("name")
    if name is not None and not isinstance(name, str):
        fields["name"] = getattr(name, "__qualname__", None) or type(name).__name__
    return fields


# ---------------------------------------------------------------------------------------------
# a population member's settings, as the records keep them

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def setting_token(value: Any, _depth: int = 0) -> Any:
    """A member's setting as JSON that is the same in every process for the same value:
    numbers, strings and containers as they are; a function as its qualified name, a
    digest of its code and the plain values it closes over (an optax schedule's init and end
    values, its steps); other objects by their repr, less memory addresses.

    >>> import optax
    >>> token = lambda end: setting_token(optax.linear_schedule(1e-3, end, 60))
    >>> token(1e-2) == token(1e-2), token(1e-2) == token(2e-2)
    (True, False)
    """
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [setting_token(v, _depth) for v in value]
    if isinstance(value, Mapping):
        return {str(k): setting_token(v, _depth) for k, v in value.items()}
    if callable(value) and hasattr(value, "__code__"):
        name = getattr(value, "__qualname__", type(value).__name__)
        token: dict[str, Any] = {"function": name, "code": code_digest(value)}
        if _depth < 4:  # the schedules an optax schedule joins; not a recursion of its own
            closure = [cell.cell_contents for cell in getattr(value, "__closure__", None) or ()]
            token["closure"] = [
                setting_token(c, _depth + 1)
                for c in closure
                if c is None or isinstance(c, (bool, int, float, str, np.generic)) or callable(c)
            ]
        return token
    return _ADDRESS.sub("", repr(value))


def setting_differences(saved: Sequence[Mapping[str, Any]], now: Sequence[Mapping[str, Any]]):
    """What differs between a checkpoint's members' settings and this population's, one
    line each (empty: the same members)."""
    lines = []
    saved_axes = sorted({k for s in saved for k in s})
    axes = sorted({k for s in now for k in s})
    if saved_axes != axes:
        lines.append(
            f"  axes: the checkpoint's {', '.join(saved_axes) or 'none'}; this population's "
            f"{', '.join(axes) or 'none'}"
        )
    if len(saved) != len(now):
        lines.append(f"  members: the checkpoint's {len(saved)}, this population's {len(now)}")
    for index, (before, after) in enumerate(zip(saved, now, strict=False)):
        for name in sorted(set(before) | set(after)):
            if before.get(name, "<unset>") != after.get(name, "<unset>"):
                lines.append(
                    f"  member {index} {name}: the checkpoint's "
                    f"{shown_setting(before.get(name, '<unset>'))}, this population's "
                    f"{shown_setting(after.get(name, '<unset>'))}"
                )
    return lines


def shown_setting(token: Any) -> str:
    """A member's setting as a record keeps it (`setting_token`), shown short."""
    if isinstance(token, Mapping) and "function" in token:
        return f"{token['function']} {token.get('closure')}"
    text = repr(token)
    return text if len(text) <= 80 else text[:77] + "..."
