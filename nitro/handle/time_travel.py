"""Going back: `n.snapshots`, `n.rewind(step)`, `n.fork(step, **changes)` and the roll-back
over a loss spike (`spike=`), on the snapshots a run keeps in memory and its checkpoints on
disk (docs/time-travel.md).

A snapshot and a checkpoint are the same record (`nitro.engine.snapshots`), and both restore
as a resume restores: a rewind is the run's state swapped for a snapshot's, under the run
guard (refused while the handle trains, so never half applied); the steps after it stay in
the history's record as an abandoned branch (`TrainState.rewinds`, `n.history(abandoned=
True)`), its checkpoints move to `<run_dir>/abandoned/`, and the reporters hear `rewound`. A
fork is a new handle built like its parent, with the changes that keep its programs as they
are, starting from the snapshot's state. A spike's roll-back is a rewind the run takes
itself, between two of the loop's calls, leaving out the batches of the call that spiked.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Self

import jax
import numpy as np

from nitro.core.run_setup import RunSetup
from nitro.core.train_state import TrainState, scalars
from nitro.engine import loop
from nitro.engine.run_keywords import KEYWORD_ONLY, RUN_KEYWORDS
from nitro.engine.snapshots import Snapshot, SnapshotRing, detached, restore_point, settle
from nitro.engine.spikes import SpikeRollback, SpikeWatch
from nitro.errors import PopulationError, SetupError, SpikeError, did_you_mean
from nitro.experiments.declaration import FieldKind, field_specs
from nitro.experiments.presets import replace
from nitro.programs.train_step import train_step_spec
from nitro.runs.checkpoint_reads import SavedStep, describe_saved
from nitro.runs.checkpoint_trees import host_tree
from nitro.runs.epoch_saves import run_record
from nitro.runs.run_dirs import checkpoint_dir

__all__ = ["TimeTravel", "train_epochs"]

# run keywords a fork does not take from its parent: where it lives and what it resumes are
# its own, and a logger object belongs to the run it logs (None, logging nothing, is taken)
_NOT_INHERITED = ("resume", "run_dir", "name", "logger")


def _inherited(given: Mapping[str, Any]) -> dict[str, Any]:
    keywords = {k: v for k, v in given.items() if k not in _NOT_INHERITED}
    if "logger" in given and given["logger"] is None:
        keywords["logger"] = None
    return keywords


# ---------------------------------------------------------------------------------------------
# the loop with spike roll-backs


def prepare(handle: Any) -> None:
    """A run's ring of snapshots (`snapshots=`) and its watch over spikes (`spike=`), kept on
    its run-time record from its first `train()`; none where the state is sharded or spread
    over processes (its checkpoints are its snapshots there)."""
    setup, runtime = handle._setup, handle._runtime
    policy = setup.keywords["snapshots"].value
    placement = setup.placement
    if runtime.snapshots is None and policy is not None:
        if not (placement.multi_process or placement.sharded):
            runtime.snapshots = SnapshotRing(policy, handle.run_id)
    spike = setup.keywords["spike"].value
    if runtime.spikes is None and spike is not None:
        runtime.spikes = SpikeWatch(spike)


def train_epochs(
    handle: Any,
    state: Any,
    events: Any,
    target: int,
    after_epoch: Any,
    stop_at: int | None,
    members: Any,
) -> tuple[Any, str]:
    """`loop.train_epochs` on the handle's setup, run time and programs; a spike
    (`SpikeRollback`) rolls the run back to its newest snapshot before the call that spiked,
    leaves that call's batches out, and trains on."""
    setup = handle._lead_setup
    if members.stacked:  # a population keeps no snapshots (yet): refused where it matters
        if setup.keywords["spike"].value is not None:
            raise PopulationError(
                "spike= is not supported for a population yet: its members train in one "
                "program, and a roll-back is a single run's for now. Train a member as a run "
                "to use it (pop.best() or pop.member(i) is one), or leave spike= out"
            )
    else:
        prepare(handle)
    try:
        while True:
            try:
                return loop.train_epochs(
                    handle._lead_setup,
                    handle._lead_runtime,
                    state,
                    handle._programs,
                    events,
                    handle._control,
                    target,
                    after_epoch=after_epoch,
                    stop_at=stop_at,
                    members=members,
                )
            except SpikeRollback as spike:
                _roll_back(handle, state, spike)
    finally:
        settle()  # the run's snapshot copies done, their thread gone


