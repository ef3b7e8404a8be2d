"""Reading saved checkpoints: which steps a checkpoints directory holds and how they rank,
one step's arrays and record (`read_checkpoint`), and where a checkpoint named by a path or
`(run_dir, "best" | "latest")` is (`resolve_checkpoint`), skipping damaged steps with a
warning naming each.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from nitro.core.run_setup import CheckpointRef
from nitro.errors import SetupError
from nitro.runs.checkpoint_names import NamedSteps, step_of, step_path
from nitro.runs.checkpoint_record import CheckpointRecord
from nitro.runs.checkpoint_trees import flatten
from nitro.runs.checkpoint_writer import (
    ORBAX,
    await_writers,
    describe_error,
    quiet_orbax,
    quiet_read_only,
)

__all__ = [
    "SavedStep",
    "describe_checkpoints",
    "describe_saved",
    "newest_record",
    "ranked_steps",
    "read_checkpoint",
    "resolve_checkpoint",
]


class _reader:
    """A read-only manager, used under the orbax lock: `with _reader(dir) as manager:`.
    This process's saves in flight into the directory finish first."""

    def __init__(self, directory: Path):
        self.directory = Path(directory).absolute()  # orbax reads absolute paths only

    def __enter__(self):
        import orbax.checkpoint as ocp

        await_writers(self.directory)
        self._held = ORBAX.held()
        self._held.__enter__()
        options = ocp.CheckpointManagerOptions(
            read_only=True, save_interval_steps=0, create=False, step_name_format=NamedSteps()
        )
        absl = logging.getLogger("absl")
        absl.addFilter(quiet_read_only)
        try:
            self.manager = self._open(ocp, options)
        except BaseException:
            self._held.__exit__(None, None, None)
            raise
        finally:
            absl.removeFilter(quiet_read_only)
        return self.manager

    def _open(self, ocp, options):
        """The manager, listed again (up to 5 times) when a step it listed was gone when it
        read it: another process's writer removed it (its keep policy), which is no damage. A
        failure while the directory stood still is raised."""
        for _ in range(4):
            before = _names(self.directory)
            try:
                return ocp.CheckpointManager(self.directory, options=options)
            except (ValueError, FileNotFoundError):
                if _names(self.directory) == before:
                    raise
        return ocp.CheckpointManager(self.directory, options=options)

    def __exit__(self, *exc):
        try:
            self.manager.close()
        finally:
            self._held.__exit__(*exc)


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def _meta_args():
    import orbax.checkpoint as ocp

    return ocp.args.Composite(meta=ocp.args.JsonRestore())


def _skip(directory: Path, step: int, why: str) -> None:
    """Warn of a damaged step, unless it is gone: a live run's writer removed it (its keep
    policy) while it was read, which is no damage."""
    path = step_path(directory.absolute(), step)
    if not path.exists():
        return
    warnings.warn(
        f"skipping the damaged checkpoint {str(path)!r} ({why}); the other "
        f"checkpoints are used. Delete that checkpoint's directory once you no longer need it.",
        RuntimeWarning,
        stacklevel=4,
    )


def _records(manager, directory: Path) -> list[tuple[int, CheckpointRecord]]:
    """(step, `CheckpointRecord`) of each saved step whose record reads, oldest first; a step whose
    record does not (an empty step directory, a truncated or corrupted file) is skipped with
    a warning naming it. Reads no array."""
    found = []
    for step in manager.all_steps():
        try:
            meta = manager.restore(step, args=_meta_args())["meta"]
            if not isinstance(meta, Mapping):
                raise ValueError(f"its record is {type(meta).__name__}, not a JSON object")
            found.append((step, CheckpointRecord.from_json(meta)))
        except Exception as error:  # noqa: BLE001 - any unreadable step is skipped, named
            _skip(directory, step, describe_error(error))
    return found


def _metric_value(manager, step: int, metric: str | None) -> float | None:
    try:
        value = (manager.metrics(step) or {}).get(metric)
    except Exception:  # noqa: BLE001 - a step without readable metrics is unranked
        return None
    return value if isinstance(value, (int, float)) else None


