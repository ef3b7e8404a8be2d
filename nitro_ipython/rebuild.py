"""When and how `%nitro train` rebuilds a handle after an edit.

Training an experiment again continues its handle while its field values are current. After
an edit of the experiment's code (a stale hook, model or helper, or a class redefined in a
cell), a run with epochs to go (stopped, failed, or `--epochs N`) takes the edit into its
handle (`apply_edits()`) and continues: epoch, step, optimizer state and history. Where it
cannot (the edit changes the model's structure, the fields or the hooks), after a completed
run, or with other field values, `%nitro train` builds a new handle from the live class,
starting from the previous handle's weights (unless `--fresh`) and keeping the steps per call
it measured, and says why. With `--resume` it continues the handle's run on disk (the run its
name last trained, else the only one that fits). Each new handle's run is named after the
handle (`exp_run`).
In a notebook a panel shows the new handle's setup while it builds.

A `nitro.Population` takes no edits and starts over as a new population: `population_to_train`
refuses `--fresh` and `--no-live-edits`, saying why, and with `--resume` builds a new population
of the same keywords that continues the run on disk.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError

import nitro
from nitro.dispatch import DispatchChoice
from nitro.staleness import current_class, is_experiment

from . import worker

__all__ = ["handle_to_train", "has_epochs_to_go", "population_to_train", "runs_experiment"]

# `%nitro train` options a population does not take, and why
_NOT_FOR_POPULATIONS = {
    "fresh": ("--fresh", "build a new nitro.Population to start over"),
}


def _fields(experiment: Any) -> dict[str, Any]:
    return {f.name: getattr(experiment, f.name) for f in dataclasses.fields(experiment) if f.init}


def _live_class(cls: type) -> type:
    """The class now bound to `cls`'s qualified name where it was defined (after an edit, the
    new one)."""
    live = current_class(cls)
    return live if is_experiment(live) else cls


def _live_experiment(experiment: Any) -> Any:
    """`experiment` as an instance of the live class (same field values, and the preset it
    was built from), for edited code."""
    cls = _live_class(type(experiment))
    if cls is type(experiment):
        return experiment
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {k: v for k, v in _fields(experiment).items() if k in known}
    preset = nitro.preset_of(experiment)
    if preset is not None and preset in nitro.presets(cls):
        return cls.from_preset(preset, **values)
    return cls(**values)


def handle_to_train(
    name: str,
    handle: nitro.Nitro | None,
    experiment: Any,
    weights: nitro.Nitro | None,
    *,
    fresh: bool = False,
    resume: bool | str = False,
    more: bool = False,
) -> nitro.Nitro:
    """The handle `%nitro train` trains under `name`: `handle` when its code and
    configuration are current; otherwise a new handle of the live experiment class (its run
    named `name`), starting from `weights` unless `fresh`, or continuing `name`'s run on disk
    with `resume` (True: the run `name` last trained, else the only run that fits; a run id
    or run directory: that run). After an edit of its code, `handle` takes the edit and
    continues its run when it has epochs to go or `more` epochs are asked for, and the edit
    keeps the run's layout; a new handle says why it starts a new run."""
    if handle is not None and handle.running and handle.stop_reason is not None:
        _finish(handle)  # the run has ended (its panel says so); its thread is finishing
    if handle is not None and handle.running:
        raise UsageError(
            f"{name} is already {handle.phase} in the background; `%nitro stop {name}` "
            f"stops it, `%nitro status {name}` shows how far it is"
        )
    live = _live_experiment(experiment)
    why = ""  # why a handle that exists is not continued
    if handle is not None and not fresh:
        if _fields(handle.experiment) != _fields(live):
            why = "its field values changed"
        elif not handle.stale_changes() and _live_class(handle.cls) is handle.cls:
            if handle.stop_reason == "error" and (more or has_epochs_to_go(handle)):
                print(
                    f"nitro: {name} continues its failed run (epoch {handle.epoch}, step "
                    f"{handle.step}, its optimizer state): its state is intact; `--fresh` "
                    f"starts over"
                )
            return handle
        elif not resume and not more and not has_epochs_to_go(handle):
            why = (
                f"the previous run completed its {handle.epoch} epochs (`--epochs N` "
                f"continues it with the edit)"
            )
        elif not resume:
            why = _continue_with_edit(name, handle)
            if not why:
                return handle
    source = None if fresh or resume else weights
    keywords = handle.given_keywords if handle is not None else {}
    if isinstance(keywords.get("steps_per_dispatch"), DispatchChoice):
        del keywords["steps_per_dispatch"]  # an earlier rebuild's: carry the newest instead
    measured = handle is not None and not handle.dispatch.probing
    if source is None and measured and "steps_per_dispatch" not in keywords:
        # keep the measured steps per call (and finish a check of the fused calls still
        # under way): an edit rarely changes how long a step takes, and measuring again
        # would compile the single step as well. With weights=handle, Nitro continues it.
        keywords["steps_per_dispatch"] = handle.dispatch
    keywords.pop("resume", None)  # a rebuilt handle starts from the previous weights
    keywords["name"] = keywords.get("name") or name
    choice = _run_to_resume(name, live, keywords["name"], resume) if resume else None
    if choice is not None:
        keywords["resume"] = str(choice.path)
    if handle is not None and "run_dir" in keywords:
        handle.close()  # the new handle writes where it wrote: it lets go of the directory
    panel = _setup_panel(type(live).__name__)
    try:
        new = nitro.Nitro(live, weights=source, **keywords)
    except nitro.WeightsError as error:
        worker.reserve_panel(None)
        if source is None:
            raise
        raise UsageError(
            f"the weights of {name} do not fit the new {type(live).__name__} model:\n"
            f"{error}\nAdd --fresh to start from newly initialized weights."
        ) from None
    except BaseException:
        worker.reserve_panel(None)
        raise
    if panel is not None and new.reporter not in set(worker.panel_reporters):
        worker.reserve_panel(None)  # this run reports another way (progress=...)
    if source is not None:
        print(
            f"nitro: {name} rebuilt from the current {type(live).__name__}, starting from the "
            f"weights of the previous run (step {source.step}) as a new run (epoch 0, a new "
            f"optimizer state): {why or 'its code changed'}"
        )
    if choice is not None and new.weights_checkpoint is not None:
        print(
            f"nitro: {name} continues run {new.run_id} from its checkpoint at epoch "
            f"{new.epoch}, step {new.step} ({choice.why})"
        )
    return new


