"""Saving a run at the end of its epochs: a checkpoint after each committed epoch when the
budget allows (its best epoch by the checkpointer's metric always, held on the host until the
next save), the newest epoch at the end of a call, the step a stopped run stopped on, and the
`CheckpointRecord` of each save (a population's: `population_save`, every member at once).
Early stopping is asked after each epoch too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from nitro.core.events import Events
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import HistoryRows, TrainState, scalars
from nitro.runs.checkpoint_record import POPULATION, CheckpointRecord, MemberRecord, PartialEpoch
from nitro.runs.checkpoint_trees import host_tree
from nitro.runs.checkpoint_writer import CheckpointStore, Save
from nitro.runs.run_dirs import member_run_id

__all__ = ["EpochSaves", "finite", "member_record", "population_save", "resume_point", "run_record"]


@dataclasses.dataclass
class EpochSaves:
    """What a run saves at the end of its epochs and of its calls: its best epoch so far by
    the checkpointer's metric (held on the host when the budget skips it, written with the
    next save), and each save's `CheckpointRecord` (`run_record`). The loop calls
    `after_epoch` once an epoch's row is committed, and the handle `end_run` at a call's end.
    `store`: the run's checkpoint writer (None: `checkpointer=None`, nothing is saved)."""

    run_id: str
    store: CheckpointStore | None
    _history_rows: HistoryRows = dataclasses.field(default_factory=HistoryRows)
    _validation_rows: HistoryRows = dataclasses.field(default_factory=HistoryRows)
    epoch_began: float | None = None  # when the epoch under way began (or its run)
    # the best value of the checkpointer's metric in the history's first `_best_rows` rows
    _best: float | None = None
    _best_rows: int = -1
    _held: Save | None = None  # a new best the budget did not save: written with the next save
    _end_best: bool = False  # the epoch the run's end saves is its best so far

    logger_state: Any = None  # () -> the logger's state(), stored in each checkpoint

    def after_epoch(
        self,
        state: Any,
        rows: Sequence[Mapping[str, Any]],
        events: Events,
        snapshot: Callable[[str | None, bool], Save],
        verdict: str | None = None,
        epochs_left: int | None = None,
        measuring: bool = False,
    ) -> str | None:
        """Checkpoint the committed epoch (when due); returns `verdict` (early stopping's).
        `rows`: the committed epochs' rows as the checkpointer's metric ranks them, the last
        this epoch's (a run's history; a population's best member's of each epoch);
        `snapshot(reason, best)`: the committed state as a save (a run's `snapshot`).
        `epochs_left`: the epochs the call trains after this one; at this epoch's pace, when
        they end (and the call's end saves) sooner than the budget would allow another save,
        this one is not due. `measuring`: "auto" is timing its call sizes (for a few seconds
        of training), and a write beside them would slow the calls it compares: under a
        budget, no save is due mid-call until it decides (the call's end saves its newest
        epoch, as always)."""
        store = self.store
        now = time.perf_counter()
        began, self.epoch_began = self.epoch_began, now
        ends_in = None
        if epochs_left is not None and began is not None:
            ends_in = epochs_left * (now - began)
        hold = measuring and (epochs_left is None or epochs_left > 0)  # mid-call
        if store is None:
            return verdict
        best = self._new_best(store, rows)
        if epochs_left == 0 or verdict is not None:
            # the run's end saves this epoch, with its stop reason (`end`)
            self._end_best = best
            if best:
                self._held = None
        elif store.due(state.epoch, ends_in=ends_in, hold=hold):
            self.save(snapshot(None, best), events)
        elif best:  # kept on the host, written with the next save or at the call's end
            self._held = snapshot(None, True)
            store.give_name(self._held)
        return verdict

    def _new_best(self, store: CheckpointStore, rows: Sequence[Mapping[str, Any]]) -> bool:
        """Whether the epoch just committed (the last of `rows`) is the run's best so far by
        the checkpointer's metric and mode."""
        config = store.config
        value = finite(rows[-1].get(config.metric)) if rows else None
        history = rows
        if self._best_rows != len(history) - 1:  # another history: a resume, restore_best
            self._best = None
            for earlier in history[:-1]:
                seen = finite(earlier.get(config.metric))
                if seen is not None and (self._best is None or config.better(seen, self._best)):
                    self._best = seen
        self._best_rows = len(history)
        if value is None or (self._best is not None and not config.better(value, self._best)):
            return False
        self._best = value
        return True

    def end(self, state: Any, events: Events, reason: str | None, snapshot: Callable) -> None:
        """A run (or population) that ends at an epoch boundary leaves its newest epoch saved,
        one stopped in the middle of an epoch the step it stopped on (`snapshot(reason,
        best)`: the save, as `after_epoch`'s). `train()` returns at once: the save is written in the background, and the next
        save, a reader of the run's checkpoints, `close()` and the process's end wait for it.
        A stopped run waits for its save, to say where it resumes from."""
        store = self.store
        if store is None:
            return
        midway = state.position or getattr(state, "epoch_trained", False)
        at_boundary = not (state.epoch == 0 or midway)
        # a stop request or max_steps, in the middle of an epoch: saved where it stopped
        stopped = reason in ("requested", "max_steps") and midway
        failures = len(store.failures)
        end_best, self._end_best = self._end_best, False
        recorded_earlier = True
        if (at_boundary and store.saved_epoch != state.epoch) or (
            stopped and store.saved_step != state.step
        ):
            recorded_earlier = False
            self.save(snapshot(reason, at_boundary and end_best), events, last=True)
        else:
            self._write_held()
            store.close_later()  # the writes finish, then the manager's threads end
        if reason is not None and (reason == "requested" or stopped):
            store.close()
            saved = store.saved_step == state.step and len(store.failures) == failures
            if saved and recorded_earlier:  # an epoch saved before the stop came
                store.record_reason(state.step, reason)
            events.note(resume_point(state, store, saved))

    def save(self, save: Save, events: Events, last: bool = False) -> None:
        """Save the committed state (after the best epoch held since, if any); `save.best`:
        it is the run's best so far by the checkpointer's metric, and no newer save replaces
        it. `last`: the call ends here."""
        events.phase("checkpointing")  # the loop (or the run's end) sets the next phase
        store = self.store
        assert store is not None  # saves come from a run with a store
        held, self._held = self._held, None
        if held is not None and held.step == save.step:
            held, save = None, save._replace(best=True)
        store.save(*save[:4], then_close=last, best=save.best, earlier=held)

    def snapshot(
        self,
        setup: RunSetup,
        state: TrainState,
        device: Mapping[str, Any],
        reason: str | None,
        best: bool,
        lazy: bool = False,
    ) -> Save:
        """A run's committed state as a save: host copies (`host_tree`) and its JSON record.
        `device`: the Device fields' values now (the record holds them); `lazy`: no later call
        donates the variables (`RunTime.restores`), so the host copies are made when the save
        is written, and a save that a newer one replaces copies nothing."""
        store = self.store
        assert store is not None
        row = state.last_row
        return Save(
            state.step,
            host_tree(setup, state.variables, lazy=lazy),
            run_record(
                setup,
                state,
                self.run_id,
                row,
                reason,
                device,
                self.logger_state() if self.logger_state is not None else None,
                self._history_rows,
                self._validation_rows,
            ),
            finite(row.get(store.config.metric)),
            best,
        )

    def _write_held(self, then_close: bool = False) -> None:
        """Hand the best epoch held on the host to the store (the call ends without a save
        of its own that would write it)."""
        held, self._held = self._held, None
        if held is not None and self.store is not None:
            self.store.save(*held[:4], then_close=then_close, best=True)

    def close(self) -> None:
        self._write_held()
        if self.store is not None:
            self.store.close()


