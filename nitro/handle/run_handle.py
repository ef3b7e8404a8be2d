"""`RunHandle`: what a run's handle (`Nitro`) and a population's (`Population`) share.

One protocol for both: `train(epochs=, steps=, background=)` on a worker thread, `wait()`,
`stop()`, `close()`, `phase`, `running`, `background`, `error`, `stop_reason`, `events`,
`reporter`, `on_phase`, `run_dir`, `run_id`, `target_epoch`, `dispatch`, `checkpoints()`,
`validate`, `evaluate`, `predict`, `history()` and the live edits. A subclass
builds its `_files` (`nitro.runs.run_files.RunFiles`, a population's `PopulationFiles`), its
events, control and guard, and says what its saves take and rank (`_saving`) and when early
stopping ends its run (`_verdict`); the loop, its saves (one `EpochSaves` policy) and the rest
are here.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn, Self, overload

import numpy as np

from nitro.core import events as events_module
from nitro.core import progress
from nitro.core.events import Events
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import TrainState
from nitro.engine import evaluation, live_edit, prediction, swaps
from nitro.engine.dispatch import DispatchChoice
from nitro.engine.run_time import RunTime
from nitro.engine.runner import (
    PREEMPTED_EXIT_CODE,
    Run,
    RunControl,
    RunGuard,
    preemption_signals,
    signals_request_stop,
    wait_for,
)
from nitro.engine.swaps import LiveEdit
from nitro.errors import Interrupted, RunningError
from nitro.experiments.declaration import edit_generation
from nitro.handle.time_travel import train_epochs
from nitro.programs.specs import ProgramSet
from nitro.programs.staleness import stale_changes, stale_report
from nitro.runs.run_files import RunFiles

__all__ = ["RunHandle", "check_amount", "scalar_frame"]


class RunHandle:
    """The run-facing surface of a handle: training on a worker thread and what it reports."""

    _noun = "n"  # how notes name the handle: n.train(epochs=N)
    _events: Events
    _control: RunControl
    _guard: RunGuard
    _files: RunFiles
    _progress: Any = None
    _run: Run | None = None
    _stop_reason: str | None = None
    _error: BaseException | None = None
    _target_epoch = 0  # where a stopped run resumes to
    _run_target = 0  # the latest run's aim, `train(steps=)`'s too
    _visualizer: Any = None  # the visualize hook's drawer (`nitro.handle.gallery.Visualizer`)

    # ------------------------------------------------------------------------------------------
    # what a subclass says

    @property
    def _counters(self) -> TrainState:
        """The state whose step, epoch and position the run counts."""
        raise NotImplementedError

    @property
    def _lead_setup(self) -> RunSetup:
        """The setup of the run (a population's first member's): its splits and limits."""
        raise NotImplementedError

    def _check_trainable(self) -> None:
        """Refuse a `train()` that cannot start, before anything is claimed."""

    def _saving(self, state: Any) -> tuple[Sequence[Mapping[str, Any]], Callable]:
        """What the run's saves rank and take of `state`: the committed epochs' rows (the
        last the newest) and `snapshot(reason, best)`, the state as a save
        (`nitro.runs.epoch_saves.EpochSaves`)."""
        raise NotImplementedError

    def _verdict(self, state: Any) -> str | None:
        """After a committed epoch: why the run ends there (early stopping), or None."""
        raise NotImplementedError

    def _end_reason(self, reason: str | None) -> str | None:
        """The run's stop reason, given the loop's (a population's: once every member has
        stopped, early stopping's verdict, or a stop request's)."""
        return reason

    def _after_epoch(
        self, state: Any, row: Any, epochs_left: int | None = None, stop_at: int | None = None
    ) -> str | None:
        """The run's files after a committed epoch (`row`: a population's every member's);
        `stop_at`: the call's stop step, whose epoch is its last (the run's end saves it,
        with its stop reason). Returns why the run ends there, or None."""
        if epochs_left is None and stop_at is not None and state.step >= stop_at:
            epochs_left = 0
        verdict = self._verdict(state)
        rows, snapshot = self._saving(state)
        measuring = self._lead_runtime.dispatch.measuring
        saves = self._files.saves
        return saves.after_epoch(
            state, rows, self._events, snapshot, verdict, epochs_left, measuring
        )

    def _loop_left(self, state: Any) -> None:
        """The loop has returned (or raised) with `state`."""

    def _end_save(self, state: Any, reason: str, events: Events) -> str:
        """The save at the run's end (with its stop reason); the run's final stop reason."""
        reason = self._end_reason(reason) or reason
        self._files.saves.end(state, events, reason, self._saving(state)[1])
        return reason

    def _segment(self, state: Any, target: int, stop_at: int | None) -> tuple[int, int | None]:
        """Where the next stretch of a run's loop ends (its target epoch and stop step): the
        call's own, or sooner, at a boundary of the handle's (a population's search: taken
        here, between two stretches, with every call read back)."""
        return target, stop_at

    def _train_run(self, target: int, stop_at: int | None, events: Events) -> str:
        """One run between start_run and end_run: the loop (in stretches, `_segment`) and its
        end's save; its stop reason."""
        members, state = self._trainees()
        self._files.open(self._lead_setup, events)
        try:
            while True:
                until, stop = self._segment(state, target, stop_at)
                members, state = self._trainees()
                before = (state.step, state.epoch, state.epoch_trained)
                state, reason = train_epochs(
                    self,
                    state,
                    events,
                    until,
                    # the saves count the call's epochs left, not the stretch's
                    after_epoch=lambda state, row, _: self._after_epoch(
                        state, row, None if stop_at is not None else target - state.epoch, stop_at
                    ),
                    stop_at=stop,
                    members=members,
                )
                if (until, stop) == (target, stop_at) or reason not in ("completed", "max_steps"):
                    break
                ended = (state.epoch >= target and not state.epoch_trained) or (
                    stop_at is not None and state.step >= stop_at
                )
                if ended or (state.step, state.epoch, state.epoch_trained) == before:
                    break  # the call's end, or nothing left to train (every member stopped)
        finally:
            self._loop_left(state)
        reason = self._end_save(state, reason, events)
        self._finish(reason)
        return reason

    def _finish(self, reason: str) -> None:
        """The run's last work before its end is reported (a run's `restore_best=`)."""

    def _after_run(self) -> None:
        """After the run has let go of the handle: an edit compiled after its last call is
        taken now."""
        if self._lead_runtime.live.pending is not None:
            self._take_swap()

    def _runtimes(self) -> list[RunTime]:
        """The run's run-time records (a population's: every member's)."""
        return [self._lead_runtime]

    def _release_workers(self, final: bool = True) -> None:
        """Stop the worker processes the data's `persistent_workers=True` kept (`final`: on
        `close()`; at a run's end, persistent ones are kept)."""
        for runtime in self._runtimes():
            for prefetcher in runtime.prefetchers.values():
                prefetcher.release_workers(final=final)

    # ------------------------------------------------------------------------------------------
    # what it reports

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self._counters.step

    @property
    def epoch(self) -> int:
        """Epochs completed."""
        return self._counters.epoch

    @property
    def cls(self) -> type:
        """The experiment class."""
        return self._lead_setup.cls

    @property
    def preset(self) -> str | None:
        """The preset the experiment was built from (`Nitro(Exp, preset=...)`,
        `Exp.from_preset(...)`), recorded in run.json, the checkpoints, the logged params and
        the export; None when none."""
        return self._lead_setup.experiment.preset

    @property
    def owner(self) -> str:
        """`module.QualName` of the experiment class (how the compile cache names it)."""
        return self._lead_setup.owner

    @property
    def splits(self) -> dict[str, Any]:
        """Split name -> the source `build_data` (or `data=`) gave (a population's: its first
        member's)."""
        return {name: split.source for name, split in self._lead_setup.splits.items()}

    @property
    def max_epochs(self) -> int:
        return self._lead_setup.max_epochs

    @property
    def dispatch(self) -> DispatchChoice:
        """Steps per program call as decided so far (a frozen value: `.steps`, `.reason`,
        `.describe()`). `Nitro(e2, weights=n)`, or `steps_per_dispatch=n.dispatch`, continues
        it instead of measuring again."""
        return self._lead_runtime.dispatch.choice

    @property
    def steps_per_call(self) -> int | None:
        """Training steps each program call runs (a population's: for every member);
        `steps_per_dispatch=`, or "auto"'s measured choice (None until it decided)."""
        return self._lead_runtime.dispatch.steps

    @property
    def target_epoch(self) -> int:
        """The epoch the current (or latest) run trains to: `max_epochs`, the epoch
        `train(epochs=N)` aimed at, or the one in which `train(steps=N)`'s (and
        `profile()`'s) steps end, as its progress shows it."""
        return self._run_target

    @property
    def phase(self) -> str:
        """Where the handle is: setup, building data, building model, routing, ready,
        training, validating, evaluating <split>, predicting, done, stopped or failed."""
        return self._events.current_phase

    @property
    def stop_reason(self) -> str | None:
        """Why the latest run ended: "completed", "max_steps", "early_stop", "requested" or
        "error" (None before)."""
        return self._stop_reason

    @property
    def error(self) -> BaseException | None:
        """The exception the latest run failed with (None when it did not fail)."""
        return self._error

    @property
    def reporter(self) -> Any:
        """The progress reporter this handle's runs report to (None when silent)."""
        return self._progress

    @property
    def events(self) -> Events:
        """The event path of this handle's runs; `events.add(reporter)` adds a reporter
        (see `nitro.events.Reporter`) beside `progress=`."""
        return self._events

    def on_phase(self, fn) -> Self:
        """Call `fn(change)` (a `nitro.events.PhaseChange`: phase, previous, step, epoch and,
        after validation, the epoch's metrics) on every phase transition of this handle."""
        self._events.add_monitor(fn)
        return self

    @property
    def running(self) -> bool:
        """True while a training run is in progress (in the foreground or the background)."""
        return self._run is not None and self._run.running

    @property
    def background(self) -> bool:
        """True while a run started with `train(background=True)` is in progress: nothing
        waits to re-raise its error (`.error` keeps it)."""
        return self.running and self._guard.background

    @property
    def run_dir(self) -> str:
        """This run's directory: checkpoints, logs and run.json live there (a population's
        holds a directory per member, `member-<i>`, for its logs)."""
        return str(self._files.run_dir)

    @property
    def run_id(self) -> str:
        """A sortable timestamp plus a short random suffix; a resumed run keeps its id."""
        return self._files.run_id

    def checkpoints(self):
        """This run's saved checkpoints: a DataFrame of step, epoch, the checkpointer's
        metric (a population's: its best member's), name (its directory's: the step, or
        `Checkpointer(name=)`'s) and path, empty when none are saved yet."""
        import pandas as pd

        from nitro.runs.checkpoint_reads import describe_saved

        self._files.wait()
        return pd.DataFrame(describe_saved(self._files.run_dir))

    # ------------------------------------------------------------------------------------------
    # training

    def train(
        self, epochs: int | None = None, *, steps: int | None = None, background: bool = False
    ) -> Self:
        """Train until `max_epochs` or `max_steps` (or for `epochs` more epochs, or `steps`
        more optimizer steps, mid-epoch if need be) on a worker thread.

        Blocks unless `background=True` (then `wait()` waits, `stop()` stops). Ctrl-C stops
        after the current call; the handle stays usable and `train()` again continues from
        where it stopped. An epoch trained but not yet validated (a stop during validation)
        is validated first; `epochs=N` then trains N more epochs after it.

        In a script (`preemption=`), SIGTERM or SIGUSR1 stops the run the same way, and once
        its step is saved the process exits with code 75; `resume="auto"` continues it.
        """
        with self._signals():
            self._check_trainable()
            check_amount(epochs, steps)
            self._guard.claim("training", background=background)
            started = False
            try:
                aim = self._aim(epochs, steps)
                if aim is None:
                    return self
                target, stop_at = aim
                if steps is None:
                    self._target_epoch = target
                self._run_target = target
                self._control.stop.clear()
                if self._control.preempted is not None:  # a signal came as this call began
                    self._control.stop.set()
                self._stop_reason = None
                self._error = None
                run = Run(
                    lambda: self._train_body(target, stop_at),
                    name=f"nitro-training-{self._lead_setup.cls.__name__}",
                    context=self,
                )
                self._run = run
                run.start()
                started = True
            finally:
                if not started:
                    self._guard.release()
            if not background:
                self._wait(run)
        return self

    def _aim(self, epochs: int | None, steps: int | None) -> tuple[int, int | None] | None:
        """The epoch a `train()` trains to and the step it stops at; None (with a note)
        when there is nothing to train. `epochs=N` or `steps=N` train that much more, past
        max_epochs and max_steps."""
        pending, noun = self._counters.epoch_trained, self._noun
        stop_at = self._lead_setup.max_steps if epochs is None else None
        if steps is not None:
            return self._epoch_of_step(steps), self.step + steps
        if stop_at is not None and self.step >= stop_at and not pending:
            progress.note(
                f"already trained to max_steps={stop_at}; {noun}.train(steps=N) trains N "
                f"more steps, {noun}.train(epochs=N) N more epochs"
            )
            return None
        if epochs is not None:  # an epoch trained but not validated is validated, then N follow
            target = self.epoch + pending + epochs
        elif self.epoch < self._target_epoch:
            target = self._target_epoch  # a stopped run resumes to where it was going
        else:
            target = self.max_epochs
        if target <= self.epoch and not pending:
            progress.note(
                f"already trained {self.epoch} of max_epochs={self.max_epochs} epochs; "
                f"{noun}.train(epochs=N) trains N more"
            )
            return None
        return target, stop_at

    def _epoch_of_step(self, steps: int) -> int:
        """The epoch (counted from 1) in which `steps` more optimizer steps end: where
        `train(steps=)` aims (an upper bound when the epoch length is unknown)."""
        setup, state = self._lead_setup, self._counters
        batches = setup.splits["train"].batches
        if batches is None:
            return state.epoch + int(state.epoch_trained) + steps
        per_epoch, done = -(-batches // setup.accum), -(-state.position // setup.accum)
        return state.epoch + -(-(done + steps) // per_epoch)

    def _train_body(self, target: int, stop_at: int | None) -> None:
        """The worker thread's work: the run between start_run and end_run, then the phase."""
        events = self._events
        try:
            with events_module.using(events):
                self._files.prepare()  # refused here: nothing has started
                events.start_run(self, target)
                try:
                    reason = self._train_run(target, stop_at, events)
                    self._stop_reason = reason
                except BaseException:
                    self._stop_reason = "error"
                    self._files.close()  # saves already begun finish; nothing partial is added
                    raise
                finally:
                    events.end_run(self)  # the stop reason is known here
                events.phase("stopped" if reason == "requested" else "done")
        except BaseException as error:
            self._stop_reason = "error"
            self._error = error
            events.phase("failed")
            raise
        finally:
            self._guard.release()
            self._after_run()

    def wait(self) -> Self:
        """Wait for a background run, then for its checkpoints' writes (a `train()` returns
        while its last save is still being written); Ctrl-C turns into a stop request.
        Re-raises the run's error, if it failed."""
        run = self._run
        if run is not None:
            with self._signals():
                self._wait(run)
        self._files.wait()
        return self

    def _signals(self) -> contextlib.AbstractContextManager[None]:
        """Ctrl-C, and the preemption signals `preemption=` takes here (none in a run across
        processes), as stop requests while `train()` or `wait()` runs."""
        setup = self._lead_setup
        # the processes of one run would each stop at a step of their own, and wait forever
        # for the others' part of the next: they end on the signal, as before
        setting = setup.keywords["preemption"].value and not setup.placement.multi_process
        return signals_request_stop(
            self._control, preemption_signals(setting), on_preempted=self._preempted
        )

    def _preempted(self, signum: signal.Signals) -> NoReturn:
        """After a preemption signal: wait for the run's stop and its save, then exit the
        process with `PREEMPTED_EXIT_CODE` (its loggers have finished with the run)."""
        run = self._run
        if run is not None:
            wait_for(run, self._control, self._say, "training")
        self._files.wait()
        where = (
            f"resume='auto' continues the run from its newest checkpoint in {self.run_dir}"
            if self._files.store is not None
            else "nothing was saved (checkpointer=None)"
        )
        self._say(
            f"{signum.name}: exiting with code {PREEMPTED_EXIT_CODE} at step {self.step}; {where}"
        )
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _wait(self, run: Run) -> None:
        wait_for(run, self._control, self._say, "training")
        if run.error is not None:
            error, run.error = run.error, None
            raise error

    def stop(self) -> Self:
        """Ask a running loop to stop after the current call. Returns at once, while the
        run finishes that call and saves it (`running` is still True): `.stop().wait()`
        returns once it has stopped, its step, history and checkpoint in agreement."""
        self._control.stop.set()
        return self

    def close(self) -> Self:
        """Finish this run's saves and let go of its run directory, so another handle (here
        or in another process) may write there; the handle stays usable, and its next write
        (`train()`) holds the directory again. Dropping the handle, or the process ending,
        lets go too: `close()` is for when the handle is kept. It also stops the worker
        processes `persistent_workers=True` kept (the next run starts new ones)."""
        with self._guard.hold("closing"):
            self._files.release()
            self._release_workers()
        return self

    def history(self):
        """A pandas DataFrame of the history: loss, validation metrics and timing, indexed by
        epoch (a population's by (member, epoch), each member's settings first)."""
        return self._table("history", "epoch")

    def validations(self):
        """A pandas DataFrame of the evaluations within epochs (`val_every_steps=N`), indexed
        by step (a population's by (member, step)): the epoch under way and each eval split's
        metrics under its prefix. The evaluations at epochs' ends are the history's."""
        return self._table("validations", "step")

    def _table(self, records: str, index: str):
        return scalar_frame(getattr(self._counters, records), [index])

    @contextlib.contextmanager
    def _held(self, what: str) -> Iterator[None]:
        """The handle held for `what` (evaluating, predicting) on its event path; Ctrl-C
        asks the work to stop."""
        with signals_request_stop(self._control), self._guard.hold(what):
            self._control.stop.clear()
            with events_module.using(self._events):
                yield

    # ------------------------------------------------------------------------------------------
    # evaluation and prediction

    def _trainees(self) -> tuple[Any, TrainState]:
        """What the programs run on: `SINGLE` and the run's state (a population: its stacked
        members and theirs)."""
        raise NotImplementedError

    def _evaluation(self, result: Any) -> Any:
        """What `evaluate` answers for the programs' result (a population: a table)."""
        return result

    def validate(self, split: str = "val", *, weights: str | None = None) -> Any:
        """Loss and metrics on the 'val' split, e.g. {'val_loss': ..., 'val_acc': ...} (a
        population's: a DataFrame, one row per member, indexed by member with its settings).
        `weights="ema"` evaluates the moving average of the weights (`ema=`)."""
        return self.evaluate(split, weights=weights)

    def evaluate(self, split: str = "test", *, weights: str | None = None) -> Any:
        """Loss and metrics on any split, prefixed with the split's name (a population's:
        every member's, from one vmapped eval forward per batch, as `validate`).

        On 'val', an epoch trained but not yet validated (a stop during its validation) is
        validated and its history row committed. Ctrl-C stops cleanly between batches and
        raises `nitro.Interrupted`; nothing is recorded.
        """
        self._check_stale("evaluate")
        with self._held(f"evaluating {split}"):
            self._lead_setup.split(split)
            previous = self.phase
            try:
                try:
                    result = self._evaluate(split, weights)
                except swaps.HostHookFailed as failure:
                    self._roll_back_host(failure)
                    result = self._evaluate(split, weights)
            finally:
                self._lead_runtime.prefetcher(split).release_workers()
                self._events.phase(previous)
            if result is None:
                raise Interrupted(
                    f"evaluating the {split!r} split was interrupted; it stopped cleanly "
                    f"between batches and recorded nothing"
                )
            return self._evaluation(result)

    def _evaluate(self, split: str, weights: str | None) -> Any:
        self._events.phase(f"evaluating {split}")
        members, state = self._trainees()
        return evaluation.evaluate_split(
            self._lead_setup,
            self._lead_runtime,
            state,
            self._programs,
            self._control,
            split,
            weights,
            members=members,
        )

    @overload
    def predict(self, batch: Mapping[str, Any], *, weights: str | None = None) -> Any: ...
    @overload
    def predict(
        self, batch: Iterable[Mapping[str, Any]], *, weights: str | None = None
    ) -> Iterator[Any]: ...
    def predict(self, batch: Any, *, weights: str | None = None):
        """Run `forward` in eval mode. A dict of arrays -> host numpy outputs (a population's
        with a leading member axis, `[members, rows, ...]`, from one vmapped program per chunk
        of rows); an iterable of such dicts -> an iterator of outputs, one per batch.
        `weights="ema"` predicts with the moving average of the weights."""
        self._check_stale("predict")
        if isinstance(batch, Mapping):
            return self._predict_batch(batch, weights)
        prediction.check_batches(self._lead_setup, batch)
        return (self._predict_batch(b, weights) for b in batch)

    def _predict_batch(self, batch: Mapping[str, Any], weights: str | None = None):
        with self._held("predicting"):
            members, state = self._trainees()
            return prediction.predict_batch(
                self._lead_setup,
                self._lead_runtime,
                state,
                self._programs,
                self._control,
                batch,
                weights,
                members=members,
            )

    # ------------------------------------------------------------------------------------------
    # looking at samples (nitro.handle.render; docs/visualize.md)

    def render(
        self,
        split: str = "val",
        batches: int = 1,
        predictions: bool = True,
        where: Any = "inline",
        *,
        samples: int = 16,
        member: int | None = None,
        weights: str | None = None,
    ) -> Any:
        """A grid of the first `samples` samples of the first `batches` batches of `split`,
        in one matplotlib figure (a `Gallery`), each drawn by the experiment's
        `visualize(self, sample, output=None)` hook (or the default views), titled with its
        label and prediction. `predictions=False` draws the data alone and compiles nothing;
        predictions come from the evaluation program validation runs. `where`: "inline"
        (shown by the notebook), "logger" (the run's loggers: TensorBoard images, MLflow
        and W&B artifacts), a file or directory path, or a list of them. A population's: one
        gallery per member (`member=` picks one)."""
        from nitro.handle.render import render

        return render(self, split, batches, predictions, where, samples, member, weights)

    def show_batch(self, split: str = "train", *, samples: int = 16, where: Any = "inline"):
        """The first `samples` samples of `split`'s first batch as its source gives them:
        `render(predictions=False)`, which compiles nothing and never touches the device."""
        from nitro.handle.render import show_batch

        return show_batch(self, split, samples, where)

    def top_losses(
        self,
        k: int = 9,
        split: str = "val",
        *,
        where: Any = "inline",
        member: int | None = None,
        weights: str | None = None,
    ) -> Any:
        """The `k` samples of `split` with the highest loss, drawn as `render` draws (highest
        first; `.table()` lists their rows, labels, predictions and losses), from one pass of
        the evaluation program validation runs. A population's: one per member."""
        from nitro.handle.render import top_losses

        return top_losses(self, k, split, where, member, weights)

    def confusion(
        self,
        split: str = "val",
        *,
        labels: str | None = None,
        classes: Sequence[Any] | None = None,
        member: int | None = None,
        weights: str | None = None,
        where: Any = "inline",
    ) -> Any:
        """A classifier's confusion matrix on `split` (a `Confusion`: `.matrix`, `.table()`,
        `.per_class()` precision, recall, F1 and support, `.plot()`), counted exactly from one
        pass of the evaluation program validation runs. `labels` names the label field (by
        default the loss's one integer field besides forward's inputs); `classes` names the
        classes; `where` as `render`'s (the loggers also get the matrix itself). A
        population's: one per member."""
        from nitro.handle.render import confusion

        return confusion(self, split, labels, classes, member, weights, where)

    _stale_checked: tuple[int, float] = (-1, 0.0)
    _stale_seen: str | None = None

    def _check_stale(self, entry: str) -> None:
        """Say once, at most every second, what changed in the experiment's code since the
        handle was built."""
        generation, last = self._stale_checked
        now = time.monotonic()
        if generation == edit_generation() and now - last < 1.0:
            return
        self._stale_checked = (edit_generation(), now)
        text = self.stale_report()
        if text and text != self._stale_seen:
            progress.note(text)
        self._stale_seen = text

    def _say(self, message: str) -> None:
        """A note for the person at the keyboard: through the reporters, or on stderr."""
        if self._progress is not None:
            self._events.note(message)
        else:
            print(f"nitro: {message}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------------------------
    # the code it runs, and live edits

    _programs: ProgramSet
    _live_edits: bool | None = None

    def _guard_with(self, guard: RunGuard) -> None:
        """The handle's control (its stop requests, its notes) and `guard`, which takes an
        edit that became ready while the handle was busy (validating, predicting) once it
        lets go."""
        self._control = RunControl()
        self._control.say = self._say
        self._guard = guard
        self._live_lock = threading.Lock()
        take_ready_edit = weakref.WeakMethod(self._take_ready_edit)  # the guard holds no handle

        def on_release() -> None:
            take = take_ready_edit()
            if take is not None:
                take()

        self._guard.on_release = on_release

    @property
    def _lead_runtime(self) -> RunTime:
        """The run time of the run (a population's first member's): its live edits."""
        raise NotImplementedError

    def _edit_variables(self) -> Any:
        """Variables of one run, whose layout an edit of the model must keep."""
        raise NotImplementedError

    def stale_changes(self) -> dict[str, list[str]]:
        """Code that changed since this handle was built: unit (a hook name or "model") ->
        the parts that changed in it ("helper mlp_block", "method MLP.__call__"; empty when
        the hook itself changed). `nitro.staleness.programs_using(unit)` names the programs
        each unit reaches."""
        return stale_changes(self._lead_setup)

    def stale_report(self) -> str | None:
        """What changed in the experiment's code since this handle was built, or None."""
        return stale_report(self._lead_setup, self._programs.held())

    def held_programs(self) -> list[str]:
        """The kinds of the compiled programs this handle holds."""
        return self._programs.held()

    # ------------------------------------------------------------------------------------------
    # live edits

    @property
    def live_edits(self) -> bool | None:
        """Whether an edit of this run's code applies while it trains (compiled beside the
        run, swapped in at the next dispatch boundary): True, False, or None, the default: on
        where the notebook extension watches the code (`%load_ext nitro`), and off in scripts,
        where `apply_edits()` applies an edit when asked. Settable."""
        return self._live_edits

    @live_edits.setter
    def live_edits(self, value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):
            raise TypeError(
                f"live_edits must be True, False or None (on where the notebook extension "
                f"watches the code), got {value!r}"
            )
        self._live_edits = value

    def apply_edits(self) -> LiveEdit:
        """Apply the experiment's code as it is now (its hooks, the helpers they call, the
        model's classes), edited since this handle was built or last swapped code: the
        programs the edit reaches compile on a thread of their own while a run goes on
        training, and swap in at its next dispatch boundary (at once when nothing trains, or
        once the call that holds the handle, such as `validate()`, returns).

        Returns the `LiveEdit` (`.wait()`, `.status`, `.note`, `.record`). An edit that
        changes what a live run keeps (the fields, the set of hooks, the batch fields a hook
        takes, the model's structure) is refused, and one that does not trace or compile
        fails; either way the run goes on with the code it had and `.note` says why. The
        first steps of swapped-in code are on probation: a non-finite loss there rolls the
        run back to the old code and the weights from before the swap, and a host hook
        (host metrics, `finalize_metrics`) that raises on its first call rolls back to the
        old code. `n.swaps()` lists the swaps."""
        with self._live_lock:
            runtime = self._lead_runtime
            return live_edit.start_edit(
                self._lead_setup,
                runtime.experiment,
                self._edit_variables(),
                self._programs,
                runtime.live,
                self._events,
                adopt=self._adopt_code,
                on_settled=self._edit_settled,
                on_ready=self._edit_ready,
                dispatch=runtime.dispatch,
            )

    @property
    def live_edit(self) -> LiveEdit | None:
        """The newest live edit (`apply_edits()`), or None."""
        return self._lead_runtime.live.latest

    def swaps(self):
        """A pandas DataFrame of the live edits swapped in (and rolled back) while training,
        indexed by the step whose call first ran the new code: status, what changed, the
        code's digest, the programs compiled, the compile's and the swap's seconds."""
        import pandas as pd

        frame = pd.DataFrame([dict(row) for row in self._counters.swaps])
        if not frame.empty:
            frame = frame.set_index("step")
        return frame

    def _adopt_code(self, setup: RunSetup, programs: ProgramSet) -> None:
        """A swap or a roll-back: the handle's code is the code the run trains on."""
        raise NotImplementedError

    def _edit_settled(self, edit: LiveEdit) -> None:
        """A refused or failed edit: said to a run's reporters (an idle handle's caller holds
        the edit and its note)."""
        if edit.note and self.running:
            self._say(edit.note)

    def _edit_ready(self) -> None:
        """Compiled: a run takes it at its next dispatch boundary; a handle that is not
        training takes it now."""
        if not self.running:
            self._take_swap()

    def _take_ready_edit(self) -> None:
        """The handle is free again: an edit that became ready while it was busy (validating,
        predicting) is taken now. A run takes its own at its next dispatch boundary."""
        try:
            runtime = self._lead_runtime
        except AttributeError:  # the handle is being built
            return
        if runtime.live.pending is not None and not self.running:
            self._take_swap()

    def _take_swap(self) -> None:
        try:
            with self._guard.hold("applying an edit"):
                runtime = self._lead_runtime
                swap = runtime.live.take()
                if swap is None:
                    return
                runtime.live.host_probation = swaps.host_probation_for(
                    swap, self._lead_setup, self._programs, runtime.experiment
                )
                self._adopt_code(swap.setup, swap.programs)
                runtime.experiment = swap.experiment
                swaps.record_swap(swap, self._counters, self._events, self._say, 0.0, settle=False)
        except RunningError:
            return  # a run started meanwhile: it takes the swap at its first call
        # settled once the handle is free: whoever waits on the edit may use the handle at once
        swap.edit._settle("swapped")

    def _roll_back_host(self, failure: swaps.HostHookFailed) -> None:
        """A host hook an edit changed raised on its first call: back to the code before it."""
        runtime = self._lead_runtime
        probation, runtime.live.host_probation = runtime.live.host_probation, None
        assert probation is not None  # raised only on probation
        runtime.experiment = probation.experiment
        swaps.roll_back_host(probation, failure, self._counters, self._events, self._say)


def check_amount(epochs: Any, steps: Any) -> None:
    """Refuse `train(epochs=, steps=)` unless each given is a positive int, and not both."""
    for name, value in (("epochs", epochs), ("steps", steps)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if steps is not None and epochs is not None:
        raise ValueError(
            f"train() takes epochs= or steps=, not both (got epochs={epochs}, "
            f"steps={steps}): train(steps=N) trains N more optimizer steps"
        )


def scalar_frame(rows: Iterable[Mapping[str, Any]], index: list[str]):
    """A DataFrame of `rows`' scalar values, indexed by `index` (when it has rows)."""
    import pandas as pd

    frame = pd.DataFrame([{k: v for k, v in row.items() if np.ndim(v) == 0} for row in rows])
    return frame.set_index(index) if not frame.empty else frame
