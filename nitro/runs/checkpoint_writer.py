"""The background writer of a run's checkpoints: `CheckpointStore`, one orbax
`CheckpointManager` per run, written by a thread of its own while training goes on (one save
written, one waiting; a newer save takes the waiting one's place), with the budget that
decides which epochs are saved. Orbax is driven by one thread at a time in the process
(`ORBAX`), and the process's end waits for the writes in flight.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from nitro.core.run_setup import CheckpointPolicy
from nitro.errors import SetupError
from nitro.runs.checkpoint_names import NamedSteps, named_paths, step_path
from nitro.runs.checkpoint_trees import materialized

if TYPE_CHECKING:
    from nitro.runs.checkpoint_record import CheckpointRecord

__all__ = [
    "ORBAX",
    "CheckpointStore",
    "Save",
    "await_writers",
    "describe_error",
    "quiet_orbax",
    "quiet_read_only",
    "warm_up",
]

# Orbax deletes a step by removing its files one by one: a process killed meanwhile would
# leave a step directory that still lists as saved but no longer restores. So steps are moved
# into this subdirectory first (one atomic rename) and removed from there.
DELETING = "deleting"

# ---------------------------------------------------------------------------------------------
# the store


_OPEN: weakref.WeakSet = weakref.WeakSet()


class _OrbaxAccess:
    """Orbax is not safe to drive from several threads at once: two managers saving in
    parallel (two handles training in the background) corrupt each other's OCDBT writes.

    Every orbax call runs under `held(manager)`. A manager whose background write is still in
    flight keeps its turn after the call returns: the next call for another manager first
    waits for that write to finish. One run's own saves still overlap its training.

    A write that fails is reported to the store that started it (`failed`), never to the
    caller that happened to wait for it, and its manager gives up its turn whatever happens:
    a failed write cannot hold the lock or make the next caller wait on it again.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._writing: Any = None  # the manager whose background write may be in flight
        self._failed: Any = None  # (error) -> None: its store's report of a failed write

    @contextmanager
    def held(self, manager: Any = None) -> Iterator[None]:
        with self._lock:
            writing, failed = self._writing, self._failed
            if writing is not None and writing is not manager:
                self._writing = self._failed = None
                try:
                    writing.wait_until_finished()
                except Exception as error:  # noqa: BLE001 - its own store reports it
                    if failed is not None:
                        failed(error)
            yield

    def started_write(self, manager: Any, failed: Any = None) -> None:
        """Under `held(manager)`: `manager` begins a background write; `failed(error)`
        reports its failure when another caller finds it."""
        self._writing, self._failed = manager, failed

    def closed(self, manager: Any) -> None:
        """Under `held(manager)`: `manager` has finished its writes (or failed) and is closed."""
        if self._writing is manager:
            self._writing = self._failed = None


ORBAX = _OrbaxAccess()

_EXIT_HOOK = threading.Lock()
_exit_hooked = False


def _finish_at_exit() -> None:  # pragma: no cover - runs at interpreter exit
    for store in list(_OPEN):
        store.wait()


_WARMED = threading.Event()


def warm_up() -> None:
    """Import orbax in a thread of its own, once a process, ahead of the first save: a run
    that starts now is usually compiling (native code, the interpreter lock free), so the
    second of importing it goes there instead of into the training calls that follow the
    first save."""
    if _WARMED.is_set() or "orbax.checkpoint.checkpoint_managers" in sys.modules:
        return
    _WARMED.set()

    def load() -> None:
        try:
            from orbax.checkpoint import checkpoint_managers  # noqa: F401
        except Exception:  # noqa: BLE001, S110 - the first save imports it again and says why
            pass

    threading.Thread(target=load, name="nitro-import-orbax", daemon=True).start()


def _hook_exit() -> None:
    """Have the process's end wait for the saves in flight, before `concurrent.futures`
    stops its executors (orbax writes with them, and refuses new work once they stop): the
    interpreter calls `threading`'s exit hooks before it joins the remaining threads, the
    latest registered first, and those before `atexit`'s."""
    global _exit_hooked
    import concurrent.futures.thread  # noqa: F401 - its hook is registered first, so runs last

    with _EXIT_HOOK:
        if _exit_hooked:
            return
        _exit_hooked = True
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            try:
                register(_finish_at_exit)
            except RuntimeError:  # the interpreter is ending already
                pass


@atexit.register
def _close_all() -> None:  # pragma: no cover - runs at interpreter exit
    for store in list(_OPEN):
        store.close()


