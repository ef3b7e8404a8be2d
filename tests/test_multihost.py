"""Two processes on localhost run one experiment with JAX's distributed runtime.

Each process has 2 fake CPU devices, so the mesh spans 4 devices in 2 processes; each feeds
its half of every global batch (`ArrayLoader(..., per_process=True)`). Both must report the
same history and parameters, equal to one process on one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from ports import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = 1e-5


def start(process_id: int, processes: int, port: int, devices: int, cwd) -> subprocess.Popen:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    return subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "multihost_checks.py"),
            str(process_id),
            str(processes),
            str(port),
        ],
        env=env,
        cwd=cwd,  # the run directories go there, not into the source tree
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    port = free_port()
    cwd = tmp_path_factory.mktemp("multihost")
    procs = [start(0, 2, port, 2, cwd), start(1, 2, port, 2, cwd), start(0, 1, 0, 1, cwd)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-4000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def assert_close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=TOLERANCE)


def test_each_process_feeds_its_half_of_the_global_batch(runs):
    first, second, single = runs
    assert [first["process"], second["process"]] == [0, 1]
    assert first["processes"] == second["processes"] == 2
    assert first["describe"] == "mesh 'data' over 4 cpu devices across 2 processes"
    assert first["local_batch"] == second["local_batch"] == 8
    assert single["local_batch"] == 16 and single["describe"] == "1 cpu device, no mesh"


def test_both_processes_report_the_same_loss_and_parameters(runs):
    first, second, _ = runs
    for key in ("loss", "val_loss", "val_acc", "validate", "params", "batch_stats"):
        assert first[key] == second[key], key


def test_the_run_across_processes_matches_one_process(runs):
    first, _, single = runs
    assert_close(first["loss"], single["loss"])
    assert_close(first["val_loss"], single["val_loss"])
    assert first["val_acc"] == single["val_acc"]
    assert first["validate"].keys() == single["validate"].keys() == {"val_loss", "val_acc"}
    for key, value in first["validate"].items():
        assert abs(value - single["validate"][key]) < TOLERANCE, key
    assert_close(first["params"], single["params"])
    assert_close(first["batch_stats"], single["batch_stats"])


def test_every_batch_is_freed_in_every_process(runs):
    for run in runs:
        for split, (placed, freed) in run["freed"].items():
            assert placed == freed > 0, (run["process"], split)


def test_host_metrics_and_predict_gather_the_global_batch(runs):
    first, second, single = runs
    assert first["host_validate"] == second["host_validate"]
    assert first["host_validate"].keys() == {"val_loss", "val_acc"}
    for key, value in first["host_validate"].items():
        assert abs(value - single["host_validate"][key]) < TOLERANCE, key
    assert np.asarray(first["host_predict"]).shape == (20, 2)
    assert first["host_predict"] == second["host_predict"]
    assert_close(first["host_predict"], single["host_predict"])


def test_auto_steps_per_dispatch_is_the_same_decision_in_every_process(runs):
    """Each process times its own steps; every one follows process 0's figures, so they run
    the same programs (a different K in one process would hang the collectives)."""
    first, second = runs[0], runs[1]
    assert first["auto"] == second["auto"]
    assert first["auto"]["step"] == 8 * 32
    assert first["auto"]["steps"] is not None, first["auto"]  # the probe decided


def test_a_grain_dataset_is_sharded_by_process_and_matches_one_process(runs):
    first, second, single = runs
    assert first["grain"]["source"] == "GrainSource"
    assert [first["grain"]["shard"], second["grain"]["shard"]] == [[0, 2], [1, 2]]
    assert single["grain"]["shard"] == [0, 1]
    assert first["grain"]["local_batch"] * 2 == single["grain"]["local_batch"]
    assert first["grain"]["loss"] == second["grain"]["loss"]
    assert_close(first["grain"]["loss"], single["grain"]["loss"])
    assert_close(first["grain"]["params"], single["grain"]["params"])
