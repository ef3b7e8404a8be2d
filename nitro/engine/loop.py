"""The training loop: functions over (setup, runtime, state, events, control).

The loss of step k is read back while the device runs step k+1, which also bounds the steps
in flight. Once a step's loss is read back, that step's batch buffers are deleted; an eval
batch's inputs and outputs are deleted once its metrics have their values. A stop, an error or
an interrupt drains the step in flight and frees its batch.

The calls of a small model leave the guard's keeping to the loop (`RESTORE_BYTES`): their
program checks each step but selects nothing and does not donate its variables, so the loop
keeps each call's input until the call is read back. At a non-finite step it goes back to that
input and runs the steps before the bad one again, one at a time (`_restored`): the variables
the select would have kept, for about a third less device time a fused step on a model of a
few thousand parameters.

A stream's calls go out one after another (`_run_stream`); the work between two calls is a
list of boundary steps with one interface (`Boundary`), built once per `train_epochs` call:
copies of the weights asked for while training (`RunControl.request_copy`, served once the
variables are kept ones), a live edit's swap, "auto"'s measurement of steps per call, and the
evaluations `val_every_steps` asks for. A call dispatched and not read back yet is a
`_Pending` (`run.in_flight`); a stream opened ahead of its epoch is an `Upcoming`.

Each readback is timed: how long it blocked is the epoch's wait for the device, and the
loop thread's other time, less data waits, compiles and evaluations, its host time (the
history's `device_ms` and `host_ms`). The loop marks each call's parts on a call timer:
`n.profile()`'s (`RunTime.profiler`), else one whose marks do nothing (`PASS_THROUGH`).

The loop is the only in-place writer of the `TrainState` it is given: it updates it as steps
complete (the handle reads its counters live) and returns it. It reads the `RunSetup` and
advances the run-time record (`RunTime`: the step feed, the dispatch measurement, the
prefetchers); it never sees the handle.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nitro.core import progress
from nitro.core.events import Events
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import TrainState
from nitro.data import is_index_addressable
from nitro.data.prefetch import EpochStream, epoch_indices
from nitro.engine import swaps
from nitro.engine.diagnostics import data_wait_advice, divergence_message, shape_error
from nitro.engine.evaluation import delete, evaluate_split, finalize_metrics
from nitro.engine.member_axis import SINGLE, add_train_metrics
from nitro.engine.profiling import PASS_THROUGH
from nitro.engine.run_time import RunTime
from nitro.engine.runner import RunControl
from nitro.engine.spikes import SpikeRollback
from nitro.engine.stepwise import one_at_a_time
from nitro.engine.swaps import (
    HostHookFailed,
    Probation,
    host_probation_for,
    probation_for,
    record_swap,
    restore_totals,
    roll_back_host,
)
from nitro.errors import DivergenceError, Once
from nitro.programs.population import take_members
from nitro.programs.specs import ProgramSet

__all__ = ["finish_epoch", "train_epochs"]

# Calls over variables of at most this many bytes are restored by the loop: it holds three
# sets at most (the call read back's input, the call in flight's input, its output).
RESTORE_BYTES = 2**28

DATA_WAIT_WARN = 0.25
DATA_WAIT_MIN_STEPS = 50  # shorter epochs are dominated by filling the pipeline
DATA_WAIT_WARNING = Once()  # the data-wait advice, once per process (`.reset()` re-arms it)


@dataclasses.dataclass
class _Pending:
    """A dispatched call (one step, or a block of fused steps) not read back yet."""

    index: int  # the global index (0-based) of its first step
    report: Any  # f32[2], or f32[count, 2]: the loss and the finiteness code per step
    metrics: Any
    staged: Any  # data.StagedBatch (count > 1: a block)
    program: Any  # the program that ran it (a live edit may swap programs before it is read)
    before: Any = None  # a `restore` program's input variables, until its verdicts are read
    output: Any = None  # and its output (compared, never read: the next call may donate it)
    # a population's under `spike=`: the variables (not donated) and flags it started from
    start: tuple[Any, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Upcoming:
    """A stream opened ahead of its epoch (during the previous epoch's validation): the
    epoch it trains, the call layout it was staged for, and the stream."""

    epoch: int
    layout: tuple[str, int]
    stream: EpochStream


class _Epoch:
    """What one train_epochs call carries between steps and epochs."""

    def __init__(
        self,
        setup: RunSetup,
        runtime: RunTime,
        programs: ProgramSet,
        events: Events,
        control: RunControl,
        members: Any = SINGLE,
        state: TrainState | None = None,
    ):
        self.setup = setup
        self.runtime = runtime
        self.programs = programs
        self.events = events
        self.control = control
        self.members = members  # SINGLE, or a population's `Stacked` members
        self.feed = members.feed(runtime)
        self.healthy = members.healthy(setup, state)
        self.dispatched = 0
        self.target = 0  # the epoch this run trains to
        self.stop_at: int | None = None  # the step this run stops at (max_steps, steps=)
        self.upcoming: Upcoming | None = None  # started early, during validation
        # (steps, micro, restore) per call -> program
        self.programs_by_count: dict[tuple, Any] = {}
        self.probation: Probation | None = None  # a live edit's first steps, and the way back
        self.compiled: dict[int, float] = {}  # steps per call -> its program's compile seconds
        # n.profile()'s call timer, else one that marks nothing
        self.profiler = runtime.profiler or PASS_THROUGH
        self.in_flight: _Pending | None = None  # the call dispatched and not read back yet
        self.switchable = False  # the stream under way can reopen with other call sizes
        self.boundaries = Boundaries(_boundaries(setup))
        self.spikes = runtime.spikes if not members.stacked else None  # `spike=`'s watch

    def settle(self, state: TrainState) -> _Pending | None:
        """Read back the call in flight, if any: every step so far counted, the weights
        current. Returns it."""
        call, self.in_flight = self.in_flight, None
        if call is not None:
            _complete(self, state, call)
        return call

    def restart_timing(self) -> None:
        """The calls go on after work that is no call's (a stream's start, an evaluation, a
        swap, a copy's wait): no timed interval spans it."""
        self.runtime.dispatch.start_stream()
        self.profiler.start_stream()


class _RollBack(Exception):
    """A live edit's first steps gave a non-finite loss: back to the code before it."""

    def __init__(self, step: int, value: float):
        super().__init__(f"step {step} gave loss {value}")
        self.step, self.value = step, value


def train_epochs(
    setup: RunSetup,
    runtime: RunTime,
    state: TrainState,
    programs: ProgramSet,
    events: Events,
    control: RunControl,
    target: int,
    after_epoch: Callable[[TrainState, Any, int | None], str | None] | None = None,
    stop_at: int | None = None,
    members: Any = SINGLE,
) -> tuple[TrainState, str]:
    """Train until epoch `target`, step `stop_at` (mid-epoch if need be: the last call is cut
    to end there) or a stop request; returns the state and the stop reason ("completed",
    "max_steps", "requested", or what `after_epoch` returned, e.g. "early_stop").

    `after_epoch(state, row, epochs_left)` runs once an epoch's row is committed
    (`epochs_left`: the epochs this call trains after it, None when a stop step ends it;
    checkpoints, early
    stopping); a reason it returns ends the run.

    An epoch is a transaction: its history row is committed (and `state.epoch` moves) once
    its training and its validation are both complete. An epoch trained but not validated
    (a stop or an error during validation) is validated first by the next call.

    `members`: who trains (`nitro.engine.member_axis`): `SINGLE`, or a population's `Stacked`
    members, whose rows `after_epoch` then gets as a list (`finish_epoch`).
    """
    run = _Epoch(setup, runtime, programs, events, control, members, state)
    members.react(runtime, state)  # a resumed run's plateaus decide as the first run's did
    runtime.dispatch.start_run()
    run.dispatched = state.step
    run.target = target
    run.stop_at = stop_at
    stop = control.stop
    try:
        while True:
            if state.epoch_trained:
                row = _host_guarded(
                    run,
                    state,
                    lambda: finish_epoch(
                        run.setup, runtime, state, run.programs, events, control, members
                    ),
                )
                if row is None:
                    break  # validation stopped: the epoch stays trained, not committed
                left = None if stop_at is not None else target - state.epoch
                verdict = after_epoch(state, row, left) if after_epoch is not None else None
                if verdict is not None and state.epoch < target:
                    return state, verdict
                continue
            if state.epoch >= target or stop.is_set() or _reached(run, state):
                break
            events.phase("training")
            if state.totals is None:
                state.totals = members.start_epoch(state)
            if not _train_epoch(run, state, target):
                break
            state.epoch_trained = True
            if state.epoch + 1 < target and not stop.is_set() and not _reached(run, state):
                # start producing the next epoch now, so validation overlaps with it
                plan, updates = runtime.dispatch, _updates(run.setup)
                run.upcoming = Upcoming(
                    state.epoch + 1,
                    plan.layout(updates),
                    members.open(
                        runtime,
                        state.epoch + 1,
                        block=_capped(run, plan.blocks(updates), state.step),
                        group=run.setup.accum,
                        **_skips(state, state.epoch + 1),
                    ),
                )
        if stop.is_set():
            _acknowledge_interrupt(control)  # between steps: at an epoch's end, say
        if stop.is_set():
            return state, "requested"
        return state, (
            "max_steps" if _reached(run, state) and state.epoch < target else "completed"
        )
    finally:
        if run.upcoming is not None:
            run.upcoming.stream.close()
            run.upcoming = None
        for prefetcher in runtime.prefetchers.values():
            prefetcher.release_workers()  # worker processes live as long as the run
        control.serve_copies()


def finish_epoch(
    setup: RunSetup,
    runtime: RunTime,
    state: TrainState,
    programs: ProgramSet,
    events: Events,
    control: RunControl,
    members: Any = SINGLE,
) -> Any:
    """Validate a trained epoch and commit its history row; returns the row, or None when a
    stop request cut validation short (then nothing is recorded and the epoch stays trained).
    A population's (`members` stacked): every member's row, evaluated by one vmapped forward
    per batch and committed to its own history; the rows of those that trained in the epoch
    are returned as `Population.history()` has them."""
    totals = state.totals
    assert totals is not None  # a trained epoch has its totals
    stacked = members.stacked
    rows = members.rows(setup, runtime, state, finalize_metrics)
    for split in setup.eval_splits:  # ("val",) by default, each under its own prefix
        if control.stop.is_set():
            return None
        events.phase("validating")
        metrics = evaluate_split(setup, runtime, state, programs, control, split, members=members)
        if metrics is None:
            _acknowledge_interrupt(control)  # an interrupt during the epoch's validation
            return None
        for row, values in zip(rows, metrics if stacked else [metrics], strict=True):
            if row is not None:  # None: a member stopped before the epoch
                row.update(values)
    wait_frac = totals.wait_seconds / totals.seconds if totals.seconds > 0 else 0.0
    timing = {"data_wait_frac": wait_frac, "epoch_seconds": totals.seconds}
    timing.update(totals.step_times())  # host_ms, device_ms
    if stacked:
        committed = members.commit(state, rows, timing, events)
    else:
        committed = rows[0]
        committed.update(timing)
        state.history.append(committed)
    for note in members.react(runtime, state):  # ReduceOnPlateau, from the next call on
        progress.note(note)
    state.epoch += 1
    state.position = 0
    state.data_state = None
    state.totals = None
    state.epoch_trained = False
    if not stacked:
        events.end_epoch(committed)
    prefetcher = runtime.prefetcher("train")
    # batches "auto" chose to build on the loop thread took microseconds each: worker threads
    # would cost more in hand-overs than they save (measured), so their share is not advice
    cheap = prefetcher.path == "inline" and prefetcher.auto_inline
    if wait_frac > DATA_WAIT_WARN and totals.steps >= DATA_WAIT_MIN_STEPS and not cheap:
        DATA_WAIT_WARNING.warn(
            f"the training loop waited for data {wait_frac:.0%} of epoch {state.epoch}. "
            + data_wait_advice(setup, prefetcher),
            module="nitro.engine.loop",
        )
    return committed


def _acknowledge_interrupt(control: RunControl) -> None:
    """Say once that an interrupt was heard, here in the run, before its reporters close (so
    the live panel's record shows it)."""
    if control.interrupts and not control.acknowledged:
        control.acknowledged = 1
        control.say("interrupted; stopping training after the current step ...")


def _train_epoch(run: _Epoch, state: TrainState, target: int) -> bool:
    """One (possibly resumed) epoch. False when a stop request cut it short."""
    setup, runtime = run.setup, run.runtime
    split = setup.splits["train"]
    totals = state.totals
    assert totals is not None  # set when the epoch began
    run.events.start_epoch(state.epoch, target, split.batches, state.position)
    begin = time.perf_counter()
    upcoming, run.upcoming = run.upcoming, None
    try:
        while True:
            plan, updates = runtime.dispatch, _updates(setup)
            if (
                upcoming is not None
                and upcoming.epoch == state.epoch
                and upcoming.layout == plan.layout(updates)
                and state.position == 0
            ):
                stream = upcoming.stream
            else:
                if upcoming is not None:
                    upcoming.stream.close()
                done = state.position // setup.accum
                blocks = _aligned(plan.blocks(updates, done), done)
                stream = run.members.open(
                    runtime,
                    state.epoch,
                    start=state.position,
                    block=_capped(run, blocks, state.step),
                    group=setup.accum,
                    state=state.data_state,
                    **_skips(state, state.epoch),
                )
            upcoming = None
            try:
                ended = _run_stream(run, state, stream)
            finally:
                stream.close()
                totals.wait_seconds += stream.wait_seconds
                totals.untimed_seconds += stream.fill_seconds
            if ended != "switch":  # "switch": steps per call decided; reopen with K
                break
    finally:
        if upcoming is not None:
            upcoming.stream.close()
        totals.seconds += time.perf_counter() - begin
    if ended in ("interrupted", "max_steps"):
        return False
    left_out = sum(1 for index in state.skipped_in(state.epoch) if index < (split.batches or 0))
    if split.batches is not None and state.position < split.batches - left_out:
        warnings.warn(
            f"the 'train' split's len() says {split.batches} batches, but its iterator ended "
            f"after {state.position}; the epoch ended there. Make len() match what it yields "
            f"(schedules use it for their horizon).",
            RuntimeWarning,
            stacklevel=2,
        )
    return True


def _skips(state: TrainState, epoch: int) -> dict[str, frozenset[int]]:
    """The stream options that leave out the batches a spike's roll-back skipped in `epoch`
    (none: the stream as ever)."""
    skip = state.skipped_in(epoch)
    return {"skip": skip} if skip else {}


def _aligned(blocks: int | Iterable[int], step_in_epoch: int) -> int | Iterable[int]:
    """Fused calls of K lined up with the epoch (each starts at a multiple of K) when a stream
    opens mid-epoch (after "auto" decided, a resume, a stop): single steps up to the next
    multiple first. So the epoch's calls are those of an epoch trained from its start, and a
    run stopped between them resumes without an epoch remainder of its own."""
    if not isinstance(blocks, int) or blocks == 1 or not step_in_epoch % blocks:
        return blocks
    lead = blocks - step_in_epoch % blocks
    return itertools.chain(itertools.repeat(1, lead), itertools.repeat(blocks))


def _reached(run: _Epoch, state: TrainState) -> bool:
    """The run has trained to its stop step (`max_steps=`, `train(steps=)`)."""
    return run.stop_at is not None and state.step >= run.stop_at


def _capped(run: _Epoch, blocks: int | Iterable[int], start: int) -> int | Iterable[int]:
    """The call sizes of a stream whose first call starts at step `start`, cut so that no call
    runs past the run's stop step, or over a step an evaluation follows (`val_every_steps`):
    the steps before it go one per call (programs that exist already), so a call ends
    exactly there."""
    stop_at, every = run.stop_at, run.setup.val_every_steps
    if stop_at is None and every is None:
        return blocks
    sizes = itertools.repeat(blocks) if isinstance(blocks, int) else iter(blocks)

    def cut() -> Iterator[int]:
        step = start
        for size in sizes:
            if stop_at is not None and step + size > stop_at:
                size = 1
            if every is not None and (step // every + 1) * every < step + size:
                size = 1  # a call ends at each step an evaluation follows (val_every_steps)
            step += size
            yield size

    return cut()


def _updates(setup: RunSetup) -> int | None:
    """Optimizer steps per epoch: batches, or batches / accum rounded up (the last step
    takes the micro-batches left)."""
    batches = setup.splits["train"].batches
    return -(-batches // setup.accum) if batches is not None else None


def _remaining(run: _Epoch, state: TrainState) -> int | None:
    """Steps the handle has left to train: to this run's target or `max_epochs`, whichever
    is further (notebook runs often train a few epochs at a time toward max_epochs). None
    when the epoch length is unknown."""
    updates = _updates(run.setup)
    if updates is None:
        return None
    horizon = max(run.target, run.setup.max_epochs)
    left = max(0, (horizon - state.epoch) * updates - -(-state.position // run.setup.accum))
    return left if run.stop_at is None else max(0, min(left, run.stop_at - state.step))


def _run_stream(run: _Epoch, state: TrainState, stream) -> str:
    """Dispatch every staged call of `stream`, reading each back one call late, with the
    run's boundary steps between two calls (`Boundary`). Returns "ended" (the stream ended),
    "interrupted" (a stop request) or "switch" (the dispatch plan changed its call sizes: K to
    time against one step, or its decision; reopen the stream)."""
    stop, stop_at, profiler = run.control.stop, run.stop_at, run.profiler
    steps = run.boundaries.for_stream(run)
    members = run.members
    run.switchable = switchable = is_index_addressable(run.runtime.prefetcher("train").source)
    run.restart_timing()
    ended = "ended"
    try:
        for staged in stream:
            if stop.is_set():
                staged.free()
                ended = "interrupted"
                _acknowledge_interrupt(run.control)
                break
            if stop_at is not None and run.dispatched >= stop_at:
                staged.free()  # staged ahead: the run stops at max_steps before it
                ended = "max_steps"
                break
            if members.stacked and members.before_call(run, state):
                staged.free()  # every member has stopped (pop.stop(i), early stopping)
                ended = "interrupted"
                break
            profiler.mark("data", run.dispatched)
            for before_call in steps.before_call:
                before_call(run, state)
            call, switch = _dispatch(run, state, staged)
            for dispatched in steps.dispatched:
                dispatched(run, state, call)
            done, run.in_flight = run.in_flight, call
            if done is not None:
                _complete(run, state, done)
            reason = None
            for after_call in steps.after_call:
                reason = after_call(run, state, done)
                if reason is not None:
                    break
            if reason is None and switch and switchable:
                reason = "switch"
            if reason is not None:
                ended = reason
                break
        last = run.settle(state)
        for stream_ended in steps.stream_ended:
            stream_ended(run, state, last, ended)
    except _RollBack as rollback:
        if run.in_flight is not None:  # ran the edited code too: drain it, count nothing
            _drain(run.in_flight)
            run.in_flight = None
        _roll_back(run, state, rollback)
        ended = "switch"  # reopen the stream where the state now is
    except SpikeRollback:
        pending, run.in_flight = run.in_flight, None
        if pending is not None:  # dispatched after the spike: drain it, count nothing
            _drain(pending)
        raise
    except DivergenceError:
        pending, run.in_flight = run.in_flight, None
        if pending is not None:  # skipped by the guard: drain it, count nothing
            _drain(pending)
            if pending.before is not None and state.variables is pending.output:
                # the call before it kept its weights, and this one, which keeps nothing,
                # trained on from them: they are its input
                state.variables = pending.before
        raise
    finally:
        pending, run.in_flight = run.in_flight, None
        if pending is not None:  # another error: the step in flight still counts
            try:
                _complete(run, state, pending)
            except Exception:  # noqa: BLE001 - the original error matters more
                _drain(pending)
        if ended != "switch":
            run.probation = None  # a stream's end (an epoch's, a stop's) ends a probation
    return ended


def _dispatch(run: _Epoch, state: TrainState, staged) -> tuple[_Pending, bool]:
    """Dispatch the call of `staged` on the run's variables (they become its output); returns
    the call, and whether the dispatch plan changed its call sizes at it (the stream then
    reopens once it is read back, where the stream's source allows)."""
    feed, plan = run.feed, run.runtime.dispatch
    index, count, micro = run.dispatched, staged.count, staged.group
    if count == 1:
        args = (
            state.variables,
            run.healthy,
            feed.device(index),
            feed.hparams(index),
            staged.device,
        )
    else:
        args = (
            state.variables,
            run.healthy,
            feed.device_block(index, count),
            feed.hparams_block(index, count),
            staged.device,
        )
    restore = _restores(run, state)
    switch = False
    # "auto": a fused size's first call is compared with single steps; a size found
    # to differ runs one step at a time (`stepwise`)
    checking = count > 1 and plan.unchecked(count)
    if checking and not restore:  # the check copies the variables
        size = sum(x.nbytes for x in jax.tree.leaves(state.variables))
        if size > swaps.PROBATION_COPY_BYTES:
            checking, switch = False, plan.too_large(count, size)
    stepwise = checking or (count > 1 and plan.one_at_a_time())
    program = None
    if checking or not stepwise:
        program = run.programs_by_count.get((count, micro, restore)) or _program(
            run, state, index, args, count, micro
        )
    if count == 1 and plan.probing and plan.recall(program, _updates(run.setup)):
        switch = True  # an earlier handle of this program measured: its choice
    before = state.variables if restore else None  # not donated: kept as it is
    start = None  # `spike=` in a population: the call's input (not donated), for a roll-back
    if run.members.stacked and run.members.spike is not None:
        start = (state.variables, run.healthy)
    try:
        if stepwise:
            single = functools.partial(_program, run, state, index, count=1, micro=micro)
            out, same, seconds = one_at_a_time(
                single, feed, index, args, count, micro, restore, program, run.members.stacked
            )
            program = run.programs_by_count[(1, micro, restore)]
            if checking:
                cost = seconds + run.compiled.pop(count, 0.0)
                switch = plan.checked(count, same, cost, seconds) or switch
        else:
            assert program is not None  # compiled above unless one step at a time
            out = program(*args)
    except TypeError as error:
        staged.free()
        raise shape_error(run.setup, staged, error) from None
    run.profiler.dispatched(index, count, program, out.report)  # a timer waits for it here
    state.variables, run.healthy = out.variables, out.healthy
    if run.members.stacked:
        state.healthy = out.healthy  # type: ignore[attr-defined]
    run.dispatched += count
    after = out.variables if before is not None else None
    call = _Pending(index, out.report, out.metrics, staged, program, before, after, start)
    return call, switch


# ---------------------------------------------------------------------------------------------
# the work between two calls


class Boundary:
    """One piece of the work between two calls of a stream (kauldron's hooks, Keras's
    callbacks). Each method does nothing here; a step overrides those it needs, and the loop
    calls only those, in a stream the step `opens` to (`Boundaries`). The run's steps are
    built once per `train_epochs` call (`_boundaries`), in the order they run."""

    def opens(self, run: _Epoch) -> bool:
        """Whether the step has work in the stream that opens now (asked once a stream)."""
        return True

    def before_call(self, run: _Epoch, state: TrainState) -> None:
        """A call's batches are in hand; the call before it (`run.in_flight`) is in flight."""

    def dispatched(self, run: _Epoch, state: TrainState, call: _Pending) -> None:
        """`call` was dispatched (`state.variables` are its output); the call before it is
        still `run.in_flight`, not read back."""

    def after_call(self, run: _Epoch, state: TrainState, done: _Pending | None) -> str | None:
        """`done`, the call before the one now in flight, was read back (None: there was
        none). A reason returned ("interrupted", "switch") ends the stream."""
        return None

    def stream_ended(
        self, run: _Epoch, state: TrainState, last: _Pending | None, ended: str
    ) -> None:
        """Every call of the stream was read back, `last` the last one (None: it was read
        back earlier); `ended` is how the stream ended."""


class Boundaries:
    """The run's boundary steps (`steps`) and, for a stream, their methods as the loop calls
    them (`for_stream`)."""

    def __init__(self, steps: Iterable[Boundary]):
        self.steps = tuple(steps)
        self._hooks: dict[tuple[Boundary, ...], _Hooks] = {}

    def for_stream(self, run: _Epoch) -> _Hooks:
        """The hooks of the steps that open to the stream opening now."""
        steps = tuple(step for step in self.steps if step.opens(run))
        hooks = self._hooks.get(steps)
        if hooks is None:
            hooks = self._hooks[steps] = _Hooks(steps)
        return hooks


class _Hooks:
    """Per method of `Boundary`, the bound methods of the steps that override it, in order:
    a method no step overrides costs a call nothing."""

    def __init__(self, steps: tuple[Boundary, ...]):
        def overriding(name: str) -> tuple[Callable[..., Any], ...]:
            base = getattr(Boundary, name)
            return tuple(getattr(s, name) for s in steps if getattr(type(s), name) is not base)

        self.before_call = overriding("before_call")
        self.dispatched = overriding("dispatched")
        self.after_call = overriding("after_call")
        self.stream_ended = overriding("stream_ended")


class ServeCopies(Boundary):
    """Copies of the weights asked for while training (`RunControl.request_copy`), served
    once the variables are kept ones: before the next call donates them, or, where the call
    in flight keeps nothing yet (a `restore` call), once its verdicts are read back."""

    def before_call(self, run: _Epoch, state: TrainState) -> None:
        call = run.in_flight
        if run.control.copies_pending and call is not None and call.before is not None:
            run.settle(state)  # the call in flight kept nothing yet: its verdicts first
            run.control.serve_copies()
            run.restart_timing()  # no timed interval spans the wait

    def dispatched(self, run: _Epoch, state: TrainState, call: _Pending) -> None:
        if run.control.copies_pending and call.before is None:  # before the next call donates
            run.control.serve_copies()

    def stream_ended(
        self, run: _Epoch, state: TrainState, last: _Pending | None, ended: str
    ) -> None:
        if run.control.copies_pending:  # every call read back: the variables are kept ones
            run.control.serve_copies()


class SwapIn(Boundary):
    """A live edit compiled beside the run takes over between two calls: the old code's call
    in flight is read back first (`_swap_in`)."""

    def before_call(self, run: _Epoch, state: TrainState) -> None:
        if run.runtime.live.pending is not None:
            run.settle(state)  # the old code's last call counts before the swap
            _swap_in(run, state)
            run.restart_timing()  # no timed interval spans the swap


class MeasureDispatch(Boundary):
    """ "auto"'s measurement of steps per call: each call read back while it measures is
    timed (`_timed`); a change of call sizes reopens the stream where its source allows.
    A stream that opens while the plan does not measure has nothing to time: measuring
    starts again only with a `train_epochs` call (`DispatchPlan.start_run`)."""

    def opens(self, run: _Epoch) -> bool:
        return run.runtime.dispatch.measuring

    def dispatched(self, run: _Epoch, state: TrainState, call: _Pending) -> None:
        plan = run.runtime.dispatch
        if run.in_flight is None and plan.measuring:
            plan.began()  # none in flight before it: timed from its dispatch

    def after_call(self, run: _Epoch, state: TrainState, done: _Pending | None) -> str | None:
        plan = run.runtime.dispatch
        if done is not None and plan.measuring:
            if _timed(run, plan, done, _updates(run.setup), state) and run.switchable:
                return "switch"
        return None

    def stream_ended(
        self, run: _Epoch, state: TrainState, last: _Pending | None, ended: str
    ) -> None:
        plan = run.runtime.dispatch
        if last is not None and ended == "ended" and plan.measuring:
            _timed(run, plan, last, _updates(run.setup), state)  # the stream's last call too


class EvaluateWithin(Boundary):
    """An evaluation of the eval splits every `val_every_steps` steps, within an epoch, once
    every step before it is read back (`_validate_within`); the evaluation is no call's
    time."""

    def after_call(self, run: _Epoch, state: TrainState, done: _Pending | None) -> str | None:
        call = run.in_flight
        if call is None or not _evaluation_due(run, call.staged):
            return None
        run.settle(state)  # every step so far counted, weights current
        begin = time.perf_counter()
        validated = _validate_within(run, state)
        assert state.totals is not None  # set when the epoch began
        state.totals.untimed_seconds += time.perf_counter() - begin
        if not validated:
            return "interrupted"
        run.restart_timing()
        return None


class TakeSnapshots(Boundary):
    """The snapshots `snapshots=` keeps (`nitro.engine.snapshots`): at a stream's first call,
    of the variables before it (always at a run's first: where each `train()` began); after a call is read back, of the input of the call in
    flight where no call donates the variables (the state of the step just counted, at no
    wait); where calls donate them, the call in flight is read back first and the variables
    copied to the host before the next call."""

    def __init__(self) -> None:
        self.began = False  # the run's first call is past: its state is kept whatever the cadence

    def opens(self, run: _Epoch) -> bool:
        return run.runtime.snapshots is not None and not run.members.stacked

    def before_call(self, run: _Epoch, state: TrainState) -> None:
        ring, call = run.runtime.snapshots, run.in_flight
        if call is None:
            first, self.began = not self.began, True
            if ring.due(state.step, first):
                copy_now = not _restores(run, state)
                ring.take(run.setup, state, state.variables, run.runtime.device_values(), copy_now)
        elif call.before is None and ring.due(state.step):
            run.settle(state)
            ring.take(run.setup, state, state.variables, run.runtime.device_values(), True)
            run.restart_timing()  # no timed interval spans the copy

    def after_call(self, run: _Epoch, state: TrainState, done: _Pending | None) -> str | None:
        ring, call = run.runtime.snapshots, run.in_flight
        if done is not None and call is not None and call.before is not None:
            if ring.due(state.step):
                ring.take(run.setup, state, call.before, run.runtime.device_values(), False)
        return None


def _boundaries(setup: RunSetup) -> list[Boundary]:
    """The boundary steps of a run of `setup`, in the order they run: those a request may
    call for at any time (a copy of the weights, a live edit, "auto"'s measurement), the
    evaluations `val_every_steps` asks for, and the snapshots."""
    steps: list[Boundary] = [ServeCopies(), SwapIn(), MeasureDispatch()]
    if setup.val_every_steps is not None:
        steps.append(EvaluateWithin())
    steps.append(TakeSnapshots())
    return steps


def _program(run: _Epoch, state: TrainState, index: int, args, count: int, micro: int):
    """The train program of calls of `count` steps like `args` (compiled on first use: its
    time is untimed, and kept in `run.compiled` for the cost of "auto"'s probe)."""
    restore = _restores(run, state)
    program = run.programs_by_count.get((count, micro, restore))
    if program is None:
        begin = time.perf_counter()
        program = run.programs.train_step(args, count, micro, restore)
        run.programs_by_count[(count, micro, restore)] = program
        compiling = time.perf_counter() - begin  # (a lookup when compiled already)
        run.compiled[count] = compiling
        assert state.totals is not None  # set when the epoch began
        state.totals.untimed_seconds += compiling
        run.profiler.compiled(index, compiling)
    return program


def _swap_in(run: _Epoch, state: TrainState) -> None:
    """Swap in the code a live edit compiled beside the run (between two calls, with none in
    flight): the loop's setup and programs, the live experiment, the handle's; the swap's row
    in `state.swaps` and to the reporters. Its first steps are on probation."""
    runtime = run.runtime
    swap = runtime.live.take()
    if swap is None:
        return
    begin = time.perf_counter()
    run.probation = probation_for(swap, run.setup, run.programs, runtime.experiment, state)
    runtime.live.host_probation = host_probation_for(
        swap, run.setup, run.programs, runtime.experiment
    )
    run.setup, run.programs, run.programs_by_count = swap.setup, swap.programs, {}
    runtime.experiment = swap.experiment
    swap.adopt(swap.setup, swap.programs)
    record_swap(swap, state, run.events, run.control.say, time.perf_counter() - begin)


def _host_guarded(run: _Epoch, state: TrainState, work: Callable[[], Any]) -> Any:
    """`work()` (it reads `run`'s code); once more on the old code when a host hook a live
    edit changed raised on its first call in it."""
    try:
        return work()
    except HostHookFailed as failure:
        live = run.runtime.live
        probation, live.host_probation = live.host_probation, None
        assert probation is not None  # raised only on probation
        run.setup, run.programs, run.programs_by_count = probation.setup, probation.programs, {}
        run.runtime.experiment = probation.experiment
        run.probation = None  # its steps' code is gone too
        roll_back_host(probation, failure, state, run.events, run.control.say)
    return work()


def _roll_back(run: _Epoch, state: TrainState, cause: _RollBack) -> None:
    """The edited code's first steps were not finite: back to the code and the state from
    before the swap (the stream reopens there), with a note and a row in `state.swaps`."""
    probation, run.probation = run.probation, None
    assert probation is not None  # raised only on probation
    runtime = run.runtime
    runtime.live.host_probation = None  # its host hooks' code is gone too
    run.setup, run.programs, run.programs_by_count = probation.setup, probation.programs, {}
    runtime.experiment = probation.experiment
    probation.swap.adopt(probation.setup, probation.programs)
    if probation.variables is not None:  # back to the state from before the swap
        state.variables = probation.variables
        state.step, state.position = probation.step, probation.position
        state.data_state = None  # the stream reopens there by replay
        restore_totals(state.totals, probation.totals)
    # else: too large to have been copied: the guard kept the weights from before the
    # non-finite step, and the counters say where that is
    back_to = state.step
    if runtime.snapshots is not None:  # those of the edited code's steps are of no branch
        runtime.snapshots.drop_after(back_to)
    if runtime.spikes is not None:
        runtime.spikes.forget_after(back_to)
    run.dispatched = state.step
    run.healthy = run.setup.placement.put_replicated(jnp.asarray(True))
    edit = probation.swap.edit
    hooks = ", ".join(f"`{u}`" for u in edit.changes) or "the code"
    note = (
        f"the edit of {hooks} gave a non-finite loss ({cause.value}) at step {cause.step}, "
        f"its first steps: rolled back to the code and the weights of step {back_to}; "
        f"the run goes on. Fix the edit and save again"
    )
    reason = f"non-finite loss {cause.value} at step {cause.step}"
    swaps.record_roll_back(
        state, edit, probation.setup, back_to + 1, reason, note, run.events, run.control.say
    )


def _timed(run: _Epoch, plan, item: _Pending, updates: int | None, state: TrainState) -> bool:
    """Give the dispatch measurement a completed call; True when its call sizes change. An
    epoch's partial accumulation group (its own program, compiled once) is no call's time."""
    if item.staged.group != run.setup.accum:
        plan.start_stream()
        return False
    return plan.completed(item.staged.count, updates, lambda: _remaining(run, state))


def _evaluation_due(run: _Epoch, staged) -> bool:
    """Whether an evaluation follows the call just dispatched (`val_every_steps`): it ends at
    a multiple of N, before the epoch's last batch (whose end validates anyway)."""
    every, setup = run.setup.val_every_steps, run.setup
    if every is None or not setup.eval_splits or run.dispatched % every:
        return False
    batches = setup.splits["train"].batches
    return batches is None or staged.index + staged.count * staged.group < batches


def _validate_within(run: _Epoch, state: TrainState) -> bool:
    """Evaluate the eval splits with the current weights, within an epoch: a row (step,
    the epoch under way, each split's metrics under its prefix) in `state.validations`, and
    to the reporters. False when a stop request cut it short (nothing is recorded)."""
    setup, runtime, control, events = run.setup, run.runtime, run.control, run.events
    row: dict[str, Any] = {"step": state.step, "epoch": state.epoch + 1}
    members, results = run.members, None  # a population's: each member's metrics
    for split in setup.eval_splits:
        events.phase("validating")
        metrics = _host_guarded(
            run,
            state,
            lambda split=split: evaluate_split(
                run.setup, runtime, state, run.programs, control, split, members=members
            ),
        )
        if metrics is None:
            _acknowledge_interrupt(control)
            return False
        if members.stacked:
            merged = zip(results or metrics, metrics, strict=True)
            results = [{**a, **b} for a, b in merged]
        else:
            row.update(metrics)
    if results is not None:
        members.validated(state, results, events)
        events.phase("training")
        return True
    state.validations.append(row)
    events.validated(row)
    events.phase("training")
    return True


def _drain(item: _Pending) -> None:
    try:
        jax.block_until_ready(item.report)
    except Exception:  # noqa: BLE001 - the error being raised matters more
        pass
    item.staged.free()
    delete(item.metrics)


def _complete(run: _Epoch, state: TrainState, item: _Pending) -> None:
    """Read back one call (it has finished once its report arrives), free its batches, and
    account each of its steps."""
    setup = run.setup
    residency = setup.experiment.train_metrics_residency
    metrics = None  # the call's train metrics, on the host
    staged = item.staged
    profiler = run.profiler
    try:
        begin = time.perf_counter()
        reports = np.asarray(item.report).reshape(-1, 2)  # waits for the call to finish
        waited = time.perf_counter() - begin
        profiler.mark("readback", item.index)
        if residency is not None:
            metrics = setup.placement.gather(item.metrics)
        if item.before is not None and run.probation is None and reports[:, 1].any():
            # the program kept nothing: back to the call's input, and its finite steps again
            # (on probation, the roll-back goes back further, to its own copy)
            state.variables = _restored(run, item, int(np.flatnonzero(reports[:, 1])[0]))
    finally:
        staged.free()
    totals = state.totals
    assert totals is not None  # set when the epoch began
    totals.device_seconds += waited
    if run.spikes is not None and run.probation is None:
        _watch_spikes(run, state, item, reports)
    if run.members.stacked:  # each member's steps, stopped where they were not finite
        try:
            run.members.complete(state, item, reports, metrics, run.events)
        finally:
            delete(item.metrics)
            if run.members.rolled_back:
                _members_back(run, state, item)
            profiler.mark("bookkeeping", item.index)
        return
    count, micro = staged.count, staged.group
    program = item.program
    probation = run.probation
    first, losses = state.step + 1, []
    if probation is None and residency is None and not reports[:, 1].any():
        # every step finite by the guard's verdict, nothing to report per step: in bulk
        losses = totals.add_losses(reports[:, 0])
        state.step += count
        state.position += count * micro
        after = staged.after
        state.data_state = after[count * micro - 1] if after is not None else None
        totals.steps += count
        run.events.steps(first, losses)
        profiler.mark("bookkeeping", item.index)
        return
    try:
        for offset, (value, code) in enumerate(reports.tolist()):
            # on probation, a non-finite loss rolls back (without a copy to go back to, only
            # one the guard caught: with check_divergence=False the run trains on, as asked)
            if probation is not None and (
                code or (probation.variables is not None and not math.isfinite(value))
            ):
                raise _RollBack(item.index + offset + 1, value)
            if code:
                raise DivergenceError(
                    divergence_message(
                        setup, run.runtime.feed, state, item.index + offset, value, int(code)
                    )
                )
            if not math.isfinite(value):  # check_divergence=False: train on, count it
                totals.nonfinite += 1
            else:
                totals.loss_sum += value
                totals.loss_count += 1
            state.step += 1
            state.position += micro
            after = staged.after
            state.data_state = after[(offset + 1) * micro - 1] if after is not None else None
            totals.steps += 1
            losses.append(value)
        if residency is not None:
            add_train_metrics(
                setup,
                totals,
                program,
                metrics,
                staged,
                len(losses),
                lambda *args, **fields: _host_guarded(
                    run, state, lambda: run.runtime.call_host_hook(run.setup, *args, **fields)
                ),
            )
    finally:
        if losses:  # the call's steps counted so far, in one event
            run.events.steps(first, losses)
        profiler.mark("bookkeeping", item.index)
    if probation is not None and state.step >= probation.until:
        run.probation = None  # the edit's first steps were finite: it stays


def _watch_spikes(run: _Epoch, state: TrainState, item: _Pending, reports: np.ndarray) -> None:
    """`spike=`: raise `SpikeRollback` when a step of the call read back spiked, naming the
    call's batches by their indices in the source's epoch (none of its steps is counted)."""
    spikes = run.spikes
    assert spikes is not None  # watched only with `spike=`
    found = spikes.first_spike(item.index, reports)
    if found is None:
        return
    offset, why = found
    delete(item.metrics)
    staged = item.staged
    count = staged.count * staged.group
    skip = state.skipped_in(state.epoch)
    indices = epoch_indices(state.position, state.position + count + len(skip), skip)
    raise SpikeRollback(
        first=item.index,
        step=item.index + offset + 1,
        loss=float(reports[offset, 0]),
        why=why,
        epoch=state.epoch,
        batches=list(itertools.islice(indices, count)),
    )


def _members_back(run: _Epoch, state: TrainState, item: _Pending) -> None:
    """`spike=` in a population: the members whose loss spiked in `item` go back to its
    start, by a select along the member axis (the others' arrays stay theirs, bit for bit).
    The call in flight was dispatched on their spiking weights: it is dropped, and its batches
    dispatched again on the state now (the others compute it as they did the first time)."""
    members = run.members
    back, members.rolled_back = members.rolled_back, {}
    assert item.start is not None  # kept by every call under `spike=`
    pending, run.in_flight = run.in_flight, None
    if pending is not None:  # its input (the state after `item`), kept as its start
        assert pending.start is not None
        jax.block_until_ready(pending.report)
        delete(pending.metrics)
        now, healthy = pending.start
        inputs = {id(leaf) for leaf in jax.tree.leaves(now)}  # a leaf passed through stays
        delete([x for x in jax.tree.leaves(state.variables) if id(x) not in inputs])
    else:
        now, healthy = state.variables, state.healthy  # type: ignore[attr-defined]
    mask = np.zeros(members.count, bool)
    mask[list(back)] = True
    flags = np.asarray(healthy).copy()
    for position, stops in back.items():  # a member past max_rollbacks stays stopped
        flags[position] = not stops
    state.variables = take_members(mask, item.start[0], now)
    place = state.place or run.setup.placement.put_replicated  # type: ignore[attr-defined]
    state.healthy = run.healthy = place(jnp.asarray(flags))  # type: ignore[attr-defined]
    members.before_call(run, state)  # the members' own steps, fed from here on
    if pending is not None:
        run.dispatched = pending.index
        run.in_flight, _ = _dispatch(run, state, pending.staged)


def _restores(run: _Epoch, state: TrainState) -> bool:
    """Whether the handle's calls are `restore` programs (`RESTORE_BYTES`): steps under the
    guard, on one device, over variables small enough to keep a call's input beside its
    output. One rule for every call of a handle, one step or fused, so that both compute a
    step alike (bit for bit), and so that no call ever donates the variables: a checkpoint
    may then copy them to the host when it is written (`RunTime.restores`)."""
    runtime = run.runtime
    if runtime.restores is None:
        size = sum(x.nbytes for x in jax.tree.leaves(state.variables))
        # and a live edit's probation then has its copy to roll back to (the guard keeps none)
        limit = min(RESTORE_BYTES, swaps.PROBATION_COPY_BYTES)
        devices = len(run.setup.placement.devices)
        runtime.restores = run.setup.check_divergence and devices == 1 and size <= limit
    return runtime.restores


def _restored(run: _Epoch, item: _Pending, bad: int):
    """The variables from before step `bad` (counted from 0) of a `restore` call: its input,
    then its steps before `bad` again, one at a time, by the one-step `restore` program. The
    steps compute as one step per call does, so the variables are those the run reached
    before its first non-finite step."""
    variables = item.before
    setup, feed, micro = run.setup, run.runtime.feed, item.staged.group
    healthy = setup.placement.put_replicated(jnp.asarray(True))
    for offset in range(bad):
        index = item.index + offset
        rows = slice(offset * micro, (offset + 1) * micro) if micro > 1 else offset
        batch = {name: array[rows] for name, array in item.staged.device.items()}
        args = (variables, healthy, feed.device(index), feed.hparams(index), batch)
        program = run.programs_by_count.get((1, micro, True))
        if program is None:  # a run of fused calls only: compiled on its first divergence
            program = run.programs_by_count[(1, micro, True)] = run.programs.train_step(
                args, 1, micro, True
            )
        out = program(*args)
        variables, healthy = out.variables, out.healthy
    return variables
