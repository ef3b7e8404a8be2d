"""`LoggingReporter`: a run's events, as logger calls.

It is a reporter of the event path (`nitro.events`), and it reads the handle through its
public API only:

| event | logger calls |
|---|---|
| `start_run(handle, target)` | `bind_run(run_dir, run_id)` (once per run directory), `log_params(run_params(handle))`, `log_tags`, `log_other("binding_report", text)`, `flush()` |
| `step(step, loss)` | `log_metrics({"loss": loss}, context="train")`, the epoch under way, the step |
| `end_epoch(row)` | "train": the epoch's mean loss and train metrics as `epoch_<name>`, and `epoch_seconds`, `host_ms`, `device_ms`; "validate": the `val_*` entries (and those of every split of `eval_splits`, `test_*` ...); "data": `data_wait_frac`; all at the row's epoch and step |
| `end_run(handle)` | `finish(status)`: the stop reason, one of `FINISH_STATUSES` |
| `phase(name)`, to a phase other than training, validating and checkpointing | `flush()` (the end of a `validate()`, say) |

Non-finite values never reach a logger: a NaN loss (with `check_divergence=False`) writes no
train line, and non-finite or non-scalar row entries are left out. The logger is wrapped in
a `LoggerGroup`, so a logger that raises is switched off with one warning naming it, and the
run goes on.

```python
n = nitro.Nitro(exp, progress=LoggingReporter(JSONLinesLogger()))
n.events.add(LoggingReporter([JSONLinesLogger(), TensorBoardLogger()]))
```
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nitro.errors import SetupError
from nitro.experiments.declaration import FieldKind, field_specs
from nitro.loggers.protocol import (
    FINISH_STATUSES,
    LoggerGroup,
    as_logger,
    finite_metrics,
    plain_value,
)

__all__ = ["LoggingReporter", "finish_status", "run_params"]

# run keywords that are objects of the session, not parameters of the run
_NOT_PARAMETERS = ("progress", "logger", "checkpointer", "early_stop", "preemption")
# the phases of a run under way; any other phase is a pause, where the loggers flush
_BUSY_PHASES = frozenset(("training", "validating", "checkpointing"))


def finish_status(stop_reason: str | None) -> str:
    """The `finish` status for a handle's `stop_reason`: "completed", "early_stop" and
    "requested" as they are; "max_steps" (trained to it): "completed"; "error", None (the run
    never said) and anything else: "error"."""
    if stop_reason == "max_steps":
        return "completed"
    return stop_reason if stop_reason in FINISH_STATUSES else "error"


def run_params(handle: Any) -> dict[str, Any]:
    """The parameters of a run as a flat table: the preset the experiment was built from
    (when it was), every field of the experiment (Device fields at their current value), the
    seed, the run keywords (schedules as `schedules.<key>`), the optimizer with its initial
    hyperparameters, and the parameter count. `handle`: what holds the run's `setup` and
    `runtime` (a `Nitro`, or a member of a population)."""
    params: dict[str, Any] = {}
    setup, runtime = handle.setup, handle.runtime
    if setup.experiment.preset is not None:
        params["preset"] = setup.experiment.preset
    experiment = runtime.experiment
    for spec in field_specs(experiment):
        if spec.kind is FieldKind.DEVICE:
            value = runtime.feed.device_value(spec.name)
        else:
            value = getattr(experiment, spec.name)
        params[spec.name] = plain_value(value)
    for name, resolved in setup.keywords.items():
        if name in _NOT_PARAMETERS or name in ("schedules", "optimizer"):
            continue
        params[name] = plain_value(resolved.value)
    params["seed"] = setup.seed
    for schedule in setup.schedules:
        params[f"schedules.{schedule.key}"] = schedule.qualified
    optimizer = setup.optimizer
    if optimizer is not None:
        params["optimizer"] = optimizer.description
        for name, value in optimizer.hyperparams.items():
            # in the dtype the step is fed (float32 0.9 shows as 0.9)
            value = np.asarray(value, optimizer.dtypes.get(name))[()]
            params[f"optimizer.{name}"] = plain_value(value)
    params["param_count"] = setup.model.param_count
    return params


def _split_row(
    row: Mapping[str, Any], evaluated: tuple[str, ...] = ("val",)
) -> dict[str, dict[str, Any]]:
    """A history row's entries by context (see the module docstring); `evaluated`: the
    splits evaluated at the epochs' ends (`eval_splits`), whose entries are "validate"."""
    prefixes = tuple(f"{split}_" for split in ("val", *evaluated))
    parts: dict[str, dict[str, Any]] = {"train": {}, "validate": {}, "data": {}}
    for name, value in row.items():
        if name in ("epoch", "step"):
            continue
        if name == "data_wait_frac":
            parts["data"][name] = value
        elif name.startswith(prefixes):
            parts["validate"][name] = value
        elif name in ("epoch_seconds", "host_ms", "device_ms"):
            parts["train"][name] = value
        else:
            parts["train"][f"epoch_{name}"] = value
    return parts