def _ranking(manager, records: list[tuple[int, CheckpointRecord]]) -> tuple[str | None, str, list]:
    """(metric, mode, [(step, value)] best first) by the checkpointer's own metric and mode,
    as recorded in the newest readable checkpoint."""
    config = (records[-1][1].checkpointer if records else None) or {}
    metric, mode = config.get("metric"), config.get("mode", "min")
    ranked = [
        (step, value)
        for step, _ in records
        if (value := _metric_value(manager, step, metric)) is not None
    ]
    ranked.sort(key=lambda item: item[1], reverse=mode == "max")
    return metric, mode, ranked


def ranked_steps(directory: str | os.PathLike) -> tuple[str | None, list[tuple[int, float]]]:
    """(the checkpointer's metric, [(step, value)] best first) of a checkpoints directory:
    the readable saved steps that recorded the metric, ranked by its mode."""
    directory = Path(directory)
    with _reader(directory) as manager:
        metric, _, ranked = _ranking(manager, _records(manager, directory))
    return metric, ranked


def describe_checkpoints(directory: str | os.PathLike):
    """(saved steps, latest epoch, metric name, best value) of a checkpoint directory, read
    from orbax's metadata and the JSON records, without loading any array. Damaged steps are
    left out (with a warning naming each); a directory orbax cannot read at all lists none."""
    directory = Path(directory)
    await_writers(directory)
    if not directory.is_dir():
        return [], None, None, None
    try:
        with _reader(directory) as manager:
            records = _records(manager, directory)
            if not records:
                return [], None, None, None
            metric, _, ranked = _ranking(manager, records)
    except Exception as error:  # noqa: BLE001 - one damaged run must not hide the others
        warnings.warn(
            f"skipping the checkpoints in {str(directory)!r}: they cannot be listed "
            f"({describe_error(error)})",
            RuntimeWarning,
            stacklevel=3,
        )
        return [], None, None, None
    best = ranked[0][1] if ranked else None
    return [step for step, _ in records], records[-1][1].epoch, metric, best