def _continue_with_edit(name: str, handle: nitro.Nitro) -> str:
    """Take the edit of `handle`'s code into `handle` itself (`apply_edits()`), so that
    training continues its run: its epoch, step, optimizer state, history and run directory.
    Returns "" when it did (and says so), else why a new run must start (the edit changes
    what a run keeps: its model's structure, its fields or hooks)."""
    edit = handle.apply_edits().wait()
    if edit.status == "failed":
        raise UsageError(f"{name}: {edit.note}")
    if edit.status == "refused":
        return _cause(edit.note)
    what = ", ".join(f"`{unit}`" for unit in edit.changes) or "its code"
    print(
        f"nitro: {name} continues its run (epoch {handle.epoch}, step {handle.step}, its "
        f"optimizer state) with the edit of {what}, which keeps the run's layout; `--fresh` "
        f"starts over"
    )
    return ""


def has_epochs_to_go(handle: nitro.Nitro) -> bool:
    """Whether `%nitro train` without `--epochs` trains `handle` further (a run stopped, failed
    or not yet trained to `max_epochs`)."""
    return handle.epoch < max(handle.target_epoch, handle.max_epochs)


def _cause(note: str) -> str:
    """The cause in a refusal's note: the text before its first ': ' outside parentheses."""
    depth = 0
    for i, char in enumerate(note):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and note.startswith(": ", i):
            return note[:i]
    return note


