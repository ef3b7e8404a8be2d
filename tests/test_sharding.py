"""Sharded state (`sharding="fsdp"`, rules over `mesh={"data": 4, "model": 2}`) on 8 fake CPU
devices matches the replicated (data-parallel) run of the same experiment.

XLA_FLAGS only counts before JAX starts, so the runs happen in one subprocess
(tests/sharding_checks.py) that prints its results as JSON. Not bitwise: a sharded layout
changes the order of the reductions in the partitioned matmuls and the all-reduces.
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
def found():
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "sharding_checks.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(HERE),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout)
    assert results["devices"] == 8
    return results


def assert_close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=0, atol=TOLERANCE)


def fsdp_rule(shape, size=8):
    """The spec fsdp promises: the largest axis `size` divides (the first on a tie)."""
    divisible = [d for d, n in enumerate(shape) if n % size == 0]
    if not divisible:
        return []
    best = max(divisible, key=lambda d: (shape[d], -d))
    return [None] * best + ["data"]


# ---------------------------------------------------------------------------------------------
# fsdp


def test_fsdp_matches_replicated_after_three_epochs(found):
    replicated, fsdp = found["replicated"], found["fsdp"]
    assert len(fsdp["loss"]) == 3
    assert_close(replicated["loss"], fsdp["loss"])
    assert_close(replicated["params"], fsdp["params"])
    assert fsdp["describe"] == "mesh 'data' over 8 cpu devices, fsdp sharding"
    assert replicated["describe"] == "mesh 'data' over 8 cpu devices"


def test_fsdp_splits_each_parameter_along_its_largest_divisible_axis(found):
    fsdp = found["fsdp"]
    shapes = [np.shape(p) for p in fsdp["params"]]
    assert fsdp["specs"] == [fsdp_rule(s) for s in shapes]
    by_path = dict(zip(fsdp["paths"], fsdp["specs"], strict=True))
    assert by_path["hidden.kernel"] == [None, "data"]  # 16 x 64: the 64
    assert by_path["mid.kernel"] == ["data"]  # 64 x 24: the 64
    assert by_path["out.bias"] == []  # (2,): no axis divides by 8
    assert all(s == [] for s in found["replicated"]["specs"])


def test_fsdp_optimizer_state_mirrors_the_parameters_at_an_eighth_of_the_bytes(found):
    fsdp, replicated = found["fsdp"], found["replicated"]
    specs = dict(zip(fsdp["paths"], fsdp["specs"], strict=True))
    for path, spec in zip(fsdp["opt_paths"], fsdp["opt_specs"], strict=True):
        param = next((p for p in specs if path.endswith("." + p)), None)
        assert spec == (specs[param] if param else []), path  # mu, nu like the param; counts
    # bytes on one device, from the arrays' own shards: 1/8 of replicated, but for the
    # leaves no axis of which divides by 8 (out.bias, the step counts), kept whole
    padding = 2 * 2 * 4 + 2 * 4  # mu and nu of out.bias (2 floats), two int32 counts
    assert fsdp["opt_bytes"] <= replicated["opt_bytes"] / 8 + padding
    assert fsdp["opt_bytes"] >= replicated["opt_bytes"] / 8
    assert fsdp["param_bytes"] <= replicated["param_bytes"] / 8 + 2 * 4


def test_evaluate_and_predict_on_fsdp_reach_the_host_whole(found):
    replicated, fsdp = found["replicated"], found["fsdp"]
    np.testing.assert_allclose(fsdp["val"]["val_loss"], replicated["val"]["val_loss"], atol=1e-6)
    assert fsdp["val"]["val_acc"] == replicated["val"]["val_acc"]
    assert fsdp["predict_type"] == "ndarray"
    assert np.shape(fsdp["predict"]) == (24, 2)
    assert_close([replicated["predict"]], [fsdp["predict"]])


def test_the_binding_report_lists_each_parameters_spec_and_bytes_per_device(found):
    report = found["fsdp"]["report"]
    assert "sharding  [Nitro keyword]" in report
    assert "fsdp over mesh {'data': 8}" in report
    assert "hidden.kernel" in report and "16x64" in report and "P(None, 'data')" in report
    assert "512 B/device" in report  # 16 * 64 floats / 8
    assert "parameters + optimizer state: 4.0 KiB/device (replicated: 31.6 KiB/device)" in report
    # replicated over 8 devices: the section too, every spec P() and the bytes whole
    replicated = found["replicated"]["report"]
    assert "replicated over mesh {'data': 8}" in replicated
    assert "(replicated: 31.6 KiB/device)" in replicated


# ---------------------------------------------------------------------------------------------
# rules on a 4 x 2 mesh


def test_megatron_rules_on_a_4x2_mesh_match_replicated(found):
    lm = found["lm"]
    assert lm["rules"]["describe"] == "mesh data=4 x model=2 over 8 cpu devices, rules sharding"
    assert_close(lm["replicated"]["loss"], lm["rules"]["loss"])
    assert_close(lm["replicated"]["params"], lm["rules"]["params"])


def test_each_attention_and_mlp_weight_is_sharded_as_the_rules_say(found):
    rules = found["lm"]["rules"]
    specs = dict(zip(rules["paths"], rules["specs"], strict=True))
    for layer in (0, 1):
        block = f"blocks.{layer}"
        for projection in ("query", "key", "value"):
            assert specs[f"{block}.attention.{projection}.kernel"] == [None, "model"]
            assert specs[f"{block}.attention.{projection}.bias"] == ["model"]
        assert specs[f"{block}.attention.out.kernel"] == ["model"]  # rows: (heads, d, width)
        assert specs[f"{block}.up.kernel"] == [None, "model"]  # columns
        assert specs[f"{block}.up.bias"] == ["model"]
        assert specs[f"{block}.down.kernel"] == ["model"]  # rows
        assert specs[f"{block}.down.bias"] == specs[f"{block}.norm1.scale"] == []
    assert specs["tokens.embedding"] == []  # no rule: replicated
    # the optimizer's momentum of each weight takes its weight's spec
    for path, spec in zip(rules["opt_paths"], rules["opt_specs"], strict=True):
        param = next((p for p in specs if path.endswith("." + p)), None)
        assert spec == (specs[param] if param else []), path
    assert rules["opt_bytes"] < found["lm"]["replicated"]["opt_bytes"]
    assert "rules over mesh {'data': 4, 'model': 2}" in rules["report"]
    assert "... 26 more parameters" in rules["report"]  # 38 parameters, the 12 largest shown


def test_nnx_with_partitioning_annotations_and_logical_names_lay_out_the_model_under_rules(found):
    lm = found["lm"]
    specs = dict(zip(lm["annotated"]["paths"], lm["annotated"]["specs"], strict=True))
    assert specs["hidden.kernel"] == [None, "model"]  # ("embed", "mlp") through its rules
    assert specs["out.kernel"] == ["model"]
    assert all(s == [] for s in lm["annotated_replicated"]["specs"])  # replicated ignores them


# ---------------------------------------------------------------------------------------------
# everything on top, sharded


def test_fused_accumulated_grouped_decayed_clipped_ema_sam_scheduled_fsdp_matches(found):
    replicated, fsdp = found["features"]["replicated"], found["features"]["fsdp"]
    assert fsdp["dispatch"] == 2  # fused: 2 steps per program call
    assert_close(replicated["loss"], fsdp["loss"])
    assert_close(replicated["params"], fsdp["params"])  # clipping: the global norm over shards
    assert_close(replicated["ema"], fsdp["ema"])
    assert fsdp["ema_specs"] == fsdp["specs"]  # the moving average lies like the parameters
    assert fsdp["specs"] == [fsdp_rule(np.shape(p)) for p in fsdp["params"]]


def test_the_guard_stops_a_sharded_run_as_it_stops_a_replicated_one(found):
    replicated, fsdp = found["features"]["replicated"], found["features"]["fsdp"]
    assert fsdp["guard"].startswith("DivergenceError: the training loss is nan")
    assert fsdp["guard"] == replicated["guard"]
    assert fsdp["kept"] and replicated["kept"]  # set_device(poison=nan): the weights before it
    assert fsdp["kept_specs"] == fsdp["specs"]  # and still sharded


def test_a_train_step_hook_runs_sharded(found):
    replicated, fsdp = found["manual"]["replicated"], found["manual"]["fsdp"]
    assert_close(replicated["loss"], fsdp["loss"])
    assert_close(replicated["params"], fsdp["params"])
    assert fsdp["specs"] == [fsdp_rule(np.shape(p)) for p in fsdp["params"]]
    specs = dict(zip(fsdp["paths"], fsdp["specs"], strict=True))
    for path, spec in zip(fsdp["opt_paths"], fsdp["opt_specs"], strict=True):
        param = next((p for p in specs if path.endswith("." + p.removeprefix("net."))), None)
        assert spec == (specs[param] if param else []), path


# ---------------------------------------------------------------------------------------------
# refusals


def test_a_rule_matching_no_parameter_is_refused_naming_it(found):
    message = found["refused"]["unmatched"]
    assert message.startswith("PlacementError")
    assert "sharding rule 'decoder\\\\.' matches no parameter (unmatched rule)" in message
    assert "'hidden.kernel'" in message and "fix the pattern" in message


def test_an_axis_that_does_not_divide_is_refused_with_the_parameter_and_sizes(found):
    message = found["refused"]["indivisible"]
    assert "parameter 'out.kernel' (shape (24, 2), size 2)" in message
    assert "mesh axis 'model' of size 4, which does not divide it" in message
    assert "leave that dimension whole (None)" in message


def test_an_axis_not_in_the_mesh_is_refused_naming_the_mesh_axes(found):
    message = found["refused"]["unknown_axis"]
    assert "naming mesh axis 'tensor'" in message and "('data', 'model')" in message
    assert "add it to the mesh" in message
    assert "2 entries for its 1 dimensions" in found["refused"]["rank"]


def test_a_mesh_larger_than_the_devices_is_refused_with_the_fix(found):
    refused = found["refused"]
    assert "spans 16 devices but only 8 cpu devices are visible" in refused["too_large"]
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in refused["too_large"]
    assert "n_devs=4 conflicts with mesh={'data': 4, 'model': 2}" in refused["n_devs_conflict"]
    assert "set n_devs=8" in refused["n_devs_conflict"]
    assert "with a 'data' axis" in refused["no_data_axis"]
    assert "got 'zero3'" in refused["bad_strategy"]


def test_rules_without_rules_or_annotations_is_refused(found):
    message = found["refused"]["no_annotations"]
    assert "its parameters carry none" in message and "sharding='fsdp'" in message


def test_a_population_refuses_a_sharded_layout_naming_the_fix(found):
    message = found["refused"]["population"]
    assert message.startswith("PopulationError")
    assert "sharding='fsdp'" in message and "leave sharding='replicated'" in message
