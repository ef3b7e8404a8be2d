"""Resuming a run: which checkpoint `resume=` continues (`resume_source`, `run_to_resume`),
what differs from it (GraphConst values are refused, changed code, Device values and the seed
are said), and its arrays read back as the run's `Variables` (`restore_variables`, for a run
and a population alike) and its record as the run's new `TrainState` (a population's, with
`restore_population`, as its stacked state and its members' records).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from nitro.core.events import Events
from nitro.core.run_setup import CheckpointRef, RunSetup
from nitro.core.train_state import TrainState, Variables
from nitro.errors import PopulationError, SetupError
from nitro.experiments.declaration import FieldKind, field_specs
from nitro.optim.fed_optimizer import describe_optimizer
from nitro.runs.checkpoint_reads import SavedStep, resolve_checkpoint
from nitro.runs.checkpoint_record import (
    CheckpointRecord,
    config_of,
    config_token,
    setting_differences,
)
from nitro.runs.checkpoint_trees import (
    LOSS_SCALE_KEYS,
    json_safe,
    leaves_from,
    place_like,
    restore_targets,
)
from nitro.runs.checkpoint_writer import await_writers
from nitro.runs.identity import (
    Choice,
    RunIdentity,
    candidates_elsewhere,
    choose_run,
    describe,
)
from nitro.runs.run_dirs import (
    experiment_root,
    list_runs,
    read_run_json,
)
from nitro.runs.run_lock import check_free
from nitro.runs.training_config import training_config, training_differences

__all__ = [
    "check_no_writer",
    "fitting_run",
    "restore",
    "restore_population",
    "restore_variables",
    "resume_source",
    "run_to_resume",
    "said_resumed",
    "warn_user",
]


_OURS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),)  # nitro/
_OURS += (os.path.join(os.path.dirname(_OURS[0]), "nitro_ipython"),)


def warn_user(message: str) -> None:
    """A RuntimeWarning pointing at the first caller outside Nitro (the user's line)."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(_OURS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level)


def _config_of_instance(experiment: Any) -> dict[str, Any]:
    return {
        spec.name: config_token(getattr(experiment, spec.name))
        for spec in field_specs(type(experiment))
        if spec.kind is FieldKind.GRAPHCONST
    }


def restore(
    files: Any,
    setup: RunSetup,
    state: TrainState,
    events: Events,
    device: Mapping[str, Any],
    say: Callable[[str], None] | None = None,
    fresh_optimizer: bool = False,
) -> tuple[TrainState, CheckpointRecord]:
    """The state a run resumes from, read from the checkpoint `files` (its `RunFiles`) planned
    to continue (a new `TrainState`; `state`, the fresh one, gives the arrays' shapes and
    stays as it was), and the checkpoint's record. `device`: the Device fields' values now,
    compared with the saved ones. `say`: how to tell the person what the resume continues and
    what differs (default: an event note; a handle without progress prints them).
    `fresh_optimizer` (`restore_optimizer=False`): the optimizer state starts afresh (the
    state's own), so the run may go on with another optimizer."""
    found = files.resume_from
    assert found is not None  # planned: a run that resumes
    note = say or events.note
    saved, record = files.read(restore_targets(setup, state.variables))
    _check_config(setup, record)
    for line in _drift_notes(setup, record, device):
        note(line)
    fresh = fresh_optimizer and state.variables.opt_state is not None
    if fresh:
        note("restore_optimizer=False: the optimizer state starts afresh")
    elif state.variables.opt_state is not None and "opt_state" not in saved:
        raise SetupError(
            f"the checkpoint at {str(found.directory)!r} step {found.step} holds no optimizer "
            f"state (it was saved by a run without a 'train' split); resume needs one: use "
            f"weights= to start from its weights instead"
        )
    variables = restore_variables(
        setup, state.variables, saved, record, found, note=note, fresh_optimizer=fresh
    )
    restored = record.train_state(variables, seed=state.seed)
    said_resumed(files, "run", restored.epoch, restored.step, note)
    return restored, record


def restore_population(
    files: Any, members: Sequence[Any], state: Any, note: Callable
) -> CheckpointRecord:
    """Continue the checkpoint a population's files found, as `restore` continues a run's:
    every member's variables, optimizer state, healthy flag, why it stopped, history and the
    running sums of its epoch under way, and the shared counters, into `state` (the fresh
    stacked state) and the members (each member's `LoggingReporter` reattaches its logger
    runs); refused, naming what differs, when the members' settings
    or the program do not. Returns the checkpoint's record."""
    found = files.resume_from
    saved, record = files.read()
    lead = members[0]
    lines = setting_differences([m.settings for m in record.members], files.settings)
    if record.batches != state.batches:
        lines.append(
            f"  batches: the checkpoint's {record.batches!r}, this population's {state.batches!r}"
        )
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
    variables = restore_variables(
        lead.setup, state.variables, saved, record, found, here="this population's", note=note
    )
    healthy = jnp.asarray([e.healthy for e in record.members])
    place = state.place or (lambda tree: tree)  # as the population lays out its members
    state.variables, state.healthy = place((variables, healthy))
    state.step, state.epoch, state.position = record.step, record.epoch, record.position
    state.prune = dict(record.prune)
    for member, entry in zip(members, record.members, strict=True):
        member.state = record.train_state(
            member.state.variables, seed=member.state.seed, member=entry
        )
        member.stopped, member.stopped_at = entry.stopped, entry.stopped_at
        member.sat_out = member.state.steps_sat_out()  # its spikes' roll-backs
        member.state.step = member.own_step(member.state.step)
        if member.stopped is not None:  # its counters stay where it stopped
            member.state.epoch = int(member.state.last_row.get("epoch", 0))
        if member.logging is not None:
            member.logging.reattach(entry.logger)
    said_resumed(files, "population", state.epoch, state.step, note)
    return record


def said_resumed(files: Any, what: str, epoch: int, step: int, note: Callable) -> None:
    """After a resume (of a run or a population, `what`): its checkpoint writer counts the
    step resumed from as saved, and `note` says what was resumed."""
    if files.store is not None:
        files.store.saved_epoch, files.store.saved_step = epoch, step
    if files.branched_from is None:
        said = f"resumed {what} {files.run_id} from its checkpoint"
    else:
        said = (
            f"resumed from {what} {files.branched_from}'s earlier checkpoint as a new {what} "
            f"{files.run_id} (the later checkpoints of {files.branched_from} stay as they "
            f"were);"
        )
    note(f"{said} at epoch {epoch}, step {step} ({files.resume_from.path})")


def resume_source(
    setup: RunSetup,
    identity: RunIdentity,
    say: Callable[[str], None],
    targets: Mapping[tuple[str, ...], Any] | None = None,
    kind: str = "run",
    prefer: Callable[[Path], bool] | None = None,
) -> SavedStep | None:
    """The checkpoint `resume=` continues: the one it names, or for "auto" the run `run_dir=`
    names, else the run of this experiment `choose_run` picks among those of `kind` (a
    population's: `prefer`, its runs of the same members); None, with a warning, when none."""
    resume = setup.resume
    if isinstance(resume, CheckpointRef):
        check_no_writer(Path(resume.path))
        return resolve_checkpoint(resume, targets=targets)
    name = setup.cls.__name__
    root = Path(setup.run_dir) if setup.run_dir is not None else experiment_root(name)
    check_free(root)  # run_dir= names a run another writer holds: its checkpoints change
    runs = list_runs(root)
    if [run.path for run in runs] == [root.absolute()]:  # run_dir= names one run: that one
        if runs[0].checkpoints:
            say(f"resume='auto' continues {kind} {runs[0].run_id}: the {kind} run_dir= names")
            return resolve_checkpoint(root, targets=targets)
        choice = None
    else:
        choice = choose_run(root, identity, config_of(setup), kind=kind, prefer=prefer)
    if choice is None:
        others = candidates_elsewhere(root, identity)
        aside = (
            f" ({others} run{'s' * (others > 1)} of other experiments named {name} there: "
            f"another module or notebook; resume=<run dir> continues one)"
            if others
            else ""
        )
        what = "checkpoint" if kind == "run" else f"{kind}'s checkpoint"
        warn_user(
            f"resume='auto' found no {what} under {str(root.absolute())!r} of "
            f"{identity.where()}; starting a fresh {kind}{aside}"
        )
        return None
    say(f"resume='auto' continues {kind} {choice.run.run_id}: {choice.why}")
    check_free(choice.path)
    return resolve_checkpoint(choice.path, targets=targets)


def check_no_writer(path: Path) -> None:
    """`resume=<path>`: refused while a writer holds the run it names (a run directory, its
    checkpoints directory or one step's)."""
    path = path.absolute()
    await_writers(path)
    for run_dir in (path, path.parent, path.parent.parent):
        if (run_dir / "checkpoints").is_dir():
            check_free(run_dir)
            return


def run_to_resume(
    experiment: Any, name: str | None = None, *, pick: str | None = None, pick_hint: str = ""
) -> Choice | None:
    """The run on disk that `experiment`'s handle named `name` continues (`%nitro train exp
    --resume`): the run the name last trained, else the only run of this experiment (same
    module, class and notebook) with its GraphConst values; several such runs are refused
    with a SetupError listing them (`pick_hint`: how to pick one). `pick`: a run id under
    `runs/<Experiment>/`, or a run directory. None when no run has a checkpoint."""
    cls = type(experiment)
    identity = RunIdentity.of(cls, name)
    root = experiment_root(cls.__name__)
    if pick is None:
        return choose_run(
            root, identity, _config_of_instance(experiment), strict=True, pick_hint=pick_hint
        )
    named = Path(pick)
    runs = list_runs(named) if named.is_dir() else []
    if [run.path for run in runs] == [named.absolute()]:
        return Choice(runs[0], f"the run directory {pick} named")
    for run in list_runs(root):
        if pick in (run.run_id, run.path.name):
            return Choice(run, f"run {pick}, as named")
    known = [
        describe(run, read_run_json(run.path))
        for run in list_runs(root)
        if run.checkpoints and identity.same_experiment(read_run_json(run.path))
    ]
    raise SetupError(
        f"no run {pick!r} under {str(root.absolute())!r}"
        + (":\nruns of " + identity.where() + ":\n" + "\n".join(known) if known else "")
        + "\nGive a run id from that list, or a run directory's path"
    )


def fitting_run(experiment: Any, name: str | None = None) -> Choice | None:
    """The run under `runs/<Experiment>/` that `resume="auto"` continues for `experiment` (a
    handle named `name`) when one of its runs has these GraphConst values; None when none
    has: then `resume="auto"` would pick the newest and refuse it, naming the values that
    differ, and `nitro train` starts a new run instead."""
    cls = type(experiment)
    config = _config_of_instance(experiment)
    root = experiment_root(cls.__name__)
    choice = choose_run(root, RunIdentity.of(cls, name), config)
    if choice is None or read_run_json(choice.path).get("graphconst") != config:
        return None
    return choice


def _check_config(setup: RunSetup, record: CheckpointRecord) -> None:
    changed = record.graphconst_differences(setup, "checkpoint", "now")
    if changed:
        raise SetupError(
            "cannot resume: GraphConst fields differ from the checkpoint's, so its state does "
            "not fit the programs this experiment builds:\n"
            + "\n".join(changed)
            + "\nBuild the experiment with the checkpoint's values, or start a new run from its "
            "weights with weights= (the model must still fit)."
        )
    if record.experiment and record.experiment != setup.owner:
        warn_user(f"resuming a checkpoint of {record.experiment} into {setup.owner}")


def restore_variables(
    setup: RunSetup,
    template: Variables,
    saved: Mapping[str, Any],
    record: CheckpointRecord,
    found: SavedStep,
    *,
    here: str = "this run's",
    note: Callable[[str], Any] | None = None,
    fresh_optimizer: bool = False,
) -> Variables:
    """A checkpoint's parameters, model state, optimizer state, moving average (with its
    step count) and float16 loss scale, shaped like `template` (a single run's variables, or
    a population's, stacked) and placed as `setup` places them (sharded leaves onto the
    template's shardings); a misfit names the leaves. A checkpoint without a moving average
    or a loss scale that `template` keeps starts them afresh (and says so through `note`).
    The training settings that differ from the checkpoint's are warned of."""
    model = setup.model
    paths = model.leaf_paths
    params = leaves_from("parameters", saved["params"], paths["parameter"], template.params)
    rest = leaves_from(
        "model state", saved.get("model_state", {}), paths["model state"], template.model_state
    )
    opt = None
    if template.opt_state is not None and not fresh_optimizer:
        opt = leaves_from(
            "optimizer state",
            saved.get("opt_state", {}),
            paths["optimizer state"],
            template.opt_state,
            misfit=_optimizer_misfit(setup, record, found),
            here=here,
        )
    differences = training_differences(record.training, training_config(setup))
    if differences is not None and not fresh_optimizer:
        warn_user(differences)
    ema = ema_steps = None
    if template.ema is not None:
        if "ema" in saved:
            ema = leaves_from(
                "moving average of the weights", saved["ema"], paths["parameter"], template.ema
            )
            ema_steps = np.asarray(saved["ema_steps"], dtype=np.int32)
        else:  # a run that did not average before: start the average here
            ema, ema_steps = list(params), np.zeros(np.shape(template.ema_steps), np.int32)
            if note is not None:
                note("the checkpoint holds no moving average: it starts from its weights")
    loss_scale = template.loss_scale
    if loss_scale is not None:  # precision="float16": resume its dynamic loss scale
        if "loss_scale" in saved:
            zeros = [np.zeros(np.shape(x), x.dtype) for x in loss_scale]
            loss_scale = leaves_from("loss scale", saved["loss_scale"], LOSS_SCALE_KEYS, zeros)
        elif note is not None:  # a run that did not scale its loss before
            scale = setup.precision.initial_scale if setup.precision is not None else 1.0
            note(
                f"the checkpoint holds no loss scale (it was not trained in float16): the "
                f"dynamic loss scale starts at {scale:g}"
            )
    put = setup.placement.put_replicated

    def place(values: list | None, likes: list | None) -> list | None:
        if values is None:
            return None
        if likes is None:
            return [put(x) for x in values]
        return [place_like(x, like, put) for x, like in zip(values, likes, strict=True)]

    return Variables(
        params=place(params, template.params),  # pyright: ignore[reportArgumentType]
        model_state=place(rest, template.model_state),  # pyright: ignore[reportArgumentType]
        opt_state=template.opt_state if fresh_optimizer else place(opt, template.opt_state),
        ema=place(ema, template.ema),
        ema_steps=(
            place_like(ema_steps, template.ema_steps, put) if ema_steps is not None else None
        ),
        loss_scale=place(loss_scale, template.loss_scale),
    )


def _optimizer_misfit(setup: RunSetup, record: CheckpointRecord, found: SavedStep) -> str:
    """What an optimizer state that does not fit means (the parameters fit: they were restored
    first), with the two optimizers and the fixes."""
    assert setup.optimizer is not None  # a run with an optimizer state
    now = describe_optimizer(setup.optimizer)
    saved = record.optimizer or "not recorded (saved by an earlier version of Nitro)"
    same = (
        " (described alike: a setting that shapes its state differs, such as decay_mask or "
        "the transformation's stages)"
        if saved == now
        else ""
    )
    return (
        f"cannot resume: the checkpoint's optimizer state does not fit this run's optimizer, "
        f"so the checkpoint was saved with another optimizer{same}:\n"
        f"  the checkpoint's: {saved}\n"
        f"  this run's:       {now}\n"
        f"Resume with the checkpoint's optimizer (the same optimizer=, gradient_clip_norm=, "
        f"weight_decay= and param groups), or start a new run from its weights with this "
        f"optimizer: Nitro({setup.cls.__name__}(...), weights={str(found.path)!r}) (a fresh "
        f"optimizer state and step count). The optimizer state's leaves that differ:"
    )


def _drift_notes(setup: RunSetup, record: CheckpointRecord, device: Mapping[str, Any]) -> list[str]:
    notes = []
    saved = record.code
    changed = [
        unit
        for unit, fp in setup.experiment.code.items()
        if unit in saved and saved[unit] != fp.digest and unit != "optimizer"
    ]
    swapped = [r for r in record.swaps if r.get("status") == "swapped"]
    if changed:
        notes.append(
            f"resuming with changed code: {', '.join(changed)} differ from the code the "
            f"checkpoint was trained with"
            + (
                f" (its last live edit, of {', '.join(swapped[-1].get('changed') or ['code'])}, "
                f"was swapped in at step {swapped[-1].get('step')})"
                if swapped
                else ""
            )
        )
    elif swapped:
        last = swapped[-1]
        notes.append(
            f"continuing with the code of the live edit swapped in at step {last.get('step')} "
            f"(of {', '.join(last.get('changed') or ['code'])}), as the checkpoint was trained"
        )
    devices = record.member.device
    for name, value in device.items():
        if name in devices and devices[name] != json_safe(value):
            notes.append(
                f"Device field {name!r} is {value!r} here and was {devices[name]!r} in the "
                f"checkpoint; the run continues with {value!r}"
            )
    seed = record.member.seed
    if seed is not None and seed != setup.seed:
        notes.append(
            f"the checkpoint's seed {seed} replaces seed={setup.seed} (the data order "
            f"and the hooks' rngs continue as they began)"
        )
    return notes
