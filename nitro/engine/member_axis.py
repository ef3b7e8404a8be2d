"""The members axis of a run: who the loop, evaluation and prediction train and measure.

A run is a population of one. The loop, `evaluate_split` and `predict_batch` take a members
object and call it at the few points where one member and many differ: the fed values and
the data stream of a call, reading a call's report back, an epoch's rows, evaluation's sums
(Lightning's `Strategy` plays this part for devices). Nowhere else do they tell the two
apart.

- `SINGLE` (`Single`): a plain run. The loop takes its own path: no member axis, no stacking,
  nothing added to a call but the look-up of `stacked`.
- `epoch_row` and `add_train_metrics`: an epoch's row and a call's train metrics, for a run
  and for each member alike.
- `Stacked`: a population. Its members (`Member`: each a run's setup, run-time record and
  train state) have their variables stacked on a leading member axis (the loop's state is a
  `PopulationState`, with one `healthy` flag per member), its programs are the run's vmapped
  (`ProgramSet(setup, members=N)`), every member's fed values are stacked per call
  (`StackedFeed`), and each member keeps its own running sums, history rows, validations and
  verdicts: a member whose step is not finite stops (its `healthy` flag stays False) and the
  others train on; the run raises `DivergenceError` when every member has stopped and one of
  them diverged. Under `spike=` a member whose loss spikes rolls back alone instead
  (`nitro.engine.member_spikes`). Pruning (`apply_prunes`) and the members' layout on the devices
  (`member_placement`) are here too.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nitro.core.events import Events
from nitro.core.metrics import MetricAccumulator, split_modes
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import EpochTotals, TrainState, Variables
from nitro.engine.diagnostics import divergence_message
from nitro.engine.feed import StackedFeed
from nitro.engine.member_spikes import MembersWatch, roll_back_member, spike_stops
from nitro.engine.run_time import RunTime
from nitro.errors import DivergenceError, PopulationError
from nitro.experiments.routing import select
from nitro.optim.precision import epoch_columns

__all__ = [
    "SINGLE",
    "Member",
    "PopulationState",
    "Single",
    "Stacked",
    "add_train_metrics",
    "apply_prunes",
    "check_member_layout",
    "member_placement",
    "shown_settings",
]


class Single:
    """One run, no member axis: the loop's, evaluation's and prediction's own path."""

    stacked = False
    count = 1

    def feed(self, runtime: RunTime):
        return runtime.feed

    def parts(self, setup: RunSetup, runtime: RunTime) -> tuple[tuple[RunSetup, RunTime], ...]:
        """Each member's setup and run-time record (its host hooks, its finalize)."""
        return ((setup, runtime),)

    def healthy(self, setup: RunSetup, state: Any) -> Any:
        """The guard's flag a run's first call gets."""
        return setup.placement.put_replicated(jnp.asarray(True))

    def open(self, runtime: RunTime, epoch: int, **options: Any) -> Any:
        """The train split's stream of `epoch`."""
        return runtime.prefetcher("train").epoch(epoch, **options)

    def react(self, runtime: RunTime, state: Any) -> list[str]:
        """Plateau schedules decide from the committed history (`StepFeed.react`): what
        changed, as notes."""
        return _reactions("", runtime, state)

    def start_epoch(self, state: Any) -> EpochTotals:
        """The running sums of an epoch."""
        return EpochTotals(train_metrics=MetricAccumulator("train_metrics"))

    def rows(self, setup: RunSetup, runtime: RunTime, state: Any, finalize: Callable) -> list:
        """The row of the epoch just trained, before evaluation (`epoch_row`)."""
        return [epoch_row(setup, runtime, state, state.step, state.variables.loss_scale, finalize)]


