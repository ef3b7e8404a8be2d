"""Live edits: code edited while a handle trains, compiled beside the run and swapped in at
a dispatch boundary.

`start_edit` re-freezes the experiment from its live class (the hooks, the helpers they call,
the model's classes) into a new `RunSetup`, checks that the train state keeps its layout (the
same fields, hooks, batch routing, and the model's parameter and state shapes), then compiles,
on a thread of its own, exactly the programs of the handle's `ProgramSet` whose code the edit
reaches (`ProgramSet.for_setup`) and which the run calls from then on (its steps per call,
evaluation: `DispatchPlan.calls`); the others compile when first called. The loop keeps
training on the old programs meanwhile. Once
compiled, the new setup and programs wait in the run-time record (`LiveEdits`) for the loop,
which swaps them in between two calls (`swaps.py`): the pause it sees is the swap, not the
compile. A handle that is not training takes them at once, or when the call that holds it
(a `validate()`) returns.

The first `PROBATION_STEPS` steps after a swap are on probation: the loop keeps a copy of
the variables from before the swap, and a non-finite loss in those steps rolls the run back to
that copy and the old programs. A host hook the edit changed (host metrics,
`finalize_metrics`) is on probation until its first call: one that raises there rolls back to
the old code (`swaps.HostProbation`). A refused or broken edit (a new model structure,
a trace error, a shape error) never reaches the loop: the old programs go on, and the note
names the hook, file and line.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from nitro.core import events as events_module
from nitro.core.events import Events
from nitro.core.frozen import FrozenDict
from nitro.core.run_setup import RunSetup
from nitro.core.sharding import build_model
from nitro.engine.dispatch import DispatchPlan
from nitro.engine.setup import (
    freeze_hook_code,
    freeze_hooks,
    hooks_fields,
    model_graphdefs,
    resolve_residency,
)
from nitro.engine.swaps import LiveEdit, LiveEdits, Swap, where_raised
from nitro.experiments.declaration import field_specs
from nitro.experiments.equinox import as_nnx_model
from nitro.experiments.fingerprint import (
    Fingerprinter,
    code_digest,
    diff_parts,
)
from nitro.experiments.linen import is_linen
from nitro.experiments.presets import preset_of, remember
from nitro.optim.param_groups import leaf_paths
from nitro.programs.compile_cache import short_dtype
from nitro.programs.specs import ProgramSet
from nitro.programs.staleness import class_is_gone, current_class

__all__ = ["Refused", "live_instance", "refreeze", "start_edit"]


class Refused(Exception):
    """An edit that cannot apply to a live run (its message says why and what to do)."""


# ---------------------------------------------------------------------------------------------
# re-freezing the experiment from its live class


def _host_digests(functions: Mapping[str, Any]) -> dict[str, str]:
    return {name: code_digest(fn) for name, fn in functions.items() if callable(fn)}


def _changes(setup: RunSetup, code, functions) -> dict[str, list[str]]:
    old = setup.experiment.code
    changes: dict[str, list[str]] = {}
    for unit, fp in code.items():
        before = old.get(unit)
        if before is None:
            changes[unit] = ["added"]
        elif before.digest != fp.digest:
            parts = [d for d in diff_parts(before.parts, fp.parts) if not d.startswith("library ")]
            changes[unit] = parts if parts != [unit] else []
    old_host = _host_digests(setup.experiment.hook_functions)
    for name, digest in _host_digests(functions).items():
        if name not in code and old_host.get(name) != digest:
            changes[name] = []
    return changes


def _fields(experiment: Any) -> dict[str, Any]:
    return {f.name: getattr(experiment, f.name) for f in dataclasses.fields(experiment) if f.init}


def live_instance(experiment: Any, cls: type) -> Any:
    """`experiment`, or an instance of `cls` (its class as edited, or as it was before an
    edit) with the same field values."""
    if type(experiment) is cls:
        return experiment
    return remember(cls(**_fields(experiment)), preset_of(experiment))


def _model_setup(setup: RunSetup, instance: Any, variables: Any):
    """The model's new graph definitions and fingerprint for edited model classes, when the
    parameters and the model state keep their layout (else `Refused`)."""
    abstract = nnx.eval_shape(
        lambda: build_model(lambda: as_nnx_model(instance.build_model(nnx.Rngs(setup.seed))))
    )
    if isinstance(abstract, Mapping):
        abstract = nnx.Dict({str(k): v for k, v in abstract.items()})
    if is_linen(abstract) or not isinstance(abstract, nnx.Module):
        raise Refused("the model's classes changed and build_model returns no NNX model")
    graphdefs, params, rest = model_graphdefs(abstract)
    paths = setup.model.leaf_paths
    notes = [
        *_layout_changes("parameter", paths["parameter"], variables.params, params),
        *_layout_changes("model state", paths["model state"], variables.model_state, rest),
    ]
    if not notes and (
        jax.tree.structure(params) != setup.model.params_def
        or jax.tree.structure(rest) != setup.model.model_state_def
    ):
        notes = ["the tree of its variables"]
    if notes:
        if len(notes) > 3:
            notes = [*notes[:3], f"and {len(notes) - 3} more"]
        raise Refused(
            f"the model's structure changed ({'; '.join(notes)}): a live run keeps its "
            f"weights' layout. Stop the run and train again to rebuild it with the new model "
            f"(`%nitro train` keeps the weights that fit)"
        )
    fingerprinter = Fingerprinter()
    structure = fingerprinter.structure(graphdefs[0])
    model = dataclasses.replace(
        setup.model,
        graphdef_train=graphdefs[0],
        graphdef_eval=graphdefs[1],
        structure=structure,
    )
    return model, fingerprinter.fingerprint(), tuple(fingerprinter.classes)


def _layout_changes(kind: str, old_paths, old_leaves, new_tree) -> list[str]:
    """'parameter hidden.kernel: f32[64,32] -> f32[64,48]' for each array of the live run's
    `old_leaves` (at `old_paths`) that the new model's `new_tree` changes, adds or removes."""

    def layout(x) -> str:
        return f"{short_dtype(str(x.dtype))}[{','.join(map(str, x.shape))}]"

    old = dict(zip(old_paths, map(layout, jax.tree.leaves(old_leaves)), strict=True))
    new = dict(zip(leaf_paths(new_tree), map(layout, jax.tree.leaves(new_tree)), strict=True))
    notes = [f"{kind} {p}: {old[p]} -> {new[p]}" for p in old if p in new and old[p] != new[p]]
    notes += [f"{kind} {p} ({new[p]}) added" for p in new if p not in old]
    notes += [f"{kind} {p} ({old[p]}) removed" for p in old if p not in new]
    return notes


