"""A population's life on disk: its run directory, a checkpoint after each epoch, exact
resume, and one logger run per member.

`Population` composes one `PopulationLife`: built with the population (it plans the
directory, and a resume restores every member's state before anything runs), held at the
start of each `train()` (`prepare`, `open`), called by the loop after each epoch
(`after_epoch`) and at the end of the run (`end_run`). The files are a run's
(`nitro.runs.run_files.PopulationFiles`), and so are the checkpoints' record, writer and reader;
the loggers are the single run's (`LoggingReporter`), one per member, each bound to the
member's directory. See docs/population.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from nitro.core.events import Events
from nitro.core.train_state import HistoryRows, scalars
from nitro.engine.run_keywords import resolve_run_keywords
from nitro.errors import PopulationError, SetupError
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
from nitro.runs.checkpoint_record import (
    POPULATION,
    CheckpointRecord,
    MemberRecord,
    PartialEpoch,
    setting_differences,
    setting_token,
)
from nitro.runs.checkpoint_trees import host_tree
from nitro.runs.checkpoint_writer import Save
from nitro.runs.checkpoints import Checkpointer
from nitro.runs.epoch_saves import finite
from nitro.runs.resume import restore_variables, said_resumed
from nitro.runs.run_dirs import member_dir, member_run_id
from nitro.runs.run_files import PopulationFiles
from nitro.runs.run_origin import OriginProbe, run_config
from nitro.runs.watched_metrics import metric_names

__all__ = ["FILE_KEYWORDS", "MemberLogging", "PopulationLife", "member_loggers"]

# the run keywords a population takes for itself: they are not its members'
FILE_KEYWORDS = ("run_dir", "checkpointer", "logger", "resume")

_DEFAULT = object()  # logger= not given: JSON Lines per member, as a single run


# ---------------------------------------------------------------------------------------------
# one logger run per member


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
    """What a `LoggingReporter` reads of its handle, for one member of a population."""

    def __init__(self, life: PopulationLife, member: Any, population: Any):
        self._life, self._member, self._population = life, member, population

    @property
    def run_dir(self) -> str:
        return str(member_dir(self._life.files.run_dir, self._member.index))

    @property
    def run_id(self) -> str:
        return member_run_id(self._life.files.run_id, self._member.index)

    @property
    def logger_tags(self) -> dict[str, str]:
        settings = {k: str(plain_value(v)) for k, v in self._member.settings.items()}
        return {"population": self._life.files.run_id, "member": str(self._member.index)} | (
            settings
        )

    @property
    def setup(self) -> Any:
        return self._member.setup

    @property
    def experiment(self) -> Any:
        return self._member.runtime.experiment

    @property
    def owner(self) -> str:
        return self._member.setup.owner

    @property
    def keywords(self) -> Mapping[str, Any]:
        return self._member.setup.keywords

    @property
    def seed(self) -> int:
        return self._member.setup.seed

    @property
    def schedules(self) -> tuple:
        return self._member.setup.schedules

    @property
    def optimizer(self) -> Any:
        return self._member.setup.optimizer

    @property
    def param_count(self) -> int:
        return self._member.setup.model.param_count

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

    def device_value(self, name: str) -> Any:
        return self._member.runtime.feed.device_value(name)

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

    def phase(self, phase: str) -> None:
        for reporter in self.reporters:
            reporter.phase(phase)

    def end_run(self, population: Any) -> None:
        for reporter, view in zip(self.reporters, self.views, strict=True):
            reporter.end_run(view)


# ---------------------------------------------------------------------------------------------
# the population's files


@dataclasses.dataclass
class PopulationLife:
    files: PopulationFiles
    logging: MemberLogging | None
    tokens: list[dict[str, Any]]  # each member's settings, as the records keep them
    _rows: list[tuple[HistoryRows, HistoryRows]] = dataclasses.field(default_factory=list)

    @classmethod
    def plan(
        cls,
        population: Any,
        members: Sequence[Any],
        keywords: Mapping[str, Any],
        say: Callable[[str], None],
        busy: Callable[[], bool],
        origin: OriginProbe | None = None,
    ) -> PopulationLife:
        """Decide where `population` lives and what it saves there (`keywords`: the
        population's `run_dir=`, `checkpointer=`, `logger=`, `resume=` given), with the
        defaults of a single run: `runs/<Experiment>/<run id>`, `Checkpointer()`, a
        `JSONLinesLogger()` per member. `origin`: where it comes from, probed since it began
        building."""
        lead = members[0]
        given = {k: keywords[k] for k in ("run_dir", "checkpointer", "resume") if k in keywords}
        resolved = resolve_run_keywords(lead.experiment, given)
        checkpointer = resolved["checkpointer"].value
        if checkpointer is not None:
            _check_metric(lead, checkpointer)
        tokens = [{k: setting_token(v) for k, v in m.settings.items()} for m in members]
        logger = keywords.get("logger", _DEFAULT)
        files = PopulationFiles.plan(
            lead.setup.cls,
            members=len(members),
            name=lead.setup.name,
            run_dir=resolved["run_dir"].value,
            resume=resolved["resume"].value,
            checkpointer=checkpointer,
            settings=tokens,
            logs=logger is not None,
            say=say,
            busy=busy,
            origin=origin,
        )
        life = cls(files, None, tokens, [(HistoryRows(), HistoryRows()) for _ in members])
        groups = member_loggers(logger, len(members), files.run_id)
        if groups is not None:
            life.logging = MemberLogging(
                [LoggingReporter(group) for group in groups],
                [_MemberView(life, m, population) for m in members],
            )
        return life

    @property
    def resumes(self) -> bool:
        return self.files.resume_from is not None

    @property
    def run_dir(self) -> Path:
        return self.files.run_dir

    @property
    def run_id(self) -> str:
        return self.files.run_id

    # ------------------------------------------------------------------------------------------
    # resume

    def restore(self, members: Sequence[Any], state: Any, events: Events) -> None:
        """Continue the checkpoint `plan` found: every member's variables, optimizer state,
        healthy flag, why it stopped, history and the running sums of its epoch under way,
        and the shared counters, into `state` (the fresh stacked state) and the members;
        refused, naming what differs, when the members' settings or the program do not."""
        found = self.files.resume_from
        assert found is not None
        saved, record = self.files.read()
        lead = members[0]
        lines = setting_differences([m.settings for m in record.members], self.tokens)
        batches, before = getattr(state, "batches", "shared"), record.batches
        if before != batches:
            lines.append(f"  batches: the checkpoint's {before!r}, this population's {batches!r}")
        lines += record.graphconst_differences(lead.setup, "the checkpoint's", "this population's")
        if lines:
            raise PopulationError(
                f"cannot resume the population in {str(found.directory.parent)!r}: this "
                f"population differs from the one its checkpoint saved:\n"
                + "\n".join(lines)
                + f"\nBuild the population as it was (its members are listed in "
                f"{str(found.directory.parent / 'population.json')!r}), or start a new one "
                f"(without resume=, or with another run_dir)"
            )
        state.variables = restore_variables(
            lead.setup,
            state.variables,
            saved,
            record,
            found,
            here="this population's",
            note=events.note,
        )
        entries = record.members
        state.healthy = jnp.asarray([e.healthy for e in entries])
        if state.place is not None:  # laid out as the population lays out its members
            state.variables, state.healthy = (
                state.place(state.variables),
                state.place(state.healthy),
            )
        state.step, state.epoch, state.position = record.step, record.epoch, record.position
        state.prune = dict(record.prune)
        for member, entry in zip(members, entries, strict=True):
            member.state.history = list(entry.history)
            member.state.validations = list(entry.validations)
            member.state.step, member.state.epoch = state.step, state.epoch
            member.stopped, member.stopped_at = entry.stopped, entry.stopped_at
            if member.stopped is not None:  # its counters stay where it stopped
                last = member.state.last_row
                member.state.step = int(member.stopped_at or 0)
                member.state.epoch = int(last.get("epoch", 0))
            partial = entry.partial_epoch
            member.totals = partial.totals() if partial is not None else None
        if self.logging is not None:
            for reporter, entry in zip(self.logging.reporters, entries, strict=True):
                saved_state = entry.logger
                if saved_state is None:
                    continue
                try:
                    reporter.logger.reattach(saved_state)
                except (TypeError, ValueError) as error:
                    raise SetupError(
                        f"cannot resume into this logger: {error}. Resume with the loggers the "
                        f"population was started with, or logger=None"
                    ) from None
        said_resumed(self.files, "population", state.epoch, state.step, events.note)

    def claim_planned(self) -> None:
        self.files.claim_planned()

    # ------------------------------------------------------------------------------------------
    # during a run

    def prepare(self) -> None:
        self.files.prepare()

    def open(self, members: Sequence[Any], events: Events) -> None:
        lead = members[0]
        record = {
            "axes": sorted({k for m in members for k in m.settings}),
            "members": [
                {"settings": token, "seed": m.setup.seed, "config": run_config(m.setup)}
                for m, token in zip(members, self.tokens, strict=True)
            ],
        }
        self.files.open(lead.setup, record, events.note)

    def after_epoch(self, members: Sequence[Any], state: Any, events: Events) -> None:
        """Checkpoint the epoch just committed, when due."""
        store = self.files.store
        if store is not None and store.due(state.epoch):
            self.files.saves.save(self._snapshot(members, state, None), events)

    def end_run(
        self, members: Sequence[Any], state: Any, events: Events, reason: str | None
    ) -> None:
        """The end of a run of the population, as a single run's (`EpochSaves.end`)."""
        self.files.saves.end(
            state, events, reason, lambda _: self._snapshot(members, state, reason)
        )

    def _snapshot(self, members: Sequence[Any], state: Any, reason: str | None) -> Save:
        """Every member's state as one save: the stacked variables and the record."""
        store = self.files.store
        assert store is not None
        lead = members[0]
        checkpointer = store.config
        assert isinstance(checkpointer, Checkpointer)
        healthy = np.asarray(state.healthy).tolist()
        loggers = self.logging.reporters if self.logging is not None else [None] * len(members)
        entries = []
        best = None
        for member, token, (history, validations), ok, reporter in zip(
            members, self.tokens, self._rows, healthy, loggers, strict=True
        ):
            row = member.state.last_row
            value = row.get(checkpointer.metric)
            if ok and (value := finite(value)) is not None:
                if best is None or checkpointer.better(value, best):
                    best = value
            partial = None
            if member.totals is not None and state.position:  # stopped mid-epoch
                partial = PartialEpoch.of(state.position, member.totals)
            entries.append(
                MemberRecord(
                    index=member.index,
                    run_id=member_run_id(self.files.run_id, member.index),
                    settings=token,
                    seed=member.setup.seed,
                    healthy=bool(ok),
                    stopped=member.stopped,
                    stopped_at=member.stopped_at,
                    history=history.to_json(member.state.history),
                    validations=validations.to_json(member.state.validations),
                    metrics=scalars(row),
                    partial_epoch=partial,
                    device=member.runtime.device_values(),
                    logger=reporter.logger.state() if reporter is not None else None,
                )
            )
        setup = lead.setup
        record = CheckpointRecord.of(
            setup,
            run_id=self.files.run_id,
            step=state.step,
            epoch=state.epoch,
            members=tuple(entries),
            kind=POPULATION,
            position=state.position,
            batches=getattr(state, "batches", "shared"),
            prune=dict(state.prune),
            metrics={checkpointer.metric: best} if best is not None else {},
            stop_reason=reason,
        )
        return Save(state.step, host_tree(setup, state.variables), record, best)

    def close(self) -> None:
        self.files.close()

    def release(self) -> None:
        self.files.release()

    def wait(self) -> None:
        self.files.wait()


def _check_metric(lead: Any, checkpointer: Checkpointer) -> None:
    """Refuse, when the population is built, a checkpointer ranking by a column its members
    do not produce (the metrics hook is probed for its names, as for a single run)."""
    setup = lead.setup
    known = {"loss", "val_loss"} | {f"{split}_loss" for split in setup.eval_splits}
    if checkpointer.metric in known:
        return
    names = metric_names(
        setup, lead.state, lead.runtime.experiment, lead.runtime.feed.current_device()
    )
    if names is not None and checkpointer.metric not in names:
        raise PopulationError(
            f"Checkpointer(metric={checkpointer.metric!r}) ranks the population's checkpoints "
            f"by a column its members do not produce; their metrics are "
            f"{', '.join(sorted(names))}"
        )