def epoch_row(
    setup: RunSetup,
    runtime: RunTime,
    state: TrainState,
    step: int,
    scale: Any,
    finalize: Callable,
) -> dict[str, Any]:
    """A run's (or a member's) row of the epoch just trained, before evaluation: its epoch
    and `step`, its training loss (NaN, with a count, where `check_divergence=False` trained
    through non-finite steps), float16's loss `scale` and the train metrics (`finalize`: the
    `finalize_metrics` hook's call), from `state`'s running sums and history."""
    totals, history = state.totals, state.history
    assert totals is not None  # set when the epoch began
    row: dict[str, Any] = {"epoch": state.epoch + 1, "step": step}
    if totals.nonfinite:  # check_divergence=False trained through them: the mean is NaN
        row["loss"] = math.nan
        row["nonfinite_steps"] = totals.nonfinite
        if not any(r.get("nonfinite_steps") for r in history):  # once a run
            warnings.warn(
                f"epoch {row['epoch']}: {totals.nonfinite} of {totals.steps} training "
                f"steps had a non-finite loss (check_divergence=False trains on), so the "
                f"epoch's loss is NaN; the history's 'nonfinite_steps' column counts them. "
                f"The weights may be NaN too: check_divergence=True stops at the first.",
                RuntimeWarning,
                stacklevel=4,
            )
    elif totals.loss_count:
        row["loss"] = totals.loss_sum / totals.loss_count
    row.update(epoch_columns(scale, history))  # float16's scale
    if not totals.train_metrics.empty:
        row.update(finalize(setup, runtime, totals.train_metrics.result(), "train"))
    return row


def add_train_metrics(
    setup: RunSetup,
    totals: EpochTotals,
    program: Any,
    metrics: Any,
    staged: Any,
    steps: int,
    call_hook: Callable[..., Any],
) -> None:
    """Add the train metrics of a call's first `steps` steps (each micro-batch's) to
    `totals`: as the program computed them (`train_metrics_residency="device"`), or from the
    `train_metrics` host hook (`call_hook("train_metrics", metrics, **fields)`)."""
    micro, device = staged.group, setup.experiment.train_metrics_residency == "device"
    for offset in range(steps):
        step_metrics = metrics if staged.count == 1 else unstack(metrics, offset)
        for sub in range(micro):
            batch_metrics = step_metrics if micro == 1 else unstack(step_metrics, sub)
            if device:
                totals.train_metrics.add(program.metric_specs, batch_metrics, staged.n_real)
                continue
            host = staged.host[offset * micro + sub] if staged.stacked else staged.host
            batch_fields = setup.splits["train"].hook_fields["train_metrics"]
            fields = setup.placement.gather(select(host, batch_fields))
            values = call_hook("train_metrics", batch_metrics, **fields)
            specs, leaves = split_modes(values, "train_metrics")
            totals.train_metrics.add(specs, leaves, staged.n_real)


def _reactions(label: str, runtime: RunTime, state: TrainState) -> list[str]:
    """What `ReduceOnPlateau` schedules changed after `state`'s history, as notes."""
    notes = []
    for key in runtime.feed.react(state.history):
        value = runtime.feed.hyperparams_at(state.step).get(key)
        if value is None:  # a Device field's
            value = float(np.asarray(runtime.feed.device_value(key)))
        last = state.history[-1] if state.history else {}
        notes.append(f"{label}{key} reduced to {value:.4g} after epoch {last.get('epoch', 0)}")
    return notes


def unstack(tree: Any, index: int) -> Any:
    """Member (or step) `index`'s slice of a stacked tree (new arrays)."""
    return jax.tree.map(lambda leaf: leaf[index], tree)


SINGLE = Single()