class CheckpointStore:
    """One run's orbax `CheckpointManager`, opened on first use, closed when the run's
    handle goes away (or at exit), with the budget that decides which epochs are saved."""

    def __init__(self, directory: str | os.PathLike, config: CheckpointPolicy, deterministic: bool):
        self.directory = Path(directory).absolute()  # orbax writes absolute paths only
        self.config = config
        self.deterministic = deterministic  # across processes: decide by epoch count only
        self._manager = None
        self._lock = threading.Lock()
        self._last_start: float | None = None
        self._last_cost = 0.0
        self.saved_epoch: int | None = None
        self.saved_step: int | None = None  # the newest step saved (or resumed from)
        self.costs: list[float] = []  # seconds each save took, its background write included
        self.failures: list[str] = []
        # Saves are written by a thread of the store's own (`_drain`), one at a time, so the
        # caller goes on at once: at most one save in flight and one pending, the pending
        # one replaced by a newer one. Several processes save together: they write inline.
        self._background = not deterministic
        self._queue = threading.Condition()  # guards the three below
        self._pending: _Job | None = None
        self._saver: threading.Thread | None = None
        self._in_flight_since: float | None = None
        self._ended: threading.Thread | None = None  # the saver that finished last
        # The budget holds the saver's own work too (it shares the cores and Python's lock
        # with training): after a save that took c seconds it rests c * (1/budget - 1) before
        # the next, the one waiting meanwhile replaced by newer ones; not while anyone waits
        # for the writes (a reader, `wait()`, the process's end).
        self._rest_until = 0.0
        self._hurry = 0  # callers waiting for the writes
        # the checkpoints' names (`Checkpointer(name=)`): orbax's step naming, and each name
        # given in this run -> its step (those on disk read at the first name given)
        self.names = NamedSteps()
        self._given: dict[str, int] | None = None
        _OPEN.add(self)

    def _open(self, ranked: bool = True):
        """The manager. `ranked`: this run produces the metric, so orbax records it with each
        step and keeps the best k by it plus the newest; a run without it (no 'val' split for
        'val_loss') keeps the newest only."""
        if self._manager is None:
            import orbax.checkpoint as ocp
            from orbax.checkpoint import checkpoint_managers as managers

            config = self.config
            metric = config.metric
            keep: list[managers.PreservationPolicy] = [managers.LatestN(n=1)]
            ranking = {}
            if ranked:
                keep.append(
                    managers.BestN(
                        get_metric_fn=lambda m: m[metric],
                        reverse=config.mode == "min",
                        n=config.k,
                        keep_checkpoints_without_metrics=False,
                    )
                )
                ranking = {"best_fn": lambda m: m[metric], "best_mode": config.mode}
            options = ocp.CheckpointManagerOptions(
                preservation_policy=managers.AnyPreservationPolicy(keep),
                enable_async_checkpointing=True,
                cleanup_tmp_directories=True,
                todelete_subdir=DELETING,
                step_name_format=self.names,
                **ranking,
            )
            self._empty_trash()  # what a killed process was deleting
            quiet_orbax()
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_names=("state", "meta")
            )
        return self._manager

    def due(self, epoch: int, ends_in: float | None = None, hold: bool = False) -> bool:
        """Whether the epoch just committed should be saved now. A save still being written
        counts as costing at least the time since it began; none is due while one waits.
        `ends_in`: the seconds until the call's end, which saves its newest epoch; a save is
        not due mid-call where the call ends sooner than the budget would allow the next
        (its write would only slow the call's last epochs, and a newer one comes). `hold`:
        the caller's timing must not share the cores with a write (under a budget)."""
        config = self.config
        if epoch % config.every:
            return False
        if config.budget is None or self.deterministic:
            return True
        if hold:
            return False
        pending = self._pending
        if pending is not None and pending.saves:
            return False  # the last save has not even begun: a newer one would replace it
        now = time.perf_counter()
        start, cost = self._last_start, self._last_cost
        since = self._in_flight_since
        if since is not None:
            start, cost = since, max(cost, now - since)
        if start is None:
            return True
        if ends_in is not None and ends_in * config.budget < cost:
            return False
        return (now - start) * config.budget >= cost

    def save(
        self,
        step: int,
        tree: Mapping[str, Any],
        record: CheckpointRecord,
        value,
        *,
        then_close: bool = False,
        best: bool = False,
        earlier: Save | None = None,
    ) -> None:
        """Save `tree` (host arrays, the caller's own) as `step`. Returns at once: the write
        goes on in the background, after the one in flight; a save still waiting for its
        turn gives way to this newer one (with `budget=None`, this one waits for that one's
        turn instead, so every `every` epochs are saved), except a new best by the metric
        (`best`), which is written before it. `earlier`: a best epoch held since (one the
        budget did not save), written first. `then_close`: the run ends here; once written,
        the manager closes (unless another save is waiting)."""
        saves = (earlier,) if earlier is not None else ()
        for named in (*saves, Save(step, tree, record, value)):
            self.give_name(named)
        if self.saved_step is None or step >= self.saved_step:  # not a best held since
            self.saved_epoch = record.epoch
            self.saved_step = step
        self._submit(_Job((*saves, Save(step, tree, record, value, best)), then_close))

    def give_name(self, save: Save) -> None:
        """Give `save` its name (`Checkpointer(name=)`, on the caller's thread, so a hook's
        error reaches it): checked, and unique in the run. A save held to be written later
        is named as it is held, so a bad name stops the run at the epoch that gave it."""
        value = save.value
        score = float(value) if value is not None and math.isfinite(value) else None
        name = self.config.name_of(epoch=save.record.epoch, step=save.step, score=score)
        if name is None or save.step in self.names.names:
            return  # unnamed, or named already (a step saved again keeps its first name)
        if self._given is None:
            self._given = {path.name: step for step, path in named_paths(self.directory).items()}
        other = self._given.get(name)
        if other is not None and other != save.step:
            raise SetupError(
                f"Checkpointer(name=...) named the checkpoint of step {save.step} {name!r}, "
                f"the name of step {other}'s checkpoint in {str(self.directory)!r}: each "
                f"checkpoint needs a name of its own. Put the step in the name (its step= "
                f"argument, or {{step}} in a format string)"
            )
        self._given[name] = save.step
        self.names.names[save.step] = name

    def step_path(self, step: int) -> Path:
        """Where step `step`'s checkpoint is: its name's directory (or, for a step saved
        before under another name or none, the directory that holds it)."""
        name = self.names.names.get(step)
        if name is not None and (self.directory / name).is_dir():
            return self.directory / name
        return step_path(self.directory, step)

    def close_later(self) -> None:
        """Finish the writes in flight and close the manager, in the background."""
        self._submit(_Job((), True))

    def _submit(self, job: _Job) -> None:
        if not self._background:
            self._run(job)
            return
        with self._queue:
            if self.config.budget is None and job.saves:
                while self._pending is not None and self._pending.saves:
                    self._queue.wait()
            pending = self._pending
            if pending is not None:
                job = _Job(
                    _coalesced(pending.saves, job.saves), job.then_close or pending.then_close
                )
            self._pending = job
            if self._saver is None:
                _hook_exit()
                self._saver = threading.Thread(
                    target=self._drain, name=f"nitro-save {self.directory}", daemon=False
                )
                self._saver.start()

    def _drain(self) -> None:
        """The saver thread: runs the pending jobs until none is left. Not a daemon: a
        process that ends waits for its writes."""
        while True:
            with self._queue:
                while self._pending is not None and not self._hurry:
                    left = self._rest_until - time.perf_counter()
                    if left <= 0:
                        break
                    self._queue.wait(left)
                job, self._pending = self._pending, None
                self._in_flight_since = time.perf_counter() if job is not None else None
                if job is None:
                    self._saver, self._ended = None, threading.current_thread()
                self._queue.notify_all()
            if job is None:
                return
            try:
                self._run(job)
            except Exception as error:  # noqa: BLE001 - a failed save must not end the saver
                self._failed(error, job.saves[-1].step if job.saves else None)

    def _run(self, job: _Job) -> None:
        if job.saves:
            began = time.perf_counter()
            for save in job.saves:
                if self._write(*save[:4]) and self._background:
                    self._finish()  # the cost counts the background write too
            ended = time.perf_counter()
            cost = ended - began
            self._last_start, self._last_cost = began, cost
            self.costs.append(cost)
            budget = self.config.budget
            if budget is not None and self._background:
                self._rest_until = ended + cost * (1 / budget - 1)
        if job.then_close and self._pending is None:
            self._close_manager()

    def _write(self, step: int, tree: Mapping[str, Any], record: CheckpointRecord, value) -> bool:
        """Hand the save to orbax, after the previous write; False when nothing was begun."""
        import orbax.checkpoint as ocp

        tree = materialized(tree)  # a lazy snapshot's host copy, on this (the saver's) thread

        metrics = (
            {self.config.metric: float(value)}
            if value is not None and math.isfinite(value)
            else None
        )
        with self._lock:
            manager = None
            try:
                manager = self._open(ranked=metrics is not None)
                with ORBAX.held(manager):
                    if step in manager.all_steps():  # saved already (a run ending at a boundary)
                        return False
                    # save() waits for the previous save (and its deletions) anyway: wait
                    # here, so the steps it moved aside can be removed before the next ones
                    manager.wait_until_finished()
                    self._empty_trash()
                    ORBAX.started_write(manager, lambda error: self._failed(error, None))
                    name = self.names.build_name(step)
                    manager.save(
                        step,
                        args=ocp.args.Composite(
                            state=ocp.args.StandardSave(tree),
                            meta=ocp.args.JsonSave(record.to_json()),
                        ),
                        metrics=metrics,
                        force=True,
                        # a named checkpoint's step, where every reader finds it
                        custom_metadata={"step": step, "name": name},
                    )
            except Exception as error:  # noqa: BLE001 - a full disk must not end the run
                self._failed(error, step)
                self._discard()
                return False
        return True

    def _empty_trash(self) -> None:
        """Remove the steps orbax moved aside for deletion (call with no save in flight)."""
        shutil.rmtree(self.directory / DELETING, ignore_errors=True)

    def _failed(self, error: BaseException, step: int | None) -> None:
        """A save that fails (a full disk, a vanished directory) leaves the earlier
        checkpoints as they were (orbax finalizes a step only once all of it is written);
        training goes on, and the first failure is reported."""
        if not self.failures:
            warnings.warn(
                f"a checkpoint could not be saved in {self.directory} "
                f"({describe_error(error)}); the earlier checkpoints are intact and "
                f"training goes on. Free space, or move the run with run_dir=.",
                RuntimeWarning,
                stacklevel=4,
            )
        self.failures.append(f"step {step}: {describe_error(error)}")

    def _discard(self) -> None:
        """Close the manager after a failed write (call under `self._lock`): orbax keeps a
        failed write's error and raises it at every later wait, so the next save opens a
        fresh manager. The failed step's temporary directory is removed when it opens."""
        manager, self._manager = self._manager, None
        if manager is not None:
            self._shut(manager, report=False)

    def _shut(self, manager: Any, report: bool = True) -> None:
        """Finish `manager`'s writes and close it; whatever fails, it gives up the orbax
        lock's turn (a failure is reported once, as a failed save)."""
        with ORBAX.held(manager):
            try:
                manager.wait_until_finished()
            except Exception as error:  # noqa: BLE001 - a full disk must not end the run
                if report:
                    self._failed(error, None)
            finally:
                try:
                    manager.close()
                except Exception as error:  # noqa: BLE001 - the same failure, again
                    if report and not self.failures:
                        self._failed(error, None)
                finally:
                    ORBAX.closed(manager)
                    self._empty_trash()

    def _finish(self) -> None:
        """Wait for the manager's write in flight; a failure is reported as a failed save."""
        with self._lock:
            if self._manager is not None:
                try:
                    with ORBAX.held(self._manager):
                        self._manager.wait_until_finished()
                except Exception as error:  # noqa: BLE001
                    self._failed(error, None)
                    self._discard()

    def _close_manager(self) -> None:
        with self._lock:
            manager, self._manager = self._manager, None
        if manager is not None:
            self._shut(manager)

    def wait(self) -> None:
        """Wait until every save begun is on disk (or has failed, with its warning). Call
        with no orbax or store lock held: the saver thread needs them."""
        with self._queue:
            self._hurry += 1
            self._queue.notify_all()  # a resting saver writes what waits at once
            try:
                while self._saver is not None:
                    self._queue.wait()
            finally:
                self._hurry -= 1
            ended, self._ended = self._ended, None
        if ended is not None and ended is not threading.current_thread():
            ended.join()  # it has nothing left to do: its end is a moment away
        self._finish()

    def close(self) -> None:
        """Finish the saves and close the manager (a later save opens it again)."""
        self.wait()
        self._close_manager()

    def abandon_after(self, step: int, into: Path) -> list[int]:
        """Move the saved steps after `step` (a branch a rewind left) into the directory
        `into`, out of the checkpoints orbax lists, once the writes in flight are done: the
        run's later saves and its resume see the branch it goes on with, and nothing is
        deleted. Returns the steps moved."""
        self.close()
        moved = []
        for saved, child in sorted(named_paths(self.directory).items()):
            if saved > step:
                into.mkdir(parents=True, exist_ok=True)
                os.replace(child, into / child.name)  # one rename: a checkpoint moves whole
                moved.append(saved)
                self.names.names.pop(saved, None)
                if self._given is not None:  # the run's later checkpoints may reuse its name
                    self._given.pop(child.name, None)
        if self.saved_step is not None and self.saved_step > step:
            self.saved_step = self.saved_epoch = None
        return sorted(moved)

    def record_reason(self, step: int, reason: str) -> bool:
        """Record in saved step `step`'s JSON record why the run ended there (`stop_reason`),
        for a run stopped at an epoch boundary after that epoch was saved (call after
        `close()`). The record is replaced whole (a new file renamed over it), so a reader
        sees the old record or the new one; False where it is not there to update, or says
        why already."""
        path = self.step_path(step) / "meta" / "metadata"  # orbax's JSON item file
        try:
            meta = json.loads(path.read_text())
            if not isinstance(meta, dict) or meta.get("step") != step or meta.get("stop_reason"):
                return False  # not that step's record, or one that says why already
            meta["stop_reason"] = reason
            partial = path.with_name(f".metadata-{os.getpid()}.tmp")
            partial.write_text(json.dumps(meta))
            os.replace(partial, path)
        except (OSError, ValueError):
            return False  # the record stays as saved, a readable checkpoint
        return True


