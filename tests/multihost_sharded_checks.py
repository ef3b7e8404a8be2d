"""One process of a sharded (`sharding="fsdp"`) run across processes, started by
tests/test_multihost_sharded.py:

    python tests/multihost_sharded_checks.py PROCESS_ID NUM_PROCESSES PORT RUN_DIR

With NUM_PROCESSES > 1 it joins JAX's distributed runtime first. It trains 2 epochs with a
checkpoint each, closes the handle, resumes the run from its checkpoint in a new handle and
trains a third epoch: each process writes its own shards, and reads back its own. Prints one
JSON object: the history, the step and the parameters (gathered from every process).
"""

from __future__ import annotations

import json
import sys

import jax

process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
run_dir = sys.argv[4]
if num_processes > 1:
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


def main():
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
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