def refreeze(
    setup: RunSetup, experiment: Any, variables: Any
) -> tuple[RunSetup, Any, dict[str, list[str]]] | None:
    """(the setup for the experiment's live code, the live experiment as an instance of the
    live class, what changed), or None when nothing changed. `Refused` when the edit changes
    what a live run keeps: the experiment's fields, its hooks, the batch fields they take,
    where metrics run, or the model's structure."""
    old_cls = setup.cls
    if class_is_gone(old_cls):
        raise Refused(f"class {old_cls.__qualname__} is gone (renamed or deleted)")
    cls = current_class(old_cls)
    name = cls.__qualname__
    kinds = lambda c: [(s.name, s.kind) for s in field_specs(c)]  # noqa: E731
    if kinds(cls) != kinds(old_cls):
        raise Refused(
            f"the fields of {name} changed ({_field_change(old_cls, cls)}): fields are part of "
            f"the setup. Stop the run and train again to build it with them"
        )
    hooks, functions = freeze_hooks(cls)
    if set(hooks) != set(setup.experiment.hooks):
        added = sorted(set(hooks) - set(setup.experiment.hooks))
        removed = sorted(set(setup.experiment.hooks) - set(hooks))
        what = "; ".join(
            x
            for x in (
                f"added {', '.join(added)}" if added else "",
                f"removed {', '.join(removed)}" if removed else "",
            )
            if x
        )
        raise Refused(
            f"hooks of {name} were {what}: a live run keeps its set of hooks. Stop the run "
            f"and train again to build it with them"
        )
    fields = hooks_fields(cls, hooks)
    for hook, spec in fields.items():
        before = setup.experiment.hook_fields.get(hook)
        if before != spec:
            raise Refused(
                f"hook `{hook}` now takes other batch fields ({_fields_of(before)} -> "
                f"{_fields_of(spec)}): the batch routing is decided at setup. Stop the run "
                f"and train again"
            )
    instance = live_instance(experiment, cls)
    if resolve_residency(instance) != dict(setup.experiment.residency):
        raise Refused(
            "metrics_residency changed where metrics run: decided at setup. Stop the run and "
            "train again"
        )
    code = dict(freeze_hook_code(cls, functions))
    model, model_code, classes = setup.model, setup.experiment.code["model"], None
    live_classes = [current_class(c) for c in setup.experiment.model_classes]
    probe = Fingerprinter()
    for c in live_classes:
        probe.add_class(c)
    if [d for d in diff_parts(model_code.parts, probe.parts) if not d.startswith("library ")]:
        model, model_code, classes = _model_setup(setup, instance, variables)
    code["model"] = dataclasses.replace(model_code, parts=FrozenDict(model_code.parts))
    if "optimizer" in setup.experiment.code:
        code["optimizer"] = setup.experiment.code["optimizer"]
    code = {u: dataclasses.replace(fp, parts=FrozenDict(fp.parts)) for u, fp in code.items()}
    changes = _changes(setup, code, functions)
    if not changes and cls is old_cls:
        return None
    new_experiment = dataclasses.replace(
        setup.experiment,
        cls=cls,
        hooks=FrozenDict(hooks),
        hook_functions=FrozenDict(functions),
        code=FrozenDict(code),
        model_classes=classes if classes is not None else setup.experiment.model_classes,
    )
    return dataclasses.replace(setup, experiment=new_experiment, model=model), instance, changes