def finite(value: Any) -> float | None:
    """A metric's value as a float, None when it is missing or not finite."""
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        value = float(value)
        return value if np.isfinite(value) else None
    return None


def resume_point(state: Any, store: CheckpointStore, saved: bool) -> str:
    """Where a stopped run (or population) can resume from: the step it stopped on, when that
    was saved."""
    where = f"epoch {state.epoch + 1}, batch {state.position}"
    if getattr(state, "epoch_trained", False):
        where = f"epoch {state.epoch + 1} trained, before its validation"
    elif not state.position:
        where = f"the end of epoch {state.epoch}"
    if saved:
        return (
            f"stopped at step {state.step} ({where}); saved {store.step_path(state.step)}: "
            f"resume= continues from there"
        )
    return (
        f"stopped at step {state.step} ({where}); that step could not be saved (see the "
        f"warning), so resume= continues from the newest checkpoint in {store.directory}"
    )


def run_record(
    setup: RunSetup,
    state: TrainState,
    run_id: str,
    row: Mapping[str, Any],
    reason: str | None,
    device: Mapping[str, Any],
    logger_state: Any = None,
    history: HistoryRows | None = None,
    validations: HistoryRows | None = None,
) -> CheckpointRecord:
    """The record of a run's save: its counters, history and epoch under way, with what a
    resume compares (`history`, `validations`: the converted rows kept across saves)."""
    member = member_record(
        state, row, device, logger_state, history, validations, _partial_epoch(state)
    )
    return CheckpointRecord.of(
        setup,
        run_id=run_id,
        step=state.step,
        epoch=state.epoch,
        members=(member,),
        metrics=member.metrics,
        stop_reason=reason,
        swaps=tuple(dict(r) for r in state.swaps),
    )