class Save(NamedTuple):
    """One save: the state `tree` of `step`, its JSON record and its metric's `value`;
    `best`: a new best by the metric when it was taken (a newer save never replaces it)."""

    step: int
    tree: Mapping[str, Any]
    record: CheckpointRecord
    value: Any
    best: bool = False


class _Job(NamedTuple):
    """What the saver does next: the saves, oldest first (none: only close), then whether
    to close the manager."""

    saves: tuple[Save, ...]
    then_close: bool


def _coalesced(waiting: tuple[Save, ...], newer: tuple[Save, ...]) -> tuple[Save, ...]:
    """The saves of a job that takes the place of a waiting one: its own, after the waiting
    job's newest best unless it brings a best of its own (a newer best is a better one); the
    waiting job's other saves give way. A job with no saves (a close) keeps the waiting
    saves."""
    if not newer:
        return waiting
    if any(save.best for save in newer):
        return newer
    bests = [save for save in waiting if save.best]
    return (*bests[-1:], *newer)


def await_writers(path: str | os.PathLike) -> None:
    """Wait for this process's saves in flight that a reader of `path` (a checkpoints
    directory, its run directory or one of its steps) would see: the first one creates the
    directory."""
    where = os.path.realpath(path)
    for store in list(_OPEN):
        directory = os.path.realpath(store.directory)
        if where in (directory, os.path.dirname(directory)) or where.startswith(directory + os.sep):
            store.wait()