def describe_saved(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """One row per readable saved checkpoint of a run: step, epoch, the metric, its name (its
    directory's) and its path."""
    directory = Path(run_dir) / "checkpoints"
    await_writers(directory)
    if not directory.is_dir():
        return []
    with _reader(directory) as manager:
        rows = []
        for step, record in _records(manager, directory):
            row: dict[str, Any] = {"step": step, "epoch": record.epoch}
            try:
                row.update(manager.metrics(step) or {})
            except Exception:  # noqa: BLE001 - the step itself reads: list it without them
                pass
            path = step_path(directory, step)
            row["name"], row["path"] = path.name, str(path)
            rows.append(row)
        return rows


def newest_record(run_dir: str | os.PathLike) -> CheckpointRecord | None:
    """The record of a run's newest readable checkpoint (its code digests, training settings,
    the versions that wrote it), or None; reads no array."""
    directory = Path(run_dir) / "checkpoints"
    await_writers(directory)
    if not directory.is_dir():
        return None
    with _reader(directory) as manager:
        records = _records(manager, directory)
    return records[-1][1] if records else None


# The last step `resolve_checkpoint` read whole to check it, kept for the `read_checkpoint`
# that follows it (resume and weights= read the step they resolved at once): one entry,
# taken by that read, so a checked step is not read twice.
_CHECKED: dict[tuple[Path, int], tuple[Any, CheckpointRecord]] = {}


def _restore_item(manager, step: int, targets: Mapping[tuple[str, ...], Any]) -> Any:
    """The tree orbax restores the state into: None (each leaf as it was saved: numpy arrays)
    for a checkpoint of host arrays read without targets, as ever; else the step's own tree
    (from its array metadata, empty subtrees included: a model without model state saves an
    empty `model_state`), each leaf named in `targets` that fits it (same shape and dtype)
    onto the target's sharding and every other leaf as a numpy array. The item never differs
    from the checkpoint's own tree, so what the restoring handle expects cannot fail the
    read: a checkpoint that does not fit the handle is read, and the leaves that differ are
    named where they are placed (`leaves_from`). A leaf saved sharded is never restored onto
    the devices it was written from (which may not exist here): without a target it is read
    whole to the host."""
    import orbax.checkpoint as ocp
    from etils import epath

    handler = ocp.StandardCheckpointHandler()
    try:
        tree = handler.metadata(epath.Path(step_path(manager.directory, step)) / "state").tree
    finally:
        handler.close()
    if not targets and all(getattr(m, "sharding", None) is None for m in flatten(tree).values()):
        return None
    return _item_of(tree, targets, ())


def _item_of(node: Any, targets: Mapping[tuple[str, ...], Any], path: tuple[str, ...]) -> Any:
    """The restore item of one node of a step's metadata tree (`_restore_item`)."""
    if isinstance(node, Mapping):
        return {str(k): _item_of(v, targets, (*path, str(k))) for k, v in node.items()}
    shape, dtype = tuple(node.shape), np.dtype(node.dtype)
    target = targets.get(path)
    if target is None or tuple(target.shape) != shape or np.dtype(target.dtype) != dtype:
        return np.broadcast_to(np.zeros((), dtype), shape)  # a numpy leaf, no memory
    return target


def _restore(
    manager, step: int, targets: Mapping[tuple[str, ...], Any] | None = None
) -> tuple[Any, CheckpointRecord]:
    """(state, meta) of one step, the leaves named in `targets` onto their shardings. A step
    that reads whole to the host where the targeted read failed is not damaged: that read is
    returned instead (`place_like` lays its leaves out), so only a step whose own tree does
    not read is ever called damaged."""
    try:
        return _read_item(manager, step, _restore_item(manager, step, targets or {}))
    except Exception as error:
        quiet_orbax()
        if not targets:
            raise
        failed = error
    try:
        return _read_item(manager, step, _restore_item(manager, step, {}))
    except Exception:  # noqa: BLE001 - damaged: the first failure says why
        raise failed from None


def _read_item(manager, step: int, item: Any) -> tuple[Any, CheckpointRecord]:
    import orbax.checkpoint as ocp

    restored = manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(item), meta=ocp.args.JsonRestore()),
    )
    state, meta = restored["state"], restored["meta"]
    if not isinstance(state, Mapping) or "params" not in state:
        raise ValueError("its state holds no parameters")
    if not isinstance(meta, Mapping):
        raise ValueError("its record is not a JSON object")
    return state, CheckpointRecord.from_json(meta)


def read_checkpoint(
    directory: Path,
    step: int,
    weights_only: bool = False,
    targets: Mapping[tuple[str, ...], Any] | None = None,
) -> tuple[Any, CheckpointRecord]:
    """(state tree of numpy arrays, `CheckpointRecord`) of one saved step. A step that cannot be read (a
    truncated file, corrupted bytes: a checksum failure) raises a `SetupError` naming it.

    `targets` (`restore_targets`: checkpoint path -> `jax.ShapeDtypeStruct` with a sharding)
    restores those leaves straight onto their shardings instead. A step read already to check
    it (`resolve_checkpoint`) is returned as that check read it: onto the targets it was given
    then (a resume passes the same ones), else as host arrays that `place_like` lays out, each
    device receiving only its shard."""
    directory = Path(directory).absolute()
    checked = _CHECKED.pop((directory, step), None)
    if checked is not None:
        return checked
    with _reader(directory) as manager:
        try:
            return _restore(manager, step, targets)
        except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many kinds
            raise SetupError(
                f"the checkpoint {str(step_path(directory, step))!r} cannot be read "
                f"({describe_error(error)}); it is damaged. Use another of the run's checkpoints"
            ) from error