class LoggingReporter:
    """Sends a run's events to a logger, a list of loggers or a `LoggerGroup`.

    >>> import nitro
    >>> from nitro.examples.digits import Digits
    >>> from nitro.loggers import JSONLinesLogger
    >>> reporter = LoggingReporter(JSONLinesLogger())
    >>> nitro.Nitro(Digits(max_epochs=1), progress=reporter).train().step
    9
    """

    def __init__(self, logger: Any):
        logger = as_logger(logger)
        if logger is None:
            raise TypeError("LoggingReporter needs a logger (or a list of loggers), not None")
        self.logger: LoggerGroup = (
            logger if isinstance(logger, LoggerGroup) else LoggerGroup([logger])
        )
        self._bound: tuple[str, str | None] | None = None
        self._described: dict[str, Any] = {}  # what start_run logged last for this run
        self._epoch: int | None = None
        self._evaluated: tuple[str, ...] = ("val",)
        self._log_metrics = self.logger.log_metrics

    def __repr__(self) -> str:
        loggers = self.logger.loggers
        return f"LoggingReporter({loggers[0] if len(loggers) == 1 else list(loggers)!r})"

    def start_run(self, handle: Any, target_epoch: int) -> None:
        logger = self.logger
        logger.reset()
        binding = (os.fspath(handle.run_dir), getattr(handle, "run_id", None))
        if binding != self._bound:
            logger.bind_run(*binding)
            self._bound, self._described = binding, {}
        # what describes the run, logged by its first call and again only when it changed
        # (a short call on a live handle does not write a kilobyte of the same report again)
        preset = handle.setup.experiment.preset
        described = {
            "params": run_params(handle),
            # a population's member adds its own (population, member, settings)
            "tags": {
                "experiment": handle.setup.owner,
                **({"preset": preset} if preset is not None else {}),
                **getattr(handle, "logger_tags", {}),
            },
            "binding_report": str(handle.binding_report()),
        }
        changed = {k: v for k, v in described.items() if self._described.get(k) != v}
        self._described = described
        if "params" in changed:
            logger.log_params(changed["params"])
        if "tags" in changed:
            logger.log_tags(changed["tags"])
        if "binding_report" in changed:
            logger.log_other("binding_report", changed["binding_report"])
        if changed:
            logger.flush()  # on disk before the first compile
        self._epoch = handle.epoch + 1
        self._evaluated = tuple(handle.setup.eval_splits)

    def start_epoch(self, epoch: int, target_epoch: int, batches: int | None, start: int) -> None:
        self._epoch = epoch + 1  # the epoch under way, as its history row will number it

    def step(self, step: int, loss: float) -> None:
        if math.isfinite(loss):
            self._log_metrics({"loss": loss}, step=step, epoch=self._epoch, context="train")

    def steps(self, first: int, losses: Sequence[float]) -> None:
        """A call's steps at once: their finite losses to the loggers in one go."""
        steps = [first + i for i, loss in enumerate(losses) if math.isfinite(loss)]
        if len(steps) != len(losses):
            losses = [loss for loss in losses if math.isfinite(loss)]
        if steps:
            self.logger.log_steps("loss", steps, losses, epoch=self._epoch, context="train")

    def end_epoch(self, row: Mapping[str, Any]) -> None:
        epoch, step = row.get("epoch"), row.get("step")
        for context, values in _split_row(row, self._evaluated).items():
            values = finite_metrics(values)
            if values:
                self._log_metrics(values, step=step, epoch=epoch, context=context)

    def validated(self, row: Mapping[str, Any]) -> None:
        values = finite_metrics({k: v for k, v in row.items() if k not in ("epoch", "step")})
        if values:
            self._log_metrics(
                values, step=row.get("step"), epoch=row.get("epoch"), context="validate"
            )

    def swapped(self, row: Mapping[str, Any]) -> None:
        """A live edit's swap (or roll-back): logged under `live_edit/step_N`, so each
        backend's record says which code ran from which step."""
        self.logger.log_other(f"live_edit/step_{row.get('step')}", dict(row))
        self.logger.flush()

    def rewound(self, row: Mapping[str, Any]) -> None:
        """A rewind (or a spike's roll-back): logged under `rewind/step_N` (N the step it
        left), so each backend's record marks the steps after `row["step"]` as abandoned."""
        marker = {k: v for k, v in row.items() if k not in ("history", "validations")}
        self.logger.log_other(f"rewind/step_{row.get('from_step')}", marker)
        self.logger.flush()

    def phase(self, phase: str) -> None:
        if phase not in _BUSY_PHASES:
            self.logger.flush()

    def end_run(self, handle: Any) -> None:
        self.logger.finish(finish_status(handle.stop_reason))

    def reattach(self, saved: Any) -> None:
        """Continue the logger runs a resumed checkpoint recorded (`saved`: its loggers'
        `state()`; None: nothing to continue); refused, naming the fix, when they cannot."""
        if saved is None:
            return
        try:
            self.logger.reattach(saved)
        except (TypeError, ValueError) as error:
            raise SetupError(
                f"cannot resume into this logger: {error}. Resume with the logger the run "
                f"was started with (its checkpoint recorded {saved!r}), or logger=None"
            ) from None
