"""Weights a run starts from (`weights=`), and the check that they fit the model.

`weights=` takes another handle (its weights, copied; at the next step boundary if it is
training), a run directory or one checkpoint (`runs/Digits/<run id>`, its newest checkpoint),
`(run_dir, "best" | "latest")`, `nitro.average(run_dir, k=3)` (the mean of the best three
checkpoints), or a population's member (`(its run_dir, i)`, or `<run_dir>/member-<i>`).
Weights are the parameters and the model's other variables; the optimizer state, counters
and history start fresh (`resume=` continues a run instead).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nitro.core.frozen import freeze
from nitro.core.run_setup import CheckpointRef, SavedWeights
from nitro.errors import SetupError, WeightsError
from nitro.optim.param_groups import leaf_paths
from nitro.runs.checkpoint_record import shown_setting
from nitro.runs.checkpoint_trees import leaves_from
from nitro.runs.run_dirs import KIND, population_of

__all__ = [
    "AveragedWeights",
    "CheckpointWeights",
    "ResolvedWeights",
    "WeightsSource",
    "average",
    "check_same_tree",
    "copy_array",
    "tree_summary",
]


class ResolvedWeights(NamedTuple):
    """Weights shaped like the model's, copied, and where they came from."""

    params: Any
    model_state: Any
    origin: str  # a sentence: the handle's `weights_origin`
    checkpoint: SavedWeights | None  # the checkpoint(s) read, when they came from disk


@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """Parameters and other model variables (trees shaped like the model's), and a sentence
    saying where they came from (shown as the handle's `weights_origin`)."""

    params: Any
    model_state: Any
    origin: str

    @classmethod
    def of(cls, model: Any, variables: Any, origin: str) -> WeightsSource:
        """Copies of the parameters and model state of `variables` (a `Variables`: flat
        leaves), as trees of `model` (its `ModelSetup`)."""
        params = jax.tree.unflatten(model.params_def, variables.params)
        rest = jax.tree.unflatten(model.model_state_def, variables.model_state)
        return cls(jax.tree.map(copy_array, params), jax.tree.map(copy_array, rest), origin)

    def resolve(self, params: Any, model_state: Any) -> ResolvedWeights:
        """These weights, shaped like the given model's (refused otherwise), copied."""
        check_same_tree("parameters", params, self.params)
        check_same_tree("model state", model_state, self.model_state)
        return ResolvedWeights(
            jax.tree.map(copy_array, self.params),
            jax.tree.map(copy_array, self.model_state),
            self.origin,
            None,
        )


@dataclasses.dataclass(frozen=True)
class CheckpointWeights:
    """The weights of a saved checkpoint: a run directory's newest or best, or one
    checkpoint's directory; with `member`, that member's of a population's checkpoint
    (`weights=(run_dir, i)`, `weights=<run_dir>/member-<i>`)."""

    source: CheckpointRef
    member: int | None = None  # a population's member: its slice of the stacked variables

    @classmethod
    def of(cls, source: str | os.PathLike | tuple) -> CheckpointWeights:
        """From what `weights=` takes: a path, or (run_dir, "best" | "latest"); a member of a
        population: (its run_dir, member index) or the member's directory."""
        if isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], int):
            return cls.member_of(source[0], source[1])
        if isinstance(source, (str, os.PathLike)):
            found = population_of(source)
            if found is not None and found[1] is not None:
                return cls.member_of(found[0], found[1])
            if found is not None:
                raise SetupError(
                    f"weights={os.fspath(source)!r} is a population's run directory, which "
                    f"holds every member's weights: name one, weights=({os.fspath(source)!r}, "
                    f"i) or weights={os.fspath(found[0] / 'member-0')!r}"
                )
        if isinstance(source, tuple):
            if len(source) != 2 or source[1] not in ("best", "latest"):
                raise SetupError(
                    f"a checkpoint is a path or (run_dir, 'best' | 'latest'); got {source!r}"
                )
            return cls(CheckpointRef(os.fspath(source[0]), source[1]))
        return cls(CheckpointRef(os.fspath(source)))

    @classmethod
    def member_of(cls, path: str | os.PathLike, member: Any) -> CheckpointWeights:
        if isinstance(member, bool) or not isinstance(member, int) or member < 0:
            raise SetupError(
                f"weights=(run_dir, member) names a member by its index, an int >= 0; got "
                f"{member!r}"
            )
        return cls(CheckpointRef(os.fspath(path)), member)

    def resolve(self, params: Any, model_state: Any) -> ResolvedWeights:
        """The checkpoint's parameters and model state (a member's slice of a population's),
        shaped like the given model's."""
        from nitro.runs.checkpoint_reads import read_checkpoint, resolve_checkpoint

        found = resolve_checkpoint(self.source)
        directory, step = found
        saved, record = read_checkpoint(*found)
        where, index = str(found.path), self.member
        if (record.kind == KIND) != (index is not None):
            raise WeightsError(
                f"{where!r} is a population's checkpoint, which holds every member's weights: "
                f"weights=({str(directory.parent)!r}, i) reads member i"
                if index is None
                else f"weights=({self.source.path!r}, {index}): {where!r} is a single run's "
                f"checkpoint, not a population's; weights={self.source.path!r} reads it"
            )
        origin = f"checkpoint {directory.parent.name or directory}/step {step}"
        entry = record.member
        if index is not None:
            count = len(record.members)
            if not 0 <= index < count:
                raise WeightsError(
                    f"weights=({self.source.path!r}, {index}): the population in "
                    f"{str(directory.parent)!r} has {count} members (0..{count - 1})"
                )
            saved = jax.tree.map(lambda a: np.asarray(a)[index], saved)
            entry = record.members[index]
            shown = ", ".join(f"{k}={shown_setting(v)}" for k, v in entry.settings.items())
            origin = (
                f"member {index} ({shown}) of population {record.run_id}, checkpoint step {step}"
            )
        checkpoint = SavedWeights(
            paths=(where,),
            run_id=entry.run_id or record.run_id,
            steps=(step,),
            epochs=(record.epoch,),
            metrics=(freeze(entry.metrics),),
        )
        restored = _weights_of(saved, params, model_state)
        return ResolvedWeights(*restored, f"{origin} (epoch {record.epoch})", checkpoint)


