"""A population's loop: N members of one experiment trained by one vmapped program per call.

Each member is a run's setup, run-time record and train state (`Member`), built as
`Nitro(e)` builds them; the members' variables travel stacked on a leading axis
(`PopulationState.variables`), with one `healthy` flag per member. Every call feeds each
member its own hyperparameters and Device fields (its schedules, evaluated on the host and
stacked into one transfer) and the same batch, from the first member's data stream (its
seed's order), or, with `batches="own"` (the default when the seeds differ), each member its
own stream's batch. A member whose step is not finite is stopped by the guard: its `healthy` flag
stays False, so every later step leaves its variables as they were (the guard's rule, per
member), and the others train on.

Validation runs every member through one vmapped eval forward per batch; each member's
metrics hook runs on its own outputs (on the host, or its device-metrics program, the same
program for every member), and its history row is committed beside the others'.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nitro.core.events import Events
from nitro.core.metrics import MetricAccumulator, split_modes
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import EpochTotals, TrainState, Variables
from nitro.engine.diagnostics import divergence_message
from nitro.engine.evaluation import delete, device_metrics, finalize_metrics, read_one_late
from nitro.engine.run_time import RunTime
from nitro.engine.runner import RunControl
from nitro.errors import DivergenceError, PopulationError
from nitro.experiments.routing import select
from nitro.programs.compile_cache import Program
from nitro.programs.population import population_eval_spec, population_train_spec
from nitro.programs.specs import ProgramSet

__all__ = [
    "Member",
    "PopulationState",
    "apply_prunes",
    "check_member_layout",
    "evaluate_members",
    "shown_settings",
    "stack",
    "train_population",
    "unstack",
]


@dataclasses.dataclass(eq=False)
class Member:
    """One member: its settings (the values of the population's axes), and the records a
    single run of those settings would have. Its `state` holds its counters and history;
    its variables live stacked in the `PopulationState`."""

    index: int
    settings: Mapping[str, Any]
    experiment: Any  # the experiment instance it was built from (its fields set)
    setup: RunSetup
    runtime: RunTime
    state: TrainState
    stopped: str | None = None  # why it stopped training ("diverged at step 12"), or None
    stopped_at: int | None = None  # the steps it trained before it stopped
    totals: EpochTotals | None = None

    @property
    def label(self) -> str:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in self.settings.items())
        return f"member {self.index} ({shown})" if shown else f"member {self.index}"


def _short(value: Any) -> str:
    text = getattr(value, "__qualname__", None) or repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclasses.dataclass(eq=False)
class PopulationState:
    """The arrays of every member, stacked on a leading axis, and the shared counters. The
    loop is its only in-place writer."""

    variables: Variables
    healthy: jax.Array  # bool[N]
    step: int = 0
    epoch: int = 0
    position: int = 0
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


def member_placement(setup: RunSetup, mesh_axis: str, members: int) -> Callable[[Any], Any]:
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
    """Stop the members `state.prune` names (`pop.stop(member)`), between two calls: each
    one's `healthy` flag turns False, so from the next call on its variables stay as they
    are; the others train on as they would have."""
    asked, state.prune = state.prune, {}
    for index, why in asked.items():
        member = members[index]
        if member.stopped is not None:
            continue
        member.stopped, member.stopped_at = why, state.step
        state.healthy = state.healthy.at[index].set(False)
        say(f"{member.label} stopped at step {state.step}: {why}; the other members train on")


def stack(trees: Sequence[Any]) -> Any:
    """Trees of equal structure as one tree of arrays with a leading member axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def unstack(tree: Any, index: int) -> Any:
    """Member `index`'s slice of a stacked tree (new arrays)."""
    return jax.tree.map(lambda leaf: leaf[index], tree)


def _stacked_host(values: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.stack([v[name] for v in values]) for name in values[0]}


@dataclasses.dataclass(eq=False)
class _Pending:
    report: Any  # f32[N, 2] or f32[N, K, 2]
    metrics: Any
    staged: Any
    program: Program
    index: int


def train_population(
    members: Sequence[Member],
    state: PopulationState,
    programs: ProgramSet,
    control: RunControl,
    target: int,
    steps_per_call: int,
    say: Callable[[str], None],
    events: Events,
    stop_at: int | None = None,
    after_epoch: Callable[[list[dict[str, Any]]], None] | None = None,
) -> str:
    """Train every member until epoch `target`, step `stop_at` (mid-epoch if need be) or a
    stop request; returns the stop reason ("completed", "max_steps" or "requested").
    Raises `DivergenceError` when every member has stopped."""
    try:
        return _train_until(
            members,
            state,
            programs,
            control,
            target,
            steps_per_call,
            say,
            events,
            stop_at,
            after_epoch,
        )
    finally:
        for member in members:  # worker processes (`prefetch="processes"`) live as the run
            for prefetcher in member.runtime.prefetchers.values():
                prefetcher.release_workers()


def _train_until(
    members, state, programs, control, target, steps_per_call, say, events, stop_at, after_epoch
) -> str:
    while state.epoch < target:
        if stop_at is not None and state.step >= stop_at:
            return "max_steps"
        batches = members[0].setup.splits["train"].batches
        events.start_epoch(state.epoch, target, batches, state.position)
        events.phase("training")
        ended = _train_epoch(
            members, state, programs, control, steps_per_call, say, events, stop_at
        )
        if ended != "ended":
            return ended
        events.phase("validating")
        rows = _validated_rows(members, state, programs, control)
        if rows is None:
            return "requested"
        shown = []
        for member, row in zip(members, rows, strict=True):
            member.totals = None
            if row is None:  # stopped before this epoch: its record ended at the stop
                continue
            member.state.history.append(row)
            member.state.step, member.state.epoch = row["step"], row["epoch"]
            shown.append({"member": member.index, **shown_settings(member.settings), **row})
        state.epoch += 1
        state.position = 0
        _early_stops(members, state, say)
        if shown:
            events.member_rows(shown)
        if after_epoch is not None:
            after_epoch(shown)
        if all(m.stopped is not None for m in members):
            return "early_stop" if members[0].setup.early_stop is not None else "requested"
    return "completed"


def _early_stops(members: Sequence[Member], state: PopulationState, say) -> None:
    """Stop each member whose monitored metric stopped improving (`early_stop=`), as a
    single run of its settings would have stopped; the others train on."""
    policy = members[0].setup.early_stop
    if policy is None:
        return
    for member in members:
        if member.stopped is None and policy.should_stop(member.state.history):
            state.prune[member.index] = (
                f"early stop at epoch {state.epoch}: {policy.metric} did not improve for "
                f"{policy.patience} epochs"
            )
    if state.prune:
        apply_prunes(members, state, say)


def shown_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Settings as history columns: numbers and strings as they are, others by their repr."""
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
        for k, v in settings.items()
    }


def _call_sizes(steps_per_call: int, step_in_epoch: int, step: int, stop_at: int | None):
    """Steps per call from optimizer step `step_in_epoch` of the epoch (`step` overall): K,
    except single steps up to the next multiple of K (a stream opened mid-epoch, after
    `train(steps=)`, so that the K-step calls line up with the epoch's) and before
    `stop_at` (so that the last call ends there)."""
    k = steps_per_call
    if k == 1 or (not step_in_epoch % k and stop_at is None):
        return k

    def sizes():
        position, at = step_in_epoch, step
        while True:
            size = k if not position % k and (stop_at is None or at + k <= stop_at) else 1
            position, at = position + size, at + size
            yield size

    return sizes()


class _Together:
    """One call's batches of every member, each from its own data stream (`batches="own"`):
    stacked on a leading member axis."""

    def __init__(self, parts: Sequence[Any]):
        self.parts = parts
        lead = parts[0]
        self.count, self.group, self.n_real = lead.count, lead.group, lead.n_real
        self.stacked = lead.stacked
        self.device = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(p.device for p in parts))

    def part(self, member: int) -> Any:
        return self.parts[member]

    def free(self) -> None:
        for part in self.parts:
            part.free()
        delete(self.device)


class _Shared:
    """One call's batches, the same for every member (`batches="shared"`)."""

    def __init__(self, staged: Any):
        self.staged = staged
        self.count, self.group, self.n_real = staged.count, staged.group, staged.n_real
        self.stacked = staged.stacked
        self.device = staged.device

    def part(self, member: int) -> Any:
        return self.staged

    def free(self) -> None:
        self.staged.free()


class _Streams:
    """The train split's calls of one epoch for the population: the first member's stream
    (shared batches) or every member's own, zipped."""

    def __init__(self, members, state: PopulationState, sizes, own: bool, accum: int):
        sources = members if own else members[:1]
        self.streams = [
            m.runtime.prefetcher("train").epoch(
                state.epoch, start=state.position, block=sizes(), group=accum
            )
            for m in sources
        ]
        self.own = own

    def __iter__(self):
        if not self.own:
            for staged in self.streams[0]:
                yield _Shared(staged)
            return
        for parts in zip(*self.streams, strict=False):
            yield _Together(parts)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


def _train_epoch(
    members, state: PopulationState, programs, control, steps_per_call, say, events, stop_at
) -> str:
    lead = members[0]
    setup = lead.setup
    accum = setup.accum
    own = state.batches == "own"
    begin = time.perf_counter()
    for member in members:
        if member.totals is None:
            member.totals = EpochTotals(train_metrics=MetricAccumulator("train_metrics"))
    in_epoch = -(-state.position // accum)
    stream = _Streams(
        members,
        state,
        lambda: _call_sizes(steps_per_call, in_epoch, state.step, stop_at),
        own,
        accum,
    )
    pending: _Pending | None = None
    ended = "ended"
    try:
        for staged in stream:
            if control.stop.is_set():
                staged.free()
                ended = "requested"
                break
            if stop_at is not None and state.step >= stop_at:
                staged.free()
                ended = "max_steps"
                break
            if state.prune:
                apply_prunes(members, state, say)
            if all(m.stopped is not None for m in members):
                staged.free()
                ended = "requested"  # every member was stopped by pop.stop(member)
                break
            count, micro = staged.count, staged.group
            one = count == 1
            hparams = np.stack(
                [m.runtime.feed.hparams_host(state.step, None if one else count) for m in members]
            )
            device = _stacked_host(
                [m.runtime.feed.device_host(state.step, None if one else count) for m in members]
            )
            place = state.place or setup.placement.put_replicated
            args = (state.variables, state.healthy, place(device), place(hparams), staged.device)
            program = programs.program(
                ("population train", len(members), count, micro, own),
                lambda setup, count=count, micro=micro: population_train_spec(
                    setup,
                    setup.splits["train"].hook_fields,
                    len(members),
                    count,
                    micro,
                    own_batches=own,
                ),
                args,
            )
            out = program(*args)
            state.variables, state.healthy = out.variables, out.healthy
            previous = pending
            pending = _Pending(out.report, out.metrics, staged, program, state.step)
            state.step += count
            state.position += count * micro
            if previous is not None:
                _complete(members, previous, say, events)
        if pending is not None:
            previous, pending = pending, None
            _complete(members, previous, say, events)
    finally:
        if pending is not None:
            _complete(members, pending, say, events)
        stream.close()
        for member in members:
            assert member.totals is not None
            member.totals.seconds += time.perf_counter() - begin
    return ended


def _complete(members: Sequence[Member], item: _Pending, say, events: Events) -> None:
    """Read one call back: each member's losses and finiteness codes, its train metrics."""
    staged = item.staged
    try:
        reports = np.asarray(item.report).reshape(len(members), -1, 2)
        metrics = None
        if members[0].setup.experiment.train_metrics_residency is not None:
            metrics = jax.device_get(item.metrics)
    finally:
        staged.free()
        delete(item.metrics)
    losses = reports[..., 0].astype(np.float64)
    codes = reports[..., 1]
    steps = reports.shape[1]
    for i, member in enumerate(members):
        totals = member.totals
        assert totals is not None
        limit = steps  # the steps of this call the member trained
        if member.stopped_at is not None:
            limit = max(0, min(steps, member.stopped_at - item.index))
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
            say(f"{member.label} stopped: {message}; the other members train on")
            limit = offset
        losses[i, limit:] = np.nan
        values = losses[i, :limit]
        finite = np.isfinite(values)
        counted = int(finite.sum())
        totals.nonfinite += limit - counted  # check_divergence=False: trains on, counted
        # added one by one, in order, as a single run adds its steps' losses
        totals.loss_sum = functools.reduce(operator.add, values[finite].tolist(), totals.loss_sum)
        totals.loss_count += counted
        totals.steps += limit
        if metrics is None:
            continue
        mine = unstack(metrics, i)
        micro = staged.group
        for offset in range(limit):
            step_metrics = mine if staged.count == 1 else unstack(mine, offset)
            for part in range(micro):  # each micro-batch's train metrics
                batch_metrics = step_metrics if micro == 1 else unstack(step_metrics, part)
                _train_metrics(
                    member, item.program, batch_metrics, staged.part(i), offset * micro + part
                )
    events.member_steps(item.index + 1, losses)  # steps count from 1, as a run's
    if all(m.stopped is not None for m in members) and any(
        m.stopped.startswith("diverged") for m in members if m.stopped is not None
    ):
        raise DivergenceError(
            "every member of the population stopped: "
            + "; ".join(f"{m.label}: {m.stopped}" for m in members)
        )


def _train_metrics(member: Member, program: Program, metrics, staged, offset: int) -> None:
    setup, totals = member.setup, member.totals
    assert totals is not None
    if setup.experiment.train_metrics_residency == "device":
        totals.train_metrics.add(program.metric_specs, metrics, staged.n_real)
        return
    host = staged.host if not staged.stacked else staged.host[offset]
    fields = setup.placement.gather(
        select(host, setup.splits["train"].hook_fields["train_metrics"])
    )
    values = member.runtime.call_host_hook(setup, "train_metrics", metrics, **fields)
    specs, leaves = split_modes(values, "train_metrics")
    totals.train_metrics.add(specs, leaves, staged.n_real)


def _validated_rows(members, state: PopulationState, programs, control) -> list[dict | None] | None:
    """Each member's history row of the epoch just trained: its training loss, then every
    eval split's metrics; None when a stop request cut validation short. A stopped member's
    record ends at its stop: the epoch it stopped in gets a last row (its step the one it
    stopped at, its results those of its final weights), later epochs none (None)."""
    rows: list[dict | None] = []
    for member in members:
        totals = member.totals
        assert totals is not None
        if member.stopped is not None and not totals.steps:
            rows.append(None)
            continue
        step = state.step if member.stopped is None else member.stopped_at
        row: dict[str, Any] = {"epoch": state.epoch + 1, "step": step}
        if totals.nonfinite:
            row["loss"] = math.nan
            row["nonfinite_steps"] = totals.nonfinite
        elif totals.loss_count:
            row["loss"] = totals.loss_sum / totals.loss_count
        if not totals.train_metrics.empty:
            results = totals.train_metrics.result()
            row.update(finalize_metrics(member.setup, member.runtime, results, "train"))
        rows.append(row)
    for split in members[0].setup.eval_splits:
        metrics = evaluate_members(members, state, programs, control, split)
        if metrics is None:
            return None
        for kept, values in zip(rows, metrics, strict=True):
            if kept is not None:
                kept.update(values)
    for member, kept in zip(members, rows, strict=True):
        assert member.totals is not None
        if kept is None:
            continue
        kept["epoch_seconds"] = member.totals.seconds
        if member.stopped is not None:
            kept["stopped"] = member.stopped
    return rows


def evaluation_variables(members: Sequence[Member], state: PopulationState) -> Variables:
    """The stacked variables evaluation uses: the weights, or their moving average when
    `EMA(evaluate=True)` (as a single run's `weights_of`)."""
    setup = members[0].setup
    variables = state.variables
    if setup.ema is not None and setup.ema.evaluate and variables.ema is not None:
        return Variables(params=variables.ema, model_state=variables.model_state)
    return Variables(params=variables.params, model_state=variables.model_state)


def evaluate_members(
    members: Sequence[Member],
    state: PopulationState,
    programs: ProgramSet,
    control: RunControl,
    split: str,
) -> list[dict[str, Any]] | None:
    """Every member's loss and metrics over one split, prefixed with its name, from one
    vmapped eval forward per batch; None when a stop request cut it short."""
    lead = members[0]
    setup = lead.setup
    info = setup.split(split)
    fields = info.hook_fields
    with_loss = "loss" in fields
    has_metrics = "metrics" in setup.experiment.hooks
    residency = setup.experiment.residency.get("metrics", "host")
    n = len(members)
    accumulators = [MetricAccumulator("metrics") for _ in members]
    loss_sums, samples = np.zeros(n, np.float64), 0
    variables = evaluation_variables(members, state)
    device = (state.place or setup.placement.put_replicated)(
        _stacked_host([m.runtime.feed.device_host_values() for m in members])
    )

    def account(staged, result) -> None:
        nonlocal samples
        try:
            n_real = int(staged.n_real)
            if with_loss:
                loss_sums[:] += np.asarray(result.loss_sum, np.float64)
            if has_metrics:
                if residency == "host":
                    outputs = jax.device_get(result.outputs)
                    host = setup.placement.gather(select(staged.host, fields["metrics"]))
                    host = {k: v[:n_real] for k, v in host.items()}
                for i, member in enumerate(members):
                    if residency == "host":
                        mine = jax.tree.map(lambda a, i=i: a[i][:n_real], outputs)
                        values = member.runtime.call_host_hook(
                            member.setup, "metrics", mine, **host
                        )
                        specs, leaves = split_modes(values, "metrics")
                    else:
                        mine = unstack(result.outputs, i)
                        specs, leaves = device_metrics(
                            member.setup, member.runtime.feed, programs, split, mine, staged, n_real
                        )
                        delete(mine)
                    accumulators[i].add(specs, leaves, n_real)
            samples += n_real
        finally:
            staged.free()
            delete(result)

    def dispatch(staged) -> Any:
        args = (variables, device, staged.device, np.int32(staged.n_real))
        program = programs.program(
            ("population eval", split, n, info.width),
            lambda setup: population_eval_spec(
                setup,
                setup.splits[split].hook_fields,
                n,
                with_loss=with_loss,
                return_outputs=has_metrics,
            ),
            args,
        )
        return program(*args)

    try:
        stopped = not read_one_late(
            lead.runtime.prefetcher(split).epoch(0), control, dispatch, account
        )
    finally:
        delete(device)
    if stopped:
        return None
    out = []
    for i, member in enumerate(members):
        results: dict[str, Any] = {}
        if with_loss and samples:
            results["loss"] = float(loss_sums[i]) / samples
        if not accumulators[i].empty:
            results.update(accumulators[i].result())
        results = finalize_metrics(member.setup, member.runtime, results, split)
        out.append({f"{split}_{k}": v for k, v in results.items()})
    return out


def predict_members(
    members: Sequence[Member],
    state: PopulationState,
    programs: ProgramSet,
    control: RunControl,
    batch: Mapping[str, Any],
) -> Any:
    """Every member's `forward` outputs for every row of `batch`, as host numpy with a
    leading member axis: one vmapped eval forward per chunk of one compiled width (as a
    single run's `predict`, `nitro.engine.prediction`)."""
    from nitro.engine.prediction import check_fields, in_chunks

    setup = members[0].setup
    fields = setup.experiment.hook_fields["forward"].resolve(tuple(batch), "predict")
    host = check_fields(setup, {k: batch[k] for k in fields})
    variables = evaluation_variables(members, state)
    device = (state.place or setup.placement.put_replicated)(
        _stacked_host([m.runtime.feed.device_host_values() for m in members])
    )

    def run(part: Mapping[str, np.ndarray], n_real: int, width: int) -> Any:
        placed = setup.placement.put_batch(part)
        args = (variables, device, placed, np.int32(n_real))
        program = programs.program(
            ("population predict", len(members), width, fields),
            lambda setup: population_eval_spec(
                setup, {"forward": fields}, len(members), with_loss=False, return_outputs=True
            ),
            args,
        )
        result = program(*args)
        outputs = setup.placement.gather(result.outputs)
        delete(result)
        delete(placed)
        return outputs

    try:
        return in_chunks(setup, control, host, run, axis=1)
    finally:
        delete(device)
