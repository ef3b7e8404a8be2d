"""A sharded run of a model without model state (the digits MLP: no Dropout, no BatchNorm)
resumes in a new process, on the devices it was trained on and on fewer; a checkpoint that
does not fit the resuming model is refused naming the leaves that differ, never as damaged.

XLA_FLAGS only counts before JAX starts, so the runs are child processes
(tests/sharded_resume_checks.py) with 8 and 4 devices, started once for the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def child(mode: str, work: Path, devices: int) -> dict:
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "sharded_resume_checks.py"), mode, str(work)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(HERE),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("sharded_resume")
    (work / "trained").mkdir()
    trained = child("train", work, 8)
    return trained, {devices: child("resume", work, devices) for devices in (8, 4)}


def test_a_digits_run_trained_fsdp_on_8_devices_saved_two_epochs(runs):
    trained, _ = runs
    assert trained["devices"] == 8
    assert trained["step"] == 26  # 1,257 training digits in batches of 96: 13 steps an epoch
    steps = sorted(p.name for p in (Path(trained["run_dir"]) / "checkpoints").iterdir())
    assert "26" in steps


@pytest.mark.parametrize("devices", [8, 4])
def test_a_new_process_resumes_a_sharded_run_without_model_state(runs, devices):
    trained, resumed = runs[0], runs[1][devices]
    assert resumed["devices"] == devices
    assert resumed["resumed_at"] == 26 and resumed["step"] == 39
    assert resumed["params"] == trained["params"]  # the saved weights, not fresh ones
    assert not [w for w in resumed["warnings"] if "damaged" in w]


@pytest.mark.parametrize("devices", [8, 4])
def test_weights_from_a_sharded_run_without_model_state_start_a_replicated_run(runs, devices):
    trained, resumed = runs[0], runs[1][devices]
    assert resumed["weights"] == trained["params"]


@pytest.mark.parametrize("devices", [8, 4])
def test_a_checkpoint_that_does_not_fit_the_model_names_the_leaves_and_is_not_damaged(
    runs, devices
):
    misfit = runs[1][devices]["misfit"]
    assert misfit is not None
    assert "hidden1.kernel: this model float32[64, 128], checkpoint float32[64, 256]" in misfit
    assert "model code" in misfit  # what would read it: the model it was saved with
    assert "damaged" not in misfit and "Delete" not in misfit
    assert not [w for w in runs[1][devices]["warnings"] if "damaged" in w or "Delete" in w]