@dataclasses.dataclass(eq=False)
class Member:
    """One member: its settings (the values of the population's axes), and the records and
    event path a single run of those settings would have. Its `state` holds its counters, history and
    validations and, as a run's, the running sums of its epoch under way (`state.totals`);
    its variables live stacked in the `PopulationState`."""

    index: int
    settings: Mapping[str, Any]
    experiment: Any  # the experiment instance it was built from (its fields set)
    setup: RunSetup
    runtime: RunTime
    state: TrainState
    stopped: str | None = None  # why it stopped training ("diverged at step 12"), or None
    stopped_at: int | None = None  # the population's steps when it stopped
    # the steps it sat out (its spikes' roll-backs, `spike=`): its own step is the
    # population's less these
    sat_out: int = 0
    # its own event path, as a run's: its steps, rows and validations (its logger run's)
    events: Events = dataclasses.field(default_factory=Events)
    logging: Any = None  # its logger run's `LoggingReporter` on that path (None: no logger)

    def own_step(self, step: int) -> int:
        """Its own steps when the population has trained `step`: less those it sat out
        (`spike=`), and where it stopped for a member that did."""
        return (step if self.stopped_at is None else int(self.stopped_at)) - self.sat_out

    @property
    def label(self) -> str:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in self.settings.items())
        return f"member {self.index} ({shown})" if shown else f"member {self.index}"


def _short(value: Any) -> str:
    text = getattr(value, "__qualname__", None) or repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclasses.dataclass(eq=False)
class PopulationState(TrainState):
    """The train state the loop trains: every member's arrays stacked on a leading axis and
    the shared counters (the members' histories are theirs). The loop is its only in-place
    writer."""

    healthy: Any = None  # bool[N]
    prune: dict[int, str] = dataclasses.field(default_factory=dict)  # member -> why, asked
    batches: str = "shared"  # "shared": every member the same batches; "own": its seed's
    place: Callable[[Any], Any] | None = None  # lays out a member-stacked tree (the mesh)


def check_member_layout(setup: RunSetup) -> None:
    """A population lays its members out itself: refuse a sharded layout or a mesh of more
    than one axis."""
    placement = setup.placement
    if placement.sharded or len(placement.axes) > 1:
        raise PopulationError(
            f"a population lays its members out itself (mesh_axis='members' or 'batch'); "
            f"sharding={placement.sharding!r} and mesh={placement.axes} do not combine with it: "
            f"leave sharding='replicated' and mesh=None, or train the members as single runs"
        )


def member_placement(setup: RunSetup, mesh_axis: str) -> Callable[[Any], Any]:
    """How member-stacked arrays (variables, fed values) lie on the run's devices: on one
    device, replicated over the mesh with each batch split across it (`mesh_axis="batch"`),
    or their member axis split across the mesh, each device training its own members on
    whole batches (`mesh_axis="members"`)."""
    placement = setup.placement
    check_member_layout(setup)
    if placement.mesh is None or mesh_axis == "batch":
        return placement.put_replicated
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(placement.mesh, PartitionSpec("data"))
    return lambda tree: jax.device_put(tree, sharding)


def apply_prunes(members: Sequence[Member], state: PopulationState, say) -> None:
    """Stop the members `state.prune` names (`pop.stop(member)`, early stopping), between two
    calls: each one's `healthy` flag turns False, so from the next call on its variables stay
    as they are; the others train on as they would have."""
    asked, state.prune = state.prune, {}
    position = {m.index: p for p, m in enumerate(members)}  # a shrunk population's rows
    for index, why in asked.items():
        if index not in position or members[position[index]].stopped is not None:
            continue  # stopped already (a shrunk population left it out)
        member = members[position[index]]
        member.stopped, member.stopped_at = why, state.step
        state.healthy = state.healthy.at[position[index]].set(False)
        say(f"{member.label} stopped at step {state.step}: {why}; the other members train on")


