"""Checkpoints of sharded runs on fake CPU devices: orbax writes each shard from its device
(nothing gathered), plain orbax reads them back whole, a run killed by SIGKILL resumes
exactly, and its checkpoint resumes on fewer devices and on a replicated layout; an export of
the sharded handle runs on one device.

XLA_FLAGS only counts before JAX starts, so the runs are child processes
(tests/sharded_checkpoint_checks.py) with 8, 4 and 1 devices, started once for the module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from lifecycle_toys import Dropped, Wide, parameters

import nitro
import nitro.bundle
from nitro.errors import SetupError

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = 1e-5


def child(mode: str, work: Path, devices: int) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
    )
    return subprocess.run(
        [sys.executable, os.path.join(HERE, "sharded_checkpoint_checks.py"), mode, str(work)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(HERE),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("sharded")
    crash = child("crash", work, 8)
    assert crash.returncode == -signal.SIGKILL, crash.stderr[-4000:]
    results = {}
    for mode, devices in (("main", 8), ("resume", 4), ("resume", 1)):
        done = child(mode, work, devices)
        assert done.returncode == 0, done.stderr[-4000:]
        results[devices] = json.loads(done.stdout)
    return work, results


def result(work: Path, name: str) -> tuple[dict, dict]:
    with np.load(work / f"{name}.npz") as arrays:
        params = dict(arrays)
    return json.loads((work / f"{name}.json").read_text()), params


def test_the_runs_are_fsdp_on_8_devices_and_resume_on_4_and_1(runs):
    work, results = runs
    assert results[8]["sharding"] and results[8]["devices"] == 8
    assert results[4]["devices"] == 4 and results[1]["devices"] == 1
    full, _ = result(work, "full")
    assert full["devices"] == 8
    assert "P('data'" in " ".join(full["specs"]) or "'data')" in " ".join(full["specs"])
    assert result(work, "on4")[0]["devices"] == 4
    assert all(spec == "P()" for spec in result(work, "replicated")[0]["specs"])
    assert result(work, "back")[0]["specs"] == full["specs"]  # replicated, then fsdp again


def test_a_sharded_save_writes_each_shard_from_its_device(runs):
    _, results = runs
    store = results[8]["store"]
    # orbax records the array as a jax.Array written in shards of 2 rows (16 rows / 8)
    assert store["value_metadata"]["params.w"]["value_type"] == "jax.Array"
    assert store["value_metadata"]["params.w"]["write_shape"] == [2, 3]
    assert store["value_metadata"]["params.b"]["value_type"] == "np.ndarray"  # replicated
    (sharding,) = store["shardings"]
    assert sharding["sharding_type"] == "NamedSharding"
    assert sharding["partition_spec"] == ["data"] and sharding["shape"] == [8]
    # what waits to be written is in the devices' host memory, not theirs; it restores onto
    # the live arrays' own memory
    assert store["live_memory"] == store["restored_memory"] == "device"
    assert store["snapshot_memory"] == "pinned_host"


def test_an_fsdp_runs_checkpoint_holds_each_parameter_in_its_shards(runs):
    shapes = runs[1][8]["saved_write_shapes"]
    assert shapes["params.hidden.kernel"] == [5, 4]  # (5, 32) split 8 ways on its last axis
    assert shapes["params.hidden.bias"] == [4]
    assert shapes["params.out.bias"] is None  # (2,): no axis 8 divides, replicated, numpy


def test_the_snapshot_survives_the_live_arrays_donation(runs):
    # the live array was deleted right after save() returned, before the write
    store = runs[1][8]["store"]
    assert store["plain_equal"] and store["host_equal"]


def test_a_sharded_checkpoint_reads_back_as_numpy_without_a_template(runs):
    store = runs[1][8]["store"]
    assert store["plain_type"] == "ndarray"  # plain orbax, numpy targets
    assert store["host_type"] == "ndarray"  # Nitro's own reader (weights=, describe)


def test_a_restore_with_targets_lands_on_their_shardings(runs):
    store = runs[1][8]["store"]
    assert store["restored_spec"] == "P('data',)"
    assert store["restored_shards"] == [[2, 3]] * 8
    assert store["restored_equal"]
    assert store["b_type"] == "ndarray"  # a leaf without a target stays on the host


def test_the_saved_checkpoint_read_with_plain_orbax_equals_the_handles_params(runs):
    assert runs[1][8]["plain_equals_params"]


def test_sigkill_mid_run_and_resume_is_bitwise_equal_to_an_uninterrupted_run(runs):
    work, _ = runs
    full, full_params = result(work, "full")
    resumed, resumed_params = result(work, "on8")
    assert resumed["loss"] == full["loss"] and resumed["val_loss"] == full["val_loss"]
    assert resumed["step"] == full["step"] and resumed["specs"] == full["specs"]
    for path, value in full_params.items():
        np.testing.assert_array_equal(resumed_params[path], value)


@pytest.mark.parametrize("name", ["on4", "on1", "replicated", "back"])
def test_a_checkpoint_of_8_devices_resumes_on_another_layout(runs, name):
    work, _ = runs
    full, full_params = result(work, "full")
    resumed, resumed_params = result(work, name)
    assert resumed["step"] == full["step"]
    np.testing.assert_allclose(resumed["loss"], full["loss"], rtol=0, atol=TOLERANCE)
    for path, value in full_params.items():
        np.testing.assert_allclose(resumed_params[path], value, rtol=0, atol=TOLERANCE)


def test_an_export_of_a_sharded_handle_runs_on_one_device(runs):
    work, _ = runs
    assert len(jax.devices()) == 1
    model = nitro.bundle.load(work / "bundle")
    x = np.load(work / "x.npy")
    np.testing.assert_allclose(model(x=x)["output"], np.load(work / "predicted.npy"), atol=1e-5)


def test_a_sharded_runs_checkpoint_reads_as_numpy_in_a_process_of_one_device(runs):
    work, _ = runs
    assert len(jax.devices()) == 1
    _, full_params = result(work, "full")
    manager = ocp.CheckpointManager(
        work / "full" / "checkpoints",
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        },
    )
    step = manager.latest_step()
    assert step is not None
    # plain orbax: numpy targets from the step's own metadata (docs/distributed-checkpoints.md)
    metadata = manager.item_metadata(step)["state"].tree
    target = jax.tree.map(
        lambda m: np.zeros(m.shape, m.dtype), metadata, is_leaf=lambda m: hasattr(m, "shape")
    )
    saved = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))[
        "state"
    ]
    manager.close()
    for path, value in full_params.items():
        node = saved["params"]
        for part in path.split("."):
            node = node[part]
        assert isinstance(node, np.ndarray)
        np.testing.assert_array_equal(node, value)
    # Nitro's own readers: weights= starts a one-device run from it
    started = nitro.Nitro(Dropped(), weights=work / "full", progress=False, checkpointer=None)
    for path, value in parameters(started).items():
        np.testing.assert_array_equal(value, full_params[path])


def test_a_sharded_checkpoint_that_does_not_fit_the_model_names_the_leaves(runs):
    work, _ = runs
    with pytest.raises(SetupError, match=r"hidden1\.kernel: missing from the checkpoint"):
        nitro.Nitro(Wide(), weights=work / "full", progress=False, checkpointer=None).train()
