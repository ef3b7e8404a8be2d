"""A run's identity and files: its directory and run id (a new one, or the one a resume
continues), one writer per directory (`run.lock`), and its run.json. The handle composes one
`RunFiles`; its `saves` (`nitro.runs.epoch_saves`) write the checkpoints, and a resume reads
one back (`nitro.runs.resume`).

A population's files are a run's (`PopulationFiles`: the same lock, checkpoint writer and
reader, one `CheckpointRecord` of kind "population" per saved step, every member's variables
stacked in it) with a directory per member for its logs, and population.json listing the
members' settings. One orbax step holds the whole population, so a save is one write: a crash
loses that save only, and a resume finds every member at the same step.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

import jax

from nitro._version import __version__
from nitro.core.events import Events
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import HistoryRows, TrainState
from nitro.errors import SetupError
from nitro.runs.checkpoint_names import named_paths
from nitro.runs.checkpoint_reads import SavedStep, read_checkpoint
from nitro.runs.checkpoint_record import POPULATION, RUN, CheckpointRecord, config_of
from nitro.runs.checkpoint_trees import restore_targets
from nitro.runs.checkpoint_writer import CheckpointStore, await_writers, warm_up
from nitro.runs.epoch_saves import EpochSaves
from nitro.runs.identity import RunIdentity, record_name, recorded
from nitro.runs.resume import resume_source
from nitro.runs.run_dirs import (
    KIND,
    MEMBER_KIND,
    POPULATION_JSON,
    checkpoint_dir,
    default_run_dir,
    experiment_root,
    member_dir,
    member_run_id,
    new_run_id,
    read_run_json,
    refuse_for_a_run,
    write_run_json,
)
from nitro.runs.run_lock import RunLock, acquire, describe_holder, holder_record
from nitro.runs.run_origin import PATCH, OriginProbe, provenance, run_config

__all__ = ["PopulationFiles", "RunFiles", "new_run_dir", "saved_steps"]


@dataclasses.dataclass
class RunFiles:
    """Where this run lives and what it saves there. `lock`: this run's hold on its
    directory (`nitro.runs.run_lock`), taken at the first write, or at `plan` for a run that
    resumes or a `run_dir=` named; `busy()`: whether the handle works now."""

    run_id: str
    run_dir: Path
    resume_from: SavedStep | None
    store: CheckpointStore | None
    identity: RunIdentity
    opened: bool = False
    branched_from: str | None = None  # resumed from an earlier checkpoint of this run
    busy: Callable[[], bool] = lambda: False
    lock: RunLock | None = None
    # False in the processes after the first of a multi-process run: process 0 alone holds
    # the lock and writes run.json (every process writes its own shards of each checkpoint)
    primary: bool = True
    claim: bool | None = None  # planned: hold the directory (True: may take it over) at once
    origin: OriginProbe | None = None  # where the run comes from, found while it sets up
    writes: bool = True  # False: nothing on disk (a population that saves and logs nothing)
    saves: EpochSaves = dataclasses.field(init=False)
    # how the refusals name this handle and the one to build instead, the kind of run it is
    WHO: ClassVar[str] = "this handle"
    BUILD: ClassVar[str] = "Nitro"
    KIND: ClassVar[str] = RUN
    WRITES: ClassVar[str] = (
        "(every run writes its run.json, even with checkpointer=None and logger=None)"
    )
    OTHER_KIND: ClassVar[str] = (
        "{path!r} is a population's checkpoint (every member's state at once): "
        "Population(..., resume={run_dir!r}) continues it, and "
        "Nitro(..., weights=({run_dir!r}, i)) starts a run from member i's weights"
    )

    def __post_init__(self) -> None:
        self.saves = EpochSaves(self.run_id, self.store)

    @classmethod
    def located(
        cls, experiment_name: str, run_dir: str | None, found: SavedStep | None
    ) -> tuple[Path, str, str | None]:
        """(directory, run id, the run it branched from) of a run (or population) that
        resumes `found` or starts afresh (in `run_dir=`, or a new directory)."""
        kind = cls.KIND
        if found is None:
            return (*new_run_dir(experiment_name, run_dir, kind=kind), None)
        directory = found.directory.parent
        run_id = read_run_json(directory).get("run_id") or directory.name
        if found.step < max(saved_steps(found.directory), default=found.step):
            # an earlier checkpoint: its run's later ones stay; this run goes on elsewhere
            return (*new_run_dir(experiment_name, run_dir, besides=directory, kind=kind), run_id)
        return directory, run_id, None

    def plan_claim(self, run_dir: str | None) -> None:
        """Whether it holds its directory once built: a run that goes on in its directory
        (resumed, or a run_dir= whose run it continues: run.json but no checkpoints yet) may
        take it over from an idle handle of this process; a new run in `run_dir=` holds it."""
        named = run_dir is not None and Path(run_dir).absolute() == self.run_dir
        continues = (self.resume_from is not None and self.branched_from is None) or (
            named and read_run_json(self.run_dir).get("run_id") == self.run_id
        )
        if continues or named:
            self.claim = continues

    @classmethod
    def plan(
        cls,
        setup: RunSetup,
        events: Events,
        *,
        say: Callable[[str], None] | None = None,
        busy: Callable[[], bool] = lambda: False,
        state: TrainState | None = None,
        origin: OriginProbe | None = None,
        **fields: Any,
    ) -> Self:
        """Decide the run's directory and id; nothing is written yet. A run that continues a
        directory that exists or names one (`run_dir=`) holds it once the handle is built
        (`claim_planned`, after a resume's checks passed). `say`: how to tell the person which
        run `resume='auto'` continues (default: an event note). `state`: the fresh state, whose
        sharded leaves a resume reads its checkpoint onto. `origin`: where the run comes
        from, probed since the handle began building. `fields`: a subclass's own."""
        identity = RunIdentity.of(setup.cls, setup.name)
        targets = restore_targets(setup, state.variables) if state is not None else None
        found = cls.resume_source(setup, identity, say or events.note, targets, **fields)
        run_dir, run_id, branched_from = cls.located(setup.cls.__name__, setup.run_dir, found)
        if setup.placement.multi_process:
            run_dir, run_id, branched_from = _process_zeros(
                setup.placement, found, run_dir, run_id, branched_from
            )
        store = None
        if setup.checkpointer is not None:
            store = CheckpointStore(
                checkpoint_dir(run_dir),
                setup.checkpointer,
                deterministic=setup.placement.multi_process,
            )
        files = cls(
            run_id,
            run_dir,
            found,
            store,
            identity,
            branched_from=branched_from,
            busy=busy,
            primary=not setup.placement.multi_process or jax.process_index() == 0,
            origin=origin,
            **fields,
        )
        files.plan_claim(setup.run_dir)
        return files

    @staticmethod
    def resume_source(
        setup: RunSetup, identity: RunIdentity, say: Callable, targets: Any, **fields: Any
    ) -> SavedStep | None:
        """The checkpoint `resume=` continues (None: a new run); a `run_dir=` that names a
        population's directory is refused first."""
        if setup.run_dir is not None:
            refuse_for_a_run(setup.run_dir, "run_dir")
        return resume_source(setup, identity, say, targets) if setup.resume else None

    def claim_planned(self) -> None:
        """Hold the directory `plan` decided to hold (a refused resume holds nothing, and an
        idle handle it would have taken the directory from keeps it)."""
        if self.claim is not None:
            self.hold(take_over=self.claim)
            self.claim = None

    def read(self, targets: Any = None) -> tuple[Any, CheckpointRecord]:
        """(the state tree, the record) of the checkpoint this run resumes from (read onto
        `targets`' shardings); refused when another kind of run saved it (`OTHER_KIND`)."""
        found = self.resume_from
        assert found is not None  # planned: a run that resumes
        saved, record = read_checkpoint(*found, targets=targets)
        if record.kind != self.KIND:
            where = {"path": str(found.path), "run_dir": str(found.directory.parent)}
            raise SetupError(self.OTHER_KIND.format(**where))
        return saved, record

    # ------------------------------------------------------------------------------------------
    # one writer

    def hold(self, *, take_over: bool = False) -> None:
        """Hold the run directory for writing (see `nitro.runs.run_lock`); refused with a
        SetupError while another handle, here or in another process, holds it."""
        lock = self.lock
        if lock is not None and lock.taken_by is not None:
            raise SetupError(
                f"{self.WHO} no longer writes run {self.run_id}: a later handle resumed it "
                f"and took {str(self.run_dir)!r} over ({describe_holder(lock.taken_by)}). "
                f"Train that one, or build a new one: "
                f"{self.BUILD}(..., resume={str(self.run_dir)!r})"
            )
        if (lock is not None and lock.held) or not self.primary:
            return
        holder = holder_record(self.run_id, self.identity.name, self.identity.owner)
        self.lock = acquire(self.run_dir, holder, self.busy, take_over=take_over)

    def release(self) -> None:
        """Finish the saves and let go of the run directory (`Nitro.close`); a later write
        holds it again, if no other handle has taken it meanwhile."""
        self.close()
        if self.lock is not None and self.lock.taken_by is None:
            self.lock.release()
            self.lock = None

    # ------------------------------------------------------------------------------------------
    # during a run

    def open(self, setup: RunSetup, events: Events) -> None:
        """Hold the run directory, create it and its run.json; the first line of a run names
        them. A run that saves under a name records it in `handles.json` beside the runs."""
        self.prepare()
        if self.opened or not self.writes:
            return
        if self.store is not None:
            warm_up()
        try:
            if self.primary:
                self._write_run_json(setup)
        except OSError as error:
            raise self._unwritable(error) from None
        self.opened = True
        events.note(f"{self.KIND} {self.run_id} in {self.run_dir}")

    def prepare(self) -> None:
        """Hold the run directory and create it (a population's, with a directory per
        member), before the run starts (and its loggers write there): a read-only or vanished
        directory is refused before any training."""
        self.saves.epoch_began = time.perf_counter()
        if not self.writes:
            return
        try:
            self.hold()
            for directory in self.directories():
                directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise self._unwritable(error) from None

    def directories(self) -> list[Path]:
        """The directories the run writes in."""
        return [self.run_dir]

    def _unwritable(self, error: OSError) -> SetupError:
        """The refusal of a run directory this handle cannot write; a handle that has written
        nothing there lets go of it, so another handle may use it at once."""
        if not self.opened and self.lock is not None and self.lock.taken_by is None:
            self.lock.release()
            self.lock = None
        return SetupError(
            f"cannot create the run directory {str(self.run_dir)!r} "
            f"({type(error).__name__}: {error.strerror or error}); nothing was trained. "
            f"Put the run where it can write with run_dir='/some/writable/dir' {self.WRITES}"
        )

    def _write_run_json(self, setup: RunSetup) -> None:
        self._write_own_json(setup, run_config(setup), seed=setup.seed)
        root = experiment_root(setup.cls.__name__).absolute()
        if self.run_dir.parent == root:
            record_name(root, self.identity, self.run_id, self.run_dir)

    def _write_own_json(
        self, setup: RunSetup, config: Mapping[str, Any], **own: Any
    ) -> dict[str, Any]:
        """Write run.json (unless this run has one already; refused when the directory now
        holds another run's) with where the run comes from (`nitro.runs.run_origin`: the
        git state, the uncommitted diff beside it, the packages) and its resolved `config`,
        and return the fields every run.json of this run shares."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        info = read_run_json(self.run_dir)
        if info.get("run_id") not in (None, self.run_id):
            raise SetupError(
                f"run_dir {str(self.run_dir)!r} now holds run {info['run_id']}, written by "
                f"another handle since {self.WHO} was built; one run directory holds one run: "
                f"build it with another run_dir, or resume={str(self.run_dir)!r} to continue "
                f"that run"
            )
        common = {
            "experiment": setup.owner,
            **self.identity.as_json(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "graphconst": config_of(setup),
            "nitro": __version__,
            "preset": setup.experiment.preset,
        }
        if not info:
            resumed = str(self.resume_from.path) if self.resume_from is not None else None
            probe = self.origin
            origin, patch = probe.result() if probe is not None else provenance(setup.cls)
            if patch is not None:
                (self.run_dir / PATCH).write_bytes(patch)
            write_run_json(
                self.run_dir,
                {
                    "run_id": self.run_id,
                    **own,
                    **common,
                    "resumed_from": resumed,
                    "config": config,
                    **origin,
                },
            )
        elif not recorded(info):  # a run of an older Nitro, resumed: it records who it is now
            write_run_json(self.run_dir, {**info, **self.identity.as_json()})
        return common

    def wait(self) -> None:
        """Wait for the saves under way to be written."""
        if self.store is not None:
            self.store.wait()

    def close(self) -> None:
        """Write the best epoch held on the host and finish the saves."""
        self.saves.close()


def _process_zeros(
    placement: Any,
    found: SavedStep | None,
    run_dir: Path,
    run_id: str,
    branched_from: str | None,
) -> tuple[Path, str, str | None]:
    """Process 0's run directory and id, in every process of a multi-process run: one run,
    one directory (each process draws a new run's id on its own). Refused in every process
    when they would resume different checkpoints: their file systems differ."""
    resumes = str(found.path) if found is not None else None
    texts = placement.gather_texts(json.dumps([resumes, str(run_dir), run_id, branched_from]))
    decided = [json.loads(text) for text in texts]
    if any(d[0] != resumes for d in decided):
        seen = "; ".join(f"process {i}: {d[0] or 'none'}" for i, d in enumerate(decided))
        raise SetupError(
            f"the processes of this run found different checkpoints to resume ({seen}): "
            f"every process must see the same run directories. Put runs/ (or run_dir=) on a "
            f"file system every host shares"
        )
    _, directory, run_id, branched_from = decided[0]
    return Path(directory), run_id, branched_from


def new_run_dir(
    experiment_name: str, run_dir: str | None, besides: Path | None = None, kind: str = RUN
) -> tuple[Path, str]:
    """(directory, run id) of a new run (or population, `kind`): `run_dir=`, refused when it
    holds checkpoints already (or, for a population, a run's files), or
    `runs/<Experiment>/<new run id>` (also when `run_dir=` names `besides`, the run an
    earlier checkpoint is resumed from)."""
    if run_dir is None or Path(run_dir).absolute() == besides:
        while True:  # not the directory of another process's run of the same second
            run_id = new_run_id()
            path = default_run_dir(experiment_name, run_id)
            if not path.exists():
                return path, run_id
    path = Path(run_dir).absolute()
    existing = read_run_json(path)
    steps = saved_steps(checkpoint_dir(path))
    other = kind == POPULATION and existing and existing.get("kind") != POPULATION
    if steps or other:
        held = existing.get("run_id", path.name)
        what = f"checkpoints of run {held}"
        if kind == POPULATION:
            what = f"a {'population' if existing.get('kind') == POPULATION else 'run'} ({held})"
        raise SetupError(
            f"run_dir {str(path)!r} already holds {what}"
            + (f" (steps {steps[0]}..{steps[-1]})" if steps else "")
            + f": resume='auto' continues it; choose another run_dir for a new {kind}"
        )
    return path, existing.get("run_id") or new_run_id()


def saved_steps(directory: Path) -> list[int]:
    await_writers(directory)
    if not directory.is_dir():
        return []
    return sorted(named_paths(directory))


# ---------------------------------------------------------------------------------------------
# a population's files


@dataclasses.dataclass
class PopulationFiles(RunFiles):
    """Where a population lives and what it saves there: a run's files (`RunFiles`: its
    directory, lock, checkpoint writer) with a directory per member and population.json.
    `settings`: each member's, as `setting_token` makes them (resume="auto" prefers a
    population of the same members), `seeds` theirs; `logs`: whether it has loggers."""

    settings: Sequence[Mapping[str, Any]] = ()
    seeds: Sequence[int] = ()
    configs: Sequence[Mapping[str, Any]] = ()  # each member's resolved configuration
    logs: bool = True
    # each member's history and validations as its saves convert them, kept across saves
    rows: list[tuple[HistoryRows, HistoryRows]] = dataclasses.field(init=False)
    WHO: ClassVar[str] = "this population"
    BUILD: ClassVar[str] = "Population"
    KIND: ClassVar[str] = POPULATION
    WRITES: ClassVar[str] = "(or checkpointer=None, logger=None to write nothing)"
    OTHER_KIND: ClassVar[str] = (
        "{path!r} is a single run's checkpoint, not a population's: "
        "Nitro(..., resume={run_dir!r}) continues it"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rows = [(HistoryRows(), HistoryRows()) for _ in self.settings]

    def plan_claim(self, run_dir: str | None) -> None:
        super().plan_claim(run_dir)
        # checkpointer=None, logger=None and no run_dir=: nothing on disk
        named = run_dir is not None or self.resume_from is not None
        self.writes = self.store is not None or self.logs or named

    @staticmethod
    def resume_source(
        setup: RunSetup, identity: RunIdentity, say: Callable, targets: Any, **fields: Any
    ) -> SavedStep | None:
        settings = [dict(s) for s in fields["settings"]]

        def same(path: Path) -> bool:  # a population of these members
            listed = read_run_json(path, POPULATION_JSON).get("members") or ()
            return [m.get("settings") for m in listed] == settings

        return resume_source(setup, identity, say, kind=KIND, prefer=same) if setup.resume else None

    def directories(self) -> list[Path]:
        return [member_dir(self.run_dir, index) for index in range(len(self.settings))]

    def _write_run_json(self, setup: RunSetup) -> None:
        """Write run.json, population.json and each member's run.json (those missing). The
        population's run.json records the configuration its members share (`setup`: the
        first member's, the axes left out)."""
        axes = sorted({k for m in self.settings for k in m})
        shared = {
            part: {k: v for k, v in values.items() if k not in axes}
            for part, values in run_config(setup).items()
        }
        common = self._write_own_json(setup, shared, kind=KIND, members=len(self.settings))
        members = [
            {
                "run_id": member_run_id(self.run_id, i),
                "member": i,
                "settings": dict(s),
                "seed": seed,
            }
            for i, (s, seed) in enumerate(zip(self.settings, self.seeds, strict=True))
        ]
        if not (self.run_dir / POPULATION_JSON).is_file():
            listed = [{**m, "dir": member_dir(".", m["member"]).name} for m in members]
            info = {"run_id": self.run_id, "experiment": setup.owner, "axes": axes}
            write_run_json(self.run_dir, {**info, "members": listed}, POPULATION_JSON)
        for member, config in zip(members, self.configs, strict=True):
            directory = member_dir(self.run_dir, member["member"])
            if not read_run_json(directory):
                own = {"kind": MEMBER_KIND, "population": self.run_id, **common, "config": config}
                write_run_json(directory, {**member, **own})
