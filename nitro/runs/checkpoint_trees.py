"""The arrays of a checkpoint: a state's variables as nested dicts keyed by the model's leaf
paths (host copies, or on-device copies of sharded leaves), the targets a sharded restore
reads onto, and restored leaves checked against a template and placed like it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nitro.errors import SetupError

__all__ = [
    "LOSS_SCALE_KEYS",
    "flatten",
    "host_tree",
    "is_sharded",
    "json_safe",
    "leaves_from",
    "materialized",
    "place_like",
    "restore_targets",
]


# ---------------------------------------------------------------------------------------------
# trees of host arrays


def _host(x: Any) -> np.ndarray:
    """A host copy of a (replicated) array; PRNG keys as their key data."""
    if isinstance(x, jax.Array):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if not x.is_fully_addressable:
            x = x.addressable_data(0)
    return np.array(x, copy=True)


def _saved(x: Any) -> Any:
    """What a save holds of a leaf: a host copy of a replicated array (`_host`), or of a
    sharded one (not fully replicated: `sharding="fsdp"`, rules) a copy with the same
    sharding in the host memory of its devices (`pinned_host`, where the devices have it), which
    orbax writes shard by shard (across processes each process writes its own shards); nothing
    is gathered. The copy is taken now, before the next step donates the live arrays to the
    program; in host memory it takes no device memory while it waits to be written (a device
    without host memory keeps an on-device copy)."""
    if is_sharded(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if _has_host_memory(x):
            return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
        return x.copy()
    return _host(x)


def _has_host_memory(x: jax.Array) -> bool:
    device = next(iter(x.sharding.device_set))
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except Exception:  # noqa: BLE001 - a backend without memory kinds
        return False


def is_sharded(x: Any) -> bool:
    """Whether `x` is a device array laid out in shards (not fully replicated)."""
    return isinstance(x, jax.Array) and not x.sharding.is_fully_replicated


def place_like(value: Any, like: Any, put_replicated: Any) -> Any:
    """A restored leaf laid out as the template leaf `like`: `put_replicated(value)` when
    `like` is replicated (as runs have always placed a restore), else onto `like`'s sharding,
    each device receiving only its own shard of the host value (nothing is gathered on one
    device; a checkpoint of another mesh is resharded here). A leaf orbax already restored
    onto that sharding is kept as it is."""
    if not is_sharded(like):
        return put_replicated(value)
    if isinstance(value, jax.Array) and value.sharding == like.sharding:
        return value
    if jnp.issubdtype(like.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(value) if isinstance(value, jax.Array) else value
        host = np.asarray(data)
        placed = jax.make_array_from_callback(host.shape, like.sharding, lambda i: host[i])
        return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(like))
    host = np.asarray(value)
    return jax.make_array_from_callback(like.shape, like.sharding, lambda i: host[i])


def _nest(paths: tuple[str, ...], leaves: list) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, leaf in zip(paths, leaves, strict=True):
        node = tree
        *parents, last = path.split(".") if path else ["value"]
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    return tree


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict's leaves by their dotted paths."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, path))
        else:
            flat[path] = value
    return flat


# the loss-scale variables of a float16 run, as a checkpoint names them
LOSS_SCALE_KEYS = ("scale", "finite_steps", "skipped_steps")


class _Later:
    """A replicated array that no later step donates, copied to the host only when its save is
    written (`host_tree(lazy=True)`): a save that a newer one replaces copies nothing."""

    __slots__ = ("array",)

    def __init__(self, array: jax.Array):
        self.array = array


def _later(x: Any) -> Any:
    return _Later(x) if isinstance(x, jax.Array) and not is_sharded(x) else _saved(x)


def materialized(tree: Any) -> Any:
    """`tree` with each `_Later` leaf copied to the host now."""
    return jax.tree.map(lambda x: _host(x.array) if isinstance(x, _Later) else x, tree)


def host_tree(setup: Any, variables: Any, lazy: bool = False) -> dict[str, Any]:
    """The variables as nested dicts of numpy arrays, keyed by the model's leaf paths; a
    sharded leaf is an on-device copy of its shards instead (`_saved`). `lazy`: no later
    step donates the variables, so a replicated leaf is copied to the host when the save is
    written, on the saver's thread, instead of now (`CheckpointStore.save` materializes it)."""
    held = _later if lazy else _saved
    paths = setup.model.leaf_paths
    tree: dict[str, Any] = {
        "params": _nest(paths["parameter"], [held(x) for x in variables.params]),
        "model_state": _nest(paths["model state"], [held(x) for x in variables.model_state]),
    }
    if variables.opt_state is not None:
        tree["opt_state"] = _nest(paths["optimizer state"], [held(x) for x in variables.opt_state])
    if variables.ema is not None:  # the moving average of the weights (ema=)
        tree["ema"] = _nest(paths["parameter"], [held(x) for x in variables.ema])
        tree["ema_steps"] = held(variables.ema_steps)
    if variables.loss_scale is not None:  # precision="float16": the dynamic loss scale
        tree["loss_scale"] = dict(
            zip(LOSS_SCALE_KEYS, map(held, variables.loss_scale), strict=True)
        )
    return tree


