"""The runs that agent tools started: run id -> handle, kind, status, result or error text.

Each run is a piece of work on its own thread (`start`): set up and train a handle (a
`nitro.Nitro`, or a `nitro.Population`: a run of many members), validate, evaluate or export. The registry records what the work returned or the error it raised, so
an agent can poll it. At most `max_finished` finished runs are kept (the oldest go first);
running ones are never dropped. Every method may be called from any thread.

This module needs nothing beyond the engine, so the notebook layer lists the registry's handles
without the MCP SDK installed.

>>> registry = RunRegistry()
>>> record = registry.start("validate", lambda record: {"val_loss": 0.25}, experiment="Toy")
>>> registry.wait(record.run_id, timeout=5).result
{'val_loss': 0.25}
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from nitro.handle.population import Population

__all__ = ["MAX_FINISHED_RUNS", "RUNS", "RunRecord", "RunRegistry", "RunStatus"]

MAX_FINISHED_RUNS = 20


class RunStatus(enum.StrEnum):
    RUNNING = "running"
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclasses.dataclass
class RunRecord:
    """One run: `handle` (a `nitro.Nitro` or a `nitro.Population`) is None until the work
    has built it (a training run sets up first)."""

    run_id: str
    kind: str  # "train", "validate", "evaluate", "export", "population" or "member"
    experiment: str
    handle: Any = None
    source: str | None = None  # the run whose handle this work used, if any
    status: RunStatus = RunStatus.RUNNING
    result: Any = None
    error: str | None = None
    started: float = dataclasses.field(default_factory=time.time)
    finished: float | None = None
    stop_requested: bool = False
    done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)
    # a population still setting up: its member count, and the members nitro_stop asked to
    # stop meanwhile (stopped before its first step); `setting_up` guards both with `handle`
    members: int | None = None
    queued_stops: list[int] = dataclasses.field(default_factory=list)
    setting_up: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)


class RunRegistry:
    """Run id -> `RunRecord`, for the runs agent tools start."""

    def __init__(self, max_finished: int = MAX_FINISHED_RUNS):
        self.max_finished = max_finished
        self._records: dict[str, RunRecord] = {}
        # guards `_records` and each record's status fields; never held while work runs
        self._lock = threading.Lock()

    def start(
        self,
        kind: str,
        work: Callable[[RunRecord], Any],
        *,
        experiment: str,
        handle: Any = None,
        source: str | None = None,
        before: Callable[[], None] | None = None,
        members: int | None = None,
    ) -> RunRecord:
        """Record a new run and call `work(record)` on a thread; returns the record at once.

        `work` returns the run's result (plain data) or raises; it may set `record.handle`.
        A training run's status (a population's too) comes from its `stop_reason` when the
        work returns.
        `before` runs first on the new thread (a notebook routes the thread's output with it).
        `members`: a population's member count, known before it is built.
        """
        with self._lock:
            run_id = secrets.token_hex(4)
            while run_id in self._records:
                run_id = secrets.token_hex(4)
            record = RunRecord(
                run_id,
                kind,
                experiment,
                handle=handle,
                source=source,
                members=members,
            )
            self._records[run_id] = record
            self._trim()
        thread = threading.Thread(
            target=self._main, args=(record, work, before), name=f"nitro-{kind}-{run_id}"
        )
        thread.daemon = True
        thread.start()
        return record

    def _main(self, record: RunRecord, work, before) -> None:
        result, error, status = None, None, RunStatus.DONE
        try:
            if before is not None:
                before()
            result = work(record)
            if record.kind in ("train", "population") and _stopped(record):
                status = RunStatus.STOPPED
        except BaseException as exc:  # noqa: BLE001 - recorded for the agent to read
            error, status = f"{type(exc).__name__}: {exc}", RunStatus.FAILED
        with self._lock:
            record.result, record.error, record.status = result, error, status
            record.finished = time.time()
            self._trim()
        record.done.set()

    def _trim(self) -> None:
        finished = [r for r in self._records.values() if r.status is not RunStatus.RUNNING]
        finished.sort(key=lambda r: r.finished or 0.0)
        for record in finished[: max(0, len(finished) - self.max_finished)]:
            del self._records[record.run_id]

    def get(self, run_id: str) -> RunRecord | None:
        with self._lock:
            return self._records.get(run_id)

    def records(self) -> list[RunRecord]:
        """Every kept run, oldest first."""
        with self._lock:
            return list(self._records.values())

    def handles(self) -> dict[str, Any]:
        """Run id -> handle for every kept run that has built one (several runs may share a
        handle: a validation of a training run uses the training run's handle); populations
        are left out."""
        with self._lock:
            records = self._records.values()
            return {r.run_id: r.handle for r in records if _single(r.handle)}

    def wait(self, run_id: str, timeout: float | None = None) -> RunRecord:
        """Wait until the run finishes or `timeout` seconds pass; returns its record."""
        record = self.get(run_id)
        if record is None:
            raise KeyError(f"no run {run_id!r}")
        record.done.wait(timeout)
        return record


def _single(handle: Any) -> bool:
    return handle is not None and not isinstance(handle, Population)


def _stopped(record: RunRecord) -> bool:
    run = record.handle
    if run is None:  # stopped while it was setting up
        return record.stop_requested
    return run.stop_reason == "requested"


# The runs of this process: the stdio server and the notebook's server share it, so runs
# outlive a `%nitro mcp stop` and `%nitro runs` lists them.
RUNS = RunRegistry()