def _from_orbax(record: logging.LogRecord) -> bool:
    if "orbax" in record.pathname:
        return True
    trace = record.exc_info[2] if record.exc_info else None
    while trace is not None:
        if "orbax" in trace.tb_frame.f_code.co_filename:
            return True
        trace = trace.tb_next
    return False


def _quiet_failed_writes(record: logging.LogRecord) -> bool:
    """Drop orbax's own reports of a failed write (its errors, with tracebacks, logged by
    every thread that waits for the write, and asyncio's "exception was never retrieved"
    for each array it could not write): the store reports each failure as one warning."""
    return not (record.levelno >= logging.ERROR and _from_orbax(record))


_QUIETED = threading.Lock()


def quiet_orbax() -> None:
    """Install the filters for orbax's failure reports, once per process."""
    with _QUIETED:
        if getattr(sys.unraisablehook, "nitro_quiet", False):
            return
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addFilter(_quiet_failed_writes)
        sys.unraisablehook = _late_reads_quiet(sys.unraisablehook)


def quiet_read_only(record: logging.LogRecord) -> bool:
    """Drop the warning orbax logs for every read-only manager ("Given directory is read
    only"): reading checkpoints is routine here, not something to warn about. Installed only
    while a reader is built, under the orbax lock."""
    return not (record.levelno == logging.WARNING and record.module == "checkpoint_manager")


def _late_reads_quiet(hook: Any) -> Any:
    """`sys.unraisablehook` less the reports of a failed restore's other reads: tensorstore
    completes them after orbax closed its event loop, and each would print a traceback
    ("Event loop is closed") for a failure already reported once."""

    def quiet(report: Any) -> None:
        error = report.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        hook(report)

    quiet.nitro_quiet = True  # pyright: ignore[reportFunctionMemberAccess]
    return quiet


def describe_error(error: BaseException) -> str:
    """An error in one line, for a warning naming a damaged checkpoint."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}".rstrip(": ")
