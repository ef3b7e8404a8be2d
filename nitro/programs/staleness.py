"""Staleness: what changed in an experiment's code since a handle froze it, and what it reaches.

A handle freezes copies of its hooks and fingerprints the code they reach (hooks, helpers,
model classes). After an edit (a re-run cell, a module reload) the live code may differ:
`stale_changes` says which units changed and in which parts, `programs_using` which compiled
programs a unit reaches. This is the public API the notebook layer builds its reload reports
on; it is documented in docs/architecture.md.

>>> import nitro
>>> [kind.value for kind in nitro.staleness.programs_using("loss")]
['train step', 'multi-step train', 'eval forward', 'population train step', 'population eval forward']
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping

from nitro.core.run_setup import RunSetup
from nitro.experiments.declaration import edit_generation, is_experiment
from nitro.experiments.fingerprint import (
    CodeFingerprint,
    Fingerprinter,
    code_digest,
    diff_parts,
    is_library_module,
)
from nitro.experiments.hooks import with_hooks
from nitro.programs.compile_cache import ProgramKind
from nitro.programs.specs import PROGRAM_UNITS, programs_using

__all__ = [
    "PROGRAM_KINDS",
    "class_is_gone",
    "code_digest",
    "current_class",
    "edit_generation",
    "is_experiment",
    "is_library_module",
    "programs_using",
    "stale_changes",
    "stale_report",
]

# Every program kind, in the order reports list them.
PROGRAM_KINDS: tuple[ProgramKind, ...] = tuple(PROGRAM_UNITS)


def current_class(cls: type) -> type:
    """The class now bound to `cls`'s qualified name in the namespace that defined it.

    After a re-run cell or a module reload that is a new class; the namespace is found through
    the globals of the class's own functions (a module's dict survives `importlib.reload`).
    Returns `cls` itself when the name is gone or bound to something else (`class_is_gone`).
    A class given hooks (`hooks=`) is its live class with the same hooks.
    """
    given = cls.__dict__.get("__nitro_hooks__")
    if given is not None:
        return with_hooks(current_class(given[0]), given[1])
    target = _bound_to_name(cls)
    return target if isinstance(target, type) else cls


def class_is_gone(cls: type) -> bool:
    """True when an edit removed `cls`: its qualified name no longer names a class in the
    namespace that defined it (the class was renamed or deleted). A class defined inside a
    function cannot be looked up again, and is never reported gone.

    >>> import nitro
    >>> class_is_gone(nitro.Nitro)
    False
    """
    given = cls.__dict__.get("__nitro_hooks__")
    if given is not None:
        return class_is_gone(given[0])
    if "<locals>" in cls.__qualname__:
        return False
    return not isinstance(_bound_to_name(cls), type)


def _bound_to_name(cls: type):
    namespace = None
    for attr in vars(cls).values():
        fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        if inspect.isfunction(fn):
            namespace = fn.__globals__
            break
    if namespace is None:
        module = sys.modules.get(cls.__module__)
        namespace = vars(module) if module is not None else {}
    head, *rest = cls.__qualname__.split(".")
    target = namespace.get(head)
    for part in rest:
        target = getattr(target, part, None)
    return target


def _own_changes(frozen: CodeFingerprint, fp: Fingerprinter, skip: str = "") -> list[str]:
    return [
        d for d in diff_parts(frozen.parts, fp.parts) if d != skip and not d.startswith("library ")
    ]


def stale_changes(setup: RunSetup) -> dict[str, list[str]]:
    """Code that changed since `setup` was built: unit (a hook name or "model") -> the parts
    that changed in it ("helper mlp_block", "method MLP.__call__"; empty when the hook itself
    changed; ["removed"] or ["added"] for hooks that disappeared or appeared)."""
    experiment = setup.experiment
    live = current_class(experiment.cls)
    changes: dict[str, list[str]] = {}
    for name, frozen in experiment.code.items():
        if name == "optimizer":
            continue
        if name == "model":
            fp = Fingerprinter()
            for cls in experiment.model_classes:
                fp.add_class(current_class(cls))
            diff = _own_changes(frozen, fp)
            if diff:
                changes["model"] = diff
            continue
        try:
            attr = inspect.getattr_static(live, name)
        except AttributeError:
            changes[name] = ["removed"]
            continue
        fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        fp = Fingerprinter(self_class=live)
        try:
            fp.hook(name, fn)
        except Exception:  # noqa: BLE001 - an unreadable hook counts as changed
            changes[name] = []
            continue
        diff = _own_changes(frozen, fp, skip=f"hook {name}")
        if diff or frozen.digest != fp.fingerprint().digest:
            changes[name] = diff
    for name in ("metrics", "train_metrics", "finalize_metrics"):
        if name not in experiment.hooks and hasattr(live, name):
            changes[name] = ["added"]
    return changes


def stale_report(setup: RunSetup, held: list[str]) -> str | None:
    """A sentence saying what changed, which programs it reaches, and what to do; None when
    nothing changed. `held` names the programs the handle holds."""
    changes = stale_changes(setup)
    if not changes:
        return None
    return describe_changes(setup.cls.__name__, changes, held)


_AS_HANDLE_PROGRAM = {
    ProgramKind.MULTI_STEP: ProgramKind.TRAIN_STEP,
    ProgramKind.POPULATION_STEP: ProgramKind.TRAIN_STEP,
    ProgramKind.POPULATION_EVAL: ProgramKind.EVAL_FORWARD,
}


def describe_changes(name: str, changes: Mapping[str, list[str]], held: list[str]) -> str:
    what = "; ".join(
        f"{unit} ({', '.join(parts)})" if parts else unit for unit, parts in changes.items()
    )
    affected = []
    for unit in changes:
        for kind in programs_using(unit):
            # the fused steps are train steps too; a population's are a handle's, vmapped
            kind = _AS_HANDLE_PROGRAM.get(kind, kind)
            if kind.value not in affected:
                affected.append(kind.value)
    reach = (
        f" It reaches the {', '.join(affected)} programs."
        if affected
        else " It runs on the host: no program recompiles."
    )
    return (
        f"{name} changed since this handle was built: {what}.{reach} This handle keeps what "
        f"it froze (programs held: {', '.join(held) or 'none yet'}); build a new handle to use "
        f"the edit, e.g. nitro.Nitro({name}(...), weights=n)."
    )
