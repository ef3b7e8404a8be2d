"""What `nitro_status` and `nitro_runs` say about a run, from the handle's public API.

A row names the run two ways: `run_id`, the id the tools know it by (a tool run's 8 hex
digits, or a notebook variable's name), and `handle_run_id`, the handle's own `n.run_id`
(a sortable timestamp plus 4 hex digits, the name of its run directory). They differ because
a tool answers its id before the handle exists, one handle serves several tool runs (training,
continuing, validating, exporting), and a resumed handle takes the id of the run it resumes.

>>> import nitro
>>> from nitro.examples.digits import Digits
>>> n = nitro.Nitro(Digits(max_epochs=1), progress=False).train()   # a notebook's run
>>> row = describe_run("n", None, n, names=["n"])
>>> row["run_id"], row["status"], row["handle_run_id"] == n.run_id
('n', 'done', True)
"""

from __future__ import annotations

import time
from typing import Any

from nitro.handle.handle import Nitro
from nitro.handle.population import Population
from nitro.mcp.convert import jsonable
from nitro.mcp.registry import RunRecord, RunStatus

__all__ = ["LatestStep", "describe_run", "error_text", "latest_step"]

# A handle's (or population's) latest stop_reason -> the status of a run the person started.
_STATUS = {
    None: "ready",
    "completed": "done",
    "early_stop": "done",
    "requested": "stopped",
    "error": "failed",
}


class LatestStep:
    """A reporter keeping a run's latest step and loss: the history has whole epochs only, so
    a status in the middle of an epoch reads the current loss here."""

    def __init__(self) -> None:
        self.latest_step: int | None = None
        self.latest_loss: float | None = None

    def step(self, step: int, loss: float) -> None:
        self.latest_step, self.latest_loss = step, loss


def latest_step(handle: Nitro, create: bool = False) -> LatestStep | None:
    """The `LatestStep` on `handle`'s event path; with `create`, added when there is none."""
    for reporter in handle.events.reporters:
        if isinstance(reporter, LatestStep):
            return reporter
    if not create:
        return None
    recorder = LatestStep()
    handle.events.add(recorder)
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


def describe_run(
    run_id: str,
    record: RunRecord | None,
    handle: Nitro | None,
    names: list[str],
    brief: bool = False,
) -> dict[str, Any]:
    """The run's row: identity, status and progress; unless `brief`, its metrics, files,
    weights, result and error too."""
    row: dict[str, Any] = {"run_id": run_id, **identity(record, handle)}
    if handle is None:
        row.update(handle_run_id=None, phase="setup", epoch=0, step=0, loss=None)
    else:
        loss = handle.last_metrics.get("loss")
        recorder = latest_step(handle)
        if recorder is not None and recorder.latest_step is not None:
            loss = recorder.latest_loss
        row.update(
            handle_run_id=handle.run_id,
            phase=handle.phase,
            epoch=handle.epoch,
            max_epochs=handle.max_epochs,
            step=handle.step,
            loss=jsonable(loss),
        )
    if brief:
        return row
    if handle is not None:
        metrics = {k: v for k, v in handle.last_metrics.items() if k not in ("epoch", "step")}
        row.update(
            running=handle.running,
            stop_reason=handle.stop_reason,
            metrics=jsonable(metrics),
            run_dir=handle.run_dir,
            weights_origin=handle.weights_origin,
            weights_checkpoint=jsonable(handle.weights_checkpoint),
            logger=_loggers(handle),
            names=names,
        )
    if record is not None:
        row.update(tool_outcome(record))
    else:
        assert handle is not None  # a run without a record is a notebook's handle
        row["error"] = error_text(handle.error)
    return row
