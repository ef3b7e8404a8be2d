"""One process of a sharded (`sharding="fsdp"`) run across processes, started by
tests/test_multihost_sharded.py:

    python tests/multihost_sharded_checks.py PROCESS_ID NUM_PROCESSES PORT RUN_DIR MODE

With NUM_PROCESSES > 1 it joins JAX's distributed runtime first. MODE `store`: the checkpoint
store saves an array sharded over every process's devices (each process writes its shards)
and reads it back onto the same sharding and, without a target, whole as numpy. MODE `run`:
it trains 2 epochs with a
checkpoint each, closes the handle, resumes the run from its checkpoint in a new handle and
trains a third epoch: each process writes its own shards, and reads back its own; then one
epoch under tensor-parallel rules on a 4 x 2 mesh. Prints one JSON object: the histories, the
step, the specs and the parameters (gathered from every process).
"""

from __future__ import annotations

import json
import sys

import jax

process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
run_dir, mode = sys.argv[4:6]
if num_processes > 1 and __name__ == "__main__":  # not in a data worker process
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )

import numpy as np  # noqa: E402
from mesh_checks import LossOnly, X, Y  # noqa: E402

import nitro  # noqa: E402
from nitro.data import ArrayLoader  # noqa: E402


@nitro.experiment
class ShardedToy(LossOnly):
    """Each process is fed its share of the global batch of 16; the metric stays on the
    device."""

    max_epochs: int = 3

    def build_data(self):
        return {
            "train": ArrayLoader({"x": X, "y": Y}, self.batch_size, seed=3, per_process=True),
            "val": ArrayLoader(
                {"x": X[:32], "y": Y[:32]}, self.batch_size, shuffle=False, per_process=True
            ),
        }


def store() -> None:
    from pathlib import Path

    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from nitro.runs.checkpoint_reads import read_checkpoint
    from nitro.runs.checkpoint_record import CheckpointRecord, MemberRecord
    from nitro.runs.checkpoint_trees import _saved
    from nitro.runs.checkpoint_writer import CheckpointStore

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    whole = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    live = jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])
    directory = Path(run_dir) / "checkpoints"
    saver = CheckpointStore(directory, nitro.Checkpointer(budget=None), deterministic=True)
    record = CheckpointRecord(run_id="checks", step=1, epoch=1, members=(MemberRecord(),))
    saver.save(1, {"params": {"w": _saved(live), "b": np.ones(3, np.float32)}}, record, 0.5)
    saver.close()
    target = jax.ShapeDtypeStruct(whole.shape, jnp.float32, sharding=sharding)
    onto, _ = read_checkpoint(directory, 1, targets={("params", "w"): target})
    w = onto["params"]["w"]
    host, _ = read_checkpoint(directory, 1)
    print(
        json.dumps(
            {
                "process": jax.process_index(),
                "spec": str(w.sharding.spec),
                "local_shards": len(w.addressable_shards),
                "shards_equal": all(
                    np.array_equal(np.asarray(s.data), whole[s.index]) for s in w.addressable_shards
                ),
                "numpy_equal": bool(np.array_equal(host["params"]["w"], whole)),
                "numpy_type": type(host["params"]["w"]).__name__,
                "shard_ids": sorted(s.device.id for s in w.addressable_shards),
            }
        ),
        flush=True,
    )


def main():
    if mode == "store":
        store()
        return
    keywords = dict(
        run_dir=run_dir,
        sharding="fsdp",
        checkpointer=nitro.Checkpointer(budget=None),
        progress=False,
        logger=None,
    )
    first = nitro.Nitro(ShardedToy(), **keywords)
    first.train(epochs=2)
    specs = [str(x.sharding.spec) for x in first.state.variables.params]
    first.close()
    resumed = nitro.Nitro(ShardedToy(), resume="auto", **keywords)
    at = resumed.epoch
    resumed.train()
    history = resumed.history()
    params = resumed.placement.gather(list(resumed.state.variables.params))
    resumed.close()
    # the same rules across processes: tensor parallel over "model" on a 4 x 2 mesh, whose
    # "model" pairs lie within a process and whose "data" rows span both
    ruled = nitro.Nitro(
        ShardedToy(max_epochs=1),
        mesh={"data": 4, "model": 2},
        sharding={r"hidden\.kernel": (None, "model"), r"^out\.kernel": ("model", None)},
        checkpointer=None,
        progress=False,
        logger=None,
    )
    ruled.train()
    print(
        json.dumps(
            {
                "process": jax.process_index(),
                "processes": jax.process_count(),
                "devices": jax.device_count(),
                "specs": specs,
                "resumed_at": at,
                "epoch": resumed.epoch,
                "step": resumed.step,
                "loss": history["loss"].tolist(),
                "val_loss": history["val_loss"].tolist(),
                "params": [np.asarray(p).tolist() for p in params],
                "rules_specs": {
                    path: str(x.sharding.spec)
                    for path, x in zip(
                        ruled.setup.model.leaf_paths["parameter"],
                        ruled.state.variables.params,
                        strict=True,
                    )
                },
                "rules_loss": ruled.history()["loss"].tolist(),
                "rules_params": [
                    np.asarray(p).tolist()
                    for p in ruled.placement.gather(list(ruled.state.variables.params))
                ],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