def shown_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Settings as history columns: numbers and strings as they are, others by their repr."""
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
        for k, v in settings.items()
    }


class Stacked:
    """A population's members, trained together on a leading member axis."""

    stacked = True

    def __init__(
        self,
        members: Sequence[Member],
        state: PopulationState,
        say: Callable,
        size: int | None = None,
    ):
        self.members = tuple(members)
        self.count = len(self.members)
        # the population's members, these and those a search left out (`member_steps` has
        # a row for each)
        self.size = size or self.count
        # a call's losses, `[members, steps]`, to whoever asks (a search's running sums)
        self.on_losses: Callable[[Sequence[Member], np.ndarray], None] | None = None
        self.state = state
        self.say = say
        self.own = state.batches == "own"
        place = state.place or self.members[0].setup.placement.put_replicated
        self._feed = StackedFeed([m.runtime.feed for m in self.members], place)
        self._feed.lags = [m.sat_out for m in self.members]
        # the guard keeps a member's variables in the program (its select, per member): the
        # loop never restores a population's calls
        self.members[0].runtime.restores = False
        # `spike=`: each member's watch; the loop keeps each call's starting variables, and
        # puts back those of the members `rolled_back` (position -> whether it stops)
        self.spike = self.members[0].setup.keywords["spike"].value
        self.watch = MembersWatch(self.spike, self.count) if self.spike is not None else None
        self.rolled_back: dict[int, bool] = {}

    @classmethod
    def of(cls, members: Sequence[Member], batches: str, mesh_axis: str, say: Callable) -> Stacked:
        """The members with their variables stacked on a leading member axis (each member's
        state lets go of its own), laid out on the devices as `mesh_axis` says."""
        states = [m.state for m in members]
        variables = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(s.variables for s in states))
        for state in states:  # the population holds them, stacked
            state.variables = Variables(params=[], model_state=[])
        place = member_placement(members[0].setup, mesh_axis)
        state = PopulationState(
            variables=place(variables),
            step=states[0].step,
            epoch=states[0].epoch,
            healthy=place(jnp.ones(len(states), bool)),
            batches=batches,
            place=place,
        )
        return cls(members, state, say)

    def feed(self, runtime: RunTime) -> StackedFeed:
        return self._feed

    def parts(self, setup: RunSetup, runtime: RunTime) -> tuple[tuple[RunSetup, RunTime], ...]:
        return tuple((m.setup, m.runtime) for m in self.members)

    def healthy(self, setup: RunSetup, state: PopulationState) -> Any:
        """Each member's flag: False for one that stopped."""
        return state.healthy

    # ------------------------------------------------------------------------------------------
    # a call: its batches, the prunes before it, its report

    def open(self, runtime: RunTime, epoch: int, *, block: int | Iterable[int], **kw) -> Any:
        """The train split's stream of an epoch: the first member's (shared batches), or
        every member's own, zipped (each call's batches stacked on a member axis)."""
        if not self.own:
            return runtime.prefetcher("train").epoch(epoch, block=block, **kw)
        sizes = (
            itertools.repeat(block, self.count)
            if isinstance(block, int)
            else itertools.tee(block, self.count)
        )
        kw.pop("state", None)  # each member's stream replays to its position
        streams = [
            m.runtime.prefetcher("train").epoch(epoch, block=size, **kw)
            for m, size in zip(self.members, sizes, strict=True)
        ]
        return _Zipped(streams)

    def before_call(self, run: Any, state: PopulationState) -> bool:
        """Take the prunes asked for since the last call (`pop.stop(i)`, early stopping):
        the next call gets the flags (`state.healthy`, which the loop keeps as each call
        returns it). True when every member has stopped: no call is left to make."""
        if state.prune:
            apply_prunes(self.members, state, self.say)
        run.healthy = state.healthy
        self._feed.lags = [m.sat_out for m in self.members]  # a resume's, a shrink's
        return all(m.stopped is not None for m in self.members)

    def react(self, runtime: RunTime, state: PopulationState) -> list[str]:
        """Each member's plateau schedules decide from its own history."""
        return [n for m in self.members for n in _reactions(f"{m.label}: ", m.runtime, m.state)]

    def start_epoch(self, state: PopulationState) -> EpochTotals:
        """The epoch's shared totals (its time), and each member's running sums."""
        for member in self.members:
            if member.state.totals is None:
                member.state.totals = SINGLE.start_epoch(member.state)
        resumed = self.members[0].state.totals  # a resumed epoch's time so far (`keep_time`)
        assert resumed is not None
        totals = SINGLE.start_epoch(state)
        totals.seconds, totals.wait_seconds = resumed.seconds, resumed.wait_seconds
        return totals

    def keep_time(self, state: PopulationState) -> None:
        """After the loop: each member's epoch under way (a run stopped in its middle) takes
        the position and the time so far, which its checkpoint saves (`_partial_epoch`)."""
        shared = state.totals
        for member in self.members:
            if shared is not None and (totals := member.state.totals) is not None:
                totals.seconds, totals.wait_seconds = shared.seconds, shared.wait_seconds
                member.state.position = state.position

    def complete(self, state: PopulationState, item: Any, reports: Any, metrics: Any, events):
        """Account a call the loop read back (`reports`: its losses and finiteness codes,
        `metrics`: its train metrics on the host, or None): each member's; a member whose
        step was not finite stops there, and the others train on."""
        staged, program = item.staged, item.program
        reports = reports.reshape(self.count, -1, 2)
        losses = reports[..., 0].astype(np.float64)
        codes = reports[..., 1]
        steps = reports.shape[1]
        firsts = [item.index - m.sat_out + 1 for m in self.members]  # each one's own steps
        limits = np.array(  # the steps of this call each member trained
            [
                steps if m.stopped_at is None else max(0, min(steps, m.stopped_at - item.index))
                for m in self.members
            ]
        )
        spikes = {} if self.watch is None else self.watch.first_spikes(losses, codes, limits)
        for i, member in enumerate(self.members):
            totals = member.state.totals
            assert totals is not None  # set when the epoch began
            limit = int(limits[i])
            if i in spikes:  # it sits the call out: back to the call's start
                assert self.spike is not None  # watched only under spike=
                found, loss = spikes[i], float(losses[i, spikes[i][0]])
                self.rolled_back[i] = roll_back_member(
                    member, self.spike, state, item, found, loss, self.say
                )
                losses[i] = np.nan
                continue
            bad = np.flatnonzero(codes[i, :limit])
            if bad.size:
                offset = int(bad[0])
                message = divergence_message(
                    member.setup,
                    member.runtime.feed,
                    member.state,
                    item.index + offset,
                    float(losses[i, offset]),
                    int(codes[i, offset]),
                )
                member.stopped = f"diverged at step {item.index + offset + 1}"
                member.stopped_at = item.index + offset
                self.say(f"{member.label} stopped: {message}; the other members train on")
                limit = offset
            losses[i, limit:] = np.nan
            totals.add_losses(losses[i, :limit])  # as a single run adds its steps' losses
            totals.steps += limit
            if metrics is not None:
                part = staged.parts[i] if isinstance(staged, _Together) else staged
                add_train_metrics(
                    member.setup,
                    totals,
                    program,
                    unstack(metrics, i),
                    part,
                    limit,
                    functools.partial(member.runtime.call_host_hook, member.setup),
                )
        state.step += staged.count
        state.position += staged.count * staged.group
        assert state.totals is not None  # set when the epoch began
        state.totals.steps += staged.count
        if self.on_losses is not None:
            self.on_losses(self.members, losses)
        shown = losses
        if self.size > self.count:  # a row for each member, NaN for those left out
            shown = np.full((self.size, losses.shape[1]), np.nan)
            shown[[m.index for m in self.members]] = losses
        events.member_steps(item.index + 1, shown)  # steps count from 1, as a run's
        for i, (member, own) in enumerate(zip(self.members, losses, strict=True)):
            if member.events.reporters and i not in self.rolled_back:
                member.events.steps(firsts[i], own.tolist())
        stopped = [m for m in self.members if m.stopped is not None]
        if len(stopped) == self.count:
            spike_stops(self.members)
        if len(stopped) == self.count and any(
            (m.stopped or "").startswith("diverged") for m in stopped
        ):
            raise DivergenceError(
                "every member of the population stopped: "
                + "; ".join(f"{m.label}: {m.stopped}" for m in self.members)
            )

    # ------------------------------------------------------------------------------------------
    # an epoch's rows

    def rows(
        self, setup: RunSetup, runtime: RunTime, state: PopulationState, finalize: Callable
    ) -> list[dict[str, Any] | None]:
        """Each member's row of the epoch just trained, before evaluation (`epoch_row`). A
        stopped member's record ends at its stop: the epoch it stopped in gets a last row
        (its step the one it stopped at), later epochs none (None)."""
        rows: list[dict[str, Any] | None] = []
        scale = state.variables.loss_scale  # float16's: each member's own, stacked
        for i, member in enumerate(self.members):
            totals = member.state.totals
            if member.stopped is not None and not (totals and totals.steps):
                rows.append(None)
                continue
            step = member.own_step(state.step)
            own = None if scale is None else [leaf[i] for leaf in scale]
            rows.append(epoch_row(member.setup, member.runtime, member.state, step, own, finalize))
        return rows

    def commit(self, state: PopulationState, rows, shared: dict[str, Any], events: Events):
        """Commit the epoch: each member's row (with the epoch's shared timing columns) to
        its history and its `end_epoch` event; the `member_rows` event; returns the rows as `history()` shows them."""
        shown = []
        for member, row in zip(self.members, rows, strict=True):
            member.state.totals, member.state.position = None, 0
            if row is None:  # stopped before this epoch: its record ended at the stop
                continue
            row.update(shared)
            if member.stopped is not None:
                row["stopped"] = member.stopped
            member.state.history.append(row)
            member.state.step, member.state.epoch = row["step"], row["epoch"]
            member.events.end_epoch(row)
            shown.append({"member": member.index, **shown_settings(member.settings), **row})
        if shown:
            events.member_rows(shown)
        return shown

    def early_stops(self, state: PopulationState) -> None:
        """Stop each member whose monitored metric stopped improving (`early_stop=`), as a
        single run of its settings would have stopped; the others train on."""
        policy = self.members[0].setup.early_stop
        if policy is None:
            return
        for member in self.members:
            if member.stopped is None and policy.should_stop(member.state.history):
                state.prune[member.index] = (
                    f"early stop at epoch {state.epoch}: {policy.metric} did not improve for "
                    f"{policy.patience} epochs"
                )
        if state.prune:
            apply_prunes(self.members, state, self.say)

    def validated(
        self, state: PopulationState, results: list[dict[str, Any]], events: Events
    ) -> None:
        """An evaluation within the epoch (`val_every_steps`): a row in each training
        member's validations and its `validated` event, and the `member_validated` event."""
        rows = []
        for member, metrics in zip(self.members, results, strict=True):
            if member.stopped is None:
                row = {"step": member.own_step(state.step), "epoch": state.epoch + 1, **metrics}
                member.state.validations.append(row)
                member.events.validated(row)
                rows.append({"member": member.index, **row})
        events.member_validated(rows)


