"""The records of live edits, and the loop's side of a swap.

A `LiveEdit` is one edit applied to a live handle; `LiveEdits` (in the run-time record) holds
the newest one and the `Swap` compiled beside the run that waits for the loop's next dispatch
boundary. When the loop swaps it in, it keeps a `Probation`: the old code and a copy of the
state from before the swap, to roll back to when the new code's first steps are not finite.
Host hooks the edit changed (host metrics, `finalize_metrics`) are on probation too
(`HostProbation`) until their first call: one that raises there rolls back to the old code.
How an edit is checked and compiled is `live_edit.py`'s.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import jax

from nitro.core.run_setup import RunSetup
from nitro.core.train_state import TrainState
from nitro.experiments.fingerprint import CodeFingerprint
from nitro.programs.specs import ProgramSet
from nitro.runs.initial_weights import copy_array

__all__ = [
    "PROBATION_COPY_BYTES",
    "PROBATION_STEPS",
    "STATUSES",
    "HostHookFailed",
    "HostProbation",
    "LiveEdit",
    "LiveEdits",
    "Probation",
    "Swap",
    "code_digest_of",
    "host_hooks",
    "host_probation_for",
    "probation_for",
    "record_swap",
    "restore_totals",
    "roll_back_host",
    "swap_note",
    "swap_row",
    "where_raised",
]

PROBATION_STEPS = 8  # steps after a swap whose non-finite loss rolls the swap back
# variables up to this size are copied at a swap, to roll back to; larger ones are not (the
# guard's weights from before the non-finite step are kept instead)
PROBATION_COPY_BYTES = 2**30

# the statuses of a live edit; the last five are final
STATUSES = ("compiling", "ready", "swapped", "refused", "failed", "rolled back", "superseded")
_FINAL = frozenset(STATUSES[2:])


@dataclasses.dataclass(eq=False)
class LiveEdit:
    """One edit applied to a live handle: what changed, where it stands, and its note.

    `status` is "compiling" (beside the run), "ready" (waiting for the next dispatch
    boundary), "swapped" (the run trains on the new code since `record["step"]`), "refused"
    (the edit changes what a live run cannot change: see `note`), "failed" (the new code does
    not trace or compile: `note` names the hook, file and line), "rolled back" (the new code
    gave a non-finite loss on its first steps; the run went back to the old code and the state
    from before the swap) or "superseded" (a newer edit replaced it before it was swapped
    in). `wait()` returns once it is swapped in or final.
    """

    changes: Mapping[str, list[str]]
    status: str = "compiling"
    note: str = ""
    record: dict[str, Any] | None = None
    compile_seconds: float = 0.0
    programs: tuple[str, ...] = ()  # titles of the programs it compiles before it swaps in
    _settled: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    def wait(self, timeout: float | None = None) -> LiveEdit:
        """Block until the edit is swapped in or final (or `timeout` seconds pass)."""
        self._settled.wait(timeout)
        return self

    @property
    def done(self) -> bool:
        return self._settled.is_set()

    def _settle(self, status: str, note: str = "") -> None:
        self.status = status
        if note:
            self.note = note
        if status in _FINAL:
            self._settled.set()

    def __str__(self) -> str:
        what = ", ".join(self.changes) or "nothing"
        return f"live edit of {what}: {self.status}" + (f" ({self.note})" if self.note else "")


@dataclasses.dataclass(eq=False)
class Swap:
    """New code ready to swap in: the setup and programs for it, the live experiment as an
    instance of the edited class, and what the swap record says."""

    edit: LiveEdit
    setup: RunSetup
    programs: ProgramSet
    experiment: Any
    compiled: tuple[str, ...]  # titles of the programs compiled for it
    reused: tuple[str, ...]  # titles of the programs it shares with the old code
    adopt: Callable[[RunSetup, ProgramSet], None]  # the handle takes the code the run trains on


@dataclasses.dataclass(eq=False)
class Probation:
    """What a swap can roll back to: the old code and the state from before it."""

    swap: Swap
    setup: RunSetup
    programs: ProgramSet
    experiment: Any
    variables: Any  # a copy from before the swap, or None (too large to copy)
    step: int
    position: int
    totals: Any
    until: int  # probation ends once this many steps have completed


@dataclasses.dataclass(eq=False)
class HostProbation:
    """The host hooks a swap changed that have not run yet, and the code to roll back to
    when one raises on its first call."""

    swap: Swap
    setup: RunSetup
    programs: ProgramSet
    experiment: Any
    hooks: set[str]  # not yet called on the new code


class HostHookFailed(Exception):
    """A host hook a live edit swapped in raised on its first call (the run rolls back)."""

    def __init__(self, hook: str, error: Exception):
        super().__init__(f"`{hook}` raised {type(error).__name__}: {error}")
        self.hook, self.error = hook, error


class LiveEdits:
    """A handle's live edits (in its run-time record): the newest edit, the swap waiting
    for the loop, and the host hooks of the last swap still on probation. `pending` is read
    by the loop between calls without the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pending: Swap | None = None
        self.latest: LiveEdit | None = None
        self.host_probation: HostProbation | None = None

    def call_host_hook(self, setup: RunSetup, name: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, a call of host hook `name` of `setup`: `HostHookFailed` when it raises on
        its first call after a swap changed it."""
        probation = self.host_probation
        if probation is None or name not in probation.hooks or probation.swap.setup is not setup:
            return fn()
        try:
            result = fn()
        except Exception as error:  # noqa: BLE001 - the roll-back's note says it
            raise HostHookFailed(name, error) from error
        probation.hooks.discard(name)
        if not probation.hooks:
            self.host_probation = None
        return result

    def offer(self, swap: Swap) -> bool:
        """Queue `swap` for the next dispatch boundary; False when a newer edit started."""
        with self._lock:
            if self.latest is not swap.edit:
                return False
            if self.pending is not None:
                self.pending.edit._settle("superseded", "a newer edit replaced it")
            self.pending = swap
            return True

    def take(self) -> Swap | None:
        with self._lock:
            swap, self.pending = self.pending, None
            return swap

    def begin(self, edit: LiveEdit) -> None:
        with self._lock:
            previous, self.latest = self.latest, edit
        if previous is not None and not previous.done and previous.status == "compiling":
            previous._settle("superseded", "a newer edit replaced it")


def code_digest_of(setup: RunSetup) -> str:
    """One digest of all of a setup's code (hooks, model, optimizer)."""
    return CodeFingerprint.combine(*setup.experiment.code.values()).digest


# ---------------------------------------------------------------------------------------------
# the loop's side: swapping in, and rolling back


def swap_row(swap: Swap, step: int, epoch: int, pause: float) -> dict[str, Any]:
    """The record of a swap: the step whose call first ran the new code, what changed, the
    code's digest, what compiled, and how long the compile and the swap took."""
    return {
        "step": step,
        "epoch": epoch,
        "status": "swapped",
        "changed": list(swap.edit.changes),
        "details": {u: list(p) for u, p in swap.edit.changes.items()},
        "code": code_digest_of(swap.setup),
        "compiled": list(swap.compiled),
        "reused": list(swap.reused),
        "compile_seconds": swap.edit.compile_seconds,
        "pause_seconds": pause,
        "at": time.time(),
    }


def record_swap(
    swap: Swap,
    state: TrainState,
    events: Any,
    say: Callable[[str], None],
    pause: float,
    settle: bool = True,
):
    """A swap taken in (by the loop, or by a handle that is not training): its row in
    `state.swaps`, the edit settled as swapped (`settle=False`: the caller settles it, once
    the handle is free again), the `swapped` event and the note."""
    row = swap_row(swap, state.step + 1, state.epoch + 1, pause)  # the first step on it
    state.swaps.append(row)
    swap.edit.record = row
    if settle:
        swap.edit._settle("swapped")
    events.swapped(row)
    say(swap_note(row))
    return row


def swap_note(row: Mapping[str, Any]) -> str:
    """The note of a swap, for the person at the keyboard."""
    changed = ", ".join(f"`{u}`" for u in row.get("changed") or []) or "the code"
    compiled = ", ".join(row.get("compiled") or []) or "nothing"
    return (
        f"swapped in the edit of {changed} at step {row['step']} (compiled {compiled} in "
        f"{row.get('compile_seconds', 0.0):.2f} s beside the run)"
    )


def probation_for(
    swap: Swap, setup: RunSetup, programs: ProgramSet, experiment: Any, state: TrainState
) -> Probation:
    """What the loop keeps while a swapped-in edit is on probation: a copy of the variables
    (the next call donates them) and the counters from before the swap. Variables over
    `PROBATION_COPY_BYTES` are not copied: a roll-back then keeps the weights the divergence
    guard kept (those from before the non-finite step)."""
    size = sum(x.nbytes for x in jax.tree.leaves(state.variables))
    variables = jax.tree.map(copy_array, state.variables) if size <= PROBATION_COPY_BYTES else None
    return Probation(
        swap=swap,
        setup=setup,
        programs=programs,
        experiment=experiment,
        variables=variables,
        step=state.step,
        position=state.position,
        totals=copy.deepcopy(state.totals),
        until=state.step + PROBATION_STEPS,
    )


def host_hooks(setup: RunSetup) -> set[str]:
    """The hooks of `setup` that run on the host, as Python: `finalize_metrics`, and the
    metrics hooks whose residency is "host"."""
    experiment = setup.experiment
    on_host = {"finalize_metrics"}
    on_host |= {hook for hook, where in experiment.residency.items() if where == "host"}
    return {hook for hook in on_host if hook in experiment.hooks}


def host_probation_for(
    swap: Swap, setup: RunSetup, programs: ProgramSet, experiment: Any
) -> HostProbation | None:
    """The host hooks `swap` changes, on probation until their first call, with the code from
    before it (`setup`, `programs`, `experiment`); None when it changes none."""
    hooks = host_hooks(swap.setup) & set(swap.edit.changes)
    if not hooks:
        return None
    return HostProbation(swap, setup, programs, experiment, hooks)


def roll_back_host(
    probation: HostProbation,
    failure: HostHookFailed,
    state: TrainState,
    events: Any,
    say: Callable[[str], None],
) -> None:
    """A host hook raised on its first call after a swap: the handle takes the code from before
    it (the caller sets its own copies from `probation`), with a row in `state.swaps` at the
    step the old code runs from, the edit settled "rolled back", the event and the note. The
    weights stay: host hooks never train them."""
    probation.swap.adopt(probation.setup, probation.programs)
    edit = probation.swap.edit
    error = failure.error
    where = where_raised(error)
    at = f" ({where})" if where else ""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    note = (
        f"the edit of `{failure.hook}` raised on its first call{at}: {type(error).__name__}: "
        f"{message}. Rolled back to the code it had before; the run goes on. Fix the edit "
        f"and save again"
    )
    reason = f"`{failure.hook}` raised {type(error).__name__}: {message}"
    record_roll_back(state, edit, probation.setup, state.step + 1, reason, note, events, say)


def record_roll_back(
    state: TrainState,
    edit: Any,
    setup: RunSetup,
    step: int,
    reason: str,
    note: str,
    events: Any,
    say: Callable[[str], None],
) -> None:
    """What a roll-back leaves: a row in `state.swaps` at `step` (the first step on the old
    code again), the edit settled "rolled back", the `swapped` event and the note."""
    row = {
        "step": step,
        "epoch": state.epoch + 1,
        "status": "rolled back",
        "changed": list(edit.changes),
        "code": code_digest_of(setup),
        "reason": reason,
        "at": time.time(),
    }
    state.swaps.append(row)
    edit._settle("rolled back", note)
    events.swapped(row)
    say(note)


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # nitro itself
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


def where_raised(error: BaseException) -> str:
    """'file.py line N' of the user code an error was raised in (the innermost frame outside
    libraries and Nitro), or ''."""
    libraries = _library_dirs()
    seen: set[int] = set()
    found = ""
    chain: BaseException | None = error
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        for frame in traceback.extract_tb(chain.__traceback__):
            path = os.path.realpath(frame.filename)
            if frame.filename.startswith("<frozen") or path.startswith(libraries):
                continue
            found = f"{os.path.basename(frame.filename)} line {frame.lineno}"
        chain = chain.__cause__ or chain.__context__
    return found


def restore_totals(totals: Any, saved: Any) -> None:
    """Put the epoch's running sums back as they were at the swap (in place: the loop holds
    the object)."""
    if totals is None or saved is None:
        return
    for field in dataclasses.fields(totals):
        setattr(totals, field.name, getattr(saved, field.name))
