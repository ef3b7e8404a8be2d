"""A data-parallel mesh over 4 fake CPU devices matches one device.

XLA_FLAGS only counts before JAX starts, so the experiment runs in a subprocess
(tests/mesh_checks.py) that prints its results as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def mesh():
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "mesh_checks.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(HERE),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout)
    assert results["devices"] == 4
    return results


def assert_close(one, four):
    assert len(one) == len(four)
    for a, b in zip(one, four, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=TOLERANCE)


def test_n_devs_4_builds_a_mesh_and_n_devs_1_builds_none(mesh):
    assert mesh["one"]["mesh"] is False
    assert mesh["one"]["describe"] == "1 cpu device, no mesh"
    assert mesh["four"]["mesh"] is True
    assert mesh["four"]["describe"] == "mesh 'data' over 4 cpu devices"


def test_the_batch_is_sharded_on_its_first_axis_and_state_replicated(mesh):
    one, four = mesh["one"]["batch_sharding"], mesh["four"]["batch_sharding"]
    # one device: cheap inline batches go into the program call as host arrays
    assert one == {"type": "host array", "spec": "None", "shards": [[16, 6]]}
    assert four["type"] == "NamedSharding" and four["spec"] == "P('data',)"
    assert four["shards"] == [[4, 6]] * 4  # the global batch of 16, 4 rows per device
    assert mesh["one"]["replicated"] and mesh["four"]["replicated"]


def test_losses_match_one_device(mesh):
    assert_close(mesh["one"]["loss"], mesh["four"]["loss"])
    assert_close(mesh["one"]["val_loss"], mesh["four"]["val_loss"])
    assert mesh["one"]["val_acc"] == mesh["four"]["val_acc"]


def test_parameters_after_several_steps_match_one_device(mesh):
    assert_close(mesh["one"]["params"], mesh["four"]["params"])


def test_groups_decay_and_clipping_on_a_mesh_match_one_device(mesh):
    assert_close(mesh["switched"]["one"], mesh["switched"]["four"])


def test_batchnorm_statistics_use_the_global_batch(mesh):
    stats = mesh["four"]["batch_stats"]
    assert any(np.abs(np.asarray(s) - np.round(np.asarray(s))).max() > 1e-3 for s in stats)
    assert_close(mesh["one"]["batch_stats"], stats)


def test_dropout_draws_one_global_mask(mesh):
    # the dropout stream advanced once per step, and the losses and parameters above only
    # match because every device count draws the same mask for the global batch
    assert mesh["one"]["rng_counts"] == mesh["four"]["rng_counts"] == [8]


def test_every_batch_is_freed_on_the_mesh(mesh):
    for split, (placed, freed) in mesh["four"]["freed"].items():
        assert placed == freed > 0, split


def test_n_devs_defaults_to_all_devices_and_reads_an_experiment_field(mesh):
    assert mesh["default"] == [4, "framework default"]
    assert mesh["field"] == [2, "field on experiment"]


def test_a_batch_that_does_not_divide_is_a_setup_error_naming_both_numbers(mesh):
    message = mesh["indivisible"]
    assert message.startswith("PlacementError")
    assert "batch of 10 samples" in message and "n_devs=4" in message
    assert "multiple of 4" in message


def test_more_devices_than_visible_is_an_error_with_the_fix(mesh):
    message = mesh["too_many"]
    assert "n_devs=8" in message and "only 4 cpu devices" in message
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in message


def test_a_live_edit_on_a_mesh_compiles_beside_the_run_and_keeps_the_weights_replicated(mesh):
    live = mesh["live_edit"]
    assert live["status"] == "swapped"
    assert live["threads"] == ["nitro-live-edit-LiveMesh"]  # nothing compiled on the loop
    before, after = live["losses"]  # the largest loss before the swap, the smallest after
    assert before < 1000.0 <= after  # the loss + 1000 from the swap on
    assert live["replicated"]


def test_a_population_splits_its_members_or_each_batch_across_the_mesh(mesh):
    found = mesh["population"]
    one = found["one"]
    assert found["members"]["spec"] == "P('data',)"  # each device its member
    assert found["members"]["devices"] == 4
    assert found["batch"]["spec"] == "P()" and found["batch"]["devices"] == 4
    for placed in ("members", "batch"):
        np.testing.assert_allclose(
            found[placed]["val_loss"], one["val_loss"], rtol=0, atol=TOLERANCE
        )
        assert_close(one["weights"], found[placed]["weights"])
    assert "3 members do not divide across n_devs=4" in found["indivisible"]
    assert "mesh_axis='batch'" in found["indivisible"]


def test_a_population_s_spike_roll_back_is_exact_on_the_mesh_either_way(mesh):
    # members 1 and 3 left batch 5 of each epoch out, bit for bit as the population trained on
    # data without it; members 0 and 2 as the population without spike=
    for axis in ("members", "batch"):
        found = mesh["population_spikes"][axis]
        assert found["skipped"] == [[m, e, 5] for m in (1, 3) for e in (1, 2, 3)], axis
        assert found["same"] == [True, True, True, True], axis
