"""A population's loggers: one logger run per member, each the single run's
(`LoggingReporter`) bound to the member's directory, reading the member as it reads a run's
handle. See docs/population.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

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


def member_loggers(spec: Any, count: int, run_id: str) -> list[Any]:
    """What `logger=` of a population gives each member: not given, `JSONLinesLogger()` (as
    a single run); None, nothing; a function, what it returns for the member's index (a
    logger class is called with no argument); Nitro's own loggers (one, or a list), a copy
    of each per member, writing in the member's directory (one MLflow or W&B run each)."""
    if spec is None:
        return []
    if spec is _DEFAULT or isinstance(spec, type):
        return [(JSONLinesLogger if spec is _DEFAULT else spec)() for _ in range(count)]
    if callable(spec) and not hasattr(spec, "log_metrics"):
        return [spec(i) for i in range(count)]
    given = as_logger(spec)  # refuses an object that is not a logger, naming what it lacks
    loggers = given.loggers if isinstance(given, LoggerGroup) else (given,)
    return [[_member_copy(logger, i, run_id) for logger in loggers] for i in range(count)]


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


class MemberLogging:
    """Each member's logger run, a `LoggingReporter` on the member's event path (its steps,
    rows and validations come there, as a run's); a reporter of the population's events that
    passes on the run's start, epochs, phases, swaps and end to every member's."""

    def __init__(
        self,
        population: Any,
        members: Sequence[Any],
        files: PopulationFiles,
        logger: Any = _DEFAULT,
        programs: Callable[[], Any] = lambda: None,
    ):
        self.population, self.members, self.files = population, members, files
        self.programs = programs  # the population's programs now, for what `remat=` saves
        made = member_loggers(logger, len(members), files.run_id)  # None: a member logs nothing
        self.reporters = [LoggingReporter(LoggerGroup([logger])) for logger in made]
        for member, reporter in zip(members, self.reporters, strict=False):
            member.logging = reporter  # its steps, rows and validations come as a run's
            member.events.add(reporter)

    def _view(self, member: Any) -> SimpleNamespace:
        """What a `LoggingReporter` reads of a run's handle, for `member` as it stands: its
        setup and run-time record, its directory, and where it stands in the run."""
        population, stopped, index = self.population, member.stopped, member.index
        run_dir = str(member_dir(self.files.run_dir, index))
        run_id = member_run_id(self.files.run_id, index)
        step = member.own_step(population.step)
        reason = population.stop_reason
        if stopped is not None:  # a stopped member's epoch and end stay where it stopped
            kind = "early_stop" if stopped.startswith("early stop") else "requested"
            reason = "error" if stopped.startswith(("diverged", "spiked")) else kind
        tags = {k: str(plain_value(v)) for k, v in member.settings.items()}
        return SimpleNamespace(
            setup=member.setup,
            runtime=member.runtime,
            run_dir=run_dir,
            run_id=run_id,
            logger_tags={"population": self.files.run_id, "member": str(index)} | tags,
            epoch=population.epoch if stopped is None else member.state.epoch,
            stop_reason=reason,
            binding_report=lambda: binding_report(
                member.setup, member.runtime, step, run_dir, run_id, programs=self.programs()
            ),
        )

    def start_run(self, population: Any, target_epoch: int) -> None:
        for member in self.members:
            member.events.start_run(self._view(member), target_epoch)

    def start_epoch(self, epoch: int, target_epoch: int, batches: int | None, start: int) -> None:
        for member in self.members:
            member.events.start_epoch(epoch, target_epoch, batches, start)

    def phase(self, phase: str) -> None:
        for reporter in self.reporters:  # not the members' phase: monitors watch the run's
            reporter.phase(phase)

    def swapped(self, row: Mapping[str, Any]) -> None:
        for member in self.members:  # every member runs the swapped-in code
            member.events.swapped(row)

    def end_run(self, population: Any) -> None:
        for member in self.members:
            member.events.end_run(self._view(member))