def _roll_back(handle: Any, state: TrainState, spike: SpikeRollback) -> None:
    """Back to the newest snapshot (or checkpoint) before the call that spiked, in place (the
    loop's state), with its batches left out from then on; past `max_rollbacks`, back there
    and stop with a `SpikeError` naming the batches."""
    policy = handle._setup.keywords["spike"].value
    done = sum(1 for row in state.rewinds if row.get("reason") == "spike")
    snapshot, saved = _newest_point(handle, spike.first)
    where = f"step {spike.step} (epoch {spike.epoch + 1}, batches {spike.batches})"
    if snapshot is None and saved is None:
        raise SpikeError(
            f"the loss spiked at {where}: {spike.why}, and there is no snapshot or checkpoint "
            f"before it to roll back to (snapshots=False?). Keep snapshots (snapshots=True) or "
            f"lower the learning rate"
        )
    stop = done >= policy.max_rollbacks
    skipped = [
        {"epoch": spike.epoch + 1, "index": index, "step": spike.step, "loss": spike.loss}
        for index in spike.batches
    ]
    restored = _go_back(
        handle, state, snapshot, saved, "spike", skipped=[] if stop else skipped, why=spike.why
    )
    for field in dataclasses.fields(TrainState):
        setattr(state, field.name, getattr(restored, field.name))
    if stop:
        earlier = [
            f"epoch {row['epoch']} batch {row['index']} (step {row['step']})"
            for row in state.skipped_batches
        ]
        raise SpikeError(
            f"the loss spiked at {where}: {spike.why}; this run has rolled back "
            f"{done} time{'s' * (done != 1)} already (Spike(max_rollbacks="
            f"{policy.max_rollbacks})), so it stopped, rolled back to step {state.step}. "
            f"Batches left out so far: {', '.join(earlier) or 'none'}. Look at those "
            f"batches, lower the learning rate, or raise max_rollbacks"
        )
    handle._say(
        f"loss spike at {where}: {spike.why}; rolled back to step {state.step} and left "
        f"those batches out (n.skipped_batches() lists them)"
    )


# ---------------------------------------------------------------------------------------------
# where the run can go back to


def _newest_point(handle: Any, step: int) -> tuple[Snapshot | None, SavedStep | None]:
    """The newest snapshot in memory, or else checkpoint on disk, of a step at most `step`."""
    ring = handle._runtime.snapshots
    snapshot = ring.newest_at_most(step) if ring is not None else None
    disk = [s for s in _saved_steps(handle) if s <= step]
    if disk and (snapshot is None or max(disk) > snapshot.step):
        return None, SavedStep(checkpoint_dir(handle._files.run_dir), max(disk))
    return snapshot, None


def _saved_steps(handle: Any) -> list[int]:
    if handle._files.store is None:
        return []
    handle._files.wait()
    return [row["step"] for row in describe_saved(handle._files.run_dir)]


