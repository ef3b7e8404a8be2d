"""Weights a run starts from (`weights=`), and the check that they fit the model.

`weights=` takes another handle (its weights, copied; at the next step boundary if it is
training), a run directory or one checkpoint (`runs/Digits/<run id>`, its newest checkpoint),
or `(run_dir, "best" | "latest")`. Weights are the parameters and the model's other variables;
the optimizer state, counters and history start fresh (`resume=` continues a run instead).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .errors import WeightsError

__all__ = [
    "CheckpointWeights",
    "WeightsSource",
    "check_same_tree",
    "copy_array",
    "leaf_paths",
    "tree_summary",
]


@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """Parameters and other model variables (trees shaped like the model's), and a sentence
    saying where they came from (shown as the handle's `weights_origin`)."""

    params: Any
    model_state: Any
    origin: str

    def resolve(self, params: Any, model_state: Any) -> tuple[Any, Any, str, None]:
        """(parameters, model state, origin, checkpoint: None) shaped like the given
        model's, copied."""
        check_same_tree("parameters", params, self.params)
        check_same_tree("model state", model_state, self.model_state)
        return (
            jax.tree.map(copy_array, self.params),
            jax.tree.map(copy_array, self.model_state),
            self.origin,
            None,
        )


@dataclasses.dataclass(frozen=True)
class CheckpointWeights:
    """The weights of a saved checkpoint: a path, or (run_dir, "best" | "latest")."""

    source: Any

    def resolve(self, params: Any, model_state: Any) -> tuple[Any, Any, str, dict[str, Any]]:
        """(parameters, model state, origin, the checkpoint's step, epoch, metrics, run id
        and path)."""
        from .checkpoints import leaves_from, read_checkpoint, resolve_checkpoint

        directory, step = resolve_checkpoint(self.source)
        saved, meta = read_checkpoint(directory, step)
        restored = []
        for what, key, tree in (
            ("parameters", "params", params),
            ("model state", "model_state", model_state),
        ):
            template = jax.tree.leaves(tree)
            leaves = leaves_from(what, saved.get(key, {}), leaf_paths(tree), template)
            leaves = [jnp.asarray(x) if not isinstance(x, jax.Array) else x for x in leaves]
            restored.append(jax.tree.unflatten(jax.tree.structure(tree), leaves))
        origin = (
            f"checkpoint {directory.parent.name or directory}/step {step} (epoch "
            f"{meta.get('epoch')})"
        )
        checkpoint = {
            "path": str(directory / str(step)),
            "run_id": meta.get("run_id"),
            "step": step,
            "epoch": meta.get("epoch"),
            "metrics": meta.get("metrics"),
        }
        return restored[0], restored[1], origin, checkpoint


def leaf_paths(tree: Any) -> tuple[str, ...]:
    """Dotted paths of a tree's leaves (`hidden1.kernel`), in leaf order."""
    return tuple(
        jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    )


def copy_array(x: jax.Array) -> jax.Array:
    """A fresh copy on the same devices (no compile; across processes a jitted copy)."""
    if x.is_fully_addressable:
        return jax.device_put(x, x.sharding, may_alias=False)
    return jnp.array(x, copy=True)


def tree_summary(tree: Any) -> dict[str, str]:
    """Dotted leaf path -> `f32[64,256]`."""
    from .compile_cache import short_dtype

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
