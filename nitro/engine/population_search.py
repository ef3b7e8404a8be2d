"""What a population's scheduler (`nitro.PBT`, `nitro.Halving`) does while it trains.

The population trains in segments that end at the scheduler's boundaries (`Search.segment`:
an epoch, or a step, mid-epoch if need be); between two segments, with every call read
back, `Search.apply` takes the boundary due:

- PBT's exploit: the worst members' variables (weights, optimizer state, moving average,
  loss scale) become those of members drawn from the best, one gather along the member axis
  of the stacked state (the program is unchanged, so nothing compiles), and their fed values
  are the donors' perturbed (`StepFeed.set_value`); a lineage row records each.
- Halving's rung: the members still training are ranked, the worst stop, and `shrink`
  gathers the stacked state down to the kept ones (the population then compiles its program
  once for the smaller count).

What the scheduler decided is a function of the members' metrics and its seed (each
boundary's draws come from `numpy.random.default_rng([seed, step])`), so a run that resumes
from a checkpoint decides again what the uninterrupted run decided. The checkpoint keeps
its record (`Search.to_json`): the boundaries applied, the lineage, each member's fed values,
the running training losses since the last boundary, and which members train.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nitro.core.progress import ranked_members
from nitro.core.train_state import Variables
from nitro.engine.member_axis import Member, PopulationState, Stacked, unstack
from nitro.engine.search import PBT, Halving, Scheduler
from nitro.errors import PopulationError

__all__ = ["Search", "full_variables", "shrink"]

# member settings that are not fed values a PBT step could perturb
NOT_PERTURBED = ("seed", "schedules", "group_lr")


class Search:
    """A population's scheduler at work: where its boundaries are, what it did at each (its
    `lineage`), each member's current fed values, and which members still train."""

    def __init__(
        self,
        scheduler: Scheduler,
        members: Sequence[Member],
        say: Callable,
        mark: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.scheduler = scheduler
        self.members = list(members)
        self.say = say
        self.mark = mark  # the `searched` event: a mark on the panel's curves
        self.applied = 0  # the last boundary applied (an epoch, or a step)
        self.lineage: list[dict[str, Any]] = []
        self.sums: dict[int, list[float]] = {}  # member -> [loss sum, steps] since a boundary
        self.names = self._names() if isinstance(scheduler, PBT) else []
        self.values: dict[int, dict[str, Any]] = {
            m.index: {name: m.runtime.feed.value(name) for name in self.names} for m in members
        }
        self.initial = {index: dict(values) for index, values in self.values.items()}

    def _names(self) -> list[str]:
        """The fed values PBT perturbs, checked against the members' feeds."""
        scheduler = self.scheduler
        assert isinstance(scheduler, PBT)
        feed = self.members[0].runtime.feed
        known = feed.fed_names()
        names = list(scheduler.rules())
        if not names:  # the fed values the members differ in, else the learning rate
            axes = dict.fromkeys(k for m in self.members for k in m.settings)
            names = [k for k in axes if k not in NOT_PERTURBED and k in known]
            names = names or ["learning_rate"]
        for name in names:
            if name not in known:
                raise PopulationError(
                    f"PBT(perturb=...) names {name!r}, which is not fed to the train step: "
                    f"perturb one of {', '.join(known)} (the optimizer's hyperparameters and "
                    f"the Device fields)"
                )
            if feed.scheduled(name):
                raise PopulationError(
                    f"PBT perturbs {name!r}, which a schedule sets (schedules=): PBT changes "
                    f"constants. Leave {name!r} out of perturb=, or give it as a constant"
                )
        return names

    @property
    def unit(self) -> str:
        return self.scheduler.unit

    # ------------------------------------------------------------------------------------------
    # where the boundaries are

    def _points(self) -> Callable[[int], int | None]:
        """The next boundary after a point (epoch or step), or None."""
        scheduler = self.scheduler
        if isinstance(scheduler, Halving):
            return lambda now: next((r for r in scheduler.rungs if r > now), None)
        every = scheduler.interval
        return lambda now: None if every is None else (now // every + 1) * every

    def _now(self, state: PopulationState) -> int:
        return state.epoch if self.unit == "epochs" else state.step

    def segment(
        self, state: PopulationState, target: int, stop_at: int | None
    ) -> tuple[int, int | None]:
        """The target epoch and stop step of the segment that trains from `state`: the call's
        own, cut at the next boundary."""
        following = self._points()(self._now(state))
        if following is None:
            return target, stop_at
        if self.unit == "epochs":
            return min(target, following), stop_at
        return target, following if stop_at is None else min(stop_at, following)

    def due(self, state: PopulationState) -> bool:
        """A boundary is here and not applied yet (the segment before it is done, its epoch
        committed when it ends one)."""
        now = self._now(state)
        if now <= self.applied or state.epoch_trained:
            return False
        if self.unit == "epochs" and state.position:
            return False
        scheduler = self.scheduler
        if isinstance(scheduler, Halving):
            return now in scheduler.rungs
        every = scheduler.interval
        return every is not None and now % every == 0

    # ------------------------------------------------------------------------------------------
    # what happens there

    def add_losses(self, members: Sequence[Member], losses: np.ndarray) -> None:
        """A call's training losses (`[members, steps]`, NaN where a member did not train):
        the running sums a steps boundary ranks by."""
        if self.unit != "steps":
            return
        for member, row in zip(members, losses, strict=True):
            finite = row[np.isfinite(row)]
            sums = self.sums.setdefault(member.index, [0.0, 0])
            sums[0] += float(finite.sum())
            sums[1] += int(finite.size)

    def _ranked(self, members: Sequence[Member]) -> tuple[str, list[tuple[Member, float]]]:
        """The members, best first by the scheduler's metric, each with its value (NaN when
        it has none: last)."""
        scheduler, rows = self.scheduler, []
        for member in members:
            if self.unit == "steps" and (scheduler.metric or "loss") == "loss":
                total, count = self.sums.get(member.index, [0.0, 0])
                rows.append({"member": member.index, "loss": total / count if count else math.nan})
            elif self.unit == "steps":  # the newest evaluation: within an epoch, or its end
                found = [*member.state.validations[-1:], *member.state.history[-1:]]
                last = max(found, key=lambda row: row.get("step", 0), default={})
                rows.append({"member": member.index, **last})
            else:
                rows.append({"member": member.index, **member.state.last_row})
        metric, order = ranked_members(rows, scheduler.metric, scheduler.mode)
        by_index = {m.index: m for m in members}
        ranked = []
        for row in order:
            value = row.get(metric)
            number = float(value) if isinstance(value, (int, float)) else math.nan
            ranked.append((by_index[int(row["member"])], number))
        return metric, ranked

    def apply(self, stacked: Stacked, state: PopulationState) -> list[Member] | None:
        """Take the boundary due at `state` (every call read back). PBT exploits in place;
        Halving stops the worst members and returns the members kept (the caller shrinks
        the population to them)."""
        now = self._now(state)
        self.applied = now
        training = [m for m in stacked.members if m.stopped is None]
        if isinstance(self.scheduler, Halving):
            kept = self._halve(training, state, now)
        else:
            kept = None
            self._exploit(stacked, training, state)
        self.sums = {}
        return kept

    def _exploit(self, stacked: Stacked, training: list[Member], state: PopulationState) -> None:
        scheduler = self.scheduler
        assert isinstance(scheduler, PBT)
        metric, ranked = self._ranked(training)
        if len(ranked) < 2:
            return
        count = max(1, int(len(ranked) * scheduler.quantile))  # at most half: two sets apart
        rng = np.random.default_rng([scheduler.seed, state.step])
        best, worst = ranked[:count], ranked[-count:]
        position = {m.index: p for p, m in enumerate(stacked.members)}
        sources = np.arange(stacked.count)
        rules = scheduler.rules()
        for loser, value in worst:
            donor, donor_value = best[int(rng.integers(len(best)))]
            sources[position[loser.index]] = position[donor.index]
            old = dict(self.values[loser.index])
            new = {
                name: _perturbed(rules.get(name, scheduler.factors), start, rng)
                for name, start in self.values[donor.index].items()
            }
            self._set_values(loser, new)
            self.lineage.append(
                {
                    "step": state.step,
                    "epoch": state.epoch,
                    "member": loser.index,
                    "copied_from": donor.index,
                    "metric": metric,
                    "value": value,
                    "donor_value": donor_value,
                    "old": old,
                    "new": dict(self.values[loser.index]),
                }
            )
        take = jnp.asarray(sources)
        gathered = jax.tree.map(lambda leaf: jnp.take(leaf, take, axis=0), state.variables)
        state.variables = state.place(gathered) if state.place is not None else gathered
        taken = "; ".join(
            f"member {row['member']} took member {row['copied_from']}'s state, "
            + ", ".join(f"{k} {v:.4g}" for k, v in row["new"].items())
            for row in self.lineage[-count:]
        )
        self.say(f"PBT at step {state.step}: {taken}")
        if self.mark is not None:
            moves = ", ".join(f"{r['member']}<-{r['copied_from']}" for r in self.lineage[-count:])
            self.mark({"step": state.step, "label": f"PBT: {moves}", "rows": self.lineage[-count:]})

    def _set_values(self, member: Member, values: Mapping[str, Any]) -> None:
        """Feed `values` to `member` from its next call (each as its feed reads it back)."""
        feed = member.runtime.feed
        for name, value in values.items():
            feed.set_value(name, value)
        self.values[member.index] = {name: feed.value(name) for name in self.names}

    def _halve(self, training: list[Member], state: PopulationState, now: int) -> list[Member]:
        scheduler = self.scheduler
        assert isinstance(scheduler, Halving)
        metric, ranked = self._ranked(training)
        keep = scheduler.kept(len(ranked))
        rung = scheduler.rungs.index(now) + 1
        where = f"rung {rung} ({self.unit[:-1]} {now})"
        for place, (member, value) in enumerate(ranked):
            kept = place < keep
            self.lineage.append(
                {
                    "step": state.step,
                    "epoch": state.epoch,
                    "rung": rung,
                    "member": member.index,
                    "metric": metric,
                    "value": value,
                    "rank": place + 1,
                    "kept": kept,
                }
            )
            if not kept:
                member.stopped = (
                    f"halved at {where}: {metric} {value:.4g}, {place + 1} of {len(ranked)}"
                )
                member.stopped_at = state.step
        self.say(
            f"halving at {where}: {keep} of {len(ranked)} members train on "
            f"({', '.join(str(m.index) for m, _ in ranked[:keep])})"
        )
        if self.mark is not None:
            label = f"halving: {len(ranked)} -> {keep}"
            self.mark({"step": state.step, "label": label, "rows": self.lineage[-len(ranked) :]})
        return sorted((m for m, _ in ranked[:keep]), key=lambda m: m.index)

    # ------------------------------------------------------------------------------------------
    # the record a checkpoint keeps

    def to_json(self, training: Sequence[Member]) -> dict[str, Any]:
        return {
            "kind": type(self.scheduler).__name__,
            "applied": self.applied,
            "lineage": [dict(row) for row in self.lineage],
            "values": {str(k): dict(v) for k, v in self.values.items()},
            "sums": {str(k): list(v) for k, v in self.sums.items()},
            "training": [m.index for m in training],
        }

    def restore(self, record: Mapping[str, Any]) -> list[int] | None:
        """Continue the record a checkpoint kept; returns the members that train (None: the
        record holds none, as an older checkpoint's)."""
        if not record:
            return None
        kind = type(self.scheduler).__name__
        if record.get("kind") != kind:
            raise PopulationError(
                f"this population searches with {kind}, and its checkpoint was saved by a "
                f"search with {record.get('kind')}: build the population with the search it "
                f"was saved with"
            )
        self.applied = int(record.get("applied", 0))
        self.lineage = [dict(row) for row in record.get("lineage", ())]
        self.sums = {int(k): [float(v[0]), int(v[1])] for k, v in record.get("sums", {}).items()}
        by_index = {m.index: m for m in self.members}
        for key, values in record.get("values", {}).items():
            member = by_index.get(int(key))
            if member is not None and values:
                self._set_values(member, values)
        training = record.get("training")
        return [int(i) for i in training] if training is not None else None


def _perturbed(rule: Any, value: Any, rng: np.random.Generator) -> Any:
    """`value` after one of `rule`'s factors (drawn), or what the rule `(value, rng)` gives."""
    if callable(rule):
        return rule(value, rng)
    return value * rule[int(rng.integers(len(rule)))]


def shrink(stacked: Stacked, kept: Sequence[Member]) -> Stacked:
    """The population's `stacked` members down to `kept`: their variables and flags gathered
    along the member axis; each member left out keeps its own variables (on the host, for
    `pop.member(i)`, its checkpoints and a resume)."""
    state = stacked.state
    position = {m.index: p for p, m in enumerate(stacked.members)}
    rows = jnp.asarray([position[m.index] for m in kept])
    for member in stacked.members:
        if member.index not in {m.index for m in kept}:
            member.state.variables = jax.device_get(
                unstack(state.variables, position[member.index])
            )
    gathered = jax.tree.map(lambda leaf: jnp.take(leaf, rows, axis=0), state.variables)
    place = state.place or (lambda tree: tree)
    state.variables, state.healthy = place((gathered, jnp.take(state.healthy, rows)))
    shrunk = Stacked(kept, state, stacked.say, size=stacked.size)
    if stacked.watch is not None and shrunk.watch is not None:  # `spike=`: their windows
        shrunk.watch.take(stacked.watch, [position[m.index] for m in kept])
    return shrunk


def full_variables(stacked: Stacked, members: Sequence[Member]) -> Variables:
    """Every member's variables stacked on the host, in member order: the training members'
    from the stacked state, the others' their own (`shrink`)."""
    position = {m.index: p for p, m in enumerate(stacked.members)}
    host = jax.device_get(stacked.state.variables)
    rows = [
        unstack(host, position[m.index]) if m.index in position else m.state.variables
        for m in members
    ]
    return jax.tree.map(lambda *leaves: np.stack(leaves), *rows)