def _point(handle: Any, step: Any) -> tuple[Snapshot | None, SavedStep | None]:
    """The snapshot in memory, or else the checkpoint on disk, of step `step`; refused,
    listing them, when there is none."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise TypeError(f"step must be an int >= 0 (a step n.snapshots lists), got {step!r}")
    ring = handle._runtime.snapshots
    snapshot = ring.at(int(step)) if ring is not None else None
    if snapshot is not None:
        return snapshot, None
    disk = _saved_steps(handle)
    if step in disk:
        return None, SavedStep(checkpoint_dir(handle._files.run_dir), int(step))
    memory = [e.step for e in ring.entries] if ring is not None else []
    raise SetupError(
        f"no snapshot or checkpoint of step {step} in this run: in memory "
        f"{', '.join(map(str, memory)) or 'none'}; on disk {', '.join(map(str, disk)) or 'none'} "
        f"(n.snapshots lists them). Take snapshots more often with snapshots=N (every N "
        f"steps)"
    )


def _restore_device(handle: Any, values: Mapping[str, Any]) -> None:
    """The Device values a snapshot was taken with, on the live handle (not the scheduled
    ones: a schedule's value follows the step)."""
    setup, runtime = handle._setup, handle._runtime
    scheduled = set(getattr(handle, "_live_scheduled", ())) | {
        s.name for s in setup.schedules if s.target == "device"
    }
    for name, value in values.items():
        if name in setup.experiment.device_specs and name not in scheduled:
            runtime.feed.set_constant(name, value)
            object.__setattr__(runtime.experiment, name, runtime.feed.device_value(name))


def _go_back(
    handle: Any,
    state: TrainState,
    snapshot: Snapshot | None,
    saved: SavedStep | None,
    reason: str,
    skipped: Sequence[Mapping[str, Any]] = (),
    why: str | None = None,
) -> TrainState:
    """The state of `snapshot` (or `saved`), as a new `TrainState` with `state`'s rewinds and
    this one's row (the abandoned branch's history rows) and `skipped` added; the handle's
    Device values, snapshots, spike watch, checkpoints and reporters follow it back."""
    setup, runtime, files = handle._setup, handle._runtime, handle._files
    restored, record = restore_point(
        setup, state.variables, snapshot=snapshot, saved=saved, seed=state.seed
    )
    number = len(state.rewinds) + 1
    row: dict[str, Any] = {
        "rewind": number,
        "from_step": state.step,
        "step": restored.step,
        "epoch": restored.epoch,
        "position": restored.position,
        "reason": reason,
        "where": "memory" if snapshot is not None else "disk",
    }
    if why is not None:
        row["why"] = why
    if skipped:
        row["skipped_batches"] = [dict(s) for s in skipped]
    row["history"] = [scalars(r) for r in state.history[len(restored.history) :]]
    row["validations"] = [scalars(r) for r in state.validations[len(restored.validations) :]]
    restored.rewinds = [*state.rewinds, row]
    restored.skipped_batches = [*restored.skipped_batches, *skipped]
    handle._replay_schedules(restored.step, handle._schedule_edits)
    _restore_device(handle, record.member.device)
    if runtime.snapshots is not None:
        runtime.snapshots.drop_after(restored.step)
    if runtime.spikes is not None:
        runtime.spikes.forget_after(restored.step)
    if files.store is not None:
        held = files.saves._held
        if held is not None and held.step > restored.step:
            files.saves._held = None
        into = files.run_dir / "abandoned" / f"rewind-{number}-from-step-{state.step}"
        moved = files.store.abandon_after(restored.step, into)
        if moved:
            row["abandoned_checkpoints"] = str(into)
    handle._events.rewound(row)
    return restored


# ---------------------------------------------------------------------------------------------
# what a fork may change


def _program_differences(
    parent: RunSetup, fork: RunSetup, parent_state, fork_state, edits: bool = False
) -> list[str]:
    """What differs between the programs (and the state's layout) of two setups of one
    experiment, one line each (empty: the same programs). `edits`: the fork was given edited
    hooks (`hooks=`), whose code may differ where a live edit's may (`live_edit.refreeze`'s
    rules: the same hooks, taking the same batch fields, metrics where they ran)."""
    lines = [
        f"GraphConst {name}: {parent.experiment.graphconst.get(name)!r} -> "
        f"{fork.experiment.graphconst.get(name)!r}"
        for name in sorted(set(parent.experiment.graphconst) | set(fork.experiment.graphconst))
        if parent.experiment.graphconst.get(name) != fork.experiment.graphconst.get(name)
    ]
    if "train" in parent.splits and "train" in fork.splits:
        specs = [
            train_step_spec(s, s.splits["train"].hook_fields, 1, s.accum) for s in (parent, fork)
        ]
        before, after = (dict(spec.static) for spec in specs)
        lines += [
            f"{key}: {before.get(key)!r} -> {after.get(key)!r}"
            for key in sorted(set(before) | set(after), key=str)
            if before.get(key) != after.get(key)
        ]
        codes = [{u: fp.digest for u, fp in s.experiment.code.items()} for s in (parent, fork)]
        lines += [
            f"the code of {u}"
            for u in sorted(set(codes[0]) | set(codes[1]))
            if codes[0].get(u) != codes[1].get(u)
            and not (edits and u in parent.experiment.hooks and u in fork.experiment.hooks)
        ]
    a, b = parent.experiment, fork.experiment
    if set(a.hooks) != set(b.hooks):
        added, removed = sorted(set(b.hooks) - set(a.hooks)), sorted(set(a.hooks) - set(b.hooks))
        lines.append(f"the hooks: added {added or 'none'}, removed {removed or 'none'}")
    lines += [
        f"the batch fields hook {hook!r} takes"
        for hook in sorted(set(a.hook_fields) & set(b.hook_fields))
        if a.hook_fields[hook] != b.hook_fields[hook]
    ]
    if dict(a.residency) != dict(b.residency):
        lines.append(f"where metrics run: {dict(a.residency)} -> {dict(b.residency)}")
    for split in sorted(set(parent.splits) & set(fork.splits)):
        before, after = dict(parent.splits[split].batch_spec), dict(fork.splits[split].batch_spec)
        shown = lambda spec: f"{spec[1]}{list(spec[0])}" if spec else "none"  # noqa: E731
        lines += [
            f"the {split!r} batches' {name}: {shown(before.get(name))} -> {shown(after.get(name))}"
            for name in sorted(set(before) | set(after))
            if before.get(name) != after.get(name)
        ]
    for name in ("params", "model_state", "opt_state", "ema", "loss_scale"):
        a, b = getattr(parent_state.variables, name), getattr(fork_state.variables, name)
        layout = lambda v: jax.tree.map(lambda x: (np.shape(x), str(x.dtype)), v)  # noqa: E731
        if (a is None) != (b is None) or (a is not None and layout(a) != layout(b)):
            lines.append(f"the layout of the {name.replace('_', ' ')}")
    return lines


def _split_changes(cls: type, changes: Mapping[str, Any]) -> tuple[dict, dict]:
    """A fork's changes as (experiment fields, run keywords); GraphConst fields and what no
    fork takes are refused, naming them."""
    specs = {s.name: s for s in field_specs(cls)}
    fields, keywords = {}, {}
    for name, value in changes.items():
        if name in RUN_KEYWORDS:
            keywords[name] = value
        elif name in specs:
            if specs[name].kind is FieldKind.GRAPHCONST:
                raise SetupError(
                    f"fork({name}=...) changes the program: {name} is a GraphConst field, "
                    f"baked into it, and a fork goes on from the snapshot under the same "
                    f"program. Start a new run from the weights instead: "
                    f"nitro.Nitro({cls.__name__}({name}=...), weights=n)"
                )
            fields[name] = value
        elif name in KEYWORD_ONLY:
            raise SetupError(
                f"fork({name}=...): a fork starts from the snapshot's weights and data; "
                f"build a new handle for other ones (nitro.Nitro(..., {name}=...))"
            )
        else:
            known = [*specs, *RUN_KEYWORDS]
            raise TypeError(
                f"fork() got an unknown change {name!r}, neither a field of {cls.__name__} nor "
                f"a run keyword.{did_you_mean(name, known)} Fields: {', '.join(specs)}"
            )
    for name in ("resume",):
        if name in keywords:
            raise SetupError(f"fork({name}=...): a fork starts from the snapshot it names")
    return fields, keywords


# ---------------------------------------------------------------------------------------------
# the handle's methods


class TimeTravel:
    """`Nitro`'s snapshots, rewinds and forks (docs/time-travel.md)."""

    _state: TrainState
    _forked_from: dict[str, Any] | None = None
    _data: Any = None  # `data=` as given to the handle

    @property
    def snapshots(self):
        """The steps this run can rewind to or fork from, a DataFrame indexed by step: its
        epoch (completed) and position (batches into the next), and where the state is:
        "memory" (a snapshot) or "disk" (a checkpoint; `path`)."""
        import pandas as pd

        h: Any = self
        rows: dict[int, dict[str, Any]] = {}
        if h._files.store is not None:
            h._files.wait()
            for row in describe_saved(h._files.run_dir):
                rows[row["step"]] = {
                    "epoch": row["epoch"],
                    "position": None,
                    "where": "disk",
                    "path": row["path"],
                }
        ring = h._runtime.snapshots
        for entry in ring.entries if ring is not None else ():
            rows[entry.step] = {
                "epoch": entry.epoch,
                "position": entry.position,
                "where": "memory",
                "path": rows.get(entry.step, {}).get("path"),
            }
        frame = pd.DataFrame(
            [{"step": step, **row} for step, row in sorted(rows.items())],
            columns=pd.Index(["step", "epoch", "position", "where", "path"]),
        )
        return frame.astype({"position": "Int64"}).set_index("step")

    def rewind(self, step: int) -> Self:
        """Go back to step `step`, a snapshot in memory or a checkpoint on disk (`n.snapshots`
        lists them): weights, optimizer state, counters, data position, random streams,
        history and Device values as they were, so training on repeats the same steps bit
        for bit. The steps after it stay as an abandoned branch: `n.history(abandoned=True)`
        shows its rows, its checkpoints move to `<run_dir>/abandoned/`, and the reporters
        and loggers mark the rewind. Refused while the handle trains (`n.stop().wait()`
        first), so it never lands half way."""
        h: Any = self
        with h._guard.hold(f"rewinding to step {step}"):
            snapshot, saved = _point(h, step)
            h._state = _go_back(h, h._state, snapshot, saved, "rewind")
        state = h._state
        row = state.rewinds[-1]
        h._say(
            f"rewound to step {state.step} (epoch {state.epoch}, batch {state.position}) from "
            f"step {row['from_step']}; the steps after it are an abandoned branch "
            f"(n.history(abandoned=True))"
        )
        return self

    def skipped_batches(self):
        """The training batches a spike's roll-back left out (`spike=`), a DataFrame: the
        epoch (counted from 1), the batch's index in the source's epoch, and the step and
        loss of the spike."""
        import pandas as pd

        return pd.DataFrame(
            [dict(row) for row in self._state.skipped_batches],
            columns=pd.Index(["epoch", "index", "step", "loss"]),
        )

    def history(self, abandoned: bool = False):
        """A pandas DataFrame of the history: loss, validation metrics and timing, indexed by
        epoch. `abandoned=True` adds the rows of the branches rewinds left, with a column
        `abandoned`: the rewind that left each (0 for the branch the run is on)."""
        frame = super().history()  # pyright: ignore[reportAttributeAccessIssue]
        if not abandoned:
            return frame
        import pandas as pd

        rows = [{**scalars(r), "abandoned": 0} for r in self._state.history]
        for rewind in self._state.rewinds:
            rows += [{**r, "abandoned": rewind["rewind"]} for r in rewind.get("history", ())]
        table = pd.DataFrame(rows)
        if table.empty:
            return table
        return table.sort_values(["epoch", "abandoned"], kind="stable").set_index("epoch")

    @property
    def forked_from(self) -> dict[str, Any] | None:
        """The run and step this handle was forked from (`n.fork`), or None."""
        if self._forked_from is None:
            return None
        return {k: v for k, v in self._forked_from.items() if k != "parent"}

    @property
    def parent(self) -> Any:
        """The handle this one was forked from, while it lives (`n.fork`); else None."""
        ref = (self._forked_from or {}).get("parent")
        return ref() if ref is not None else None

    def fork(self, step: int | None = None, **changes: Any) -> Any:
        """A new handle that starts from this run's snapshot (or checkpoint) of step `step`
        (None: its state now, refused while it trains) with `changes`: Device and Host
        fields, schedules (merged over this run's `schedules=`), run keywords that leave the
        programs as they are (the learning rate, max_epochs, early stopping, the
        checkpointer, ...), and edited hooks (`hooks=nitro.hooks(loss=...)`) where a live
        edit's rules take them (the same hooks, batch fields and model layout; their programs
        compile). Any other change of a program (a GraphConst field, `accum=`, `sam=`,
        another optimizer) is refused, naming it. The fork has a run
        directory of its own; both handles can train, in the background at once. With no
        changes it trains on bit for bit as this run did from `step`."""
        h: Any = self
        fields, keywords = _split_changes(h.cls, changes)
        if step is None:
            with h._guard.hold("forking"):
                snapshot, saved = _snapshot_now(h), None
        else:
            snapshot, saved = _point(h, step)
        parent: RunSetup = h._setup
        given = _inherited(parent.given_keywords)
        if "schedules" in keywords:
            keywords["schedules"] = {**dict(given.get("schedules") or {}), **keywords["schedules"]}
        if "steps_per_dispatch" not in given:
            given["steps_per_dispatch"] = h.dispatch  # what it measured: no new measurement
        given.update(keywords)
        experiment = replace(h._runtime.experiment, **fields)
        build: Any = type(self)  # Nitro
        fork = build(experiment, data=getattr(h, "_data", None), **given)
        differences = _program_differences(
            parent, fork._setup, h._state, fork._state, edits="hooks" in keywords
        )
        if differences:
            fork.close()
            named = ", ".join(f"{k}=..." for k in changes) or "no change"
            raise SetupError(
                f"fork({named}) changes the program, and a fork goes on from the snapshot's "
                f"state under its programs: " + "; ".join(differences) + ". Start a new run "
                "from the weights instead: nitro.Nitro(..., weights=n)"
            )
        state, record = restore_point(
            fork._setup,
            fork._state.variables,
            snapshot=snapshot,
            saved=saved,
            seed=fork._setup.seed,
            compare_training=False,
        )
        if "seed" in keywords:
            state.seed = fork._setup.seed
        # the parent's live schedule changes up to the step, under the fork's own
        named = set(keywords.get("schedules") or ())
        fork._replay_schedules(
            state.step,
            [
                (at, kept)
                for at, s in h._schedule_edits
                if (kept := {k: v for k, v in s.items() if k not in named})
            ],
        )
        # the snapshot's Device values, where no change names them
        _restore_device(fork, {k: v for k, v in record.member.device.items() if k not in fields})
        fork._state = state
        fork._target_epoch = fork._run_target = max(fork.max_epochs, state.epoch)
        fork._forked_from = {
            "run_id": h.run_id,
            "run_dir": h.run_dir,
            "step": state.step,
            "parent": weakref.ref(h),  # the panel overlays its curves on the fork's
        }
        fork._say(f"forked from run {h.run_id} at step {state.step} (epoch {state.epoch})")
        return fork


def _snapshot_now(handle: Any) -> Snapshot:
    """The handle's state now, as a snapshot (an idle handle's: its arrays copied now)."""
    setup, state = handle._setup, handle._state
    device = handle._runtime.device_values()
    entry = Snapshot(state.step, state.epoch, state.position, 0, 0.0)
    entry.tree = host_tree(setup, state.variables)
    entry.record = run_record(setup, detached(state), handle.run_id, state.last_row, None, device)
    entry.ready.set()
    return entry
