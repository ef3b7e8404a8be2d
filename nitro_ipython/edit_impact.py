"""What an edit makes stale: which programs of a live run recompile, and which are reused.

Built on the engine's public staleness API (`Nitro.stale_changes()`: each hook, helper or model
class that changed since the handle was built; `nitro.staleness.programs_using`: which programs
each unit of code reaches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import nitro
from nitro.staleness import PROGRAM_KINDS, programs_using

from .rebuild import has_epochs_to_go

__all__ = ["EditImpact", "edit_impact", "held_programs"]

EVERY_PROGRAM = tuple(kind.value for kind in PROGRAM_KINDS)


def held_programs(owner: str) -> list[str]:
    """Kinds of the programs compiled so far for an experiment (module.qualname)."""
    kinds = []
    for program in nitro.cache_stats().programs:
        if program["owner"] == owner and program["kind"] not in kinds:
            kinds.append(program["kind"])
    return kinds


@dataclasses.dataclass
class EditImpact:
    name: str
    experiment: str
    changes: list[str]
    recompile: list[str]
    reused: list[str]
    host_only: bool
    continues: bool = True  # `%nitro train` continues the run (it has epochs to go)

    def __str__(self) -> str:
        what = "; ".join(self.changes)
        head = f"{self.name} ({self.experiment}): {what} changed"
        if self.host_only:
            return f"{head}; it runs on the host, so nothing recompiles."
        if not self.recompile:
            return f"{head}; no program compiled so far uses it."
        text = f"{head}: {_join(self.recompile)} will recompile"
        if self.reused:
            text += f"; {_join(self.reused)} {'is' if len(self.reused) == 1 else 'are'} reused"
        if not self.continues:
            return (
                f"{text}. `%nitro train {self.name}` starts a new run with the edit from its "
                f"weights; `--epochs N` continues this one."
            )
        if any(change.startswith("model") for change in self.changes):
            return (
                f"{text}. `%nitro train {self.name}` continues the run with the edit (a new run "
                f"from its weights if the model's structure changed)."
            )
        return f"{text}. `%nitro train {self.name}` continues the run with the edit."


def _train_programs_left_out(handle: Any) -> set[str]:
    """The train programs a handle rebuilt from `handle` will not compile: it continues
    `handle`'s steps per call (`n.dispatch`), so once that is decided it runs fused calls
    of K steps (single steps only for an epoch's remainder) or single steps, not both. The
    compile cache may hold both for the experiment: the single steps "auto" timed before it
    chose K, or another handle's."""
    steps = handle.dispatch.steps
    if steps is None:  # still measuring: it may compile either
        return set()
    if steps == 1:
        return {"multi-step train"}
    try:
        batches = len(handle.splits["train"])
    except (KeyError, TypeError):  # batches unknown: a remainder may need single steps
        return set()
    return {"train step"} if batches % steps == 0 else set()


def _join(names: Iterable[str]) -> str:
    names = list(names)
    if len(names) <= 1:
        return "".join(names) or "nothing"
    return ", ".join(names[:-1]) + " and " + names[-1]


def edit_impact(handle: Any, name: str) -> EditImpact | None:
    """The programs an edit makes stale for `handle`, or None when the edit does not reach it."""
    changes = handle.stale_changes()
    if not changes:
        return None
    described = [
        f"{unit} ({', '.join(parts)})" if parts else unit for unit, parts in changes.items()
    ]
    stale = {kind.value for unit in changes for kind in programs_using(unit)}
    held = held_programs(handle.owner)
    unused = _train_programs_left_out(handle)  # the rebuilt run never calls them
    held = [kind for kind in held if kind not in unused]
    order = {kind: i for i, kind in enumerate(EVERY_PROGRAM)}
    recompile = sorted((k for k in stale if k in held), key=lambda k: order.get(k, 99))
    reused = [kind for kind in held if kind not in stale]
    return EditImpact(
        name=name,
        experiment=handle.cls.__name__,
        changes=described,
        recompile=recompile,
        reused=reused,
        host_only=not stale,
        continues=has_epochs_to_go(handle),
    )
