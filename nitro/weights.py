"""Weights a run starts from (`weights=`), and the check that they fit the model."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .errors import WeightsError

__all__ = ["WeightsSource", "check_same_tree", "copy_array", "tree_summary"]


@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """Parameters and other model variables (trees shaped like the model's), and a sentence
    saying where they came from (shown as the handle's `weights_origin`)."""

    params: Any
    model_state: Any
    origin: str


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
