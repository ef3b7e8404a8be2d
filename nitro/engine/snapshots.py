"""Snapshots: a run's state kept on the host at a cadence, to rewind to, fork from and roll a
loss spike back to (docs/time-travel.md).

A snapshot is a checkpoint kept in memory: the `CheckpointRecord` a save writes and the tree
of host arrays it writes (`host_tree`), so restoring one is a resume's restore
(`restore_variables`, then `CheckpointRecord.train_state`), and the run's checkpoints on disk
are its older snapshots (`restore_point` reads either).

The loop takes one between two calls once it is due (`TakeSnapshots`), and one where each
`train()` call begins: at a stream's first call, before anything is dispatched; or, where no call donates the variables (the calls the
loop restores itself, `RunTime.restores`), once a call is read back, from the input of the
call in flight, which is the state of the step just counted: nothing waits for it. A worker
thread then copies the arrays to the host and builds the record, and lets the device arrays
go; no snapshot is taken while the last one is still being copied, so snapshots hold at most
one set of device arrays, for as long as one copy takes, and otherwise host memory only.
Where calls donate the variables, the loop reads the call in flight back and copies the
arrays itself before the next call.

`Snapshots(every=, keep=, max_bytes=)` sets the cadence (`snapshots=` run keyword): every
`every` steps, or "auto", as often as keeps their cost (the loop's time and the copy's)
within `budget` of training time, at most one a `min_seconds`; the ring keeps the newest
`keep` within `max_bytes`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

from nitro.core.run_setup import RunSetup
from nitro.core.train_state import HistoryRows, TrainState, Variables
from nitro.errors import SetupError
from nitro.runs.checkpoint_reads import SavedStep, read_checkpoint
from nitro.runs.checkpoint_record import CheckpointRecord
from nitro.runs.checkpoint_trees import host_tree, materialized, restore_targets
from nitro.runs.epoch_saves import run_record
from nitro.runs.resume import restore_variables

__all__ = [
    "MEMORY",
    "Snapshot",
    "SnapshotRing",
    "Snapshots",
    "check_snapshots",
    "detached",
    "restore_point",
]

MEMORY = Path("<memory>")  # where a snapshot in memory says it is, in a restore's messages


@dataclasses.dataclass(frozen=True)
class Snapshots:
    """How often a run keeps its state in host memory, and how much of it (the `snapshots=`
    run keyword; `False` or `None` keeps none).

    Args:
      every: steps between snapshots (one is taken at the first call boundary at or past
        each multiple of `every`), or "auto": as often as keeps their cost within `budget`
        of training time, at most one every `min_seconds`.
      keep: the newest snapshots kept; older ones are dropped (the run's checkpoints on
        disk stay, as older snapshots).
      max_bytes: the most host memory the snapshots hold together; the oldest go first.
      budget: "auto"'s largest fraction of training time for snapshots.
      min_seconds: "auto"'s least time between two snapshots.

    >>> Snapshots(every=100, keep=4)
    Snapshots(every=100, keep=4, max_bytes=2147483648, budget=0.01, min_seconds=1.0)
    """

    every: int | str = "auto"
    keep: int = 8
    max_bytes: int = 2**31
    budget: float = 0.01
    min_seconds: float = 1.0

    def __post_init__(self) -> None:
        every = self.every
        if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise SetupError(
                f"Snapshots(every={every!r}): every is the steps between snapshots, an int "
                f">= 1, or 'auto' (as often as a 1% budget of training time allows)"
            )
        for name in ("keep", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SetupError(f"Snapshots({name}={value!r}): {name} must be an int >= 1")
        if not (isinstance(self.budget, (int, float)) and 0 < self.budget <= 1):
            raise SetupError(
                f"Snapshots(budget={self.budget!r}): budget is a fraction of training time, "
                f"in (0, 1]"
            )
        if not (isinstance(self.min_seconds, (int, float)) and self.min_seconds >= 0):
            raise SetupError(
                f"Snapshots(min_seconds={self.min_seconds!r}): min_seconds must be >= 0"
            )


def check_snapshots(value: Any) -> Snapshots | None:
    """The `snapshots=` run keyword: a `Snapshots`, an int (every that many steps), True (the
    default policy), or False / None (none)."""
    if value is None or value is False:
        return None
    if value is True:
        return Snapshots()
    if isinstance(value, Snapshots):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return Snapshots(every=value)
    raise ValueError(
        f"snapshots must be a nitro.Snapshots(every=, keep=, max_bytes=), an int (a snapshot "
        f"every that many steps), True (the default, nitro.Snapshots()) or False/None (none); "
        f"got {value!r}"
    )


@dataclasses.dataclass(eq=False)
class Snapshot:
    """One snapshot in memory: its counters at once, its `record` and host `tree` once the
    worker has copied them (`wait()`), and the Device values it was taken with (as the
    handle holds them: `record.member.device` too)."""

    step: int
    epoch: int
    position: int
    nbytes: int
    taken: float  # time.time() when it was taken
    record: CheckpointRecord | None = None
    tree: Mapping[str, Any] | None = None
    error: BaseException | None = None
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)

    def wait(self) -> Snapshot:
        """Wait for its copy (milliseconds); raises what the copy raised."""
        self.ready.wait()
        if self.error is not None:
            raise self.error
        return self


_PENDING: collections.deque[Callable[[], None]] = collections.deque()
_WORKER: threading.Thread | None = None
_WORKER_LOCK = threading.Lock()


def _submit(job: Callable[[], None]) -> None:
    """Run `job` on the copying thread: one for every ring's copies (each takes
    milliseconds), started when one is asked for and gone once none is left, so no thread
    outlives the run that took the snapshots (`settle`)."""
    global _WORKER
    with _WORKER_LOCK:
        _PENDING.append(job)
        if _WORKER is None:
            _WORKER = threading.Thread(target=_drain, name="nitro-snapshots", daemon=True)
            _WORKER.start()


def _drain() -> None:
    global _WORKER
    while True:
        with _WORKER_LOCK:
            if not _PENDING:
                _WORKER = None
                return
            job = _PENDING.popleft()
        job()  # a copy records its own error on its snapshot


def settle() -> None:
    """Wait until every copy asked for is done and the copying thread has ended."""
    while True:
        with _WORKER_LOCK:
            worker = _WORKER
        if worker is None:
            return
        worker.join()


def detached(state: TrainState, variables: Any = None) -> TrainState:
    """A copy of `state`'s counters, history and running sums that later steps do not change
    (its rows are never changed once committed: the lists are copied, not the rows), with
    `variables` as its arrays."""
    totals = state.totals
    return TrainState(
        variables=variables,
        step=state.step,
        epoch=state.epoch,
        position=state.position,
        seed=state.seed,
        history=list(state.history),
        validations=list(state.validations),
        swaps=list(state.swaps),
        totals=dataclasses.replace(totals, train_metrics=None) if totals is not None else None,
        epoch_trained=state.epoch_trained,
        data_state=state.data_state,
        skipped_batches=list(state.skipped_batches),
        rewinds=list(state.rewinds),
    )


class SnapshotRing:
    """A run's snapshots in memory, oldest first, within the policy's `keep` and
    `max_bytes`; thread-safe (the loop adds, the handle lists and restores)."""

    def __init__(self, policy: Snapshots, run_id: str):
        self.policy = policy
        self.run_id = run_id
        self._lock = threading.Lock()
        self._entries: list[Snapshot] = []
        self._last_step: int | None = None
        self._last_time = 0.0
        self._cost = 0.0  # seconds the last snapshot took: the loop's and the copy's
        self.seconds = 0.0  # seconds every snapshot took so far, the loop's and the copies'
        self._copying: Snapshot | None = None
        self._history_rows = HistoryRows()
        self._validation_rows = HistoryRows()
        self.off: str | None = None  # why snapshots stopped (one larger than max_bytes)

    @property
    def entries(self) -> list[Snapshot]:
        with self._lock:
            return list(self._entries)

    def due(self, step: int, begins: bool = False) -> bool:
        """Whether a snapshot of step `step` is due now ("auto": once the one before it is
        copied); `begins`: a run (a `train()` call) begins there, and its state is kept
        whatever the cadence, so a rewind can always undo a call."""
        last, every = self._last_step, self.policy.every
        if self.off is not None or last == step:
            return False
        if begins:
            return True
        if every == "auto":
            copying = self._copying
            if copying is not None and not copying.ready.is_set():
                return False
            if last is None:
                return True
            wait = max(self.policy.min_seconds, self._cost / self.policy.budget)
            return time.perf_counter() - self._last_time >= wait
        if last is None:
            return True
        assert isinstance(every, int)
        return step // every != last // every

    def take(
        self,
        setup: RunSetup,
        state: TrainState,
        variables: Variables,
        device: Mapping[str, Any],
        copy_now: bool,
    ) -> Snapshot | None:
        """Keep `state` with `variables` (its arrays now) and the Device values `device`: the
        host copies are made now (`copy_now`: the next call donates them) or by the worker
        thread, which also builds the record. None when it alone is larger than the ring."""
        began = time.perf_counter()
        leaves = jax.tree.leaves(variables)
        nbytes = sum(int(getattr(x, "nbytes", 0)) for x in leaves)
        if nbytes > self.policy.max_bytes:
            self.off = (
                f"a snapshot holds {nbytes / 2**20:.0f} MiB, more than max_bytes="
                f"{self.policy.max_bytes} (nitro.Snapshots(max_bytes=...) raises it)"
            )
            return None
        copy = detached(state)
        tree = host_tree(setup, variables, lazy=not copy_now)
        entry = Snapshot(copy.step, copy.epoch, copy.position, nbytes, time.time())
        device = dict(device)
        with self._lock:
            self._entries = [e for e in self._entries if e.step != entry.step]
            self._entries.append(entry)
            kept, total = [], 0
            for e in reversed(self._entries):
                if len(kept) < self.policy.keep and total + e.nbytes <= self.policy.max_bytes:
                    kept.append(e)
                    total += e.nbytes
            self._entries = kept[::-1]
            self._last_step, self._last_time = entry.step, time.perf_counter()
            self._copying = entry
        spent = time.perf_counter() - began

        def finish() -> None:
            start = time.perf_counter()
            try:
                entry.tree = materialized(tree)
                entry.record = run_record(
                    setup,
                    copy,
                    self.run_id,
                    copy.last_row,
                    None,
                    device,
                    None,
                    self._history_rows,
                    self._validation_rows,
                )
            except BaseException as error:  # noqa: BLE001 - said by whoever waits for it
                entry.error = error
            finally:
                self._cost = spent + time.perf_counter() - start
                self.seconds += self._cost
                entry.ready.set()

        _submit(finish)
        return entry

    def at(self, step: int) -> Snapshot | None:
        with self._lock:
            return next((e for e in self._entries if e.step == step), None)

    def newest_at_most(self, step: int) -> Snapshot | None:
        """The newest snapshot of a step at most `step`."""
        with self._lock:
            found = [e for e in self._entries if e.step <= step]
        return found[-1] if found else None

    def drop_after(self, step: int) -> None:
        """Forget the snapshots after `step` (a branch left behind); the next one is due at
        once."""
        with self._lock:
            self._entries = [e for e in self._entries if e.step <= step]
            self._last_step = None

    def wait(self) -> None:
        """Wait for the copy under way, if any."""
        copying = self._copying
        if copying is not None:
            copying.ready.wait()


def restore_point(
    setup: RunSetup,
    template: Variables,
    *,
    snapshot: Snapshot | None = None,
    saved: SavedStep | None = None,
    seed: int,
    compare_training: bool = True,
    note: Any = None,
) -> tuple[TrainState, CheckpointRecord]:
    """The state a snapshot in memory (`snapshot`) or a checkpoint on disk (`saved`) holds,
    restored as a resume restores it, onto `template`'s shapes and placement, and its record.
    `compare_training=False`: the run keywords that change the training may differ from the
    record's on purpose (a fork's), so they are not warned about."""
    if snapshot is not None:
        snapshot.wait()
        tree, record = snapshot.tree, snapshot.record
        found = SavedStep(MEMORY, snapshot.step)
    else:
        if saved is None:
            raise SetupError("restore_point needs a snapshot or a saved step")
        tree, record = read_checkpoint(
            saved.directory, saved.step, targets=restore_targets(setup, template)
        )
        found = saved
    assert tree is not None and record is not None  # a finished snapshot has both
    if record.kind != "run":
        raise SetupError(
            f"the checkpoint {str(found.path)!r} is a population's: a run rewinds to and forks "
            f"from its own snapshots and checkpoints"
        )
    if not compare_training:
        record = dataclasses.replace(record, training=None)
    variables = restore_variables(setup, template, tree, record, found, note=note)
    return record.train_state(variables, seed=seed), record
