"""Child processes for tests/test_sharded_checkpoints.py, run with fake CPU devices (the test
sets XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts):

    python tests/sharded_checkpoint_checks.py MODE WORK_DIR

- `crash` (8 devices): trains `Dropped` sharded (`sharding="fsdp"`) in WORK_DIR/crashed,
  SIGKILLs itself in the middle of epoch 3, once epoch 2's checkpoint is on disk.
- `main` (8 devices): the store with a hand-sharded tree (what it writes, plain orbax
  reading it back, a restore onto shardings), an uninterrupted sharded run, the crashed
  run resumed on 8 devices, on a replicated layout, and one epoch replicated then fsdp again;
  an export of the sharded handle.
- `resume` (4 or 1 devices): resumes a copy of the crashed run on every visible device.

Each prints one JSON object; arrays go to .npz files in WORK_DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from lifecycle_toys import Dropped, KillAt, parameters  # noqa: E402

import nitro  # noqa: E402
from nitro.runs.checkpoint_reads import read_checkpoint, resolve_checkpoint  # noqa: E402
from nitro.runs.checkpoint_record import CheckpointRecord, MemberRecord  # noqa: E402
from nitro.runs.checkpoint_writer import CheckpointStore  # noqa: E402

EVERY_EPOCH = nitro.Checkpointer(budget=None)
STEPS_PER_EPOCH = 8  # Dropped: 64 samples in batches of 8


def plain_orbax_numpy(step_dir: Path) -> dict:
    """A saved step's state read with plain orbax as numpy arrays, whatever devices it was
    written from: a target tree of numpy leaves, taken from orbax's own metadata."""
    metadata = ocp.StandardCheckpointHandler().metadata(step_dir / "state")
    target = jax.tree.map(
        lambda m: np.zeros(m.shape, m.dtype),
        metadata.tree,
        is_leaf=lambda m: hasattr(m, "shape"),
    )
    return ocp.StandardCheckpointer().restore(step_dir / "state", target)


def flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        out.update(flat(value, path) if isinstance(value, dict) else {path: value})
    return out


