"""Parameter groups: which group each parameter leaf belongs to, and what each group gets.

An experiment names each leaf's group with a `param_group(self, path) -> str` method (`path`
is the dotted leaf path, `hidden.kernel`). The optimizer partitions the parameters by group
(`optax.partition`), and each group gets its own copy of the optimizer and its own fed
hyperparameters (`<group>/<name>`); `group_lr` gives each group's learning rate as a ratio of
the run's.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from nitro.errors import OptimizerError

__all__ = ["ParamGroup", "group_labels", "group_prefix", "leaf_paths", "param_groups"]


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """A parameter group: its leaves, its learning-rate ratio and its decayed leaves."""

    name: str
    paths: tuple[str, ...]
    size: int  # parameters
    lr_ratio: float | None  # from group_lr; None: 1, unless the group has its own schedule
    decayed: tuple[str, ...]


def group_labels(
    param_group: Callable[[str], str] | None,
    group_lr: Mapping[str, float] | None,
    paths: Sequence[str],
) -> list[str] | None:
    """Each leaf's group from the `param_group` hook, or None without groups."""
    if param_group is None:
        if group_lr:
            raise OptimizerError(
                f"group_lr={dict(group_lr)!r} needs parameter groups: define a "
                f"`param_group(self, path) -> str` method on the experiment that names each "
                f"parameter's group (e.g. `return 'backbone' if path.startswith('encoder') "
                f"else 'head'`)"
            )
        return None
    labels = []
    for path in paths:
        label = param_group(path)
        if not isinstance(label, str) or not label or "/" in label:
            raise OptimizerError(
                f"param_group({path!r}) returned {label!r}; it must return a group name: a "
                f"non-empty str without '/'"
            )
        labels.append(label)
    unknown = sorted(set(group_lr or ()) - set(labels))
    if unknown:
        have = sorted(set(labels))
        close = difflib.get_close_matches(unknown[0], have, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise OptimizerError(
            f"group_lr names {', '.join(map(repr, unknown))}, but no parameter belongs to "
            f"{'it' if len(unknown) == 1 else 'them'}: param_group puts the parameters in "
            f"{', '.join(map(repr, have))}.{hint}"
        )
    return labels


def param_groups(
    labels: Sequence[str],
    paths: Sequence[str],
    leaves: Sequence[Any],
    group_lr: Mapping[str, float] | None,
    decayed: Sequence[bool] | None,
) -> tuple[ParamGroup, ...]:
    """One `ParamGroup` per group name, sorted by name."""
    decayed = decayed or [False] * len(paths)
    return tuple(
        ParamGroup(
            name=group,
            paths=tuple(p for p, label in zip(paths, labels, strict=True) if label == group),
            size=int(
                sum(np.size(x) for x, label in zip(leaves, labels, strict=True) if label == group)
            ),
            lr_ratio=(group_lr or {}).get(group),
            decayed=tuple(
                p
                for p, label, d in zip(paths, labels, decayed, strict=True)
                if label == group and d
            ),
        )
        for group in sorted(set(labels))
    )


def group_prefix(path: tuple) -> str:
    """`backbone/` for a state under `optax.partition`'s group "backbone"; "" outside."""
    parts = []
    for before, key in itertools.pairwise(path):
        if getattr(before, "name", None) == "inner_states" and hasattr(key, "key"):
            parts.append(f"{key.key}/")
    return "".join(parts)


def leaf_paths(tree: Any) -> tuple[str, ...]:
    """Dotted paths of a tree's leaves (`hidden1.kernel`), in leaf order."""
    return tuple(
        jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    )
