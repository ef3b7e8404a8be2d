"""Where arrays live: one device, a 1-D data-parallel mesh over axis "data", or a mesh with
named axes (`mesh={"data": 4, "model": 2}`).

On a mesh the batch is sharded on its first axis over "data" (replicated over any other axis);
parameters, model state and optimizer state are laid out as the `sharding=` strategy says
(`nitro.core.sharding`: replicated, fsdp or rules), Device fields replicated. XLA's SPMD
partitioner inserts the collectives, so a BatchNorm sees the global batch and results match one
device to float tolerance. Across hosts
this is JAX's own runtime: call `jax.distributed.initialize()` first, and each process feeds
its own share of every global batch (`ArrayLoader(..., per_process=True)`); the mesh then spans
every device of every process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from nitro.core import sharding as layouts
from nitro.errors import PlacementError

__all__ = ["Placement", "PlacementError"]


def _identity(tree):
    return tree


class Placement:
    """The devices of a run and how its arrays are laid out on them.

    `n_devs=None` takes every visible device; `n_devs=1` builds no mesh. In a multi-process
    run the mesh spans all processes' devices, so `n_devs` must be all of them. `mesh` (axis
    name -> size, with a "data" axis) shapes the mesh over the first product-of-sizes devices;
    `sharding` is the state's strategy: "replicated", "fsdp", or a rules mapping.
    """

    def __init__(
        self,
        n_devs: int | None = None,
        mesh: Mapping[str, int] | None = None,
        sharding: str | Mapping[str, Any] = "replicated",
    ):
        devices = jax.devices()
        available = len(devices)
        if mesh is not None:
            n_devs = _mesh_size(mesh, n_devs, available, devices[0].platform)
        if n_devs is None:
            n_devs = available
        if isinstance(n_devs, bool) or not isinstance(n_devs, (int, np.integer)) or n_devs < 1:
            raise PlacementError(f"n_devs must be a positive int, got {n_devs!r}")
        if n_devs > available:
            raise PlacementError(
                f"n_devs={n_devs} but only {available} {devices[0].platform} device"
                f"{'s are' if available != 1 else ' is'} visible. Lower n_devs, or on CPU set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n_devs} before JAX starts."
            )
        self.multi_process = jax.process_count() > 1
        if self.multi_process and n_devs != available:
            raise PlacementError(
                f"n_devs={n_devs} in a run across {jax.process_count()} processes; the mesh "
                f"must span every process's devices: leave n_devs unset or set n_devs={available}"
            )
        self.n_devs = int(n_devs)
        self.devices = devices[: self.n_devs]
        self.rules = dict(sharding) if isinstance(sharding, Mapping) else None
        self.sharding = "rules" if isinstance(sharding, Mapping) else str(sharding)
        self.axes = dict(mesh) if mesh is not None else {"data": self.n_devs}
        self.layout: layouts.Layout | None = None  # set by `lay_out`
        if self.n_devs > 1 or self.multi_process or mesh is not None or self.sharded:
            shape = tuple(self.axes.values())
            self.mesh = Mesh(np.array(self.devices).reshape(shape), tuple(self.axes))
            self.batch_sharding = NamedSharding(self.mesh, PartitionSpec("data"))
            # K stacked batches (fused steps): the stacked axis is not sharded
            self.block_sharding = NamedSharding(self.mesh, PartitionSpec(None, "data"))
            self.replicated = NamedSharding(self.mesh, PartitionSpec())
        else:
            self.mesh = None
            self.batch_sharding = self.replicated = SingleDeviceSharding(self.devices[0])
            self.block_sharding = self.batch_sharding
        self._transfer = jax.jit(
            _identity, in_shardings=self.batch_sharding, out_shardings=self.batch_sharding
        )
        self._block_transfer = jax.jit(
            _identity, in_shardings=self.block_sharding, out_shardings=self.block_sharding
        )

    @property
    def sharded(self) -> bool:
        """Whether the state is laid out otherwise than replicated."""
        return self.sharding != "replicated"

    @property
    def data_size(self) -> int:
        """How many ways the batch is split: the size of the mesh's "data" axis."""
        return self.axes["data"]

    @property
    def local_share(self) -> int:
        """How many of the mesh's devices this process feeds."""
        return sum(d.process_index == jax.process_index() for d in self.devices)

    def describe(self) -> str:
        platform = self.devices[0].platform
        if self.mesh is None:
            return f"1 {platform} device, no mesh"
        hosts = f" across {jax.process_count()} processes" if self.multi_process else ""
        if len(self.axes) == 1:
            where = f"mesh 'data' over {self.n_devs} {platform} devices{hosts}"
        else:
            shape = " x ".join(f"{name}={size}" for name, size in self.axes.items())
            where = f"mesh {shape} over {self.n_devs} {platform} devices{hosts}"
        return where + (f", {self.sharding} sharding" if self.sharded else "")

    def check_batch(self, batch_size: int, split: str) -> None:
        """`batch_size` is what this process's source yields: the global batch in one process,
        this process's share of it across processes."""
        if self.mesh is None:
            return
        if self.multi_process:
            local = self.local_share
            if batch_size % local:
                raise PlacementError(
                    f"this process's share of a '{split}' batch has {batch_size} samples, which "
                    f"does not divide across its {local} devices. Choose a global batch that "
                    f"is a multiple of n_devs={self.n_devs}."
                )
            return
        if len(self.axes) > 1 and batch_size % self.data_size:
            raise PlacementError(
                f"the '{split}' batch of {batch_size} samples does not divide across the "
                f"mesh's 'data' axis of {self.data_size} devices. The batch size is global: "
                f"choose a multiple of {self.data_size}, or a 'data' size in mesh= that "
                f"divides {batch_size}."
            )
        if batch_size % self.data_size:
            raise PlacementError(
                f"the '{split}' batch of {batch_size} samples does not divide across "
                f"n_devs={self.n_devs} devices. The batch size is global: choose a multiple of "
                f"{self.n_devs}, or set n_devs to a divisor of {batch_size}."
            )

    def put_batch(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Copy a host batch to the device(s), sharded on the batch axis.

        A jitted identity copies (never aliasing a host buffer a loader may reuse) and costs a
        fraction of `jax.device_put` per call.
        """
        if self.multi_process:
            return {
                k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
                for k, v in batch.items()
            }
        return self._transfer(dict(batch))

    def put_block(self, block: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Copy K stacked host batches (`[K, batch, ...]`) to the device(s), each batch sharded
        on its batch axis as `put_batch` does, the stacked axis not."""
        if self.multi_process:
            return {
                k: jax.make_array_from_process_local_data(self.block_sharding, np.asarray(v))
                for k, v in block.items()
            }
        return self._block_transfer(dict(block))

    def gather(self, tree: Any) -> Any:
        """Bring device arrays (or this process's host rows) to the host, whole: across
        processes every process receives the global batch, in process order."""
        if self.multi_process:
            from jax.experimental import multihost_utils

            return multihost_utils.process_allgather(tree, tiled=True)
        return jax.device_get(tree)

    def agree(self, values: Sequence[float]) -> list[float]:
        """Process 0's `values`, in every process (a decision taken from timings, such as
        steps per call, must be the same everywhere); `values` itself in one process."""
        if not self.multi_process:
            return list(values)
        from jax.experimental import multihost_utils

        agreed = multihost_utils.broadcast_one_to_all(np.asarray(values, np.float32))
        return [float(v) for v in np.asarray(agreed)]

    def gather_texts(self, text: str) -> list[str]:
        """Every process's `text`, in process order (`[text]` in one process): what each
        process decided on its own (a run directory), for all to compare."""
        if not self.multi_process:
            return [text]
        from jax.experimental import multihost_utils

        data = np.frombuffer(text.encode(), np.uint8)
        sizes = np.ravel(multihost_utils.process_allgather(np.array([data.size], np.int32)))
        padded = np.zeros(max(int(sizes.max()), 1), np.uint8)
        padded[: data.size] = data
        rows = np.asarray(multihost_utils.process_allgather(padded))
        return [bytes(row[:size]).decode() for row, size in zip(rows, sizes, strict=True)]

    def local_rows(self, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """This process's share of a global host batch (all of it in one process)."""
        if not self.multi_process:
            return dict(batch)
        share = self.local_share
        out = {}
        for name, value in batch.items():
            value = np.asarray(value)
            per_device = value.shape[0] // self.n_devs
            start = jax.process_index() * share * per_device
            out[name] = value[start : start + share * per_device]
        return out

    def lay_out(self, params: Any, model_state: Any) -> tuple[Any, Any]:
        """Decide the parameters' and model state's shardings (`self.layout`) and place them:
        the refusals of `nitro.core.sharding` (an unmatched rule, an axis that does not divide)
        come from here, before anything compiles."""
        from nitro.optim.param_groups import leaf_paths

        if self.mesh is None:
            return self.put_replicated(params), self.put_replicated(model_state)
        layout = self.layout = layouts.Layout(self.mesh, self.sharding)
        paths, leaves = leaf_paths(params), jax.tree.leaves(params)
        shapes = [tuple(np.shape(x)) for x in leaves]
        annotated = layouts.partition_annotations(params) if self.sharding == "rules" else ()
        if (
            self.sharding == "rules"
            and not self.rules
            and not any(a is not None for a in annotated)
        ):
            raise PlacementError(
                "sharding='rules' lays the model out by its nnx.with_partitioning annotations, "
                "but its parameters carry none: annotate them (kernel_init=nnx.with_partitioning("
                "init, (None, 'model'))), give rules (sharding={path pattern: PartitionSpec}), "
                "or use sharding='fsdp'"
            )
        specs = layouts.param_specs(self.sharding, paths, shapes, self.mesh, self.rules, annotated)
        layout.params = layout.shardings(specs)
        itemsizes = [np.dtype(x.dtype).itemsize for x in leaves]
        layout.param_rows = [
            (path, shape, layout.per_device(shape, size, s), spec, _size(shape) * size)
            for path, shape, size, s, spec in zip(
                paths, shapes, itemsizes, layout.params, specs, strict=True
            )
        ]
        rest = jax.tree.leaves(model_state)
        rest_specs = layouts.state_specs(
            "replicated" if self.sharding == "rules" else self.sharding,
            leaf_paths(model_state),
            [() if _is_key(x) else tuple(np.shape(x)) for x in rest],
            self.mesh,
        )
        layout.model_state = layout.shardings(rest_specs)
        return (
            self.put_sharded(params, layout.params),
            self.put_sharded(model_state, layout.model_state),
        )

    def put_opt_state(self, opt_state: Any) -> Any:
        """Place an optimizer state: fsdp's rule per leaf, or (rules) the spec of the parameter
        each leaf mirrors; recorded in `self.layout.opt_state`."""
        layout = self.layout
        if layout is None or opt_state is None:
            return self.put_replicated(opt_state)
        from nitro.optim.param_groups import leaf_paths

        leaves = jax.tree.leaves(opt_state)
        shapes = [tuple(np.shape(x)) for x in leaves]
        specs = layouts.state_specs(
            self.sharding,
            leaf_paths(opt_state),
            shapes,
            layout.mesh,
            [row[0] for row in layout.param_rows],
            [row[1] for row in layout.param_rows],
            [row[3] for row in layout.param_rows],
        )
        layout.opt_state = layout.shardings(specs)
        sizes = [np.dtype(x.dtype).itemsize for x in leaves]
        layout.opt_bytes = (
            sum(
                layout.per_device(s, i, h)
                for s, i, h in zip(shapes, sizes, layout.opt_state, strict=True)
            ),
            sum(_size(s) * i for s, i in zip(shapes, sizes, strict=True)),
        )
        return self.put_sharded(opt_state, layout.opt_state)

    def put_sharded(self, tree: Any, shardings: Sequence[Any]) -> Any:
        """Place each leaf of `tree` with its sharding (leaf order). Across processes each
        process passes the same whole value and keeps the shards on its own devices."""
        leaves, treedef = jax.tree.flatten(tree)
        placed = [self._put(x, s) for x, s in zip(leaves, shardings, strict=True)]
        return jax.tree.unflatten(treedef, placed)

    def _put(self, x: Any, sharding: Any) -> jax.Array:
        if _is_key(x):
            data = self._put(jax.random.key_data(x), self.replicated)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        if not self.multi_process or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, sharding)  # already global: JAX reshards it across processes
        value = np.asarray(x)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    def put_like(self, tree: Any, like: Sequence[Any]) -> Any:
        """Place `tree`'s leaves on the shardings of the live leaves `like` (same order): how
        weights loaded into a running handle keep its layout."""
        return self.put_sharded(tree, [x.sharding for x in like])

    def put_replicated(self, tree: Any) -> Any:
        """Replicate `tree` over the mesh. Across processes every process passes the same
        value (the same seed builds the same model everywhere)."""
        if self.multi_process:
            return jax.tree.map(self._replicate_across_processes, tree)
        return jax.device_put(tree, self.replicated)

    def _replicate_across_processes(self, x: Any) -> jax.Array:
        if _is_key(x):
            data = self._replicate_across_processes(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.make_array_from_process_local_data(self.replicated, np.asarray(x))


def _size(shape: tuple) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _mesh_size(mesh: Mapping[str, int], n_devs: int | None, available: int, platform: str) -> int:
    """The devices `mesh=` spans (the product of its sizes), checked against `n_devs` and the
    visible devices."""
    if not isinstance(mesh, Mapping) or "data" not in mesh:
        raise PlacementError(
            f"mesh must be a dict of axis name -> size with a 'data' axis (the axis the batch "
            f"is split over), e.g. mesh={{'data': 4, 'model': 2}}; got {mesh!r}"
        )
    for name, size in mesh.items():
        if not isinstance(name, str) or isinstance(size, bool) or not isinstance(size, int):
            raise PlacementError(f"mesh axis {name!r} must map a name to an int size, got {size!r}")
        if size < 1:
            raise PlacementError(f"mesh axis {name!r} has size {size}; sizes are >= 1")
    total = int(np.prod(list(mesh.values())))
    if total > available:
        raise PlacementError(
            f"mesh={dict(mesh)} spans {total} devices but only {available} {platform} device"
            f"{'s are' if available != 1 else ' is'} visible. Shrink the mesh's axes to a "
            f"product <= {available}, or on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={total} before JAX starts."
        )
    if n_devs is not None and n_devs != total:
        raise PlacementError(
            f"n_devs={n_devs} conflicts with mesh={dict(mesh)}, which spans {total} devices; "
            f"drop n_devs (a mesh sets it) or set n_devs={total}"
        )
    return total
