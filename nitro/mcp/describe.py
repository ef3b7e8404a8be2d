"""What `nitro_status` and `nitro_runs` say about a run or a population (a run of many
members), from the handle's public API: one row, with a population's members in it.

A row names the run two ways: `run_id`, the id the tools know it by (a tool run's 8 hex
digits, or a notebook variable's name), and `handle_run_id`, the handle's own `n.run_id`
(a sortable timestamp plus 4 hex digits, the name of its run directory). They differ because
a tool answers its id before the handle exists, one handle serves several tool runs (training,
continuing, validating, exporting), and a resumed handle takes the id of the run it resumes.

>>> import nitro
>>> from nitro.examples.digits import Digits
>>> n = nitro.Nitro(Digits(max_epochs=1), progress=False).train()   # a notebook's run
>>> row = describe("n", None, n, names=["n"])
>>> row["run_id"], row["status"], row["handle_run_id"] == n.run_id
('n', 'done', True)
>>> pop = nitro.Population(Digits(max_epochs=1), seed=[0, 1], progress=False).train()
>>> row = describe("pop", None, pop, names=["pop"], brief=True)
>>> row["population"], row["members"], row["axes"], row["status"], row["epoch"]
(True, 2, {'seed': [0, 1]}, 'done', 1)
"""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np

from nitro.handle.handle import Nitro
from nitro.handle.population import Population
from nitro.mcp.convert import jsonable
from nitro.mcp.members import axes_of, member_rows
from nitro.mcp.registry import RunRecord, RunStatus

__all__ = ["LatestSteps", "describe", "error_text", "latest_steps"]

# A handle's (or population's) latest stop_reason -> the status of a run the person started.
_STATUS = {
    None: "ready",
    "completed": "done",
    "early_stop": "done",
    "requested": "stopped",
    "error": "failed",
}


class LatestSteps:
    """A reporter keeping what a run's history does not hold yet (it has whole epochs only):
    the latest step and its loss, one per member of a population (a member that had stopped
    keeps its last), and the run's latest notes (compiles, a member stopped, a diverged
    step)."""

    def __init__(self, notes: int = 10) -> None:
        self.latest_step: int | None = None
        self.losses: list[float | None] = []
        self.notes: collections.deque[str] = collections.deque(maxlen=notes)

    def step(self, step: int, loss: float) -> None:
        self.latest_step, self.losses = step, [loss]

    def member_steps(self, first: int, losses: Any) -> None:
        values = np.asarray(losses, dtype=np.float64)
        latest = list(self.losses) + [None] * (values.shape[0] - len(self.losses))
        for i, row in enumerate(values):
            finite = row[np.isfinite(row)]  # NaN: the member had stopped
            if finite.size:
                latest[i] = float(finite[-1])
        self.losses, self.latest_step = latest, first + values.shape[1] - 1

    def note(self, message: str, done: bool = False) -> None:
        self.notes.append(message)


def latest_steps(run: Nitro | Population, create: bool = False) -> LatestSteps | None:
    """The `LatestSteps` on `run`'s event path; with `create`, added when there is none."""
    for reporter in run.events.reporters:
        if isinstance(reporter, LatestSteps):
            return reporter
    if not create:
        return None
    recorder = LatestSteps()
    run.events.add(recorder)
    return recorder


def error_text(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _loggers(handle: Nitro) -> list[str] | None:
    logger = handle.logger
    return None if logger is None else [type(lg).__name__ for lg in logger.loggers]


def identity(record: RunRecord | None, run: Nitro | Population | None) -> dict[str, Any]:
    """A run's `kind`, `experiment`, `status` and `started_by`: a tool run's from its
    `record`, else a notebook's (a handle or a population) from `run` itself."""
    if record is not None:
        running = record.status is RunStatus.RUNNING or (run is not None and run.running)
        return {
            "kind": record.kind,
            "experiment": record.experiment,
            "status": "running" if running else record.status.value,
            "started_by": "agent",
        }
    assert run is not None  # a run without a record is a notebook's
    return {
        "kind": "notebook",
        "experiment": run.cls.__qualname__,
        "status": "running" if run.running else _STATUS.get(run.stop_reason, "done"),
        "started_by": "notebook",
    }


def tool_outcome(record: RunRecord) -> dict[str, Any]:
    """A tool run's result, error, source and seconds (so far, while it runs)."""
    return {
        "result": jsonable(record.result),
        "error": record.error,
        "source": record.source,
        "seconds": round((record.finished or time.time()) - record.started, 3),
    }


def describe(
    run_id: str,
    record: RunRecord | None,
    run: Nitro | Population | None,
    names: list[str],
    brief: bool = False,
) -> dict[str, Any]:
    """The row of a run or a population: identity, status and progress; unless `brief`, its
    metrics (a population's: each member's), files, notes, result and error too. `run` is
    None while a tool run sets it up."""
    row: dict[str, Any] = {"run_id": run_id, **identity(record, run)}
    population = isinstance(run, Population) or (
        run is None and record is not None and record.kind == "population"
    )
    recorder = None if run is None else latest_steps(run)
    if run is None:
        row.update(handle_run_id=None, phase="setup", epoch=0, step=0)
    else:
        row.update(
            handle_run_id=run.run_id,
            preset=run.preset,
            phase=run.phase,
            epoch=run.epoch,
            max_epochs=run.max_epochs,
            target_epoch=run.target_epoch,
            step=run.step,
        )
    if isinstance(run, Population):
        losses = _member_losses(run, recorder)
        row.update(population=True, members=len(run), axes=axes_of(run.members), losses=losses)
    elif population:
        row.update(
            population=True, members=record.members if record else None, axes=None, losses=None
        )
    else:
        loss = None if run is None else run.last_metrics.get("loss")
        if recorder is not None and recorder.latest_step is not None:
            loss = recorder.losses[0]
        row["loss"] = jsonable(loss)
    if brief:
        return row
    if run is not None:
        row.update(running=run.running, stop_reason=run.stop_reason, run_dir=run.run_dir)
    if isinstance(run, Population):
        _, ranked = run.ranking("val_loss", "min")
        best, value = ranked[0] if ranked else (None, None)
        row.update(
            stopped=sorted(run.stopped),
            best={"metric": "val_loss", "member": best, "value": value},
            steps_per_call=run.steps_per_call,
            member_status=member_rows(run, row["losses"]),
        )
    elif run is not None:
        metrics = {k: v for k, v in run.last_metrics.items() if k not in ("epoch", "step")}
        row.update(
            metrics=jsonable(metrics),
            weights_origin=run.weights_origin,
            weights_checkpoint=jsonable(run.weights_checkpoint),
            logger=_loggers(run),
        )
    if run is not None:
        row.update(names=names, notes=[] if recorder is None else list(recorder.notes))
    if record is not None:
        row.update(tool_outcome(record))
    else:
        row["error"] = error_text(getattr(run, "error", None))
    return row


def _member_losses(population: Population, recorder: LatestSteps | None) -> list[Any]:
    """Each member's latest loss: the latest step's, read back by the reporter, else the
    latest epoch's."""
    read = [] if recorder is None else recorder.losses
    rows = population.last_metrics
    losses = [read[m] if m < len(read) else rows[m].get("loss") for m in range(len(population))]
    return jsonable(losses)
