"""An fsdp run across two processes of 4 fake CPU devices each saves its checkpoint (each
process its own shards) and resumes from it; it matches one process of 8 devices."""

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


def start(
    process_id: int, processes: int, port: int, devices: int, run_dir, mode: str = "run"
) -> subprocess.Popen:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    script = os.path.join(HERE, "multihost_sharded_checks.py")
    return subprocess.Popen(
        [sys.executable, script, str(process_id), str(processes), str(port), str(run_dir), mode],
        env=env,
        cwd=os.path.dirname(run_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(procs: list[subprocess.Popen]) -> list[dict]:
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


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    port = free_port()
    work = tmp_path_factory.mktemp("multihost_store")
    return finish([start(i, 2, port, 4, work / "store", "store") for i in (0, 1)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    port = free_port()
    work = tmp_path_factory.mktemp("multihost_sharded")
    return finish(
        [
            start(0, 2, port, 4, work / "across"),
            start(1, 2, port, 4, work / "across"),
            start(0, 1, 0, 8, work / "one"),
        ]
    )


def test_each_process_saves_and_restores_its_own_shards(stored):
    first, second = stored
    assert [first["process"], second["process"]] == [0, 1]
    for run in stored:
        assert run["spec"] == "P('data',)" and run["local_shards"] == 4
        assert run["shards_equal"]  # restored onto its own devices, each shard its rows
        assert run["numpy_type"] == "ndarray" and run["numpy_equal"]  # whole, without a target
    assert set(first["shard_ids"]).isdisjoint(second["shard_ids"])


def test_the_run_is_sharded_across_both_processes_and_resumes_from_its_checkpoint(runs):
    first, second, single = runs
    assert [first["process"], second["process"]] == [0, 1]
    assert first["processes"] == 2 and first["devices"] == single["devices"] == 8
    assert "P(None, 'data')" in first["specs"] and first["specs"] == single["specs"]
    for run in runs:
        assert run["resumed_at"] == 2 and run["epoch"] == 3


def test_both_processes_agree_and_match_one_process_of_8_devices(runs):
    first, second, single = runs
    assert first["loss"] == second["loss"] and first["params"] == second["params"]
    assert first["step"] == single["step"]
    np.testing.assert_allclose(first["loss"], single["loss"], rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(first["val_loss"], single["val_loss"], rtol=0, atol=TOLERANCE)
    for a, b in zip(first["params"], single["params"], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=TOLERANCE)


def test_rules_on_a_4x2_mesh_across_both_processes_match_one_process_of_8_devices(runs):
    first, second, single = runs
    assert first["rules_specs"] == single["rules_specs"]
    assert first["rules_specs"]["hidden.kernel"] == "P(None, 'model')"
    assert first["rules_specs"]["out.kernel"] == "P('model',)"  # trailing None dropped
    assert first["rules_loss"] == second["rules_loss"]
    np.testing.assert_allclose(first["rules_loss"], single["rules_loss"], rtol=0, atol=TOLERANCE)
    for a, b in zip(first["rules_params"], single["rules_params"], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=TOLERANCE)