def member_record(
    state: TrainState,
    row: Mapping[str, Any],
    device: Mapping[str, Any],
    logger_state: Any,
    history: HistoryRows | None,
    validations: HistoryRows | None,
    partial_epoch: PartialEpoch | None,
    **fields: Any,
) -> MemberRecord:
    """A run's (or a population member's, with its `fields`) part of a save: its seed,
    history, validations, newest metrics (`row`), epoch under way, Device values, its
    loggers' state, the batches a spike's roll-back left out and its rewinds."""
    return MemberRecord(
        seed=state.seed,
        history=(history or HistoryRows()).to_json(state.history),
        metrics=scalars(row),
        validations=(validations or HistoryRows()).to_json(state.validations),
        partial_epoch=partial_epoch,
        device=dict(device),
        logger=logger_state,
        skipped_batches=tuple(getattr(state, "skipped_batches", ())),
        rewinds=tuple(getattr(state, "rewinds", ())),
        **fields,
    )


def population_save(
    files: Any,
    members: Sequence[Any],
    state: Any,
    reason: str | None,
    best: bool,
    value: Any,
    search: Mapping[str, Any] | None = None,
) -> Save:
    """Every member of a population as one save: the stacked variables, and each member's
    record (`member_record`, with its logger runs' state) beside the shared counters; ranked
    by `value` (its best member's of the checkpointer's metric). `files`: the population's
    (`PopulationFiles`); `search`: its search's record, as it stands."""
    store = files.store
    assert store is not None
    config, healthy = store.config, np.asarray(state.healthy).tolist()
    entries = tuple(
        member_record(
            member.state,
            member.state.last_row,
            member.runtime.device_values(),
            member.logging.logger.state() if member.logging is not None else None,
            history,
            validations,
            _partial_epoch(member.state),
            index=member.index,
            run_id=member_run_id(files.run_id, member.index),
            settings=token,
            healthy=bool(ok),
            stopped=member.stopped,
            stopped_at=member.stopped_at,
        )
        for member, token, (history, validations), ok in zip(
            members, files.settings, files.rows, healthy, strict=True
        )
    )
    setup = members[0].setup
    record = CheckpointRecord.of(
        setup,
        run_id=files.run_id,
        step=state.step,
        epoch=state.epoch,
        members=entries,
        kind=POPULATION,
        position=state.position,
        batches=state.batches,
        prune=dict(state.prune),
        search=dict(search or {}),
        metrics={config.metric: value} if value is not None else {},
        stop_reason=reason,
    )
    return Save(state.step, host_tree(setup, state.variables), record, value, best)


def _partial_epoch(state: TrainState) -> PartialEpoch | None:
    """The epoch under way of a run stopped in its middle (None at an epoch boundary): the
    batches it completed and its running sums, so a resume continues at the next batch.
    The epoch's train metrics (the train_metrics hook) start again from there."""
    totals = state.totals
    if totals is None or not (state.position or state.epoch_trained):
        return None
    # the source's iterator state, when it has one
    return PartialEpoch.of(
        state.position, totals, trained=state.epoch_trained, data_state=state.data_state
    )
