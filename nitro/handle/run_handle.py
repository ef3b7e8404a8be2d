"""`RunHandle`: what a run (`Nitro`) and a population (`Population`) share as handles.

A population is a run of many members, trained by the same loop (`engine.loop.train_epochs`
over a members axis); its handle is a run's handle with members. This base holds the
run-facing surface both have: `train()` and its worker thread, `wait`, `stop`, `close`, the
counters, the phase, the reporter and the event path, the run directory, the saved
checkpoints and the history tables. A subclass says where its counters, its lead setup and
its files are, and what its worker thread runs (`_train_body`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Self

import numpy as np

from nitro.core import events as events_module
from nitro.core import progress
from nitro.core.events import Events
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import TrainState
from nitro.engine.runner import Run, RunControl, RunGuard, sigint_requests_stop, wait_for

__all__ = ["RunHandle", "check_amount", "scalar_frame"]


class RunHandle:
    """The handle of a run: one (`nitro.Nitro`) or a population of members
    (`nitro.Population`). `isinstance(h, RunHandle)` holds for both."""

    _noun = "n"  # how notes name the handle: "n.train(steps=N) trains N more steps"
    _thread = "training"  # the worker thread's name: nitro-<_thread>-<class>
    _waiting = "training"  # what a Ctrl-C while waiting stops

    _reporter: Any
    _events: Events
    _control: RunControl
    _guard: RunGuard
    _run: Run | None
    _stop_reason: str | None
    _error: BaseException | None
    _target_epoch: int  # where a stopped run resumes to
    _run_target: int  # the current (or latest) run's aim, `train(steps=)`'s too

    def _init_run(self, reporter: Any, events: Events, guard: RunGuard) -> None:
        """The parts every handle starts with: reporter, event path, control and guard."""
        self._reporter, self._events, self._guard = reporter, events, guard
        self._control = RunControl()
        self._control.say = self._say
        self._run = None
        self._stop_reason = None
        self._error = None

    # ------------------------------------------------------------------------------------------
    # where a subclass keeps its parts

    @property
    def _counters(self) -> TrainState:
        """The state whose counters and history the handle shows."""
        raise NotImplementedError

    @property
    def _lead_setup(self) -> RunSetup:
        """The setup the run trains by (a population's first member's)."""
        raise NotImplementedError

    @property
    def _run_files(self) -> Any:
        """The run's files (`run_dir`, `run_id`)."""
        raise NotImplementedError

    def _wait_saves(self) -> None:
        """Wait for the checkpoints being written."""
        raise NotImplementedError

    def _release(self) -> None:
        """Let go of the run directory (the guard is held)."""
        raise NotImplementedError

    def _check_trainable(self) -> None:
        """Refuse a `train()` this handle cannot run."""

    def _train_body(self, target: int, stop_at: int | None = None) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------
    # what it shows

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
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
    def max_epochs(self) -> int:
        return self._lead_setup.max_epochs

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
        """Why the latest run ended: "completed", "requested", "early_stop" or "error" (None
        before)."""
        return self._stop_reason

    @property
    def error(self) -> BaseException | None:
        """The exception the latest run failed with (None when it did not fail)."""
        return self._error

    @property
    def reporter(self) -> Any:
        """The progress reporter (`progress=`) this handle's runs report to (None when silent)."""
        return self._reporter

    @property
    def events(self) -> Events:
        """The event path of this handle's runs: `events.add(reporter)` adds a reporter beside
        `progress=` (see `nitro.events.Reporter`)."""
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
        """The run's directory: checkpoints, logs and run.json live there (a population's
        members each have a directory `member-<i>` in it for their logs)."""
        return str(self._run_files.run_dir)

    @property
    def run_id(self) -> str:
        """A sortable timestamp plus a short random suffix; a resumed run keeps its id."""
        return self._run_files.run_id

    def checkpoints(self):
        """The run's saved checkpoints: a DataFrame of step, epoch and the checkpointer's
        metric (a population's: its best member's), empty when none are saved yet."""
        import pandas as pd

        from nitro.runs.checkpoint_reads import describe_saved

        self._wait_saves()
        return pd.DataFrame(describe_saved(self._run_files.run_dir))

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

    # ------------------------------------------------------------------------------------------
    # training

    def train(
        self, epochs: int | None = None, *, steps: int | None = None, background: bool = False
    ) -> Self:
        """Train until `max_epochs` or `max_steps` (or for `epochs` more epochs, or `steps`
        more optimizer steps, mid-epoch if need be) on a worker thread (a population: every
        member, in one program per call).

        Blocks unless `background=True` (then `wait()` waits, `stop()` stops). Ctrl-C stops
        after the current call; the handle stays usable and `train()` again continues from
        where it stopped. An epoch trained but not yet validated (a stop during validation)
        is validated first; `epochs=N` then trains N more epochs after it.
        """
        with sigint_requests_stop(self._control):
            self._check_trainable()
            check_amount(epochs, steps)
            self._guard.claim("training", background=background)
            started = False
            try:
                planned = self._plan(epochs, steps)
                if planned is None:
                    return self
                target, stop_at = planned
                self._control.stop.clear()
                self._stop_reason = None
                self._error = None
                run = Run(
                    lambda: self._train_body(target, stop_at),
                    name=f"nitro-{self._thread}-{self._lead_setup.cls.__name__}",
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

    def _plan(self, epochs: int | None, steps: int | None) -> tuple[int, int | None] | None:
        """(the epoch to train to, the step to stop at) for `train(epochs=, steps=)`, or None
        (said why) when there is nothing to train."""
        noun, pending = self._noun, self._pending()
        # epochs=N or steps=N train that much more, past max_epochs and max_steps
        stop_at = self._lead_setup.max_steps if epochs is None else None
        if steps is not None:
            stop_at = self.step + steps
            target = self._epoch_of_step(steps)
        elif stop_at is not None and self.step >= stop_at and not pending:
            progress.note(
                f"already trained to max_steps={stop_at}; {noun}.train(steps=N) trains N "
                f"more steps, {noun}.train(epochs=N) N more epochs"
            )
            return None
        elif epochs is not None:  # N more epochs of training: an epoch trained but
            # not validated (a stop during validation) is validated, then N follow
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
        if steps is None:
            self._target_epoch = target  # where a stopped run resumes to
        self._run_target = target
        return target, stop_at

    def _pending(self) -> bool:
        return self._counters.epoch_trained

    def _epoch_of_step(self, steps: int) -> int:
        """The epoch (counted from 1) in which `steps` more optimizer steps end: where
        `train(steps=)` aims (an upper bound when the epoch length is unknown)."""
        setup, state = self._lead_setup, self._counters
        batches = setup.splits["train"].batches
        if batches is None:
            return state.epoch + int(state.epoch_trained) + steps
        per_epoch, done = -(-batches // setup.accum), -(-state.position // setup.accum)
        return state.epoch + -(-(done + steps) // per_epoch)

    def wait(self) -> Self:
        """Wait for a background run, then for its checkpoints' writes (a `train()` returns
        while its last save is still being written); Ctrl-C turns into a stop request.
        Re-raises the run's error, if it failed."""
        run = self._run
        if run is not None:
            with sigint_requests_stop(self._control):
                self._wait(run)
        self._wait_saves()
        return self

    def _wait(self, run: Run) -> None:
        wait_for(run, self._control, self._say, self._waiting)
        if run.error is not None:
            error, run.error = run.error, None
            raise error

    def stop(self) -> Self:
        """Ask a running loop to stop after the current step. Returns at once, while the
        run finishes that step and saves it (`running` is still True): `.stop().wait()`
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
            self._release()
        return self

    @contextlib.contextmanager
    def _held(self, what: str) -> Iterator[None]:
        """The handle held for `what` (evaluating, predicting) on its event path; Ctrl-C
        asks the work to stop."""
        with sigint_requests_stop(self._control), self._guard.hold(what):
            self._control.stop.clear()
            with events_module.using(self._events):
                yield

    def _say(self, message: str) -> None:
        """A note for the person at the keyboard: through the reporters, or on stderr."""
        if self._reporter is not None:
            self._events.note(message)
        else:
            print(f"nitro: {message}", file=sys.stderr, flush=True)


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
