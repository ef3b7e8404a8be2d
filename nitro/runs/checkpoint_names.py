"""Checkpoint names: what a run's checkpoint directories are called on disk.

By default a checkpoint is orbax's step directory, `<run_dir>/checkpoints/<step>`.
`Checkpointer(name=...)` names each one instead (`checkpoint_name`, the default hook when
naming, gives `epoch-0006-step-4500-val_loss=0.0416831`). The names go through orbax's own
step naming (`NamedSteps`, an orbax `NameFormat`): orbax writes a named checkpoint to a
temporary directory and renames it into place once whole, as it does a step directory, and
records its step in the checkpoint's `_CHECKPOINT_METADATA` (`custom_metadata`), where every
reader finds it. Step directories and named ones list together, so a run saved before naming
resumes with names, and the other way round.

>>> checkpoint_name(epoch=6, step=4500, metric="val_loss", score=0.04168312)
'epoch-0006-step-4500-val_loss=0.0416831'
>>> checkpoint_name(epoch=1, step=9, metric="val/acc*", score=None)
'epoch-0001-step-9'
>>> checkpoint_name(epoch=1, step=9, metric="val/acc*", score=0.5)
'epoch-0001-step-9-val_acc_=0.5'
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "NamedSteps",
    "checkpoint_name",
    "name_problem",
    "named_paths",
    "step_of",
    "step_path",
]

# What a checkpoints directory holds besides checkpoints: the steps orbax moves aside for
# deletion (`checkpoint_writer.DELETING`) and its root metadata.
RESERVED = ("deleting", "metadata")
STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's per-checkpoint metadata file
_TEMPORARY = ".orbax-checkpoint-tmp"  # orbax's temporary directories carry this
_UNSAFE = re.compile(r"[/\\:*?\"<>|\[\]{}\s]")


def checkpoint_name(*, epoch: int, step: int, metric: str, score: float | None) -> str:
    """The default name of a named checkpoint: `epoch-%04d-step-<step>-<metric>=<%.6g score>`,
    the metric segment left out with no score. The metric's name is made safe for a path:
    path and glob characters become `_`, at most 40 characters, and an empty one `metric`."""
    name = f"epoch-{epoch:04d}-step-{step}"
    if score is None:
        return name
    safe = _UNSAFE.sub("_", metric)[:40] or "metric"
    return f"{name}-{safe}={score:.6g}"


def name_problem(name: Any, step: int) -> str | None:
    """What is wrong with `name` as the directory of step `step`'s checkpoint (None: nothing)."""
    if not isinstance(name, str):
        return f"a str, got {type(name).__name__} {name!r}"
    if not name:
        return "a non-empty str, got ''"
    if "/" in name or "\\" in name or os.sep in name or "\0" in name:
        return f"a name without path separators, got {name!r}"
    if name.startswith("."):
        return f"a name that does not start with '.' (a hidden file), got {name!r}"
    if name.isdigit() and int(name) != step:
        return f"a name that is not another step's number (orbax's step {name}), got {name!r}"
    if name in RESERVED:
        return f"a name other than {' or '.join(map(repr, RESERVED))} (orbax's own), got {name!r}"
    if _TEMPORARY in name:
        return f"a name without {_TEMPORARY!r} (orbax's unfinished saves), got {name!r}"
    if len(name.encode()) > 200:
        return f"a name of at most 200 bytes, got {len(name.encode())} bytes"
    return None


def _recorded_step(path: Path) -> int | None:
    """The step orbax recorded for the checkpoint at `path` (a named one), None where none."""
    try:
        meta = json.loads((path / STEP_METADATA).read_text())
    except (OSError, ValueError):
        return None
    custom = meta.get("custom_metadata") if isinstance(meta, dict) else None
    step = custom.get("step") if isinstance(custom, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def step_of(path: str | os.PathLike) -> int | None:
    """The step of a finished checkpoint directory: a step directory's number, or the step a
    named one recorded; None for anything else (an unfinished save, another directory)."""
    path = Path(path)
    name = path.name
    if name in RESERVED or _TEMPORARY in name or not path.is_dir():
        return None
    if name.isdigit():
        return int(name)
    return _recorded_step(path)


class NamedSteps:
    """An orbax `NameFormat` (`orbax.checkpoint.path.step`) for a run's checkpoints: a step is
    written as the name given to it (`names[step]`, set before it is saved; a step without
    one is its number) and found by its directory's number or by the step its metadata
    records. A checkpoint is listed only once orbax has renamed it into place (finished).

    Plain orbax reads named checkpoints with it:
    `ocp.CheckpointManagerOptions(step_name_format=nitro.runs.NamedSteps())`."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}

    def __repr__(self) -> str:
        return "NamedSteps()"

    def build_name(self, step: int) -> str:
        return self.names.get(step, str(step))

    def find_all(self, base_path: Any) -> Iterator[Any]:
        from orbax.checkpoint.path import step as step_lib

        found = named_paths(os.fspath(base_path))
        for step, path in found.items():
            if not path.name.isdigit():
                self.names.setdefault(step, path.name)
        return iter([step_lib.Metadata(step=s, path=_epath(p)) for s, p in sorted(found.items())])

    def find_step(self, base_path: Any, step: int) -> Any:
        for metadata in self.find_all(base_path):
            if metadata.step == step:
                return metadata
        raise ValueError(f"no finished checkpoint of step {step} in {os.fspath(base_path)}")


def _epath(path: Path) -> Any:
    from etils import epath

    return epath.Path(path)


def _listed(directory: Path) -> list[tuple[Path, int]]:
    """(path, step) of each finished checkpoint in `directory`, by name."""
    from orbax.checkpoint.path import step as step_lib

    try:
        children = sorted(directory.iterdir(), key=lambda p: p.name)
    except OSError:
        return []
    listed = []
    for child in children:
        step = step_of(child)
        if step is not None and step_lib.is_path_finalized(_epath(child)):
            listed.append((child, step))
    return listed


def step_path(directory: str | os.PathLike, step: int) -> Path:
    """Where step `step`'s checkpoint is in `directory`: its step directory, or the named
    directory that recorded that step (its step directory's path when there is neither)."""
    directory = Path(directory)
    plain = directory / str(step)
    if plain.is_dir():
        return plain
    for path, found in _listed(directory):
        if found == step:
            return path
    return plain


def named_paths(directory: str | os.PathLike) -> dict[int, Path]:
    """step -> path of each finished checkpoint in `directory` (one path a step)."""
    found: dict[int, Path] = {}
    for path, step in _listed(Path(directory)):
        if step not in found or not found[step].name.isdigit():
            found[step] = path
    return found
