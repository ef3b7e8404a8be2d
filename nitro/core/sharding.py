"""How a run's state is laid out over a mesh: one `PartitionSpec` per leaf.

Three strategies (the `sharding=` run keyword), each giving every parameter, model-state and
optimizer-state leaf a spec over the mesh's named axes; Nitro places the leaves with them and
XLA's SPMD partitioner does every gather and reduction:

- "replicated": every leaf whole on every device (data parallel).
- "fsdp": every leaf split along its largest axis that the "data" axis size divides (the first
  such axis on a tie); a leaf with no such axis, and a scalar, stays replicated.
- rules: a mapping of path pattern -> spec. The first pattern that `re.search` finds in a
  parameter's dotted path (`blocks.0.attn.qkv.kernel`) gives its spec; an `nnx.with_partitioning`
  annotation on the model gives the spec of a parameter no pattern matches; anything else is
  replicated. An optimizer-state leaf takes the spec of the parameter its path ends with
  (optax's state mirrors the parameters: `0.mu.blocks.0.attn.qkv.kernel`) when the shapes
  agree (for models by name, a train_step hook's: the model's state ending with the rest of the
  path), and is replicated otherwise. Model state (batch statistics, RNG counts) follows fsdp's
  rule under fsdp and is replicated under rules.

>>> fsdp_spec((512, 1024), 8)
P(None, 'data')
>>> fsdp_spec((3,), 8)
P()
>>> as_spec(("data", None))
P('data', None)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nitro.errors import PlacementError

__all__ = [
    "STRATEGIES",
    "Layout",
    "partition_annotations",
    "as_spec",
    "check_rules",
    "fsdp_spec",
    "param_specs",
    "state_specs",
]

STRATEGIES = ("replicated", "fsdp", "rules")
DATA = "data"


def as_spec(value: Any) -> PartitionSpec:
    """A rule's value as a PartitionSpec: a PartitionSpec, or a tuple of axis names / None /
    tuples of axis names (one entry per dimension)."""
    if isinstance(value, PartitionSpec):
        return value
    if isinstance(value, str):
        return PartitionSpec(value)
    if isinstance(value, (tuple, list)) and all(
        entry is None
        or isinstance(entry, str)
        or (isinstance(entry, (tuple, list)) and all(isinstance(e, str) for e in entry))
        for entry in value
    ):
        return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in value))
    raise ValueError(
        f"a sharding rule's spec must be a jax.sharding.PartitionSpec or a tuple of mesh axis "
        f"names or None, one per dimension, e.g. (None, 'model'); got {value!r}"
    )


def check_rules(value: Mapping[Any, Any]) -> dict[str, PartitionSpec]:
    """The rules of `sharding={pattern: spec}`, each pattern compiled once to check it."""
    if not value:
        raise ValueError(
            "sharding= got an empty rules mapping; give {path pattern: spec}, e.g. "
            "{r'attn\\.qkv\\.kernel': (None, 'model')}, or sharding='replicated'"
        )
    rules = {}
    for pattern, spec in value.items():
        if not isinstance(pattern, str):
            raise ValueError(f"sharding rule keys are path patterns (str); got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"sharding rule {pattern!r} is not a regex: {error}") from None
        rules[pattern] = as_spec(spec)
    return rules


def fsdp_spec(shape: Sequence[int], size: int, axis: str = DATA) -> PartitionSpec:
    """The fsdp spec of a leaf: its largest dimension that `size` divides, sharded over
    `axis` (the first such on a tie); replicated when none divides (and for a scalar)."""
    best = None
    for dim, length in enumerate(shape):
        if length % size == 0 and length >= size and (best is None or length > shape[best]):
            best = dim
    if best is None or size == 1:
        return PartitionSpec()
    return PartitionSpec(*(axis if dim == best else None for dim in range(len(shape))))


def partition_annotations(params: Any) -> list[PartitionSpec | None]:
    """The `nnx.with_partitioning` annotation of each parameter leaf (None where none), in
    leaf order. Flax keeps it as the Variable's `out_sharding` metadata; logical axis names
    become mesh axes through Flax's own translation (`nnx.spmd.get_var_pspec`: the Variable's
    `sharding_rules` metadata, and a `flax.core.spmd.logical_axis_rules` context)."""
    found: list[PartitionSpec | None] = []
    for variable in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        spec = None
        if isinstance(variable, nnx.Variable) and variable.get_metadata().get("out_sharding"):
            spec = nnx.spmd.get_var_pspec(variable)
        found.append(spec)
    return found


def _check_spec(spec: PartitionSpec, shape: tuple, path: str, mesh: Mesh, origin: str) -> None:
    sizes = dict(mesh.shape)
    if len(spec) > len(shape):
        raise PlacementError(
            f"{origin} gives parameter {path!r} (shape {shape}) the spec {spec}, which has "
            f"{len(spec)} entries for its {len(shape)} dimensions; give at most one entry per "
            f"dimension (None leaves a dimension whole)"
        )
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        unknown = [a for a in axes if a not in sizes]
        if unknown:
            raise PlacementError(
                f"{origin} gives parameter {path!r} the spec {spec}, naming mesh axis "
                f"{unknown[0]!r}, but the mesh's axes are {tuple(sizes)}; add it to the mesh "
                f"(mesh={{'data': ..., {unknown[0]!r}: ...}}) or name one of {tuple(sizes)}"
            )
        ways = int(np.prod([sizes[a] for a in axes]))
        if shape[dim] % ways:
            raise PlacementError(
                f"{origin} shards dimension {dim} of parameter {path!r} (shape {shape}, size "
                f"{shape[dim]}) over mesh axis {entry!r} of size {ways}, which does not divide "
                f"it; choose a mesh axis size that divides {shape[dim]}, or leave that "
                f"dimension whole (None) in the spec"
            )


def param_specs(
    strategy: str,
    paths: Sequence[str],
    shapes: Sequence[tuple],
    mesh: Mesh,
    rules: Mapping[str, PartitionSpec] | None = None,
    annotated: Sequence[Any] = (),
) -> list[PartitionSpec]:
    """The spec of each parameter (in leaf order), checked against the mesh."""
    if strategy == "replicated":
        return [PartitionSpec() for _ in paths]
    if strategy == "fsdp":
        size = dict(mesh.shape)[DATA]
        return [fsdp_spec(shape, size) for shape in shapes]
    rules = dict(rules or {})
    unmatched = [p for p in rules if not any(re.search(p, path) for path in paths)]
    if unmatched:
        raise PlacementError(
            f"sharding rule {unmatched[0]!r} matches no parameter (unmatched rule); parameter "
            f"paths are like {', '.join(map(repr, paths[:4]))}"
            f"{f' ... ({len(paths)} in all)' if len(paths) > 4 else ''}: fix the pattern "
            f"(a regex searched in the dotted path) or drop the rule"
        )
    annotated = list(annotated) or [None] * len(paths)
    specs = []
    for path, shape, note in zip(paths, shapes, annotated, strict=True):
        pattern = next((p for p in rules if re.search(p, path)), None)
        if pattern is not None:
            spec, origin = rules[pattern], f"sharding rule {pattern!r}"
        elif note is not None:
            spec, origin = as_spec(note), "the model's nnx.with_partitioning annotation"
        else:
            spec, origin = PartitionSpec(), ""
        _check_spec(spec, tuple(shape), path, mesh, origin)
        specs.append(spec)
    return specs


def state_specs(
    strategy: str,
    paths: Sequence[str],
    shapes: Sequence[tuple],
    mesh: Mesh,
    param_paths: Sequence[str] = (),
    param_shapes: Sequence[tuple] = (),
    by_param: Sequence[PartitionSpec] = (),
) -> list[PartitionSpec]:
    """Specs of optimizer-state or model-state leaves: fsdp's rule per leaf; under rules, the
    spec of the parameter whose path the leaf's path ends with (same shape), else replicated."""
    if strategy == "replicated":
        return [PartitionSpec() for _ in paths]
    if strategy == "fsdp":
        size = dict(mesh.shape)[DATA]
        return [fsdp_spec(shape, size) for shape in shapes]
    ordered = sorted(
        zip(param_paths, param_shapes, by_param, strict=True), key=lambda item: -len(item[0])
    )
    specs = []
    for path, shape in zip(paths, shapes, strict=True):
        spec = PartitionSpec()
        for param, param_shape, param_spec in ordered:
            if _mirrors(path, param) and tuple(shape) == tuple(param_shape):
                spec = param_spec
                break
        specs.append(spec)
    return specs


