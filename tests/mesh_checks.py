"""Runs in a subprocess with 4 fake CPU devices (XLA_FLAGS is set by tests/test_mesh.py before
JAX starts) and prints one JSON object of results for the tests to assert on."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import optax
from flax import nnx

import nitro
from nitro.data import ArrayLoader

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 6)).astype(np.float32)
Y = (X[:, 0] + X[:, 1] > 0).astype(np.int32)


class Net(nnx.Module):
    """Linear (no bias: a bias before BatchNorm gets no gradient), BatchNorm, Dropout."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(6, 16, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))


@nitro.experiment
class LossOnly:
    batch_size: int = 16
    max_epochs: int = 2

    def build_data(self):
        return {
            "train": ArrayLoader({"x": X, "y": Y}, self.batch_size, seed=3),
            "val": ArrayLoader(
                {"x": X[:20], "y": Y[:20]}, self.batch_size, shuffle=False, drop_last=False
            ),
        }

    def build_model(self, rngs: nnx.Rngs):
        return Net(rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nitro.experiment
class MeshToy(LossOnly):
    def metrics(self, logits, *, y):
        return {"acc": (logits.argmax(-1) == y).mean()}


@nitro.experiment
class TwoDevices(MeshToy):
    n_devs: int = 2


@nitro.experiment
class Grouped(MeshToy):
    def param_group(self, path):
        return "body" if path.startswith(("hidden", "norm")) else "head"


SWITCHES = dict(group_lr={"body": 0.5}, weight_decay=0.1, decay_to="init", gradient_clip_norm=0.5)


def switched(n_devs):
    """Parameters after training with groups, decay toward init and clipping."""
    n = nitro.Nitro(Grouped(), n_devs=n_devs, progress=False, **SWITCHES)
    n.train()
    return state(n, nnx.Param)


def state(n, kind):
    return [np.asarray(leaf).tolist() for leaf in jax.tree.leaves(nnx.state(n.model, kind))]


def rng_counts(n):
    return [int(leaf) for leaf in jax.tree.leaves(nnx.state(n.model, nnx.RngCount))]


def run(n_devs):
    n = nitro.Nitro(MeshToy(), n_devs=n_devs, progress=False)
    n.train()
    history = n.history()
    return {
        "describe": n.placement.describe(),
        "mesh": n.placement.mesh is not None,
        "loss": history["loss"].tolist(),
        "val_loss": history["val_loss"].tolist(),
        "val_acc": history["val_acc"].tolist(),
        "params": state(n, nnx.Param),
        "batch_stats": state(n, nnx.BatchStat),
        "rng_counts": rng_counts(n),
        "replicated": all(
            leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == n_devs
            for leaf in jax.tree.leaves(n.state.variables)
        ),
        "batch_sharding": first_batch_sharding(n),
        "freed": {s: [p.placed, p.freed] for s, p in n.runtime.prefetchers.items()},
    }


def first_batch_sharding(n):
    with n.runtime.prefetchers["train"].epoch(0) as stream:
        staged = next(stream)
        x = staged.device["x"]
        if not hasattr(x, "sharding"):  # one device: inline batches go into the call as is
            result = {"type": "host array", "spec": "None", "shards": [list(x.shape)]}
        else:
            result = {
                "type": type(x.sharding).__name__,
                "spec": str(getattr(x.sharding, "spec", None)),
                "shards": sorted(tuple(s.data.shape) for s in x.addressable_shards),
            }
        staged.free()
    return result


def error_of(make):
    try:
        make()
    except Exception as error:  # noqa: BLE001 - reported to the test
        return f"{type(error).__name__}: {error}"
    return None


LIVE_MODULE = """
import optax
from flax import nnx

import nitro
from nitro.data import ArrayLoader
from mesh_checks import X, Y

SCALE = 1.0


class Small(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(6, 16, rngs=rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


@nitro.experiment
class LiveMesh:
    def build_data(self):
        return {"train": ArrayLoader({"x": X, "y": Y}, 8)}

    def build_model(self, rngs):
        return Small(rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, outputs, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(outputs, y).mean() * SCALE
"""


def live_edit():
    """A loss edit swapped into a run on a 4-device mesh: its status, where it compiled, and
    whether the weights stay replicated over the mesh."""
    import importlib
    import tempfile
    import time
    from pathlib import Path

    from nitro.core.progress import SilentReporter

    class Losses(SilentReporter):
        def __init__(self):
            self.losses = {}

        def step(self, step, loss):
            self.losses[step] = loss

    folder = Path(tempfile.mkdtemp())
    path = folder / "live_mesh_module.py"
    path.write_text(LIVE_MODULE)
    sys.path.insert(0, str(folder))
    module = importlib.import_module("live_mesh_module")
    losses = Losses()
    n = nitro.Nitro(
        module.LiveMesh(),
        n_devs=4,
        max_epochs=100_000,
        checkpointer=None,
        logger=None,
        progress=losses,
        steps_per_dispatch=1,
    )
    n.train(background=True)
    while n.step < 20:
        time.sleep(0.01)
    compiles = len(nitro.explain_compiles())
    # a constant added to the loss: the same gradients, and losses above 1000 from the swap on
    # however far the run had trained (the cross-entropy it adds to falls towards 0)
    path.write_text(LIVE_MODULE.replace("* SCALE", "* SCALE + 1000.0"))
    importlib.invalidate_caches()
    importlib.reload(module)
    edit = n.apply_edits().wait(300)
    swap = edit.record["step"] if edit.record else 0
    while n.step < swap + 10:
        time.sleep(0.01)
    n.stop().wait()
    # a step away from the swap on either side, whichever step the record names
    after = [losses.losses[s] for s in range(swap + 2, swap + 8)]
    before = [losses.losses[s] for s in range(swap - 6, swap - 1)]
    return {
        "status": edit.status,
        "threads": sorted({r.thread for r in nitro.explain_compiles()[compiles:]}),
        "losses": [float(max(before)), float(min(after))],
        "replicated": all(
            leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 4
            for leaf in n.state.variables.params
        ),
    }


def population():
    """A population of 4 on a 4-device mesh, its members split across the devices and, the
    other way, each batch: both against the same population on one device."""

    def trained(n_devs, mesh_axis="members"):
        pop = nitro.Population(
            MeshToy(),
            learning_rate=[1e-3, 3e-3, 1e-2, 3e-2],
            n_devs=n_devs,
            mesh_axis=mesh_axis,
            progress=False,
        ).train()
        leaf = pop._axis.state.variables.params[0]
        return {
            "val_loss": pop.history()["val_loss"].tolist(),
            "weights": [np.asarray(p).tolist() for p in pop.member(3).state.variables.params],
            "spec": str(getattr(leaf.sharding, "spec", None)),
            "devices": len(leaf.sharding.device_set),
        }

    return {
        "one": trained(1),
        "members": trained(4),
        "batch": trained(4, "batch"),
        "indivisible": error_of(
            lambda: nitro.Population(MeshToy(), seed=[0, 1, 2], n_devs=4, progress=False)
        ),
    }


def population_spikes():
    """`spike=` in a population of 4 on the 4-device mesh (its members split, or each batch):
    members 1 and 3 roll back over batch 5 of every epoch, bit for bit the members of the
    population trained on the data without it (tests/test_population_spikes.py); members 0
    and 2 as in the population without `spike=`."""
    from test_population_spikes import SPIKE, Marked, member_history

    gains = [1.0, float("nan"), 1.0, 1e3]
    found = {}
    for axis in ("members", "batch"):
        keywords = dict(gain=gains, steps_per_dispatch=1, n_devs=4, mesh_axis=axis)
        pop = nitro.Population(Marked(), spike=SPIKE, progress=False, **keywords).train()
        clean = nitro.Population(Marked(dropped=1), progress=False, **keywords).train()
        plain = nitro.Population(Marked(), progress=False, **keywords).train()
        same = []
        for index, other in ((0, plain), (1, clean), (2, plain), (3, clean)):
            mine = member_history(pop, index)
            weights = zip(
                pop.member(index).state.variables.params,
                other.member(index).state.variables.params,
                strict=True,
            )
            same.append(
                mine.equals(member_history(other, index)[mine.columns])
                and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in weights)
            )
        skipped = pop.skipped_batches()[["member", "epoch", "index"]].astype(int)
        found[axis] = {"skipped": skipped.values.tolist(), "same": same}
    return found


def main():
    results = {"devices": jax.device_count(), "flags": os.environ.get("XLA_FLAGS", "")}
    results["one"] = run(1)
    results["four"] = run(4)
    results["switched"] = {"one": switched(1), "four": switched(4)}
    default = nitro.Nitro(MeshToy(), progress=False)
    results["default"] = [default.placement.n_devs, default.keywords["n_devs"].source]
    field = nitro.Nitro(TwoDevices(), progress=False)
    results["field"] = [field.placement.n_devs, field.keywords["n_devs"].source]
    results["indivisible"] = error_of(
        lambda: nitro.Nitro(MeshToy(batch_size=10), n_devs=4, progress=False)
    )
    results["too_many"] = error_of(lambda: nitro.Nitro(MeshToy(), n_devs=8, progress=False))
    results["live_edit"] = live_edit()
    results["population"] = population()
    results["population_spikes"] = population_spikes()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
