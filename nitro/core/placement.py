"""Where arrays live: one device, or a 1-D data-parallel mesh over axis "data".

On a mesh the batch is sharded on its first axis and everything else (parameters, optimizer
state, Device fields) is replicated; XLA's SPMD partitioner inserts the collectives, so a
BatchNorm sees the global batch and results match one device to float tolerance. Across hosts
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

from nitro.errors import PlacementError

__all__ = ["Placement", "PlacementError"]


def _identity(tree):
    return tree


class Placement:
    """The devices of a run and how its arrays are laid out on them.

    `n_devs=None` takes every visible device; `n_devs=1` builds no mesh. In a multi-process
    run the mesh spans all processes' devices, so `n_devs` must be all of them.
    """

    def __init__(self, n_devs: int | None = None):
        devices = jax.devices()
        available = len(devices)
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
        if self.n_devs > 1 or self.multi_process:
            self.mesh = Mesh(np.array(self.devices), ("data",))
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
    def local_share(self) -> int:
        """How many of the mesh's devices this process feeds."""
        return sum(d.process_index == jax.process_index() for d in self.devices)

    def describe(self) -> str:
        platform = self.devices[0].platform
        if self.mesh is None:
            return f"1 {platform} device, no mesh"
        hosts = f" across {jax.process_count()} processes" if self.multi_process else ""
        return f"mesh 'data' over {self.n_devs} {platform} devices{hosts}"

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
        if batch_size % self.n_devs:
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

    def put_replicated(self, tree: Any) -> Any:
        """Replicate `tree` over the mesh. Across processes every process passes the same
        value (the same seed builds the same model everywhere)."""
        if self.multi_process:
            return jax.tree.map(self._replicate_across_processes, tree)
        return jax.device_put(tree, self.replicated)

    def _replicate_across_processes(self, x: Any) -> jax.Array:
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = self._replicate_across_processes(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.make_array_from_process_local_data(self.replicated, np.asarray(x))