@dataclasses.dataclass(frozen=True)
class AveragedWeights:
    """The mean of the weights of several saved checkpoints (`nitro.average` builds it).

    Floating-point leaves (parameters, batch statistics) are averaged; other leaves (RNG
    counts and keys) come from the first checkpoint, the best one. A damaged checkpoint (a
    truncated or corrupted file) is skipped with a warning, and the next ranked one (from
    `spares`) takes its place.
    """

    checkpoints: tuple[tuple[str, int], ...]  # (checkpoints directory, step), best first
    ranking: str  # how they were chosen, for the origin
    spares: tuple[tuple[str, int], ...] = ()  # the next ranked, in place of damaged ones

    def resolve(self, params: Any, model_state: Any) -> ResolvedWeights:
        """The mean of the checkpoints' weights, shaped like the given model's."""
        from pathlib import Path

        from nitro.runs.checkpoint_reads import read_checkpoint

        trees = {"parameters": ("params", params), "model state": ("model_state", model_state)}
        sums: dict[str, list] = {}
        firsts: dict[str, list] = {}
        records, used, damaged = [], [], []
        k = len(self.checkpoints)
        for directory, step in self.checkpoints + self.spares:
            if len(used) == k:
                break
            try:
                saved, record = read_checkpoint(Path(directory), step)
            except SetupError as error:
                if "given" in self.ranking:  # the caller's list: no other takes its place
                    raise WeightsError(f"average(): {error}") from error
                warnings.warn(
                    f"average(): {error}; the next ranked checkpoint takes its place",
                    RuntimeWarning,
                    stacklevel=2,
                )
                damaged.append(str(Path(directory) / str(step)))
                continue
            records.append(record)
            used.append((directory, step))
            for what, (key, tree) in trees.items():
                leaves = leaves_from(
                    what, saved.get(key, {}), leaf_paths(tree), jax.tree.leaves(tree)
                )
                if what not in sums:
                    firsts[what] = leaves
                    sums[what] = [np.array(x, np.float64) if _floating(x) else None for x in leaves]
                    continue
                for total, x in zip(sums[what], leaves, strict=False):
                    if total is not None:
                        total += np.asarray(x, np.float64)
        if len(used) < k:
            raise WeightsError(
                f"average() needs {k} readable checkpoints of {self.checkpoints[0][0]!r}, but "
                f"only {len(used)} read: {', '.join(damaged)} cannot be read (damaged, see "
                f"the warnings). Lower k, or give a list of checkpoint paths."
            )
        averaged = []
        for what, (_, tree) in trees.items():
            leaves = [
                jnp.asarray((total / k).astype(np.asarray(first).dtype))
                if total is not None
                else (first if isinstance(first, jax.Array) else jnp.asarray(first))
                for total, first in zip(sums[what], firsts[what], strict=False)
            ]
            averaged.append(jax.tree.unflatten(jax.tree.structure(tree), leaves))
        run_dir = Path(self.checkpoints[0][0]).parent
        steps = [step for _, step in used]
        origin = (
            f"the mean of {k} checkpoint{'s' * (k != 1)} of {run_dir.name or run_dir} "
            f"({self.ranking}): steps {', '.join(map(str, steps))}"
        )
        checkpoint = SavedWeights(
            paths=tuple(str(Path(d) / str(s)) for d, s in used),
            run_id=records[0].run_id,
            steps=tuple(steps),
            epochs=tuple(r.epoch for r in records),
            metrics=tuple(freeze(r.metrics) for r in records),
            averaged=True,
        )
        return ResolvedWeights(averaged[0], averaged[1], origin, checkpoint)


