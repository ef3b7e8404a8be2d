"""`Population`: many variants of one experiment trained side by side as one vmapped program.

`nitro.Population(e, learning_rate=[1e-3, 1e-2], seed=[0, 1])` is the cartesian product of its
list-valued keywords (4 members), `members=[{...}, {...}]` an explicit list; every other
keyword is shared by all members. A member is what `Nitro(e, **its settings)` would set up
(so building a population compiles nothing); they must share one program, so an axis may be
a run keyword whose value is fed to the step (seed, learning rate, the optimizer's other fed
hyperparameters, schedules) or a Device field, and anything that would change the program is
refused naming the field. See docs/population.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from nitro.core import events as events_module
from nitro.core import progress
from nitro.core.events import Events
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import TrainState
from nitro.engine.live_edit import live_instance
from nitro.engine.member_axis import (
    Member,
    PopulationState,
    Stacked,
    apply_prunes,
    check_member_layout,
    shown_settings,
)
from nitro.engine.population_search import Search, full_variables, shrink
from nitro.engine.resolved import RunKeywords
from nitro.engine.run_keywords import RUN_KEYWORDS, resolve_run_keywords
from nitro.engine.run_time import RunTime
from nitro.engine.runner import RunGuard
from nitro.engine.search import Halving, Proposal, split_search
from nitro.engine.setup import build
from nitro.errors import PopulationError, SetupError
from nitro.experiments.declaration import field_specs
from nitro.experiments.presets import replace
from nitro.handle.binding_report import BindingReport, binding_report
from nitro.handle.handle import check_experiment, experiment_to_run, weights_source
from nitro.handle.population_loggers import MemberLogging
from nitro.handle.population_members import (
    PopulationMembers,
    check_axis,
    check_one_program,
    check_shared,
)
from nitro.handle.run_handle import scalar_frame
from nitro.programs.specs import ProgramSet
from nitro.runs.checkpoint_record import setting_token
from nitro.runs.epoch_saves import finite, population_save
from nitro.runs.resume import restore_population
from nitro.runs.run_files import PopulationFiles
from nitro.runs.run_origin import OriginProbe, run_config
from nitro.runs.watched_metrics import check_watched_metrics

__all__ = ["Population"]

# where the population lives and what it saves: its members' setups hold them, not their given
# keywords (a member taken as a handle starts a run of its own); `logger=` is the population's
FILE_KEYWORDS = ("run_dir", "checkpointer", "resume")


# "auto" unrolls populations of at most this many members on one CPU device: bench/population.py
# measured the unrolled step faster than the vmapped one there (a vmapped convolution runs as a
# grouped one, 7.6x slower on the digits CNN), while its compile time grows with the members
UNROLLED_MEMBERS = 16


class Population(PopulationMembers):
    """Members of one experiment, differing in fed values, trained by one program.

    >>> import nitro
    >>> from nitro.examples.digits import Digits
    >>> pop = nitro.Population(Digits(max_epochs=1), learning_rate=[1e-3, 1e-2], progress=False)
    >>> len(pop), pop.members                                     # compiles nothing
    (2, [{'learning_rate': 0.001}, {'learning_rate': 0.01}])
    >>> pop.train().history().index.names
    FrozenList(['member', 'epoch'])

    Given the class, `preset=` builds the members' experiment from that preset
    (`Population(Digits, preset="small", learning_rate=[...])`); the keywords that name fields
    then share or vary them, as for an instance.
    """

    def __init__(
        self,
        experiment: Any,
        *,
        members: Sequence[Mapping[str, Any]] | None = None,
        batches: str | None = None,
        mesh_axis: str = "members",
        preset: str | None = None,
        search: Any = None,
        vectorize: bool | str = "auto",
        **keywords: Any,
    ):
        experiment = experiment_to_run(
            experiment, preset, keywords, call="Population", take_fields=False
        )
        cls = check_experiment(experiment)
        origin = OriginProbe(cls)  # git runs beside the members' setup
        given = {"members": members, "batches": batches, "mesh_axis": mesh_axis, "search": search}
        given["vectorize"] = None if vectorize == "auto" else vectorize
        self._given = (experiment, {k: v for k, v in given.items() if v is not None} | keywords)
        if vectorize not in ("auto", True, False):
            raise PopulationError(
                f"vectorize={vectorize!r}: pass True (one vmapped step for every member), False "
                f"(each member's step one after another in one program) or 'auto' (False for "
                f"up to {UNROLLED_MEMBERS} members on one CPU device, where XLA runs a vmapped "
                f"convolution as a slow grouped one; True elsewhere)"
            )
        if mesh_axis not in ("members", "batch"):
            raise PopulationError(
                f"mesh_axis={mesh_axis!r}: pass 'members' (each device trains its share of the "
                f"members on whole batches) or 'batch' (every member on every device, each batch "
                f"split across them)"
            )
        if batches not in (None, "shared", "own"):
            raise PopulationError(
                f"batches={batches!r}: pass 'shared' (every member trains on the same batches, "
                f"a fair comparison of the settings) or 'own' (each member its seed's data order)"
            )
        self._mesh_axis = mesh_axis
        proposal, self._scheduler = split_search(search)
        if proposal is not None:
            if members is not None:
                raise PopulationError(
                    f"Population() takes members= or search={proposal.kind}(...), not both: "
                    f"the search fills the members"
                )
            members = proposal
        # shared by every member, as Nitro(...) takes them: where the weights start, the splits
        self._weights = weights_source(keywords.pop("weights", None))
        self._data = keywords.pop("data", None)
        # a list is an axis; logger=[...] is the population's loggers (each member a copy)
        axes = {k: v for k, v in keywords.items() if isinstance(v, list) and k != "logger"}
        shared = {k: v for k, v in keywords.items() if k not in axes}
        if members is not None:
            if axes:
                raise PopulationError(
                    f"Population() takes members= or list-valued axes, not both (got members= "
                    f"and {', '.join(sorted(axes))}=[...]): put every member's values in "
                    f"members=[{{...}}, ...]"
                )
            if isinstance(members, (str, Mapping)) or not all(
                isinstance(m, Mapping) for m in members
            ):
                raise PopulationError(
                    "members= takes a list of dicts, one per member: "
                    "members=[{'learning_rate': 1e-3}, {'learning_rate': 1e-2}]"
                )
            settings = [dict(m) for m in members]
        else:
            for name, values in axes.items():
                if not values:
                    raise PopulationError(f"axis {name}=[] has no values: give at least one")
            settings = [
                dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())
            ]
        if not settings:
            raise PopulationError("members=[] has no members: give at least one")
        if batches is None:  # members of other seeds read their own seed's order, as alone
            seeds = {repr(s.get("seed", shared.get("seed"))) for s in settings}
            batches = "own" if len(seeds) > 1 else "shared"
        self._batches_mode = batches
        specs = {s.name: s for s in field_specs(cls)}
        for name in dict.fromkeys(k for s in settings for k in s):
            try:
                check_axis(cls, specs, name)
            except PopulationError as error:
                if not isinstance(members, Proposal):
                    raise
                raise PopulationError(f"{members.kind} space key {name!r}: {error}") from None
        for name, value in shared.items():
            check_shared(specs, name, value)
        self._settings = settings
        shared_fields = {k: v for k, v in shared.items() if k in specs and k not in RUN_KEYWORDS}
        own = (*FILE_KEYWORDS, "logger")
        self._shared_keywords = {
            k: v for k, v in shared.items() if k not in shared_fields and k not in own
        }
        self._files_keywords = {k: v for k, v in shared.items() if k in FILE_KEYWORDS}
        self._experiment = replace(experiment, **shared_fields)
        self._guard_with(RunGuard(lambda: f"this {cls.__name__} population", name="pop"))
        reporter = progress.make_reporter(
            self._shared_keywords.get("progress", True), population=True
        )
        self._progress = reporter
        self._events = Events([reporter] if reporter is not None else [])
        with events_module.using(self._events):
            self._members = [self._build_member(0, settings[0], specs)]
            # with shared batches only the first member's stream is read: the others take its
            # sources as they are instead of calling build_data again
            shared_data = self._data
            if shared_data is None and batches == "shared":
                lead_splits = self._members[0].setup.splits
                shared_data = {name: split.source for name, split in lead_splits.items()}
            self._members += [
                self._build_member(i, s, specs, shared_data)
                for i, s in enumerate(settings)
                if i > 0
            ]
        check_one_program(self._members)
        lead = self._members[0]
        lead.runtime.dispatch.for_members(len(settings))  # its calls train every member
        check_member_layout(lead.setup)
        devices = lead.setup.placement.n_devs
        if mesh_axis == "members" and devices > 1 and len(settings) % devices:
            raise PopulationError(
                f"{len(settings)} members do not divide across n_devs={devices} devices "
                f"(mesh_axis='members' gives each device its share of the members): give a "
                f"multiple of {devices} members, or mesh_axis='batch' to split each batch instead"
            )
        try:  # early_stop= and checkpointer= watch what the members produce, as a run's
            runtime = lead.runtime
            check_watched_metrics(
                lead.setup, lead.state, runtime.experiment, runtime.feed.current_device()
            )
        except SetupError as error:
            raise PopulationError(str(error)) from None
        if vectorize == "auto":  # unrolled where it is faster, and compiles in reasonable time
            cpu = lead.setup.placement.devices[0].platform == "cpu"
            vectorize = not (cpu and devices == 1 and len(settings) <= UNROLLED_MEMBERS)
        self._vectorize = bool(vectorize)
        self._programs = ProgramSet(
            lead.setup, len(settings), own_batches=batches == "own", vectorize=self._vectorize
        )
        self._search = None if self._scheduler is None else self._searching(devices, mesh_axis)
        self._axis: Stacked | None = None  # the loop's members object: stacked on first use
        self._stacking = threading.Lock()  # pop.stop(i) may stack before the run's thread
        guard = self._guard  # not the population: its run directory's lock must not keep it
        loggers = {k: v for k, v in shared.items() if k == "logger"}
        self._files = PopulationFiles.plan(
            lead.setup,
            self._events,
            say=self._say,
            busy=lambda: guard.activity is not None,
            origin=origin,
            settings=[{k: setting_token(v) for k, v in m.settings.items()} for m in self._members],
            seeds=[m.setup.seed for m in self._members],
            configs=[run_config(m.setup) for m in self._members],
            logs=loggers.get("logger", True) is not None,
        )
        self._logging = MemberLogging(
            self, self._members, self._files, programs=lambda: self._programs, **loggers
        )
        if self._logging.reporters:  # logger=None costs nothing
            self._events.add(self._logging)
        if self._files.resume_from is not None:
            with events_module.using(self._events):
                state = self._stacked().state
                record = restore_population(self._files, self._members, state, self._say)
                training = None if self._search is None else self._search.restore(record.search)
                if training is not None and len(training) < len(self._members):
                    self._shrink([self._members[i] for i in training])
        self._files.claim_planned()

    def _build_member(
        self, index: int, setting: Mapping[str, Any], specs, data: Any = None
    ) -> Member:
        fields = {k: v for k, v in setting.items() if k in specs and k not in RUN_KEYWORDS}
        instance = replace(self._experiment, **fields)
        given = {**self._shared_keywords, **{k: v for k, v in setting.items() if k not in fields}}
        keywords = {**given, **self._files_keywords, "logger": None, "progress": False}
        try:
            resolved = RunKeywords.of(resolve_run_keywords(instance, keywords))
        except SetupError as error:  # name the member whose value it is
            shown = progress.settings_label(setting)
            raise PopulationError(f"member {index} ({shown}): {error}") from None
        events = Events()
        setup, runtime, state = build(
            instance,
            resolved,
            given,
            events=events,
            data=self._data if data is None else data,
            weights=self._weights,
        )
        return Member(index, dict(setting), instance, setup, runtime, state, events=events)

    # ------------------------------------------------------------------------------------------
    # what it holds

    def __repr__(self) -> str:
        axes = sorted({k for s in self._settings for k in s})
        return (
            f"<Population of {len(self)} {self.cls.__name__} members over "
            f"{', '.join(axes) or 'nothing'}: epoch {self.epoch}, step {self.step}>"
        )

    @property
    def members(self) -> list[dict[str, Any]]:
        """Each member's settings (the values of the axes), in member order."""
        return [dict(s) for s in self._settings]

    @property
    def experiment(self) -> Any:
        """The experiment the population was built from (its shared fields as given)."""
        return self._given[0]

    @property
    def given_keywords(self) -> dict[str, Any]:
        """The keywords the population was built with: `nitro.Population(pop.experiment,
        **pop.given_keywords)` builds it again (with `resume=`, to continue its run)."""
        return dict(self._given[1])

    @property
    def stopped(self) -> dict[int, str]:
        """Member -> why it stopped training (it diverged, stopped early, was pruned, or
        spiked past `Spike(max_rollbacks=)`), for the members that did."""
        return {m.index: m.stopped for m in self._members if m.stopped is not None}

    @property
    def stopped_at(self) -> dict[int, int]:
        """Member -> the steps it trained before it stopped, for the members that did: its
        history's last row has that step, and its weights are those of that step."""
        return {m.index: m.own_step(self.step) for m in self._members if m.stopped is not None}

    @property
    def member_steps(self) -> list[int]:
        """Each member's own steps so far, in member order: the population's `step` less the
        batches a spike's roll-back left out for it (`spike=`), or where it stopped."""
        return [m.own_step(self.step) for m in self._members]

    def _stacked(self) -> Stacked:
        """The members stacked, once: the loop's members object, with the stacked state."""
        with self._stacking:
            if self._axis is None:
                members, say = self._members, self._say
                self._axis = Stacked.of(members, self._batches_mode, self._mesh_axis, say)
                if self._search is not None:
                    self._axis.on_losses = self._search.add_losses
            return self._axis

    def _searching(self, devices: int, mesh_axis: str) -> Search:
        """The scheduler of `search=` at work, its settings checked against the members."""
        scheduler = self._scheduler
        assert scheduler is not None
        lead = self._members[0].setup
        if isinstance(scheduler, Halving) and devices > 1 and mesh_axis == "members":
            sizes = scheduler.sizes(len(self._members))
            if any(size % devices for size in sizes):
                raise PopulationError(
                    f"Halving shrinks the population to {' -> '.join(map(str, sizes))} members, "
                    f"which do not all divide across n_devs={devices} devices: give keep= or "
                    f"rungs= whose sizes do, or mesh_axis='batch'"
                )
        metric = scheduler.metric
        if scheduler.unit == "steps" and metric not in (None, "loss"):
            every = lead.val_every_steps
            points = scheduler.rungs if isinstance(scheduler, Halving) else [scheduler.interval]
            if every is None or any(p is not None and p % every for p in points):
                raise PopulationError(
                    f"{type(scheduler).__name__}(unit='steps', metric={metric!r}) ranks by an "
                    f"evaluation within the epoch at each boundary: give val_every_steps= a "
                    f"divisor of its boundaries, or metric='loss' (the training loss since the "
                    f"last boundary)"
                )
        return Search(scheduler, self._members, self._say, mark=self._events.searched)

    def _shrink(self, kept: list[Member]) -> None:
        """The population down to the members `kept`: their variables gathered, and the
        programs made for their count (compiled once, on their first call)."""
        with self._stacking:
            assert self._axis is not None  # stacked before a search shrinks it
            axis = self._axis = shrink(self._axis, kept)
            axis.on_losses = self._search.add_losses if self._search is not None else None
        own = self._batches_mode == "own"
        self._programs = ProgramSet(
            self._lead_setup, len(kept), own_batches=own, vectorize=self._vectorize
        )
        self._lead_runtime.dispatch.for_members(len(kept))

    # ------------------------------------------------------------------------------------------
    # training and evaluation

    @property
    def vectorized(self) -> bool:
        """True: one vmapped step trains every member; False: the program steps each member
        after the other (`Population(..., vectorize=)`; "auto" picks False for up to 16
        members on one CPU device, where a vmapped convolution runs as a much slower grouped
        one)."""
        return self._vectorize

    def binding_report(self, member: int = 0) -> BindingReport:
        """Where every value of member `member` came from (its settings among the run
        keywords and Device fields, as `Nitro(...).binding_report()` shows a run's), after a
        section on the population: its members, their axes, how its program goes over them
        (`vectorize=`) and which batches they read. `%nitro bind POP` shows member 0's."""
        count = len(self._members)
        if isinstance(member, bool) or not isinstance(member, int) or not 0 <= member < count:
            raise PopulationError(
                f"binding_report(member={member!r}): this population has {count} members, "
                f"numbered 0 to {count - 1}"
            )
        chosen = self._members[member]
        axes = sorted({k for s in self._settings for k in s})
        shape = "vmapped" if self._vectorize else "unrolled, one member's step after another"
        lines = [
            f"members = {count}  (this report: member {member}, "
            f"{progress.settings_label(chosen.settings) or 'no settings'})",
            f"axes = {', '.join(axes) or 'none'}",
            f"member axis = {shape}  [vectorize]",
            f"batches = {self._batches_mode!r}",
            f"logger = {'a logger run per member' if self._logging.reporters else 'none'}",
        ]
        report = binding_report(
            chosen.setup,
            chosen.runtime,
            self.step,
            self.run_dir,
            self.run_id,
            history=chosen.state.history,
            programs=self._programs,
        )
        own = set(chosen.settings)

        def keyword(line: str) -> str | None:  # the member's settings are the population's
            name = line.split(" = ", 1)[0]
            if name in ("logger", "progress"):  # the population's own, above
                return None
            if name in own:
                return line.replace("[Nitro keyword]", f"[member {member}'s setting]")
            return line

        sections = [
            (title, [kept for line in body if (kept := keyword(line)) is not None])
            if title == "run keywords"
            else (title, body)
            for title, body in report.sections
        ]
        return BindingReport([("population", lines), *sections])

    @property
    def batches(self) -> str:
        """ "shared": every member trains on the same batches (the first member's data order);
        "own": each member on its own seed's order, as it would alone (the default when the
        members' seeds differ; `Population(..., batches="shared")` shares the first's)."""
        return self._batches_mode

    @property
    def _counters(self) -> TrainState:
        return self._members[0].state if self._axis is None else self._axis.state

    @property
    def _lead_setup(self) -> RunSetup:
        return self._members[0].setup

    @property
    def _lead_runtime(self) -> RunTime:
        return self._members[0].runtime

    def _edit_variables(self) -> Any:
        """One member's variables as shapes (a running population's may be donated)."""
        stacked = self._stacked().state.variables
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)

    def _adopt_code(self, setup: RunSetup, programs: ProgramSet) -> None:
        """A swap or a roll-back: every member runs the code (the first member's `setup`,
        the others' their own with its experiment and model), each its experiment's
        instance of the class it names."""
        self._programs = programs
        for member in self._members:
            own = dataclasses.replace(member.setup, experiment=setup.experiment, model=setup.model)
            member.setup = setup if member.index == 0 else own
            member.experiment = live_instance(member.experiment, setup.cls)
            member.runtime.experiment = live_instance(member.runtime.experiment, setup.cls)

    def _check_trainable(self) -> None:
        if all(m.stopped is not None for m in self._members):
            raise PopulationError(
                "every member of this population has stopped ("
                + "; ".join(f"{m.label}: {m.stopped}" for m in self._members)
                + "): pop.best() or pop.member(i) is a handle that trains on"
            )

    def _segment(
        self, state: PopulationState, target: int, stop_at: int | None
    ) -> tuple[int, int | None]:
        """The search's boundary due here is taken (PBT's exploit, a rung that shrinks the
        population), and the stretch trained next ends at its next one."""
        search = self._search
        if search is None:
            return target, stop_at
        if search.due(state):
            kept = search.apply(self._stacked(), state)
            if kept is not None:
                self._shrink(kept)
        return search.segment(state, target, stop_at)

    def _loop_left(self, state: PopulationState) -> None:
        self._stacked().keep_time(state)
        self._release_workers(final=False)  # worker processes live as the run

    def _runtimes(self) -> list[RunTime]:
        return [m.runtime for m in self._members]

    def _saving(self, state: PopulationState) -> tuple[list[dict[str, Any]], Callable]:
        """Each committed epoch as the saves rank it (its best member's value of the
        checkpointer's metric), and the population as a save (`population_save`)."""
        store, best = self._files.store, {}
        if store is None:  # nothing is saved: neither is read
            return [], population_save
        metric, better = store.config.metric, store.config.better
        for row in (r for m in self._members for r in m.state.history):
            value, seen = finite(row.get(metric)), best.setdefault(row["epoch"], None)
            if value is not None and (seen is None or better(value, seen)):
                best[row["epoch"]] = value
        members, files, value = self._members, self._files, best.get(state.epoch)
        rows = [{metric: best.get(epoch)} for epoch in range(1, state.epoch + 1)]
        search = self._search

        def snapshot(why: str | None, new: bool):
            if search is None:
                return population_save(files, members, state, why, new, value)
            axis, view = self._stacked(), state
            if axis.count < len(members):  # every member's variables, as before it shrank
                healthy = np.zeros(len(members), bool)
                healthy[[m.index for m in axis.members]] = np.asarray(state.healthy)
                full = full_variables(axis, members)
                view = dataclasses.replace(state, variables=full, healthy=healthy)
            record = search.to_json(axis.members)
            return population_save(files, members, view, why, new, value, search=record)

        return rows, snapshot

    def _verdict(self, state: PopulationState) -> str | None:
        """Stop each member whose monitored metric stopped improving (`early_stop=`) as its
        single run would have stopped; the run ends once every member has stopped."""
        self._stacked().early_stops(state)
        return self._end_reason(None)

    def _end_reason(self, reason: str | None) -> str | None:
        if all(m.stopped is not None for m in self._members):  # early stopping, or prunings
            return "early_stop" if self._members[0].setup.early_stop is not None else "requested"
        return reason

    def stop(self, member: int | None = None, why: str | None = None) -> Population:
        """`pop.stop()`: ask a running population to stop after the current call.
        `pop.stop(i)`: stop member `i` only (prune it): from the next call on its variables
        stay as they are and the others train on, each as it would have without the pruning.
        Its slot still runs in every call (masked), so pruning saves no time."""
        if member is None:
            self._control.stop.set()
            return self
        if isinstance(member, bool) or not isinstance(member, int):
            raise TypeError(f"pop.stop(member) takes a member index, got {member!r}")
        if not 0 <= member < len(self):
            raise IndexError(f"member {member} of a population of {len(self)}")
        axis = self._stacked()  # a run that has not stacked its members yet finds it so
        axis.state.prune[member] = why or f"stopped by pop.stop({member})"
        if not self.running:
            apply_prunes(axis.members, axis.state, self._say)
        return self

    def _trainees(self) -> tuple[Stacked, PopulationState]:
        members = self._stacked()
        return members, members.state

    def _evaluation(self, rows: Any) -> Any:
        """Every member's loss and metrics, a DataFrame indexed by member, its settings first."""
        members = zip(self._stacked().members, rows, strict=True)
        shown = [{"member": m.index, **shown_settings(m.settings), **row} for m, row in members]
        return scalar_frame(shown, ["member"])