class _Together:
    """One call's batches of every member, each from its own data stream (`batches="own"`):
    stacked on a member axis, after the stack's axis in a stack of steps or micro-batches
    (`nitro.programs.population`)."""

    def __init__(self, parts: Sequence[Any]):
        self.parts = parts
        lead = parts[0]
        self.index, self.count, self.group = lead.index, lead.count, lead.group
        self.n_real, self.host, self.after = lead.n_real, lead.host, None
        axis = 1 if lead.stacked else 0
        self.device = jax.tree.map(
            lambda *leaves: jnp.stack(leaves, axis), *(p.device for p in parts)
        )

    @property
    def stacked(self) -> bool:
        return self.count * self.group > 1

    def free(self) -> None:
        for part in self.parts:
            part.free()
        for leaf in jax.tree.leaves(self.device):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()


class _Zipped:
    """Every member's stream of an epoch, read together."""

    def __init__(self, streams: Sequence[Any]):
        self.streams = streams

    def __iter__(self):
        for parts in zip(*self.streams, strict=False):
            yield _Together(parts)

    @property
    def wait_seconds(self) -> float:
        return sum(s.wait_seconds for s in self.streams)

    @property
    def fill_seconds(self) -> float:
        return sum(s.fill_seconds for s in self.streams)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
