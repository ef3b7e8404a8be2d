"""A population's loggers: one logger run per member, each the single run's
(`LoggingReporter`) bound to the member's directory, reading the member as it reads a run's
handle. See docs/population.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nitro.errors import PopulationError
from nitro.handle.binding_report import binding_report
from nitro.loggers import (
    CSVLogger,
    JSONLinesLogger,
    LoggerGroup,
    LoggingReporter,
    MLflowLogger,
    TensorBoardLogger,
    WandbLogger,
    as_logger,
)
from nitro.loggers.protocol import plain_value
from nitro.runs.run_dirs import member_dir, member_run_id
from nitro.runs.run_files import PopulationFiles

__all__ = ["MemberLogging", "member_loggers"]

_DEFAULT = object()  # logger= not given: JSON Lines per member, as a single run


def member_loggers(spec: Any, count: int, run_id: str) -> list[LoggerGroup] | None:
    """What `logger=` of a population gives each member: not given, `JSONLinesLogger()` (as
    a single run); None, nothing; a function, what it returns for the member's index (a
    logger class is called with no argument); Nitro's own loggers (one, or a list), a copy
    of each per member, writing in the member's directory (one MLflow or W&B run each)."""
    if spec is None:
        return None
    if spec is _DEFAULT:
        return [LoggerGroup([JSONLinesLogger()]) for _ in range(count)]
    made: list[Any]
    if isinstance(spec, type):
        made = [spec() for _ in range(count)]
    elif callable(spec) and not hasattr(spec, "log_metrics"):
        made = [spec(i) for i in range(count)]
    else:
        given = as_logger(spec)  # refuses an object that is not a logger, naming what it lacks
        loggers = given.loggers if isinstance(given, LoggerGroup) else (given,)
        made = [[_member_copy(lg, i, run_id) for lg in loggers] for i in range(count)]
    groups = []
    for logger in made:
        group = as_logger(logger)  # None: this member logs nothing
        groups.append(group if isinstance(group, LoggerGroup) else LoggerGroup([group]))
    return groups


def _member_copy(logger: Any, index: int, run_id: str) -> Any:
    """A logger like `logger`, for member `index`: a new one of its type and settings."""
    if isinstance(logger, (JSONLinesLogger, CSVLogger)):
        if logger.path is not None:
            raise PopulationError(
                f"logger={logger!r}: a population writes one file per member, in "
                f"member-<i>/ of its run directory; give {type(logger).__name__}() without a "
                f"path, or logger=lambda i: {type(logger).__name__}(f'...-{{i}}') for one "
                f"path per member"
            )
        return type(logger)()
    if isinstance(logger, TensorBoardLogger):
        logdir = logger.logdir
        return TensorBoardLogger(
            os.path.join(logdir, f"member-{index}") if logdir is not None else None,
            flush_secs=logger.flush_secs,
        )
    if isinstance(logger, MLflowLogger):
        return MLflowLogger(
            logger._uri,
            experiment=logger.experiment,
            run_name=f"{logger.run_name}-member-{index}" if logger.run_name else None,
            tags=logger.extra_tags,
            flush_secs=logger.flush_secs,
            timeout=logger.timeout,
        )
    if isinstance(logger, WandbLogger):
        options = dict(logger.options)
        if options.get("name"):
            options["name"] = f"{options['name']}-member-{index}"
        options["group"] = options.get("group") or run_id  # the population's runs together
        return WandbLogger(logger.project, dir=logger._dir, timeout=logger.timeout, **options)
    raise PopulationError(
        f"logger={logger!r}: a population gives each member a logger run of its own, and "
        f"{type(logger).__qualname__} is not one of Nitro's loggers, which it copies per "
        f"member; pass logger=lambda i: {type(logger).__qualname__}(...), called once per "
        f"member with its index"
    )


class _MemberView:
    """What a `LoggingReporter` reads of its handle, for one member of a population: the
    member's setup and run-time record, and where it stands in the population's run."""

    def __init__(self, files: PopulationFiles, member: Any, population: Any):
        self._files, self._member, self._population = files, member, population
        self.setup, self.runtime = member.setup, member.runtime

    @property
    def run_dir(self) -> str:
        return str(member_dir(self._files.run_dir, self._member.index))

    @property
    def run_id(self) -> str:
        return member_run_id(self._files.run_id, self._member.index)

    @property
    def logger_tags(self) -> dict[str, str]:
        settings = {k: str(plain_value(v)) for k, v in self._member.settings.items()}
        return {"population": self._files.run_id, "member": str(self._member.index)} | settings

    @property
    def epoch(self) -> int:
        member = self._member  # a stopped member's epoch stays where it stopped
        return self._population.epoch if member.stopped is None else member.state.epoch

    @property
    def stop_reason(self) -> str | None:
        stopped = self._member.stopped
        if stopped is None:
            return self._population.stop_reason
        if stopped.startswith("diverged"):
            return "error"
        return "early_stop" if stopped.startswith("early stop") else "requested"

    def binding_report(self):
        member = self._member
        step = self._population.step if member.stopped is None else member.stopped_at
        return binding_report(member.setup, member.runtime, step, self.run_dir, self.run_id)


class MemberLogging:
    """A reporter of the population's events: each member's logger run, through a
    `LoggingReporter` of its own (its steps' losses, its history rows, its end)."""

    def __init__(self, reporters: Sequence[LoggingReporter], views: Sequence[_MemberView]):
        self.reporters = list(reporters)
        self.views = list(views)

    @classmethod
    def of(
        cls, population: Any, members: Sequence[Any], files: PopulationFiles, logger: Any = _DEFAULT
    ) -> MemberLogging | None:
        """The members' logger runs `logger=` gives (`member_loggers`); None for none."""
        groups = member_loggers(logger, len(members), files.run_id)
        if groups is None:
            return None
        views = [_MemberView(files, m, population) for m in members]
        return cls([LoggingReporter(group) for group in groups], views)

    def start_run(self, population: Any, target_epoch: int) -> None:
        for reporter, view in zip(self.reporters, self.views, strict=True):
            reporter.start_run(view, target_epoch)

    def start_epoch(self, epoch: int, target_epoch: int, batches: int | None, start: int) -> None:
        for reporter in self.reporters:
            reporter.start_epoch(epoch, target_epoch, batches, start)

    def member_steps(self, first: int, losses: Any) -> None:
        for reporter, row in zip(self.reporters, np.asarray(losses), strict=True):
            reporter.steps(first, row.tolist())

    def member_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for row in rows:  # the members that trained this epoch (a stopped one's ended)
            index = int(row["member"])
            history = self.views[index]._member.state.history
            if history:
                self.reporters[index].end_epoch(history[-1])

    def member_validated(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for row in rows:  # the members that train (a stopped one has no validation after)
            self.reporters[int(row["member"])].validated(
                {k: v for k, v in row.items() if k != "member"}
            )

    def phase(self, phase: str) -> None:
        for reporter in self.reporters:
            reporter.phase(phase)

    def end_run(self, population: Any) -> None:
        for reporter, view in zip(self.reporters, self.views, strict=True):
            reporter.end_run(view)
