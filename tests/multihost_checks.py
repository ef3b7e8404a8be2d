"""One process of a multi-process run on localhost, started by tests/test_multihost.py.

    python tests/multihost_checks.py PROCESS_ID NUM_PROCESSES PORT

With NUM_PROCESSES > 1 it joins JAX's distributed runtime first; every process then builds
the same experiment, whose loaders yield this process's share of each global batch. Prints
one JSON object: the history, the parameters and the batch statistics.
"""

from __future__ import annotations

import json
import sys

import jax

process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
if num_processes > 1 and __name__ == "__main__":  # not in a data worker process
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from mesh_checks import LossOnly, X, Y  # noqa: E402

import nitro  # noqa: E402
from nitro.data import ArrayLoader  # noqa: E402


@nitro.experiment
class SharedToy(LossOnly):
    """Loaders that feed each process its share of the global batch of 16, and a metric
    computed on the device (host metrics would fetch other processes' outputs)."""

    def build_data(self):
        return {
            "train": ArrayLoader({"x": X, "y": Y}, self.batch_size, seed=3, per_process=True),
            "val": ArrayLoader(
                {"x": X[:32], "y": Y[:32]}, self.batch_size, shuffle=False, per_process=True
            ),
        }

    def metrics(self, logits, *, y):
        return {"acc": (logits.argmax(-1) == y).mean()}

    def metrics_residency(self, hook):
        return "device"


@nitro.experiment
class HostMetrics(SharedToy):
    """The same metric on the host: every process gathers the global batch's outputs."""

    def metrics_residency(self, hook):
        return "host"


@nitro.experiment
class LongerEpochs(SharedToy):
    """32 global batches an epoch: long enough for "auto" to time fused calls."""

    def build_data(self):
        x, y = np.tile(X, (8, 1)), np.tile(Y, 8)
        return {"train": ArrayLoader({"x": x, "y": y}, self.batch_size, seed=3, per_process=True)}


@nitro.experiment
class GrainSamples(SharedToy):
    """A Grain dataset of samples, shuffled by Grain: each process batches its slice of every
    global batch (jax.process_index() of jax.process_count()), as ArrayLoader(per_process=True)
    does."""

    def build_data(self):
        import grain

        rows = [{"x": X[i], "y": Y[i]} for i in range(len(X))]
        return {"train": grain.MapDataset.source(rows).shuffle(seed=5)}


def main():
    host = nitro.Nitro(HostMetrics(max_epochs=1), progress=False)
    host_validate = host.validate()
    host_predict = host.predict({"x": X[:20]})
    n = nitro.Nitro(SharedToy(), progress=False)
    n.train()
    history = n.history()
    result = {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "describe": n.placement.describe(),
        "local_batch": n.runtime.prefetchers["train"].source.batch_size,
        "loss": history["loss"].tolist(),
        "val_loss": history["val_loss"].tolist(),
        "val_acc": history["val_acc"].tolist(),
        "validate": n.validate(),
        "params": [np.asarray(p).tolist() for p in jax.tree.leaves(nnx.state(n.model, nnx.Param))],
        "batch_stats": [
            np.asarray(p).tolist() for p in jax.tree.leaves(nnx.state(n.model, nnx.BatchStat))
        ],
        "freed": {s: [p.placed, p.freed] for s, p in n.runtime.prefetchers.items()},
        "host_validate": host_validate,
        "host_predict": np.asarray(host_predict).tolist(),
    }
    nitro.dispatch.PROBE_SHARE = float("inf")  # measure however short the run
    auto = nitro.Nitro(LongerEpochs(max_epochs=8), progress=False, checkpointer=None)
    auto.train()
    choice = auto.dispatch
    result["auto"] = {
        "steps": choice.steps,
        "checking": choice.checking,
        "reason": choice.reason,
        "step": auto.step,
    }
    grained = nitro.Nitro(
        GrainSamples(max_epochs=2), progress=False, checkpointer=None, prefetch="threads"
    )
    grained.train()
    source = grained.runtime.prefetchers["train"].source
    result["grain"] = {
        "source": type(source).__name__,
        "shard": [source.process, source.processes],
        "local_batch": source.batch_size,
        "loss": grained.history()["loss"].tolist(),
        "params": [
            np.asarray(p).tolist() for p in jax.tree.leaves(nnx.state(grained.model, nnx.Param))
        ],
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