def _field_change(old: type, new: type) -> str:
    before = {s.name: s.kind.value for s in field_specs(old)}
    after = {s.name: s.kind.value for s in field_specs(new)}
    notes = [f"added {k}" for k in after if k not in before]
    notes += [f"removed {k}" for k in before if k not in after]
    notes += [
        f"{k}: {before[k]} -> {after[k]}" for k in after if k in before and before[k] != after[k]
    ]
    return ", ".join(notes) or "their order"


def _fields_of(spec: Any) -> str:
    if spec is None:
        return "none"
    return ", ".join((*spec.required, *spec.optional)) or "none"


# ---------------------------------------------------------------------------------------------
# compiling beside the run


class _NotesOnly:
    """The run's events as the side thread's compiles see them: their notes reach the run's
    reporters, prefixed; the run's phase is the loop's alone."""

    def __init__(self, events: Events):
        self.events = events

    @property
    def current_phase(self) -> str:
        return self.events.current_phase

    def phase(self, phase: str) -> None:
        pass

    def note(self, message: str, done: bool = False) -> None:
        self.events.note(f"live edit: {message}", done)


def _failure_note(changes: Mapping[str, list[str]], error: BaseException) -> str:
    hooks = ", ".join(f"`{u}`" for u in changes) or "the code"
    where = where_raised(error)
    at = f" ({where})" if where else ""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (
        f"the edit of {hooks} failed to compile{at}: {type(error).__name__}: {message}. The "
        f"run goes on with the code it had; fix it and save again"
    )


def _called(dispatch: DispatchPlan, setup: RunSetup, slot: tuple) -> bool:
    """Whether the run calls the program of a `ProgramSet` slot: the train programs of the
    steps per call it uses, evaluation's; not predict's (compiled at the next predict)."""
    if slot[0] == "predict":
        return False
    if slot[0] != "train":
        return True
    batches = setup.splits["train"].batches
    return dispatch.calls(slot[1], None if batches is None else -(-batches // setup.accum))


def start_edit(
    setup: RunSetup,
    experiment: Any,
    variables: Any,
    programs: ProgramSet,
    live: LiveEdits,
    events: Events,
    adopt: Callable[[RunSetup, ProgramSet], None],
    on_settled: Callable[[LiveEdit], None] | None = None,
    on_ready: Callable[[], None] | None = None,
    dispatch: DispatchPlan | None = None,
) -> LiveEdit:
    """Start applying the live code of `setup`'s experiment: refused, or compiled on a thread
    of its own and offered to the loop (`live.pending`; then `on_ready()`). `adopt(setup,
    programs)` is how the handle takes the code the run trains on (at a swap or a roll-back);
    `on_settled(edit)` hears of an edit refused or failed. With `dispatch` (the run's steps
    per call), only the programs the run calls are compiled (`edit.programs`); the others
    compile when first called. Returns the edit at once."""
    try:
        found = refreeze(setup, experiment, variables)
    except Refused as refusal:
        edit = LiveEdit(changes={})
        edit._settle("refused", f"{refusal}; the run goes on with the code it had")
        if on_settled is not None:
            on_settled(edit)
        return edit
    if found is None:
        edit = LiveEdit(changes={})
        edit._settle("swapped", "nothing that runs changed")
        return edit
    new_setup, instance, changes = found
    try:
        new_programs, pending = programs.for_setup(new_setup)
    except Exception as error:  # noqa: BLE001 - the note says it; the run goes on
        edit = LiveEdit(changes=changes)
        edit._settle("failed", _failure_note(changes, error))
        if on_settled is not None:
            on_settled(edit)
        return edit
    if dispatch is not None:
        pending = [p for p in pending if _called(dispatch, setup, p.slot)]
    edit = LiveEdit(changes=changes, programs=tuple(dict.fromkeys(p.spec.title for p in pending)))
    live.begin(edit)

    def compile_beside() -> None:
        start = time.perf_counter()
        try:
            with events_module.using(_NotesOnly(events)):  # pyright: ignore[reportArgumentType]
                compiled = new_programs.compile_pending(pending, warm=True)
        except Exception as error:  # noqa: BLE001 - the note says it; the run goes on
            edit._settle("failed", _failure_note(changes, error))
            if on_settled is not None:
                on_settled(edit)
            return
        edit.compile_seconds = time.perf_counter() - start
        titles = tuple(dict.fromkeys(p.title for p in compiled))
        reused = tuple(t for t in new_programs.held() if t not in titles)
        swap = Swap(edit, new_setup, new_programs, instance, titles, reused, adopt)
        if edit.status != "compiling":  # a newer edit started meanwhile
            return
        edit._settle("ready")  # before the loop can take it and make it "swapped"
        if not live.offer(swap):
            edit._settle("superseded", "a newer edit replaced it")
            return
        if on_ready is not None:
            on_ready()

    thread = threading.Thread(
        target=compile_beside, name=f"nitro-live-edit-{setup.cls.__name__}", daemon=True
    )
    thread.start()
    return edit