def read_record(source: Any, which: str = "latest") -> CheckpointRecord:
    """The record of a saved step, without a handle and without its arrays (`nitro.runs.read`):
    `source` is what `resolve_checkpoint` takes (a run directory, its checkpoints directory,
    one step's directory, or `(run_dir, "best" | "latest")`)."""
    found = resolve_checkpoint(source, which, read=False)
    with _reader(found.directory) as manager:
        return dict(_records(manager, found.directory))[found.step]


class SavedStep(NamedTuple):
    """One saved checkpoint: its checkpoints directory and step."""

    directory: Path
    step: int

    @property
    def path(self) -> Path:
        """Its directory: the step's number, or its name (`Checkpointer(name=)`)."""
        return step_path(self.directory, self.step)


def resolve_checkpoint(
    source: CheckpointRef | str | os.PathLike | tuple,
    which: str = "latest",
    *,
    read: bool = True,
    targets: Mapping[tuple[str, ...], Any] | None = None,
) -> SavedStep:
    """Where a checkpoint is: a run directory (its newest or best checkpoint), a checkpoints
    directory, or one checkpoint's directory (its step or its name);
    `(run_dir, "best" | "latest")` chooses.

    The chosen step is read whole first. A damaged one (an empty step directory, a truncated
    or corrupted file) is skipped with a warning naming it, and the next one is taken: the
    newest before it, or for "best" the next best, then the newest. A step named explicitly
    is not replaced: its damage is an error naming it. `read=False` checks only the steps'
    JSON records (for a reader that handles damaged arrays itself). `targets`
    (`restore_targets`) reads the sharded leaves of that check straight onto their shardings,
    so a resume of a sharded run never holds its whole state on one host."""
    if isinstance(source, tuple):
        if len(source) != 2 or source[1] not in ("best", "latest"):
            raise SetupError(
                f"a checkpoint is a path or (run_dir, 'best' | 'latest'); got {source!r}"
            )
        source = CheckpointRef(os.fspath(source[0]), source[1])
    if isinstance(source, CheckpointRef):
        source, which = source.path, source.which
    path = Path(source).absolute()  # orbax reads absolute paths only
    await_writers(path)
    if not path.exists():
        raise SetupError(f"no checkpoint at {str(path)!r}: the path does not exist")
    step = None
    if (path / "checkpoints").is_dir():
        directory = path / "checkpoints"
    elif (path / "state").exists() and step_of(path) is not None:
        directory, step = path.parent, step_of(path)
    else:
        directory = path
    with _reader(directory) as manager:
        if step is not None:
            if step not in manager.all_steps():
                steps = list(manager.all_steps())
                raise SetupError(
                    f"{str(path)!r} is not a finished checkpoint (saved steps: {steps})"
                )
            candidates = [step]
        else:
            records = _records(manager, directory)
            if not records:
                listed = list(manager.all_steps())
                raise SetupError(
                    f"no checkpoint in {str(directory)!r}: it holds no saved steps (a run "
                    f"saves after each epoch's validation)"
                    if not listed
                    else f"no readable checkpoint in {str(directory)!r}: every saved step "
                    f"({', '.join(map(str, listed))}) is damaged (see the warnings above)"
                )
            candidates = [s for s, _ in reversed(records)]
            if which == "best":
                ranked = [s for s, _ in _ranking(manager, records)[2]]
                candidates = ranked + [s for s in candidates if s not in ranked]
        if not read:
            return SavedStep(directory, candidates[0])
        _CHECKED.clear()
        damaged = []
        for candidate in candidates:
            try:
                _CHECKED[(directory, candidate)] = _restore(manager, candidate, targets)
            except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many kinds
                if step is not None:
                    raise SetupError(
                        f"the checkpoint {str(path)!r} cannot be read ({describe_error(error)}); it is "
                        f"damaged. Give another step, or the run directory for its newest "
                        f"readable checkpoint"
                    ) from error
                _skip(directory, candidate, describe_error(error))
                damaged.append(candidate)
                continue
            return SavedStep(directory, candidate)
    raise SetupError(
        f"no readable checkpoint in {str(directory)!r}: every saved step "
        f"({', '.join(map(str, sorted(set(damaged))))}) is damaged (see the warnings above)"
    )