def _floating(x: Any) -> bool:
    dtype = np.asarray(x).dtype if not isinstance(x, jax.Array) else x.dtype
    return jnp.issubdtype(dtype, jnp.floating)


def average(source: Any, k: int = 3) -> AveragedWeights:
    """Weights that are the mean of `k` checkpoints: the best `k` of a run by its
    checkpointer's metric (`source` is a run directory or its `checkpoints` folder), or the
    checkpoints listed (`source` is a list of checkpoint paths; `k` is then ignored). Start a
    handle from them with `weights=`:

    >>> import nitro
    >>> from nitro.examples.digits import Digits
    >>> run = nitro.Nitro(Digits(max_epochs=3), progress=False).train()
    >>> n = nitro.Nitro(Digits(), weights=nitro.average(run.run_dir, k=2))
    >>> n.weights_origin
    'the mean of 2 checkpoints of ... (best 2 by val_loss): steps ...'

    Averaging checkpoints of one run (as in stochastic weight averaging) tends to find a
    flatter, better-generalizing point than any one of them. Batch statistics are averaged
    too; re-estimating them on training data can help a model with batch normalization.
    """
    from pathlib import Path

    from nitro.runs.checkpoint_reads import ranked_steps, resolve_checkpoint
    from nitro.runs.checkpoint_writer import await_writers

    if isinstance(source, (list, tuple)) and not (
        len(source) == 2 and source[1] in ("best", "latest")
    ):
        if not source:
            raise WeightsError("average() got an empty list; give checkpoint paths to average")
        found = [resolve_checkpoint(path, read=False) for path in source]
        return AveragedWeights(tuple((str(d), s) for d, s in found), f"{len(found)} given")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise WeightsError(f"average(k={k!r}): k must be an int >= 1")
    if not isinstance(source, (str, os.PathLike)):
        raise WeightsError(
            f"average() takes a run directory, its checkpoints folder or a list of checkpoint "
            f"paths; got {source!r}. For a run's best k checkpoints: average(run_dir, k=...)"
        )
    path = Path(source)
    await_writers(path)
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not directory.is_dir():
        raise WeightsError(f"average(): no checkpoints at {str(path)!r} (give a run directory)")
    metric, ranked = ranked_steps(directory)
    if len(ranked) < k:
        have = f"{len(ranked)} ranked by {metric}" if metric else "none ranked"
        raise WeightsError(
            f"average(k={k}) needs {k} checkpoints ranked by the run's metric, but "
            f"{str(directory)!r} has {have} (a run keeps its best Checkpointer(k=...) "
            f"checkpoints plus the newest). Lower k, or give a list of checkpoint paths."
        )
    return AveragedWeights(
        tuple((str(directory), step) for step, _ in ranked[:k]),
        f"best {k} by {metric}",
        spares=tuple((str(directory), step) for step, _ in ranked[k:]),
    )


def copy_array(x: jax.Array) -> jax.Array:
    """A fresh copy on the same devices (no compile; across processes a jitted copy)."""
    if x.is_fully_addressable:
        return jax.device_put(x, x.sharding, may_alias=False)
    return jnp.array(x, copy=True)


def tree_summary(tree: Any) -> dict[str, str]:
    """Dotted leaf path -> `f32[64,256]`."""
    from nitro.programs.compile_cache import short_dtype

    return {
        jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"): (
            f"{short_dtype(str(x.dtype))}[{','.join(map(str, np.shape(x)))}]"
        )
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def check_same_tree(what: str, expected: Any, given: Any) -> None:
    """Refuse weights whose leaves differ from the model's, naming each differing leaf."""
    exp, got = tree_summary(expected), tree_summary(given)
    if exp == got:
        return
    lines = [
        f"  {key}: this model {exp.get(key, 'missing')}, weights {got.get(key, 'missing')}"
        for key in sorted(set(exp) | set(got))
        if exp.get(key) != got.get(key)
    ]
    more = f"\n  ... and {len(lines) - 6} more" if len(lines) > 6 else ""
    raise WeightsError(
        f"weights= does not fit: the {what} differ (build the model with the same GraphConst "
        f"values)\n" + "\n".join(lines[:6]) + more
    )


def _weights_of(saved: Mapping[str, Any], params: Any, model_state: Any) -> tuple[Any, Any]:
    """A checkpoint's parameters and model state, shaped like the given model's trees."""

    restored = []
    for what, key, tree in (
        ("parameters", "params", params),
        ("model state", "model_state", model_state),
    ):
        leaves = leaves_from(what, saved.get(key, {}), leaf_paths(tree), jax.tree.leaves(tree))
        leaves = [jnp.asarray(x) if not isinstance(x, jax.Array) else x for x in leaves]
        restored.append(jax.tree.unflatten(jax.tree.structure(tree), leaves))
    return restored[0], restored[1]
