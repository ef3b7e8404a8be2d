"""Importing weights: files in PyTorch layout read and loaded into Flax NNX models, each rule
checked against PyTorch's arithmetic written out in numpy, the round trip, bad input, and
`weights=nitro.Partial` through `Nitro(...)`."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import nitro
import nitro.weights
from nitro.errors import WeightsError

RNG = np.random.default_rng(0)


def normal(*shape, dtype=np.float32):
    return RNG.normal(size=shape).astype(dtype)


def leaves(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def conv_nchw(x, weight, groups=1, padding=1):
    """PyTorch's convolution (cross-correlation, weight (O, I/groups, *k)) on channels-first."""
    spatial = "DHW"[3 - (x.ndim - 2) :]
    numbers = (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")
    return jax.lax.conv_general_dilated(
        x, weight, (1,) * (x.ndim - 2), [(padding, padding)] * (x.ndim - 2),
        dimension_numbers=numbers, feature_group_count=groups,
    )  # fmt: skip


def last_to_channels(x):
    return np.moveaxis(np.asarray(x), -1, 1)


# ---------------------------------------------------------------------------------------------
# the conversion rules, each against PyTorch's arithmetic


def test_a_linear_weight_out_by_in_is_transposed_into_the_kernel():
    weight, bias, x = normal(3, 5), normal(3), normal(4, 5)
    model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    report = nitro.weights.load({"weight": weight, "bias": bias}, model)
    np.testing.assert_allclose(model(x), x @ weight.T + bias, rtol=1e-5, atol=1e-5)
    assert report.converted == {"kernel": "linear"}
    assert report.loaded["bias"] == nitro.weights.LoadedLeaf("bias", "same", None)


@pytest.mark.parametrize(
    ("dims", "channels", "groups"),
    [(1, (4, 6), 1), (2, (4, 6), 1), (2, (4, 6), 2), (2, (4, 4), 4), (3, (2, 4), 1)],
    ids=["conv1d", "conv2d", "grouped", "depthwise", "conv3d"],
)
def test_a_conv_weight_oihw_gives_the_same_output_as_pytorch_channels_first(dims, channels, groups):
    cin, cout = channels
    weight, bias = normal(cout, cin // groups, *(3,) * dims), normal(cout)
    x = normal(2, cin, *(5,) * dims)
    model = nnx.Conv(
        cin, cout, (3,) * dims, padding=1, feature_group_count=groups, rngs=nnx.Rngs(0)
    )
    report = nitro.weights.load({"weight": weight, "bias": bias}, model)
    expected = conv_nchw(x, weight, groups) + bias.reshape(1, cout, *(1,) * dims)
    got = last_to_channels(model(np.moveaxis(x, 1, -1)))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert report.converted == {"kernel": "conv"}


def conv_transpose_nchw(x, weight, stride):
    """PyTorch's ConvTranspose2d (weight (I, O, kh, kw), no padding), as its definition: each
    input pixel scatters its weighted kernel into the output."""
    n, cin, h, w = x.shape
    _, cout, kh, kw = weight.shape
    out = np.zeros((n, cout, (h - 1) * stride + kh, (w - 1) * stride + kw), np.float64)
    for i in range(h):
        for j in range(w):
            patch = np.einsum("nc,cokl->nokl", x[:, :, i, j], weight)
            out[:, :, i * stride : i * stride + kh, j * stride : j * stride + kw] += patch
    return out


@pytest.mark.parametrize("transpose_kernel", [False, True])
def test_a_conv_transpose_weight_gives_pytorchs_transposed_convolution(transpose_kernel):
    weight, bias, x = normal(3, 2, 3, 3), normal(2), normal(2, 3, 4, 4)
    model = nnx.ConvTranspose(
        3, 2, (3, 3), strides=2, padding="VALID", transpose_kernel=transpose_kernel,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    report = nitro.weights.load({"weight": weight, "bias": bias}, model)
    expected = conv_transpose_nchw(x, weight, 2) + bias.reshape(1, 2, 1, 1)
    got = last_to_channels(model(np.moveaxis(x, 1, -1)))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert report.converted == {"kernel": "conv_transpose"}


def test_batch_norm_takes_pytorchs_running_statistics_as_its_batch_statistics():
    torch = {
        "weight": normal(4),
        "bias": normal(4),
        "running_mean": normal(4),
        "running_var": np.abs(normal(4)) + 0.5,
        "num_batches_tracked": np.array(7, np.int64),
    }
    model = nnx.BatchNorm(4, use_running_average=True, rngs=nnx.Rngs(0))
    report = nitro.weights.load(torch, model)
    x = normal(3, 4)
    expected = (x - torch["running_mean"]) / np.sqrt(torch["running_var"] + 1e-5)
    expected = expected * torch["weight"] + torch["bias"]
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-5)
    assert report.converted == dict.fromkeys(["mean", "var", "scale"], "batch_norm")
    assert report.ignored == ("num_batches_tracked",)
    assert report.unused == ()


@pytest.mark.parametrize("kind", ["layer", "group"])
def test_layer_and_group_norm_take_weight_as_scale(kind):
    weight, bias, x = normal(6), normal(6), normal(2, 6)
    if kind == "layer":
        model = nnx.LayerNorm(6, rngs=nnx.Rngs(0))
        groups = x[:, None, :]
    else:
        model = nnx.GroupNorm(6, num_groups=3, epsilon=1e-6, rngs=nnx.Rngs(0))
        groups = x.reshape(2, 3, 2)
    report = nitro.weights.load({"weight": weight, "bias": bias}, model)
    mean, var = groups.mean(-1, keepdims=True), groups.var(-1, keepdims=True)
    expected = ((groups - mean) / np.sqrt(var + 1e-6)).reshape(2, 6) * weight + bias
    np.testing.assert_allclose(model(x), expected, rtol=1e-4, atol=1e-4)
    assert report.converted == {"scale": "norm"}


def test_an_embedding_weight_is_the_embedding_table():
    table = normal(10, 4)
    model = nnx.Embed(10, 4, rngs=nnx.Rngs(0))
    report = nitro.weights.load({"weight": table}, model)
    np.testing.assert_array_equal(model(jnp.array([3, 7])), table[[3, 7]])
    assert report.converted == {"embedding": "embedding"}


def attention_reference(x, wq, bq, wk, bk, wv, bv, wo, bo, heads):
    """PyTorch's multi-head attention (projections (out, in), heads split from the output)."""
    n, t, e = x.shape
    d = wq.shape[0] // heads

    def split(y):
        return y.reshape(n, t, heads, d).transpose(0, 2, 1, 3)

    q, k, v = split(x @ wq.T + bq), split(x @ wk.T + bk), split(x @ wv.T + bv)
    logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    mixed = (weights @ v).transpose(0, 2, 1, 3).reshape(n, t, heads * d)
    return mixed @ wo.T + bo


@pytest.mark.parametrize("spelling", ["fused", "split", "timm"])
def test_attention_projections_fused_or_split_give_pytorchs_attention(spelling):
    e, heads = 8, 2
    wq, wk, wv, wo = (normal(e, e) for _ in range(4))
    bq, bk, bv, bo = (normal(e) for _ in range(4))
    source = {
        "fused": {
            "in_proj_weight": np.concatenate([wq, wk, wv]),
            "in_proj_bias": np.concatenate([bq, bk, bv]),
            "out_proj.weight": wo,
            "out_proj.bias": bo,
        },
        "split": {
            **{f"{n}_proj.weight": w for n, w in zip("qkv", (wq, wk, wv), strict=True)},
            **{f"{n}_proj.bias": b for n, b in zip("qkv", (bq, bk, bv), strict=True)},
            "out_proj.weight": wo,
            "out_proj.bias": bo,
        },
        "timm": {
            "qkv.weight": np.concatenate([wq, wk, wv]),
            "qkv.bias": np.concatenate([bq, bk, bv]),
            "proj.weight": wo,
            "proj.bias": bo,
        },
    }[spelling]
    model = nnx.MultiHeadAttention(heads, e, decode=False, rngs=nnx.Rngs(0))
    report = nitro.weights.load(source, model)
    x = normal(2, 3, e)
    expected = attention_reference(x, wq, bq, wk, bk, wv, bv, wo, bo, heads)
    np.testing.assert_allclose(model(x), expected, rtol=1e-4, atol=1e-4)
    assert set(report.converted.values()) == {"attention"}
    assert len(report.loaded) == 8


class Scaled(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.gamma = nnx.Param(jnp.zeros((3,)))
        self.proj = nnx.Linear(3, 3, rngs=rngs)


def test_a_plain_param_loads_by_its_name_and_shape():
    gamma = normal(3)
    model = Scaled(nnx.Rngs(0))
    source = {"gamma": gamma, "proj.weight": normal(3, 3), "proj.bias": normal(3)}
    report = nitro.weights.load(source, model)
    np.testing.assert_array_equal(model.gamma[...], gamma)
    assert report.loaded["gamma"].rule == "same"


# ---------------------------------------------------------------------------------------------
# names


class Net(nnx.Module):
    """A stack of every layer type: PyTorch's `features` is an nn.Sequential."""

    def __init__(self, rngs: nnx.Rngs, classes: int = 3):
        self.features = nnx.Sequential(
            nnx.Conv(3, 4, (3, 3), rngs=rngs),
            nnx.BatchNorm(4, rngs=rngs),
            nnx.Conv(4, 4, (3, 3), feature_group_count=4, rngs=rngs),
        )
        self.blocks = nnx.List([nnx.LayerNorm(4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)])
        self.attention = nnx.MultiHeadAttention(2, 4, decode=False, rngs=rngs)
        self.up = nnx.ConvTranspose(4, 2, (2, 2), rngs=rngs)
        self.embed = nnx.Embed(5, 4, rngs=rngs)
        self.head = nnx.Linear(4, classes, rngs=rngs)


def pytorch_names(model) -> dict[str, np.ndarray]:
    """The model's weights as a PyTorch module of the same structure names them."""
    return nitro.weights.to_torch(model)


def test_pytorch_names_find_the_nnx_leaves_sequential_indices_and_brackets_included():
    source = pytorch_names(Net(nnx.Rngs(1)))
    assert "features.0.weight" in source and "blocks.1.weight" in source
    bracketed = {k.replace("blocks.1", "blocks[1]"): v for k, v in source.items()}
    model = Net(nnx.Rngs(2))
    report = nitro.weights.load(bracketed, model)
    assert report.loaded["features.layers.0.kernel"] == ("features.0.weight", "conv", None)
    assert report.loaded["blocks.1.kernel"] == ("blocks[1].weight", "linear", None)
    assert report.left == report.unused == ()
    assert_same(leaves(model), leaves(Net(nnx.Rngs(1))))


def test_a_key_map_of_regex_pairs_renames_the_sources_keys():
    source = {f"model.{k}": v for k, v in pytorch_names(Net(nnx.Rngs(1))).items()}
    model = Net(nnx.Rngs(2))
    report = nitro.weights.load(source, model, key_map=[(r"^model\.", ""), (r"^head\.", "head.")])
    assert report.loaded["head.kernel"].key == "model.head.weight"
    assert report.left == report.unused == ()


def test_a_key_map_function_renames_and_leaves_keys_out_with_none():
    source = pytorch_names(Net(nnx.Rngs(1)))
    source["extra.weight"] = normal(2)
    model = Net(nnx.Rngs(2))
    report = nitro.weights.load(
        source, model, key_map=lambda k: None if k.startswith(("head.", "extra.")) else k,
        strict=False,
    )  # fmt: skip
    assert report.left == ("head.bias", "head.kernel")
    assert report.unused == ("head.weight", "head.bias", "extra.weight")


def test_nnx_names_load_as_they_are_without_conversion():
    original = Net(nnx.Rngs(1))
    flat = {
        jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(v)
        for path, v in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(original)))[
            0
        ]
    }
    model = Net(nnx.Rngs(2))
    report = nitro.weights.load(flat, model)
    assert report.converted == {}
    assert_same(leaves(model), leaves(original))


class WithDropout(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)


def test_a_saved_models_rng_state_is_ignored_not_refused():
    original = WithDropout(nnx.Rngs(1))
    state = nnx.to_pure_dict(nnx.state(original))
    flat = {
        jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(
            jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v
        )
        for path, v in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    assert "dropout.rngs.key" in flat
    model = WithDropout(nnx.Rngs(2))
    report = nitro.weights.load(flat, model)
    assert report.ignored == ("dropout.rngs.count", "dropout.rngs.key")
    np.testing.assert_array_equal(model.linear.kernel[...], original.linear.kernel[...])


# ---------------------------------------------------------------------------------------------
# the round trip


def test_a_model_with_dropout_saves_no_rng_state_in_pytorch_layout(tmp_path):
    """A Dropout's key and count are no weights: a PyTorch `state_dict` has none, and
    `load_state_dict(strict=True)` would refuse them."""
    model = WithDropout(nnx.Rngs(1))
    assert sorted(nitro.weights.to_torch(model)) == ["linear.bias", "linear.weight"]
    path = nitro.weights.save(tmp_path / "dropout.safetensors", model)
    assert sorted(load_file(str(path))) == ["linear.bias", "linear.weight"]
    again = WithDropout(nnx.Rngs(2))
    report = nitro.weights.load(path, again)
    assert report.left == report.unused == ()
    assert again.linear.kernel[...].tobytes() == model.linear.kernel[...].tobytes()


def test_saved_in_pytorch_layout_and_loaded_back_the_weights_are_bitwise_equal(tmp_path):
    original = Net(nnx.Rngs(1))
    path = nitro.weights.save(tmp_path / "net.safetensors", original)
    saved = load_file(str(path))
    assert saved["head.weight"].shape == (3, 4)  # PyTorch's (out, in)
    assert saved["features.0.weight"].shape == (4, 3, 3, 3)  # OIHW, nn.Sequential's name
    assert saved["attention.in_proj_weight"].shape == (12, 4)
    model = Net(nnx.Rngs(2))
    report = nitro.weights.load(path, model)
    assert report.left == report.unused == ()
    for got, want in zip(leaves(model), leaves(original), strict=True):
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()


def test_bfloat16_weights_round_trip_bitwise(tmp_path):
    original = nnx.Linear(4, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    path = nitro.weights.save(tmp_path / "bf16.safetensors", original)
    model = nnx.Linear(4, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(2))
    nitro.weights.load(path, model)
    assert np.asarray(model.kernel[...]).tobytes() == np.asarray(original.kernel[...]).tobytes()


def test_the_loaded_model_shares_no_memory_with_the_callers_arrays_or_the_file(tmp_path):
    bias = normal(3)
    model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    nitro.weights.load({"weight": normal(3, 5), "bias": bias}, model)
    bias[:] = 0
    assert np.all(np.asarray(model.bias[...]) != 0)
    path = tmp_path / "linear.safetensors"
    save_file({"weight": normal(3, 5), "bias": np.ones(3, np.float32)}, str(path))
    nitro.weights.load(path, model)
    with open(path, "r+b") as file:  # the same bytes rewritten in place
        data = bytearray(file.read())
        data[-12:] = np.zeros(3, np.float32).tobytes()
        file.seek(0)
        file.write(data)
    np.testing.assert_array_equal(model.bias[...], np.ones(3))


# ---------------------------------------------------------------------------------------------
# sources


def test_read_takes_a_directory_of_shards_with_or_without_an_index(tmp_path):
    arrays = pytorch_names(Net(nnx.Rngs(1)))
    names = sorted(arrays)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for folder in ("indexed", "plain"):
        (tmp_path / folder).mkdir()
        for shard, keys in shards.items():
            save_file({k: arrays[k] for k in keys}, str(tmp_path / folder / shard))
    index = {"weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (tmp_path / "indexed" / "model.safetensors.index.json").write_text(json.dumps(index))
    for folder in ("indexed", "plain"):
        read = nitro.weights.read(tmp_path / folder)
        assert sorted(read) == names
        model = Net(nnx.Rngs(2))
        assert nitro.weights.load(tmp_path / folder, model).unused == ()


def test_an_index_naming_a_missing_shard_is_refused_naming_it(tmp_path):
    save_file({"weight": normal(2, 2)}, str(tmp_path / "a.safetensors"))
    index = {"weight_map": {"weight": "a.safetensors", "bias": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=r"lists shards that are not in .*: b.safetensors"):
        nitro.weights.read(tmp_path)


def test_read_takes_an_npz_file(tmp_path):
    arrays = pytorch_names(Net(nnx.Rngs(1)))
    np.savez(tmp_path / "net.npz", **arrays)
    model = Net(nnx.Rngs(2))
    nitro.weights.load(tmp_path / "net.npz", model)
    assert_same(leaves(model), leaves(Net(nnx.Rngs(1))))


def test_read_takes_a_plain_orbax_checkpoint_of_an_nnx_state(tmp_path):
    import orbax.checkpoint as ocp

    original = Net(nnx.Rngs(1))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", nnx.state(original))
    checkpointer.wait_until_finished()
    model = Net(nnx.Rngs(2))
    report = nitro.weights.load(tmp_path / "ckpt", model)
    assert report.converted == {} and report.left == ()
    assert_same(leaves(model), leaves(original))


def test_read_takes_an_orbax_checkpoint_managers_newest_step(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path / "managed") as manager:
        for step in (1, 2):
            weights = {"weight": np.full((2, 3), step, np.float32), "bias": np.zeros(2)}
            manager.save(step, args=ocp.args.StandardSave(weights))
        manager.wait_until_finished()
    read = nitro.weights.read(tmp_path / "managed")
    np.testing.assert_array_equal(read["weight"], np.full((2, 3), 2))


def test_read_takes_another_nitro_runs_directory():
    from toys import TinyMLP, Toy

    run = nitro.Nitro(Toy(max_epochs=1), progress=False).train()
    read = nitro.weights.read(run.run_dir)
    assert sorted(read) == ["hidden.bias", "hidden.kernel", "out.bias", "out.kernel"]
    model = TinyMLP(5, 8, 2, rngs=nnx.Rngs(9))
    nitro.weights.load(run.run_dir, model)
    np.testing.assert_array_equal(model.out.kernel[...], run.model.out.kernel[...])


# ---------------------------------------------------------------------------------------------
# bad input: a clear error, and the model as it was


def test_a_missing_file_is_refused_naming_it(tmp_path):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(WeightsError, match=r"no weights at '.*nowhere.safetensors': the path"):
        nitro.weights.load(tmp_path / "nowhere.safetensors", model)


def test_a_truncated_safetensors_file_is_refused_naming_it_and_the_model_is_unchanged(tmp_path):
    path = nitro.weights.save(tmp_path / "net.safetensors", Net(nnx.Rngs(1)))
    path.write_bytes(path.read_bytes()[:-100])
    model = Net(nnx.Rngs(2))
    before = leaves(model)
    with pytest.raises(WeightsError, match=r"net.safetensors' cannot be read .* truncated"):
        nitro.weights.load(path, model)
    assert_same(leaves(model), before)


def test_a_key_map_pattern_that_matches_nothing_is_refused_naming_it():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    source = {"weight": normal(2, 2), "bias": normal(2)}
    with pytest.raises(WeightsError, match=r"key_map pattern '\^encoder\\\\.' matches no key"):
        nitro.weights.load(source, model, key_map=[(r"^encoder\.", "")])


def test_keys_that_name_no_leaf_are_refused_with_the_fix():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(WeightsError, match=r"no key of .* names a leaf .* key_map="):
        nitro.weights.load({"encoder.weight": normal(2, 2)}, model)


def test_integer_weights_into_float_params_are_refused_naming_the_key():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    before = leaves(model)
    source = {"weight": np.ones((2, 2), np.int32), "bias": normal(2)}
    with pytest.raises(WeightsError, match=r"dtype mismatch: 'weight' .* is int32, .*'kernel'"):
        nitro.weights.load(source, model)
    assert_same(leaves(model), before)


def test_float16_weights_are_cast_to_the_models_float32_and_the_report_says_so():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    source = {"weight": normal(2, 2, dtype=np.float16), "bias": normal(2)}
    report = nitro.weights.load(source, model)
    assert model.kernel[...].dtype == jnp.float32
    assert report.cast == {"kernel": "float16 -> float32"}
    assert "1 cast (float16 -> float32)" in str(report)


def test_a_shape_mismatch_is_refused_naming_both_paths_and_shapes():
    model = Net(nnx.Rngs(0), classes=3)
    before = leaves(model)
    source = pytorch_names(Net(nnx.Rngs(1), classes=5))
    with pytest.raises(WeightsError) as error:
        nitro.weights.load(source, model)
    assert str(error.value) == (
        "shape mismatch: 'head.weight' of 'a dict of 22 arrays' is f32[5,4], but the model's "
        "'head.kernel' f32[4,3] takes f32[3,4] in PyTorch layout (linear). Build the model "
        "with the source's sizes, or leave the key out with key_map"
    )
    assert_same(leaves(model), before)


def test_strict_refuses_leaves_left_and_keys_unused_and_says_how_to_allow_them():
    model = Net(nnx.Rngs(0))
    source = pytorch_names(Net(nnx.Rngs(1)))
    del source["head.bias"]
    source["classifier.weight"] = normal(3, 4)
    with pytest.raises(WeightsError) as error:
        nitro.weights.load(source, model)
    assert "1 leaves of the model have no weights in 'a dict of 22 arrays'" in str(error.value)
    assert "head.bias" in str(error.value) and "classifier.weight" in str(error.value)
    assert "strict=False" in str(error.value)
    report = nitro.weights.load(source, model, strict=False)
    assert report.left == ("head.bias",) and report.unused == ("classifier.weight",)


# ---------------------------------------------------------------------------------------------
# weights=nitro.Partial: a backbone from a file, a new head


@nitro.experiment
class FineTune:
    classes: nitro.GraphConst[int] = 2
    max_epochs: int = 1

    def build_data(self):
        x = RNG.normal(size=(32, 6, 6, 3)).astype(np.float32)
        y = (x.mean((1, 2, 3)) > 0).astype(np.int32)
        return {"train": nitro.data.ArrayLoader({"x": x, "y": y}, 8)}

    def build_model(self, rngs: nnx.Rngs):
        return Classifier(self.classes, rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, outputs, *, y):
        import optax

        return optax.softmax_cross_entropy_with_integer_labels(outputs, y).mean()


class Backbone(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.stem = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.norm(nnx.relu(self.stem(x))).mean((1, 2))


class Classifier(nnx.Module):
    def __init__(self, classes: int, rngs: nnx.Rngs):
        self.backbone = Backbone(rngs)
        self.head = nnx.Linear(4, classes, rngs=rngs)

    def __call__(self, x):
        return self.head(self.backbone(x))


def test_partial_loads_a_backbone_into_a_bigger_model_and_the_head_keeps_its_init(tmp_path):
    pretrained = Backbone(nnx.Rngs(7))
    path = nitro.weights.save(tmp_path / "backbone.safetensors", pretrained)
    fresh = nitro.Nitro(FineTune(), progress=False)
    before = nitro.cache_stats().misses
    n = nitro.Nitro(FineTune(), weights=nitro.Partial(path, into="backbone"), progress=False)
    assert nitro.cache_stats().misses == before  # loading compiles nothing
    model = n.model
    np.testing.assert_array_equal(model.backbone.stem.kernel[...], pretrained.stem.kernel[...])
    np.testing.assert_array_equal(model.head.kernel[...], fresh.model.head.kernel[...])
    assert n.weights_origin == (
        f"backbone from {path} (4 leaves, 2 converted from PyTorch layout); 2 leaves from "
        f"build_model"
    )
    report = str(n.binding_report())
    assert f"  {path}: 4 leaves: backbone.norm.bias, backbone.norm.scale, " in report
    assert "  build_model: 2 leaves: head.bias, head.kernel" in report
    n.train()
    assert n.epoch == 1
    manifest = n.export(str(tmp_path / "bundle"))
    assert manifest["provenance"]["weights_origin"] == n.weights_origin


def test_partial_with_a_wrong_sub_module_or_bad_file_refuses_the_handle(tmp_path):
    path = nitro.weights.save(tmp_path / "backbone.safetensors", Backbone(nnx.Rngs(7)))
    with pytest.raises(
        WeightsError, match=r"has no sub-module 'bakbone' .* Did you mean 'backbone'"
    ):
        nitro.Nitro(FineTune(), weights=nitro.Partial(path, into="bakbone"), progress=False)
    with pytest.raises(
        WeightsError,
        match=r"weights=Partial\(.*into='head'.*\): no key of .* names a leaf of this Linear",
    ):
        nitro.Nitro(FineTune(), weights=nitro.Partial(path, into="head", strict=False))