def restore_targets(setup: Any, variables: Any) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """Where a restore puts each sharded leaf of `variables` (the fresh state: the template):
    its checkpoint path -> shape, dtype and the template leaf's sharding. Orbax reads each of
    them straight onto those devices, each process only its own shards, resharding a
    checkpoint written on another mesh. Replicated leaves are not named: they are read to
    the host and placed as ever."""
    paths = setup.model.leaf_paths
    groups = [("params", paths["parameter"], variables.params)]
    groups.append(("model_state", paths["model state"], variables.model_state))
    if variables.opt_state is not None:
        groups.append(("opt_state", paths["optimizer state"], variables.opt_state))
    if variables.ema is not None:
        groups.append(("ema", paths["parameter"], variables.ema))
    targets = {}
    for key, names, leaves in groups:
        for name, leaf in zip(names, leaves, strict=True):
            if is_sharded(leaf) and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                parts = tuple(name.split(".")) if name else ("value",)
                targets[(key, *parts)] = jax.ShapeDtypeStruct(
                    leaf.shape, leaf.dtype, sharding=leaf.sharding
                )
    return targets


def _dtype(x: Any) -> np.dtype:
    """An array's dtype, without copying a device array to the host."""
    return x.dtype if isinstance(x, (np.ndarray, jax.Array)) else np.asarray(x).dtype


def leaves_from(
    what: str,
    saved: Mapping[str, Any],
    paths,
    template: list,
    misfit: str | None = None,
    here: str = "this model",
) -> list:
    """Leaves in the template's order from a saved nested dict; a mismatch names the leaves
    (`here`: what the template is), after `misfit` (what it means and the fix; by default,
    that the model differs)."""
    flat = flatten(saved) if paths != ("",) else {"": saved.get("value")}
    missing = [p for p in paths if p not in flat]
    extra = [p for p in flat if p not in set(paths)]
    problems = [f"  {p}: missing from the checkpoint" for p in missing[:6]]
    problems += [f"  {p}: in the checkpoint, not in {here}" for p in extra[:6]]
    leaves = []
    for path, like in zip(paths, template, strict=True):
        value = flat.get(path)
        if value is None:
            continue
        is_key = isinstance(like, jax.Array) and jnp.issubdtype(like.dtype, jax.dtypes.prng_key)
        expected = np.shape(jax.random.key_data(like)) if is_key else np.shape(like)
        dtype = jax.random.key_data(like).dtype if is_key else _dtype(like)
        found = _dtype(value)
        if tuple(np.shape(value)) != tuple(expected) or found != dtype:
            problems.append(
                f"  {path}: {here} {dtype}{list(expected)}, checkpoint "
                f"{found}{list(np.shape(value))}"
            )
            continue
        if is_key:
            value = jax.random.wrap_key_data(
                value if isinstance(value, jax.Array) else np.asarray(value),  # pyright: ignore[reportArgumentType]  # jax annotates Array, takes any array
                impl=jax.random.key_impl(like),
            )
        leaves.append(value)
    if problems:
        raise SetupError(
            (
                misfit
                or f"the checkpoint's {what} do not fit this model (build it with the same "
                f"GraphConst values and model code):"
            )
            + "\n"
            + "\n".join(problems)
        )
    return leaves


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, np.generic):
        return json_safe(value.item())
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    return repr(value)