def _mirrors(path: str, param: str) -> bool:
    """Whether optimizer-state leaf `path` mirrors parameter `param`: it ends with the
    parameter's path (`0.mu.hidden.kernel`), or, for models by name (a train_step hook's
    `net.hidden.kernel`), starts with the model and ends with the rest
    (`net.0.mu.hidden.kernel`)."""
    if path == param or path.endswith("." + param):
        return True
    model, _, rest = param.partition(".")
    return bool(rest) and path.startswith(model + ".") and path.endswith("." + rest)


class Layout:
    """The shardings of a run's state leaves (leaf order of each tree), and the parameters'
    specs for the binding report."""

    def __init__(self, mesh: Mesh, strategy: str):
        self.mesh = mesh
        self.strategy = strategy
        self.params: list[NamedSharding] = []
        self.model_state: list[NamedSharding] = []
        self.opt_state: list[NamedSharding] | None = None
        # path, shape, bytes per device, spec, bytes whole
        self.param_rows: list[tuple[str, tuple, int, PartitionSpec, int]] = []
        self.opt_bytes: tuple[int, int] = (0, 0)  # (per device, replicated)

    def shardings(self, specs: Sequence[PartitionSpec]) -> list[NamedSharding]:
        return [NamedSharding(self.mesh, spec) for spec in specs]

    @staticmethod
    def per_device(shape: tuple, itemsize: int, sharding: NamedSharding) -> int:
        return int(np.prod(sharding.shard_shape(tuple(shape)), dtype=np.int64)) * itemsize


def build_model(build: Callable[[], Any]) -> Any:
    """`build()` (the experiment's `build_model`) with Flax's eager sharding off, so an
    `nnx.with_partitioning` annotation stays metadata for the placement and needs no mesh
    around the construction. Every variable without an annotation then records the eager
    sharding Flax would have given it anywhere else, so its metadata is what the person's own
    model has (a `jax.tree.map` over both agrees)."""
    with nnx.use_eager_sharding(False):
        model = build()
    eager = nnx.using_eager_sharding()
    if eager:
        models = model.values() if isinstance(model, Mapping) else [model]
        for part in models:
            if not isinstance(part, nnx.Module):
                continue  # refused by the caller, which names what it got
            for _, node in nnx.iter_graph(part):
                if isinstance(node, nnx.Variable) and _annotation(node) is None:
                    node.set_metadata("eager_sharding", eager)
    return model


def _annotation(variable: nnx.Variable) -> Any:
    return variable.get_metadata("out_sharding", None) or variable.get_metadata("sharding", None)
