"""Decoupled weight decay toward zero, the initial weights, or a given anchor, as an optax
transformation.

Placed after the optimizer, it subtracts `learning_rate * weight_decay * (param - anchor)`
from the update of every decayed leaf, the decay of AdamW (Loshchilov & Hutter) scaled by the
same learning rate as the optimizer's step:

    update = optimizer_update - learning_rate * weight_decay * (param - anchor)

With the anchor at zero this is `optax.adamw`'s decay (`optax.add_decayed_weights` before the
learning rate); with the anchor at the initial weights it is L2-SP (Li et al., 2018), which
keeps a fine-tuned model near its pretrained weights. The anchor lives in the state, so it is
saved with checkpoints and restored on resume.

>>> import jax.numpy as jnp
>>> tx = decoupled_weight_decay(0.1, 0.5, decayed=(True,), toward="init")
>>> params = {"w": jnp.ones(2)}
>>> state = tx.init(params)
>>> updates, _ = tx.update({"w": jnp.zeros(2)}, state, {"w": jnp.full(2, 3.0)})
>>> updates["w"].tolist()     # -0.1 * 0.5 * (3 - 1)
[-0.10000000149011612, -0.10000000149011612]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from nitro.errors import OptimizerError
from nitro.optim.param_groups import leaf_paths

__all__ = [
    "DecoupledDecayState",
    "anchor_leaves",
    "decay_flags",
    "decoupled_weight_decay",
    "default_decays",
]

TOWARD = ("zero", "init")


class DecoupledDecayState(NamedTuple):
    """The anchors of the decayed leaves (empty when decaying toward zero)."""

    anchor: tuple


def default_decays(path: str, leaf: Any) -> bool:
    """The default rule: decay weight matrices and kernels, not biases, norm scales or other
    leaves with `ndim <= 1`."""
    return jnp.ndim(leaf) > 1


def _masked(node: Any) -> bool:
    return isinstance(node, optax.MaskedNode)


def decoupled_weight_decay(
    learning_rate: Any,
    weight_decay: Any,
    decayed: Sequence[bool],
    toward: str = "zero",
) -> optax.GradientTransformation:
    """Subtract `learning_rate * weight_decay * (param - anchor)` from each decayed leaf's
    update.

    Args:
      learning_rate: the optimizer's learning rate (the decay is scaled by it).
      weight_decay: the decay coefficient.
      decayed: one flag per parameter leaf, in leaf order: whether the leaf decays. Leaves
        that `optax.masked` (or `optax.partition`) hides from this transformation are skipped.
      toward: "zero", or "init" to decay toward the parameters `init` sees (their copy is the
        anchor; write another anchor into the state to decay toward it).
    """
    if toward not in TOWARD:
        raise ValueError(f"toward must be one of {TOWARD}, got {toward!r}")
    decayed = tuple(bool(d) for d in decayed)

    def _leaves(tree: Any) -> list:
        leaves = jax.tree.leaves(tree, is_leaf=_masked)
        if len(leaves) != len(decayed):
            raise ValueError(
                f"decoupled_weight_decay has {len(decayed)} decay flags for a tree of "
                f"{len(leaves)} leaves"
            )
        return leaves

    def init(params: Any) -> DecoupledDecayState:
        if toward == "zero":
            return DecoupledDecayState(anchor=())
        # A copy: the anchor must not alias the parameters, which a train step donates.
        anchor = tuple(
            jnp.copy(p)
            for p, d in zip(_leaves(params), decayed, strict=True)
            if d and not _masked(p)
        )
        return DecoupledDecayState(anchor=anchor)

    def update(updates: Any, state: optax.OptState, params: Any = None):
        if params is None:
            raise ValueError(
                "decoupled_weight_decay needs the parameters: call update(updates, state, params)"
            )
        leaves, treedef = jax.tree.flatten(updates, is_leaf=_masked)
        # optax hands each stage back the state its `init` returned
        anchors = iter(cast(DecoupledDecayState, state).anchor)
        out = []
        for u, p, d in zip(leaves, _leaves(params), decayed, strict=True):
            if d and not _masked(u):
                offset = p if toward == "zero" else p - next(anchors)
                u = u - (learning_rate * weight_decay * offset).astype(u.dtype)
            out.append(u)
        return jax.tree.unflatten(treedef, out), state

    return optax.GradientTransformation(init, update)


def decay_flags(
    rule: Callable[[str, Any], bool] | None, paths: Sequence[str], leaves: Sequence[Any]
) -> tuple[bool, ...]:
    """Whether each leaf decays, by `rule(path, leaf)` (the `decay_mask` keyword; default
    `default_decays`)."""
    rule = rule or default_decays
    flags = []
    for path, leaf in zip(paths, leaves, strict=True):
        flag = rule(path, leaf)
        if not isinstance(flag, (bool, np.bool_)):
            raise OptimizerError(
                f"decay_mask({path!r}, leaf) returned {flag!r}; it must return True (the "
                f"leaf decays) or False"
            )
        flags.append(bool(flag))
    return tuple(flags)


def anchor_leaves(decay_to: Any, params: Any) -> list:
    """The leaves of a given anchor, in the parameters' leaf order, checked against them."""
    from flax import nnx

    if isinstance(decay_to, nnx.Module):
        decay_to = nnx.state(decay_to, nnx.Param)
    if not all(hasattr(leaf, "shape") for leaf in jax.tree.leaves(decay_to)) or not jax.tree.leaves(
        decay_to
    ):
        raise OptimizerError(
            f"decay_to is a {type(decay_to).__name__}; give 'zero', 'init', a model (e.g. "
            f"another handle's `.model`), or a tree of arrays shaped like the parameters"
        )
    given = dict(zip(leaf_paths(decay_to), jax.tree.leaves(decay_to), strict=True))
    paths = leaf_paths(params)
    problems = [f"  {p}: missing from decay_to" for p in paths if p not in given]
    problems += [f"  {p}: in decay_to, not a parameter" for p in given if p not in set(paths)]
    leaves = []
    for path, param in zip(paths, jax.tree.leaves(params), strict=True):
        anchor = given.get(path)
        if anchor is None:
            continue
        if np.shape(anchor) != np.shape(param):
            problems.append(
                f"  {path}: parameter shape {np.shape(param)}, decay_to {np.shape(anchor)}"
            )
            continue
        bad = int(np.size(anchor) - jnp.count_nonzero(jnp.isfinite(anchor)))
        if bad:  # weight decay would pull the weights to it: the run's first step diverges
            problems.append(f"  {path}: {bad} of {np.size(anchor)} values are not finite")
            continue
        leaves.append(jnp.array(anchor, dtype=param.dtype, copy=True))
    if problems:
        raise OptimizerError(
            "decay_to does not fit the parameters (give 'zero', 'init', a model, or a tree "
            "of finite values shaped like the parameters):\n" + "\n".join(problems[:8])
        )
    return leaves
