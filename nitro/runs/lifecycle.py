"""A run's life on disk: its directory and id, checkpoints after each epoch, resume, early
stopping. The handle composes one `RunFiles`; the loop calls `after_epoch` once an epoch's
row is committed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nitro._version import __version__
from nitro.core.events import Events
from nitro.core.run_setup import CheckpointRef, RunSetup, SplitSetup
from nitro.core.train_state import TrainState, Variables
from nitro.errors import SetupError
from nitro.experiments.declaration import FieldKind, field_specs
from nitro.experiments.fingerprint import code_digest
from nitro.optim.fed_optimizer import describe_optimizer
from nitro.runs.checkpoint_reads import SavedStep, read_checkpoint, resolve_checkpoint
from nitro.runs.checkpoint_trees import (
    LOSS_SCALE_KEYS,
    host_tree,
    json_safe,
    leaves_from,
    place_like,
    restore_targets,
)
from nitro.runs.checkpoint_writer import CheckpointStore, Save, await_writers, warm_up
from nitro.runs.checkpoints import Checkpointer
from nitro.runs.identity import (
    Choice,
    RunIdentity,
    candidates_elsewhere,
    choose_run,
    describe,
    record_name,
    recorded,
)
from nitro.runs.run_dirs import (
    checkpoint_dir,
    default_run_dir,
    experiment_root,
    list_runs,
    new_run_id,
    read_run_json,
    write_run_json,
)
from nitro.runs.run_lock import RunLock, acquire, check_free, describe_holder, holder_record
from nitro.runs.training_config import training_config, training_differences

__all__ = ["RunFiles", "check_watched_metrics", "config_of", "metric_names", "run_to_resume"]

_OURS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),)  # nitro/
_OURS += (os.path.join(os.path.dirname(_OURS[0]), "nitro_ipython"),)


def warn_user(message: str) -> None:
    """A RuntimeWarning pointing at the first caller outside Nitro (the user's line)."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(_OURS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level)


def config_token(value: Any) -> Any:
    """A JSON value standing for a GraphConst value; functions stand for their code."""
    if callable(value) and not isinstance(value, type) and hasattr(value, "__code__"):
        return f"<code {code_digest(value)}>"
    return json_safe(value)


def config_of(setup: RunSetup) -> dict[str, Any]:
    return {name: config_token(v) for name, v in setup.experiment.graphconst.items()}


def _config_of_instance(experiment: Any) -> dict[str, Any]:
    return {
        spec.name: config_token(getattr(experiment, spec.name))
        for spec in field_specs(type(experiment))
        if spec.kind is FieldKind.GRAPHCONST
    }


@dataclasses.dataclass
class RunFiles:
    """Where this run lives and what it saves there. `lock`: this run's hold on its
    directory (`nitro.runs.run_lock`), taken at the first write, or at `plan` for a run that
    resumes or a `run_dir=` named; `busy()`: whether the handle works now."""

    run_id: str
    run_dir: Path
    resume_from: SavedStep | None
    store: CheckpointStore | None
    opened: bool = False
    branched_from: str | None = None  # resumed from an earlier checkpoint of this run
    identity: RunIdentity | None = None
    busy: Callable[[], bool] = lambda: False
    lock: RunLock | None = None
    locks: bool = True  # False on the secondary processes of a multi-process run
    claim: bool | None = None  # planned: hold the directory (True: may take it over) at once
    _history_rows: _ScalarRows = dataclasses.field(default_factory=lambda: _ScalarRows())
    _epoch_began: float | None = None  # when the epoch under way began (or its run)
    # the best value of the checkpointer's metric in the history's first `_best_rows` rows
    _best: float | None = None
    _best_rows: int = -1
    _held: Save | None = None  # a new best the budget did not save: written with the next save
    _end_best: bool = False  # the epoch the run's end saves is its best so far

    @classmethod
    def plan(
        cls,
        setup: RunSetup,
        events: Events,
        *,
        say: Callable[[str], None] | None = None,
        busy: Callable[[], bool] = lambda: False,
        state: TrainState | None = None,
    ) -> RunFiles:
        """Decide the run's directory and id; nothing is written yet. A run that continues a
        directory that exists or names one (`run_dir=`) holds it once the handle is built
        (`claim_planned`, after a resume's checks passed). `say`: how to tell the person which
        run `resume='auto'` continues (default: an event note). `state`: the fresh state, whose
        sharded leaves a resume reads its checkpoint onto."""
        identity = RunIdentity.of(setup.cls, setup.name)
        if setup.run_dir is not None:
            from nitro.runs.population_dirs import refuse_for_a_run

            refuse_for_a_run(setup.run_dir, "run_dir")
        targets = restore_targets(setup, state.variables) if state is not None else None
        found = (
            _resume_source(setup, identity, say or events.note, targets) if setup.resume else None
        )
        branched_from = None
        if found is not None:
            directory, step = found
            run_dir = directory.parent
            run_id = read_run_json(run_dir).get("run_id") or run_dir.name
            if step < max(_saved_steps(directory), default=step):
                # an earlier checkpoint: its run's later ones stay; this run goes on elsewhere
                branched_from, origin = run_id, run_dir
                run_dir, run_id = _new_run_dir(setup, besides=origin)
        else:
            run_dir, run_id = _new_run_dir(setup)
        store = None
        if setup.checkpointer is not None:
            store = CheckpointStore(
                checkpoint_dir(run_dir),
                setup.checkpointer,
                deterministic=setup.placement.multi_process,
            )
        files = cls(
            run_id,
            run_dir,
            found,
            store,
            branched_from=branched_from,
            identity=identity,
            busy=busy,
            locks=not setup.placement.multi_process or _primary_process(),
        )
        named = setup.run_dir is not None and Path(setup.run_dir).absolute() == run_dir
        # this run goes on in its directory: resumed, or a run_dir= whose run it continues
        # (run.json but no checkpoints yet: its run id is taken); it may take the directory
        # over from an idle handle of this process
        continues = (found is not None and branched_from is None) or (
            named and read_run_json(run_dir).get("run_id") == run_id
        )
        if continues or named:
            files.claim = continues
        return files

    def claim_planned(self, setup: RunSetup) -> None:
        """Hold the directory `plan` decided to hold (a refused resume holds nothing, and an
        idle handle it would have taken the directory from keeps it)."""
        if self.claim is not None:
            self.hold(setup, take_over=self.claim)
            self.claim = None

    # ------------------------------------------------------------------------------------------
    # one writer

    def hold(self, setup: RunSetup, *, take_over: bool = False) -> None:
        """Hold the run directory for writing (see `nitro.runs.run_lock`); refused with a
        SetupError while another handle, here or in another process, holds it."""
        lock = self.lock
        if lock is not None and lock.taken_by is not None:
            raise SetupError(
                f"this handle no longer writes run {self.run_id}: a later handle resumed it "
                f"and took {str(self.run_dir)!r} over ({describe_holder(lock.taken_by)}). "
                f"Train that handle, or build a new one: Nitro(..., resume={str(self.run_dir)!r})"
            )
        if (lock is not None and lock.held) or not self.locks:
            return
        holder = holder_record(self.run_id, setup.name, setup.owner)
        self.lock = acquire(self.run_dir, holder, self.busy, take_over=take_over)

    def release(self) -> None:
        """Finish the saves and let go of the run directory (`Nitro.close`); a later write
        holds it again, if no other handle has taken it meanwhile."""
        self.close()
        if self.lock is not None and self.lock.taken_by is None:
            self.lock.release()
            self.lock = None

    # ------------------------------------------------------------------------------------------
    # resume

    def restore(
        self,
        setup: RunSetup,
        state: TrainState,
        events: Events,
        device: Mapping[str, Any],
        say: Callable[[str], None] | None = None,
    ) -> tuple[TrainState, dict[str, Any]]:
        """The state to resume from, read from the checkpoint (a new `TrainState`; `state`,
        the fresh one, gives the arrays' shapes and stays as it was), and the checkpoint's
        JSON record. `device`: the Device fields' values now, compared with the saved ones.
        `say`: how to tell the person what the resume continues and what differs (default:
        an event note; a handle without progress prints them)."""
        assert self.resume_from is not None  # planned: a run that resumes
        note = say or events.note
        directory, step = self.resume_from
        saved, meta = read_checkpoint(
            directory, step, targets=restore_targets(setup, state.variables)
        )
        if meta.get("kind") == "population":
            raise SetupError(
                f"{str(self.resume_from.path)!r} is a population's checkpoint (every member's "
                f"state at once): Population(..., resume={str(directory.parent)!r}) continues "
                f"it, and Nitro(..., weights=({str(directory.parent)!r}, i)) starts a run from "
                f"member i's weights"
            )
        _check_config(setup, meta)
        for line in _drift_notes(setup, meta, device):
            note(line)
        variables = state.variables
        if variables.opt_state is not None and "opt_state" not in saved:
            raise SetupError(
                f"the checkpoint at {str(directory)!r} step {step} holds no optimizer state "
                f"(it was saved by a run without a 'train' split); resume needs one: use "
                f"weights= to start from its weights instead"
            )
        params, rest, opt, ema, ema_steps = restore_leaves(
            setup,
            variables,
            saved,
            misfit=_optimizer_misfit(setup, meta, self.resume_from),
            here="this run's",
            note=note,
        )
        differences = training_differences(meta.get("training"), training_config(setup))
        if differences is not None:
            warn_user(differences)
        loss_scale = variables.loss_scale
        if loss_scale is not None:  # precision="float16": resume its dynamic loss scale
            if "loss_scale" in saved:
                loss_scale = leaves_from(
                    "loss scale",
                    saved["loss_scale"],
                    LOSS_SCALE_KEYS,
                    [np.zeros(x.shape, x.dtype) for x in loss_scale],
                )
            else:  # a run that did not scale its loss before
                scale = setup.precision.initial_scale if setup.precision is not None else 1.0
                note(
                    f"the checkpoint holds no loss scale (it was not trained in float16): the "
                    f"dynamic loss scale starts at {scale:g}"
                )
        restored = TrainState.from_checkpoint(
            placed_like(setup, variables, params, rest, opt, ema, ema_steps, loss_scale),
            meta,
            seed=state.seed,
        )
        if self.store is not None:
            self.store.saved_epoch = restored.epoch
            self.store.saved_step = restored.step
        if self.branched_from is None:
            said = f"resumed run {self.run_id} from its checkpoint"
        else:
            said = (
                f"resumed from run {self.branched_from}'s earlier checkpoint as a new run "
                f"{self.run_id} (the later checkpoints of {self.branched_from} stay as they "
                f"were);"
            )
        note(f"{said} at epoch {restored.epoch}, step {restored.step} ({self.resume_from.path})")
        return restored, meta

    # ------------------------------------------------------------------------------------------
    # during a run

    def open(self, setup: RunSetup, events: Events) -> None:
        """Hold the run directory, create it and its run.json; the first line of a run names
        them. A run that saves under a name records it in `handles.json` beside the runs."""
        self.prepare(setup)
        if self.opened:
            return
        if self.store is not None:
            warm_up()
        try:
            self._write_run_json(setup)
        except OSError as error:
            raise self._unwritable(error) from None
        self.opened = True
        events.note(f"run {self.run_id} in {self.run_dir}")

    def prepare(self, setup: RunSetup) -> None:
        """Hold the run directory and create it, before the run starts (and its loggers
        write there): a read-only or vanished directory is refused before any training."""
        self._epoch_began = time.perf_counter()
        try:
            self.hold(setup)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise self._unwritable(error) from None

    def _unwritable(self, error: OSError) -> SetupError:
        """The refusal of a run directory this handle cannot write; a handle that has written
        nothing there lets go of it, so another handle may use it at once."""
        if not self.opened and self.lock is not None and self.lock.taken_by is None:
            self.lock.release()
            self.lock = None
        return SetupError(
            f"cannot create the run directory {str(self.run_dir)!r} "
            f"({type(error).__name__}: {error.strerror or error}); nothing was trained. "
            f"Put the run where it can write with run_dir='/some/writable/dir' (every run "
            f"writes its run.json, even with checkpointer=None and logger=None)"
        )

    def _write_run_json(self, setup: RunSetup) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        info = read_run_json(self.run_dir)
        identity = self.identity or RunIdentity.of(setup.cls, setup.name)
        if info.get("run_id") not in (None, self.run_id):
            raise SetupError(
                f"run_dir {str(self.run_dir)!r} now holds run {info['run_id']}, written by "
                f"another handle since this one was built; one run directory holds one run: "
                f"build this handle with another run_dir, or resume={str(self.run_dir)!r} to "
                f"continue that run"
            )
        if not info:
            write_run_json(
                self.run_dir,
                {
                    "run_id": self.run_id,
                    "experiment": setup.owner,
                    **identity.as_json(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "seed": setup.seed,
                    "graphconst": config_of(setup),
                    "nitro": __version__,
                    "resumed_from": (
                        str(self.resume_from[0] / str(self.resume_from[1]))
                        if self.resume_from is not None
                        else None
                    ),
                },
            )
        elif not recorded(info):  # a run of an older Nitro, resumed: it records who it is now
            write_run_json(self.run_dir, {**info, **identity.as_json()})
        root = experiment_root(setup.cls.__name__).absolute()
        if self.run_dir.parent == root:
            record_name(root, identity, self.run_id, self.run_dir)

    logger_state: Any = None  # () -> the logger's state(), stored in each checkpoint

    def after_epoch(
        self,
        setup: RunSetup,
        state: TrainState,
        row: dict[str, Any],
        events: Events,
        device: Mapping[str, Any],
        epochs_left: int | None = None,
        lazy: bool = False,
        measuring: bool = False,
    ) -> str | None:
        """Checkpoint the committed epoch (when due), then ask early stopping. `device`: the
        Device fields' values now (the checkpoint records them). `epochs_left`: the epochs
        the call trains after this one; at this epoch's pace, when they end (and the call's
        end saves) sooner than the budget would allow another save, this one is not due.
        `lazy`: no later call donates the variables (`RunTime.restores`), so a save copies them
        to the host when it is written, and a save that a newer one replaces copies nothing.
        `measuring`: "auto" is timing its call sizes (for a few seconds of training), and a
        write beside them would slow the calls it compares: under a budget, no save is due
        mid-call until it decides (the call's end saves its newest epoch, as always)."""
        store = self.store
        now = time.perf_counter()
        began, self._epoch_began = self._epoch_began, now
        ends_in = None
        if epochs_left is not None and began is not None:
            ends_in = epochs_left * (now - began)
        hold = measuring and (epochs_left is None or epochs_left > 0)  # mid-call
        verdict = None
        if setup.early_stop is not None and setup.early_stop.should_stop(state.history):
            verdict = "early_stop"
        if store is None:
            return verdict
        best = self._new_best(store, state, row)
        if epochs_left == 0 or verdict is not None:
            # the run's end saves this epoch, with its stop reason (`end_run`)
            self._end_best = best
            if best:
                self._held = None
        elif store.due(state.epoch, ends_in=ends_in, hold=hold):
            self._save(setup, state, row, events, device, lazy=lazy, best=best)
        elif best:  # kept on the host, written with the next save or at the call's end
            self._held = self._snapshot(setup, state, row, device, None, lazy, best=True)
        return verdict

    def _new_best(self, store: CheckpointStore, state: TrainState, row: Mapping) -> bool:
        """Whether the epoch just committed (`row`, the history's last) is the run's best so
        far by the checkpointer's metric and mode."""
        config = store.config
        value = _finite(row.get(config.metric))
        history = state.history
        if self._best_rows != len(history) - 1:  # another history: a resume, restore_best
            self._best = None
            for earlier in history[:-1]:
                seen = _finite(earlier.get(config.metric))
                if seen is not None and (self._best is None or config.better(seen, self._best)):
                    self._best = seen
        self._best_rows = len(history)
        if value is None or (self._best is not None and not config.better(value, self._best)):
            return False
        self._best = value
        return True

    def end_run(
        self,
        setup: RunSetup,
        state: TrainState,
        events: Events,
        reason: str,
        device: Mapping[str, Any],
        lazy: bool = False,
    ) -> None:
        """A run that ends at an epoch boundary leaves its newest epoch saved (`lazy`: as
        `after_epoch`). `train()`
        returns at once: the save is written in the background, and the next save, a reader
        of the run's checkpoints, `close()` and the process's end wait for it. A stopped run
        waits for its save, to say where it resumes from."""
        store = self.store
        if store is None:
            return
        at_boundary = not (state.epoch == 0 or state.position or state.epoch_trained)
        # a stop request or max_steps, in the middle of an epoch: saved where it stopped
        stopped = reason in ("requested", "max_steps") and (state.position or state.epoch_trained)
        failures = len(store.failures)
        end_best, self._end_best = self._end_best, False
        recorded_earlier = True
        if (at_boundary and store.saved_epoch != state.epoch) or (
            stopped and store.saved_step != state.step
        ):
            recorded_earlier = False
            self._save(
                setup,
                state,
                state.last_row,
                events,
                device,
                reason,
                last=True,
                lazy=lazy,
                best=at_boundary and end_best,
            )
        else:
            self._write_held()
            store.close_later()  # the writes finish, then the manager's threads end
        if reason == "requested" or (reason == "max_steps" and stopped):
            store.close()
            saved = store.saved_step == state.step and len(store.failures) == failures
            if saved and recorded_earlier:  # an epoch saved before the stop came
                store.record_reason(state.step, reason)
            events.note(_resume_point(state, store, saved))

    def _save(
        self,
        setup: RunSetup,
        state: TrainState,
        row: Mapping[str, Any],
        events: Events,
        device: Mapping[str, Any],
        reason: str | None = None,
        last: bool = False,
        lazy: bool = False,
        best: bool = False,
    ) -> None:
        """Save the committed state (after the best epoch held since, if any). `best`: it is
        the run's best so far by the checkpointer's metric, and no newer save replaces it."""
        events.phase("checkpointing")  # the loop (or the run's end) sets the next phase
        store = self.store
        assert store is not None  # saves come from a run with a store
        save = self._snapshot(setup, state, row, device, reason, lazy, best)
        held, self._held = self._held, None
        if held is not None and held.step == save.step:
            held, save = None, save._replace(best=True)
        store.save(*save[:4], then_close=last, best=save.best, earlier=held)

    def _snapshot(
        self,
        setup: RunSetup,
        state: TrainState,
        row: Mapping[str, Any],
        device: Mapping[str, Any],
        reason: str | None,
        lazy: bool,
        best: bool,
    ) -> Save:
        """The committed state as a save: host copies (`host_tree`) and its JSON record."""
        store = self.store
        assert store is not None
        return Save(
            state.step,
            host_tree(setup, state.variables, lazy=lazy),
            checkpoint_meta(
                setup,
                state,
                self.run_id,
                row,
                reason,
                device,
                self.logger_state() if self.logger_state is not None else None,
                self._history_rows,
            ),
            _finite(row.get(store.config.metric)),
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


def _finite(value: Any) -> float | None:
    """A metric's value as a float, None when it is missing or not finite."""
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        value = float(value)
        return value if np.isfinite(value) else None
    return None


def _resume_point(state: TrainState, store: CheckpointStore, saved: bool) -> str:
    """Where a stopped run can resume from: the step it stopped on, when that was saved."""
    where = f"epoch {state.epoch + 1}, batch {state.position}"
    if state.epoch_trained:
        where = f"epoch {state.epoch + 1} trained, before its validation"
    elif not state.position:
        where = f"the end of epoch {state.epoch}"
    if saved:
        return (
            f"stopped at step {state.step} ({where}); saved {store.directory / str(state.step)}: "
            f"resume= continues from there"
        )
    return (
        f"stopped at step {state.step} ({where}); that step could not be saved (see the "
        f"warning), so resume= continues from the newest checkpoint in {store.directory}"
    )


def checkpoint_meta(
    setup: RunSetup,
    state: TrainState,
    run_id: str,
    row: Mapping[str, Any],
    reason: str | None,
    device: Mapping[str, Any],
    logger_state: Any = None,
    rows: _ScalarRows | None = None,
) -> dict[str, Any]:
    checkpointer = setup.checkpointer
    assert checkpointer is None or isinstance(checkpointer, Checkpointer)  # the keyword's check
    return {
        "format": 1,
        "nitro": __version__,
        "jax": jax.__version__,
        "run_id": run_id,
        "experiment": setup.owner,
        "step": state.step,
        "epoch": state.epoch,
        "seed": state.seed,
        "history": rows.of(state.history) if rows is not None else _ScalarRows().of(state.history),
        "metrics": _scalars(row),
        "validations": [_scalars(r) for r in state.validations],
        "swaps": [dict(r) for r in state.swaps],
        "stop_reason": reason,
        "graphconst": config_of(setup),
        "device": dict(device),
        "code": {unit: fp.digest for unit, fp in setup.experiment.code.items()},
        "optimizer": describe_optimizer(setup.optimizer) if setup.optimizer is not None else None,
        "training": training_config(setup),
        "checkpointer": dataclasses.asdict(checkpointer) if checkpointer else None,
        "logger": logger_state,
        "partial_epoch": _partial_epoch(state),
    }


def _scalars(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if np.ndim(v) == 0}


class _ScalarRows:
    """The history's scalar columns as each checkpoint records them, each row converted once:
    a handle that trained a thousand one-epoch calls does not convert a thousand rows per
    save. Rows are never changed once committed; a history that is not the one seen last
    (another handle's, or one replaced by a resume) is converted afresh."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: list[Mapping[str, Any]] = []
        self._rows: list[dict[str, Any]] = []

    def of(self, history: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        with self._lock:
            n = len(self._seen)
            if n > len(history) or (n and history[n - 1] is not self._seen[-1]):
                self._seen, self._rows, n = [], [], 0
            for row in history[n:]:
                self._seen.append(row)
                self._rows.append(_scalars(row))
            return list(self._rows)


def _partial_epoch(state: TrainState) -> dict[str, Any] | None:
    """The epoch under way of a run stopped in its middle (None at an epoch boundary): the
    batches it completed and its running sums, so a resume continues at the next batch.
    The epoch's train metrics (the train_metrics hook) start again from there."""
    totals = state.totals
    if totals is None or not (state.position or state.epoch_trained):
        return None
    return {
        "position": state.position,
        "trained": state.epoch_trained,
        "loss_sum": totals.loss_sum,
        "loss_count": totals.loss_count,
        "nonfinite": totals.nonfinite,
        "steps": totals.steps,
        "wait_seconds": totals.wait_seconds,
        "seconds": totals.seconds,
        "device_seconds": totals.device_seconds,
        "untimed_seconds": totals.untimed_seconds,
        "data_state": state.data_state,  # the source's iterator state, when it has one
    }


def _new_run_dir(setup: RunSetup, besides: Path | None = None) -> tuple[Path, str]:
    """(directory, run id) of a new run: `run_dir=`, refused when it holds checkpoints
    already, or `runs/<Experiment>/<new run id>` (also when `run_dir=` names `besides`, the
    run an earlier checkpoint is resumed from)."""
    if setup.run_dir is None or Path(setup.run_dir).absolute() == besides:
        run_id = new_run_id()
        return default_run_dir(setup.cls.__name__, run_id), run_id
    run_dir = Path(setup.run_dir).absolute()
    existing = read_run_json(run_dir)
    steps = _saved_steps(checkpoint_dir(run_dir))
    if steps:
        raise SetupError(
            f"run_dir {str(run_dir)!r} already holds checkpoints of run "
            f"{existing.get('run_id', run_dir.name)} (steps {steps[0]}..{steps[-1]}): "
            f"resume='auto' continues it; choose another run_dir for a new run"
        )
    return run_dir, existing.get("run_id") or new_run_id()


def _saved_steps(directory: Path) -> list[int]:
    await_writers(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _primary_process() -> bool:
    return jax.process_index() == 0


def _resume_source(
    setup: RunSetup,
    identity: RunIdentity,
    say: Callable[[str], None],
    targets: Mapping[tuple[str, ...], Any] | None = None,
) -> SavedStep | None:
    resume = setup.resume
    if isinstance(resume, CheckpointRef):
        _check_no_writer(Path(resume.path))
        return resolve_checkpoint(resume, targets=targets)
    name = setup.cls.__name__
    root = Path(setup.run_dir) if setup.run_dir is not None else experiment_root(name)
    runs = list_runs(root)
    if [run.path for run in runs] == [root.absolute()]:  # run_dir= names one run: that one
        if runs[0].checkpoints:
            check_free(root)
            say(f"resume='auto' continues run {runs[0].run_id}: the run run_dir= names")
            return resolve_checkpoint(root, targets=targets)
        choice = None
    else:
        choice = choose_run(root, identity, config_of(setup))
    if choice is None:
        others = candidates_elsewhere(root, identity)
        aside = (
            f" ({others} run{'s' * (others > 1)} of other experiments named {name} there: "
            f"another module or notebook; resume=<run dir> continues one)"
            if others
            else ""
        )
        warn_user(
            f"resume='auto' found no checkpoint under {str(root.absolute())!r} of "
            f"{identity.where()}; starting a fresh run{aside}"
        )
        return None
    say(f"resume='auto' continues run {choice.run.run_id}: {choice.why}")
    check_free(choice.path)
    return resolve_checkpoint(choice.path, targets=targets)


def _check_no_writer(path: Path) -> None:
    """`resume=<path>`: refused while a writer holds the run it names (a run directory, its
    checkpoints directory or one step's)."""
    path = path.absolute()
    await_writers(path)
    for run_dir in (path, path.parent, path.parent.parent):
        if (run_dir / "checkpoints").is_dir():
            check_free(run_dir)
            return


def run_to_resume(
    experiment: Any, name: str | None = None, *, pick: str | None = None, pick_hint: str = ""
) -> Choice | None:
    """The run on disk that `experiment`'s handle named `name` continues (`%nitro train exp
    --resume`): the run the name last trained, else the only run of this experiment (same
    module, class and notebook) with its GraphConst values; several such runs are refused
    with a SetupError listing them (`pick_hint`: how to pick one). `pick`: a run id under
    `runs/<Experiment>/`, or a run directory. None when no run has a checkpoint."""
    cls = type(experiment)
    identity = RunIdentity.of(cls, name)
    root = experiment_root(cls.__name__)
    if pick is None:
        return choose_run(
            root, identity, _config_of_instance(experiment), strict=True, pick_hint=pick_hint
        )
    named = Path(pick)
    runs = list_runs(named) if named.is_dir() else []
    if [run.path for run in runs] == [named.absolute()]:
        return Choice(runs[0], f"the run directory {pick} named")
    for run in list_runs(root):
        if pick in (run.run_id, run.path.name):
            return Choice(run, f"run {pick}, as named")
    known = [
        describe(run, read_run_json(run.path))
        for run in list_runs(root)
        if run.checkpoints and identity.same_experiment(read_run_json(run.path))
    ]
    raise SetupError(
        f"no run {pick!r} under {str(root.absolute())!r}"
        + (":\nruns of " + identity.where() + ":\n" + "\n".join(known) if known else "")
        + "\nGive a run id from that list, or a run directory's path"
    )


def _check_config(setup: RunSetup, meta: dict[str, Any]) -> None:
    saved = meta.get("graphconst") or {}
    now = config_of(setup)
    changed = [
        f"  {name}: checkpoint {saved.get(name, '<unset>')!r}, now {now.get(name, '<unset>')!r}"
        for name in sorted(set(saved) | set(now))
        if saved.get(name) != now.get(name)
    ]
    if changed:
        raise SetupError(
            "cannot resume: GraphConst fields differ from the checkpoint's, so its state does "
            "not fit the programs this experiment builds:\n"
            + "\n".join(changed)
            + "\nBuild the experiment with the checkpoint's values, or start a new run from its "
            "weights with weights= (the model must still fit)."
        )
    if meta.get("experiment") and meta["experiment"] != setup.owner:
        warn_user(f"resuming a checkpoint of {meta['experiment']} into {setup.owner}")


def restore_leaves(
    setup: RunSetup,
    template: Variables,
    saved: Mapping[str, Any],
    *,
    misfit: str,
    here: str,
    note: Callable[[str], Any] | None = None,
) -> tuple[list, list, list | None, list | None, Any]:
    """A checkpoint's parameters, model state, optimizer state and moving average (with its
    step count), shaped like `template` (a single run's variables, or a population's,
    stacked); a misfit names the leaves. A checkpoint without a moving average that
    `template` keeps starts the average from the weights (and says so through `note`)."""
    model = setup.model
    params = leaves_from(
        "parameters", saved["params"], model.leaf_paths["parameter"], template.params
    )
    rest = leaves_from(
        "model state",
        saved.get("model_state", {}),
        model.leaf_paths["model state"],
        template.model_state,
    )
    opt = None
    if template.opt_state is not None:
        opt = leaves_from(
            "optimizer state",
            saved.get("opt_state", {}),
            model.leaf_paths["optimizer state"],
            template.opt_state,
            misfit=misfit,
            here=here,
        )
    ema = ema_steps = None
    if template.ema is not None:
        if "ema" in saved:
            ema = leaves_from(
                "moving average of the weights",
                saved["ema"],
                model.leaf_paths["parameter"],
                template.ema,
            )
            ema_steps = np.asarray(saved["ema_steps"], dtype=np.int32)
        else:  # a run that did not average before: start the average here
            ema, ema_steps = list(params), np.zeros(np.shape(template.ema_steps), np.int32)
            if note is not None:
                note("the checkpoint holds no moving average: it starts from its weights")
    return params, rest, opt, ema, ema_steps


def placed_like(
    setup: RunSetup,
    template: Variables,
    params: list,
    rest: list,
    opt: list | None,
    ema: list | None,
    ema_steps: Any,
    loss_scale: list | None = None,
) -> Variables:
    """Restored leaves laid out as the template's (the fresh state's) leaves: replicated
    ones as the placement replicates, sharded ones onto their shardings (`place_like`)."""
    put = setup.placement.put_replicated

    def place(values: list, likes: list | None) -> list:
        if likes is None:
            return [put(x) for x in values]
        return [place_like(x, like, put) for x, like in zip(values, likes, strict=True)]

    return Variables(
        params=place(params, template.params),
        model_state=place(rest, template.model_state),
        opt_state=place(opt, template.opt_state) if opt is not None else None,
        ema=place(ema, template.ema) if ema is not None else None,
        ema_steps=(
            place_like(ema_steps, template.ema_steps, put) if ema_steps is not None else None
        ),
        loss_scale=place(loss_scale, template.loss_scale) if loss_scale is not None else None,
    )


def _optimizer_misfit(setup: RunSetup, meta: dict[str, Any], found: SavedStep) -> str:
    """What an optimizer state that does not fit means (the parameters fit: they were restored
    first), with the two optimizers and the fixes."""
    assert setup.optimizer is not None  # a run with an optimizer state
    now = describe_optimizer(setup.optimizer)
    saved = meta.get("optimizer") or "not recorded (saved by an earlier version of Nitro)"
    same = (
        " (described alike: a setting that shapes its state differs, such as decay_mask or "
        "the transformation's stages)"
        if saved == now
        else ""
    )
    return (
        f"cannot resume: the checkpoint's optimizer state does not fit this run's optimizer, "
        f"so the checkpoint was saved with another optimizer{same}:\n"
        f"  the checkpoint's: {saved}\n"
        f"  this run's:       {now}\n"
        f"Resume with the checkpoint's optimizer (the same optimizer=, gradient_clip_norm=, "
        f"weight_decay= and param groups), or start a new run from its weights with this "
        f"optimizer: Nitro({setup.cls.__name__}(...), weights={str(found.path)!r}) (a fresh "
        f"optimizer state and step count). The optimizer state's leaves that differ:"
    )


def _drift_notes(setup: RunSetup, meta: dict[str, Any], device: Mapping[str, Any]) -> list[str]:
    notes = []
    saved = meta.get("code") or {}
    changed = [
        unit
        for unit, fp in setup.experiment.code.items()
        if unit in saved and saved[unit] != fp.digest and unit != "optimizer"
    ]
    swapped = [r for r in meta.get("swaps") or [] if r.get("status") == "swapped"]
    if changed:
        notes.append(
            f"resuming with changed code: {', '.join(changed)} differ from the code the "
            f"checkpoint was trained with"
            + (
                f" (its last live edit, of {', '.join(swapped[-1].get('changed') or ['code'])}, "
                f"was swapped in at step {swapped[-1].get('step')})"
                if swapped
                else ""
            )
        )
    elif swapped:
        last = swapped[-1]
        notes.append(
            f"continuing with the code of the live edit swapped in at step {last.get('step')} "
            f"(of {', '.join(last.get('changed') or ['code'])}), as the checkpoint was trained"
        )
    devices = meta.get("device") or {}
    for name, value in device.items():
        if name in devices and devices[name] != json_safe(value):
            notes.append(
                f"Device field {name!r} is {value!r} here and was {devices[name]!r} in the "
                f"checkpoint; the run continues with {value!r}"
            )
    if int(meta.get("seed", setup.seed)) != setup.seed:
        notes.append(
            f"the checkpoint's seed {meta['seed']} replaces seed={setup.seed} (the data order "
            f"and the hooks' rngs continue as they began)"
        )
    return notes


def check_watched_metrics(
    setup: RunSetup, state: TrainState, experiment: Any, device: Mapping[str, jax.Array]
) -> None:
    """Refuse at setup an early stop or a checkpointer watching a metric the run does not
    produce (the metrics hook's names are probed on `experiment`, the handle's live copy, with
    the `device` field arrays; see `metric_names`), or one of a split that is not among
    `eval_splits`. A checkpointer on `val_loss` in a run without a 'val' split keeps the
    newest checkpoint only."""
    early_stop, checkpointer = setup.early_stop, setup.checkpointer
    known = {"loss", "val_loss"} | {f"{split}_loss" for split in setup.eval_splits}
    names: set[str] | None = None
    watched = [w.metric for w in (early_stop, checkpointer) if w is not None]
    if any(metric not in known for metric in watched):
        names = metric_names(setup, state, experiment, device)
    if early_stop is not None:
        early_stop.check(
            tuple(setup.splits),
            names if early_stop.metric not in known else None,
            setup.eval_splits,
        )
    if checkpointer is not None:
        prefix = checkpointer.metric.split("_", 1)[0]
        if prefix in setup.splits and prefix not in ("train", "val", *setup.eval_splits):
            raise SetupError(
                f"Checkpointer(metric={checkpointer.metric!r}) ranks checkpoints by the "
                f"{prefix!r} split, which is not evaluated at the epochs' ends "
                f"(eval_splits={setup.eval_splits!r}); pass "
                f"eval_splits={(*setup.eval_splits, prefix)!r}"
            )
    if checkpointer is None or names is None or checkpointer.metric in known | names:
        return
    raise SetupError(
        f"Checkpointer(metric={checkpointer.metric!r}) ranks checkpoints by a column this run "
        f"does not produce; its metrics are {', '.join(sorted(names))}"
    )


def metric_names(
    setup: RunSetup, state: TrainState, experiment: Any, device: Mapping[str, jax.Array]
) -> set[str] | None:
    """The history columns a run produces, when they can be known without training: loss,
    each eval split's loss (val_loss, ...) and, by tracing forward on the first batch's
    shapes and calling the metrics hook on zeros, the metrics' names. None when they cannot
    be determined."""
    names = set()
    if "train" in setup.splits:
        names.add("loss")
    evaluated = [setup.splits[split] for split in setup.eval_splits]
    for split in evaluated:
        if "loss" in split.hook_fields:
            names.add(f"{split.name}_loss")
    hooks = setup.experiment.hooks
    if "train_metrics" in hooks or "finalize_metrics" in hooks:
        return None  # their names can depend on the data: checked when the first row arrives
    if "metrics" in hooks and evaluated:
        found = _probe_metrics(setup, state, evaluated[0], experiment, device)
        if found is None:
            return None
        names |= {f"{split.name}_{k}" for split in evaluated for k in found}
    return names


def _probe_metrics(
    setup: RunSetup,
    state: TrainState,
    val: SplitSetup,
    experiment: Any,
    device: Mapping[str, jax.Array],
) -> set[str] | None:
    """The keys the metrics hook returns: forward traced abstractly for the outputs' shapes,
    then the hook called on zeros of those shapes (host) or traced (device)."""
    from nitro.core.metrics import split_modes
    from nitro.programs.specs import eval_spec

    wanted = val.hook_fields.get("metrics", ())
    if not set(wanted) <= set(val.batch_spec):
        return None  # host-only fields: their shapes are not recorded
    abstract = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)  # noqa: E731
    try:
        evaluate = eval_spec(setup, val.hook_fields, with_loss=False, return_outputs=True).build(
            set()
        )
        variables = Variables(
            params=[abstract(x) for x in state.variables.params],
            model_state=[abstract(x) for x in state.variables.model_state],
        )
        abstract_device = {k: abstract(v) for k, v in device.items()}
        batch = {
            name: jax.ShapeDtypeStruct(shape, np.dtype(dtype))
            for name, (shape, dtype) in val.batch_spec.items()
        }
        result = jax.eval_shape(evaluate, variables, abstract_device, batch, np.int32(1))
        outputs = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), result.outputs)
        fields = {k: np.zeros(*val.batch_spec[k]) for k in wanted}
        values = setup.experiment.hook_functions["metrics"](experiment, outputs, **fields)
        specs, _ = split_modes(values, "metrics")
        return {path for path, _ in specs}
    except Exception:  # noqa: BLE001 - unknown here: checked at the first validation instead
        return None