def store_checks(work: Path) -> dict:
    """The store on a hand-sharded tree: it writes each shard, reads back whole as numpy,
    and restores onto a sharding without gathering."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharded = NamedSharding(mesh, PartitionSpec("data"))
    whole = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    live = jax.device_put(whole, sharded)
    tree = {"params": {"w": live, "b": np.ones(3, np.float32)}}
    from nitro.runs.checkpoint_trees import _saved

    snapshot = _saved(live)
    tree = {"params": {"w": snapshot, "b": tree["params"]["b"]}}
    directory = work / "store" / "checkpoints"
    store = CheckpointStore(directory, nitro.Checkpointer(budget=None), deterministic=False)
    record = CheckpointRecord(run_id="checks", step=1, epoch=1, members=(MemberRecord(),))
    store.save(1, tree, record, 0.5)
    live.delete()  # what the next step's donation does to the live array
    store.close()
    metadata = json.loads((directory / "1" / "state" / "_METADATA").read_text())
    values = {
        key.strip("()',").replace("', '", "."): value["value_metadata"]
        for key, value in metadata["tree_metadata"].items()
    }
    shardings = json.loads((directory / "1" / "state" / "_sharding").read_text())
    plain = plain_orbax_numpy(directory / "1")
    host, _ = read_checkpoint(directory, 1)
    targets = {("params", "w"): jax.ShapeDtypeStruct((16, 3), jnp.float32, sharding=sharded)}
    onto, _ = read_checkpoint(directory, 1, targets=targets)
    w = onto["params"]["w"]
    return {
        "value_metadata": values,
        "shardings": [json.loads(s) for s in shardings.values()],
        "plain_equal": bool(np.array_equal(plain["params"]["w"], whole)),
        "plain_type": type(plain["params"]["w"]).__name__,
        "host_type": type(host["params"]["w"]).__name__,
        "host_equal": bool(np.array_equal(host["params"]["w"], whole)),
        "restored_spec": str(w.sharding.spec),
        "restored_shards": sorted(list(s.data.shape) for s in w.addressable_shards),
        "restored_equal": bool(np.array_equal(np.asarray(w), whole)),
        "b_type": type(onto["params"]["b"]).__name__,
        "live_memory": live.sharding.memory_kind,
        "snapshot_memory": snapshot.sharding.memory_kind,
        "restored_memory": w.sharding.memory_kind,
    }


def sharding_keyword() -> dict:
    from nitro.engine.run_keywords import RUN_KEYWORDS

    return {"sharding": "fsdp"} if "sharding" in RUN_KEYWORDS else {}


def shardings_of(n) -> list[str]:
    return [str(getattr(x.sharding, "spec", x.sharding)) for x in n.state.variables.params]


def write(n, out: Path) -> None:
    np.savez(out.with_suffix(".npz"), **parameters(n))
    history = n.history()
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "loss": history["loss"].tolist(),
                "val_loss": history["val_loss"].tolist(),
                "step": n.step,
                "epoch": n.epoch,
                "specs": shardings_of(n),
                "devices": jax.device_count(),
            }
        )
    )


def resume(run_dir: Path, out: Path, **keywords) -> None:
    n = nitro.Nitro(
        Dropped(),
        run_dir=run_dir,
        checkpointer=EVERY_EPOCH,
        resume="auto",
        progress=False,
        **keywords,
    )
    write(n.train(), out)


def main(mode: str, work: Path) -> None:
    sharding = sharding_keyword()
    if mode == "crash":
        crashed = work / "crashed"
        progress = KillAt(2 * STEPS_PER_EPOCH + 3, crashed / "checkpoints" / "16")
        nitro.Nitro(
            Dropped(), run_dir=crashed, checkpointer=EVERY_EPOCH, progress=progress, **sharding
        ).train()
        raise SystemExit("the run was not killed")
    results: dict = {"devices": jax.device_count(), "sharding": bool(sharding)}
    if mode == "main":
        results["store"] = store_checks(work)
        for copy in ("on8", "on4", "on1", "replicated", "back"):
            shutil.copytree(work / "crashed", work / copy)
        full = nitro.Nitro(
            Dropped(), run_dir=work / "full", checkpointer=EVERY_EPOCH, progress=False, **sharding
        )
        write(full.train(), work / "full")
        found = resolve_checkpoint(work / "full", read=False)
        saved = flat(plain_orbax_numpy(found.path))
        mine = parameters(full)
        results["plain_equals_params"] = all(
            np.array_equal(saved[f"params.{path}"], value) for path, value in mine.items()
        )
        results["saved_write_shapes"] = {
            key.strip("()',").replace("', '", "."): value["value_metadata"].get("write_shape")
            for key, value in json.loads((found.path / "state" / "_METADATA").read_text())[
                "tree_metadata"
            ].items()
            if key.startswith("('params'")
        }
        resume(work / "on8", work / "on8", **sharding)
        resume(
            work / "replicated",
            work / "replicated",
            **({"sharding": "replicated"} if sharding else {}),
        )
        # and back: one epoch resumed replicated (a checkpoint of host arrays), then fsdp
        there = nitro.Nitro(
            Dropped(),
            run_dir=work / "back",
            checkpointer=EVERY_EPOCH,
            resume="auto",
            progress=False,
            sharding="replicated",
        )
        there.train(epochs=1)
        there.close()
        resume(work / "back", work / "back", **sharding)
        x = np.random.default_rng(5).normal(size=(13, 5)).astype(np.float32)
        np.save(work / "x.npy", x)
        np.save(work / "predicted.npy", np.asarray(full.predict({"x": x})))
        full.export(work / "bundle")
    elif mode == "resume":
        here = work / f"on{jax.device_count()}"
        resume(here, here, **(sharding if jax.device_count() > 1 else {}))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