def _run_to_resume(name: str, experiment: Any, run_name: str, resume: bool | str):
    """The run `%nitro train ... --resume [RUN_ID]` continues (None: none has a checkpoint;
    the new handle starts a fresh run, which is said)."""
    target = name.removesuffix("_run")
    hint = (
        f"Pick one: `%nitro train {target} --resume RUN_ID` (or a run directory's path); "
        f"in Python, nitro.Nitro(..., resume='runs/{type(experiment).__name__}/RUN_ID')"
    )
    pick = resume if isinstance(resume, str) else None
    try:
        choice = nitro.run_to_resume(experiment, run_name, pick=pick, pick_hint=hint)
    except nitro.SetupError as error:
        raise UsageError(f"%nitro train --resume: {error}") from None
    if choice is None:
        print(
            f"nitro: no checkpoint of {name} ({type(experiment).__name__} from this notebook) "
            f"under runs/{type(experiment).__name__}/ to resume; starting a fresh run"
        )
    return choice


def _finish(handle: nitro.Nitro, timeout: float = 10.0) -> None:
    """Wait for the thread of a run that has ended to finish (it reports the end first)."""
    deadline = time.monotonic() + timeout
    while handle.running and time.monotonic() < deadline:
        time.sleep(0.005)


def _setup_panel(title: str):
    """In a notebook, a panel that shows the setup while a new handle builds its data and
    model (seconds, on a first run), then serves the run."""
    if not worker.widgets_available():
        return None
    from .panel import LivePanel

    panel = LivePanel()
    panel.title.value = f"<b>{title}</b>"
    panel.status.value = "<b>setting up</b> &middot; the data, the model, the optimizer ..."
    panel.show(visible=True)
    worker.reserve_panel(panel)
    return panel


def runs_experiment(handle: Any, experiment: Any) -> bool:
    """Whether `handle` is a handle of `experiment`'s class (by its qualified name, so a
    class redefined by an edit still counts), which `%nitro train` continues."""
    cls = type(experiment)
    return (
        isinstance(handle, nitro.Nitro) and handle.owner == f"{cls.__module__}.{cls.__qualname__}"
    )


def population_to_train(pop: Any, name: str, args) -> Any:
    """The population `%nitro train POP` trains: `pop`, or with `--resume [RUN_ID]` a new
    one of its experiment and keywords that continues a run on disk (`resume=`: this
    experiment's population of the same members, the run RUN_ID beside `pop`'s directory, or
    a path). Refused, saying why, for the options a population does not take, and when there
    is no checkpoint to continue or it is not these members'."""
    for option, (flag, why) in _NOT_FOR_POPULATIONS.items():
        if getattr(args, option, False):
            raise UsageError(
                f"%nitro train {name} {flag}: {name} is a nitro.Population, and {why}; "
                f"train it with `%nitro train {name} [--epochs N] [--background] [--resume]`"
            )
    if not args.resume:
        return pop
    if pop.running:
        raise UsageError(
            f"%nitro train {name} --resume: {name} is {pop.phase} in the background; `%nitro "
            f"stop {name}` stops it (then `%nitro train {name}` goes on from where it stopped)"
        )
    target: Any = True
    root = Path(pop.given_keywords.get("run_dir") or Path(pop.run_dir).parent)
    if isinstance(args.resume, str):
        beside = Path(pop.run_dir).parent / args.resume
        target = args.resume if Path(args.resume).exists() else str(beside)
    keywords = {**pop.given_keywords, "resume": target}
    pop.close()  # the new population may write where it did; its next train() holds it again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            new = nitro.Population(pop.experiment, **keywords)
        except (nitro.PopulationError, nitro.SetupError) as error:
            raise UsageError(f"%nitro train {name} --resume: {error}") from None
    if not new.step:  # resume="auto" found no checkpoint: nothing to continue
        new.close()
        raise UsageError(
            f"%nitro train {name} --resume: no checkpoint of a {pop.cls.__name__} population "
            f"under {str(root.absolute())!r} to continue (a population saves one in its run "
            f"directory after its epochs, unless checkpointer=None); `%nitro train {name}` "
            f"trains {name} on from epoch {pop.epoch}, `--resume RUN_ID` names a run"
        )
    for warning in caught:  # what the resume said (a changed setting): the user's to read
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    print(
        f"nitro: {name} continues population {new.run_id} from its checkpoint at epoch "
        f"{new.epoch}, step {new.step} ({new.run_dir})"
    )
    return new
