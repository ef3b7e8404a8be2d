"""nitro.models: the Flax NNX ports of timm's ResNet and ConvNeXt V2 compute what timm computes.

The fixtures (tests/fixtures/timm, written by its generate.py from timm's own code) hold tiny
models' state_dicts in PyTorch layout and their outputs in eval and train mode; each is
loaded here by `nitro.weights.load`'s default names, with no torch installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from huggingface_hub.file_download import repo_folder_name
from safetensors.numpy import load_file

import nitro
import nitro.models
import nitro.weights
from nitro.errors import WeightsError

FIXTURES = Path(__file__).parent / "fixtures" / "timm"
MANIFEST = json.loads((FIXTURES / "fixtures.json").read_text())
BLOCKS = {"BasicBlock": nitro.models.BasicBlock, "Bottleneck": nitro.models.Bottleneck}


def _tiny(name: str) -> nitro.models.ResNet | nitro.models.ConvNeXt:
    spec = MANIFEST["fixtures"][name]
    kwargs = dict(spec["kwargs"], num_classes=spec["num_classes"], rngs=nnx.Rngs(1))
    if spec["family"] == "resnet":
        return nitro.models.ResNet(**{**kwargs, "block": BLOCKS[kwargs["block"]]})
    return nitro.models.ConvNeXt(**kwargs)


def _loaded(name: str, mode: str, weights=None) -> nitro.models.ResNet | nitro.models.ConvNeXt:
    model = _tiny(name)
    nitro.weights.load(weights or FIXTURES / f"{name}.safetensors", model)
    model.train() if mode == "train" else model.eval()
    return model


def _check_parity(name: str, mode: str, weights=None) -> None:
    """Every output of a fresh model, one call each (as the fixture's), within 1e-5."""
    expected = np.load(FIXTURES / f"{name}.npz")
    x = jnp.asarray(expected["x"])

    def close(actual, key):
        np.testing.assert_allclose(np.asarray(actual), expected[key], rtol=1e-5, atol=1e-5)

    model = _loaded(name, mode, weights)
    close(model(x), f"{mode}/logits")
    if mode == "train":  # the running statistics after one train-mode call, as PyTorch's
        state = nitro.weights.to_torch(model)  # PyTorch's names: `bn1.running_var`
        running = sorted(k for k in state if ".running_" in k)
        assert running == sorted(
            k.removeprefix("train/state/") for k in expected.files if "/state/" in k
        )
        for key in running:
            close(state[key], f"train/state/{key}")
    close(_loaded(name, mode, weights).forward_features(x), f"{mode}/features")
    final, features = _loaded(name, mode, weights).forward_intermediates(x)
    close(final, f"{mode}/features")
    assert len(features) == sum(k.startswith(f"{mode}/intermediate_") for k in expected.files)
    for index, feature in enumerate(features):
        close(feature, f"{mode}/intermediate_{index}")


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", sorted(MANIFEST["fixtures"]))
def test_the_port_matches_timm_within_1e_5_in_logits_features_and_running_statistics(name, mode):
    _check_parity(name, mode)


@pytest.mark.parametrize("name", sorted(MANIFEST["fixtures"]))
def test_a_fixture_with_one_weight_perturbed_fails_the_comparison(name):
    weights = load_file(FIXTURES / f"{name}.safetensors")
    key = [k for k, v in weights.items() if v.ndim == 4][-1]  # the last convolution
    weights[key] = weights[key].copy()
    weights[key].flat[0] += 1e-3
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        _check_parity(name, "eval", weights)


def test_list_models_names_every_model_create_builds():
    assert nitro.models.list_models() == [
        "convnextv2_atto",
        "convnextv2_base",
        "convnextv2_femto",
        "convnextv2_nano",
        "convnextv2_pico",
        "convnextv2_tiny",
        "resnet18",
        "resnet18d",
        "resnet50",
        "resnet50d",
    ]
    assert nitro.models.list_models("resnet50*") == ["resnet50", "resnet50d"]


@pytest.mark.parametrize("name", sorted(MANIFEST["models"]))
def test_each_model_has_as_many_parameters_as_timm_s(name):
    num_classes = MANIFEST["fixtures"]["resnet_basic"]["num_classes"]
    model = nnx.eval_shape(lambda: nitro.models.create(name, num_classes=num_classes))
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert sum(int(np.prod(v.shape)) for _, v in params) == MANIFEST["models"][name]["parameters"]


@pytest.mark.parametrize(
    "name", [n for n, entry in sorted(MANIFEST["models"].items()) if "state_dict" in entry]
)
def test_timm_s_state_dict_of_each_full_model_loads_strictly_by_its_own_names(name):
    shapes = MANIFEST["models"][name]["state_dict"]
    state = {
        k: np.full(s, 0.5, np.int64 if k.endswith("tracked") else np.float32)
        for k, s in shapes.items()
    }
    model = nitro.models.create(name, num_classes=5)
    report = nitro.weights.load(state, model)
    assert report.left == () and report.unused == ()
    assert len(report.loaded) + len(report.ignored) == len(shapes)
    assert all(k.endswith("num_batches_tracked") for k in report.ignored)


def test_create_builds_a_model_that_takes_nhwc_images_and_gives_features_by_timm_s_api():
    model = nitro.models.create("convnextv2_atto", num_classes=9, rngs=nnx.Rngs(0))
    x = jnp.zeros((2, 64, 64, 3))
    assert model(x).shape == (2, 9)
    assert model.forward_features(x).shape == (2, 2, 2, 320)
    final, features = model.forward_intermediates(x, indices=2)
    assert final.shape == (2, 2, 2, 320)
    assert [f.shape for f in features] == [(2, 4, 4, 160), (2, 2, 2, 320)]
    resnet = nitro.models.create("resnet18d", num_classes=0, in_chans=1)
    assert resnet(jnp.zeros((1, 32, 32, 1))).shape == (1, 512)


def test_an_unknown_name_is_refused_with_the_close_ones():
    with pytest.raises(
        ValueError, match=r"no model named 'convnext_atto'.*Did you mean 'convnextv2_atto'"
    ):
        nitro.models.create("convnext_atto")


def test_drop_path_drops_whole_residual_branches_in_train_mode_only():
    model = nitro.models.ConvNeXt(
        depths=(1, 1, 1, 1), dims=(8, 8, 8, 8), num_classes=4, drop_path_rate=0.9, rngs=nnx.Rngs(3)
    )
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 32, 32, 3)), jnp.float32)
    model.eval()
    assert np.array_equal(model(x), model(x))
    model.train()
    assert not np.array_equal(model(x), model(x))


# ------------------------------------------------------------------------------------------
# pretrained=: a file, or a Hugging Face Hub id from a cache laid out as huggingface_hub's


def _timm_like_checkpoint(tmp_path: Path, name: str, num_classes: int) -> Path:
    """A checkpoint in timm's names and PyTorch layout: `name` seeded 7, its classifier for
    `num_classes`, saved by `nitro.weights.save`."""
    source = nitro.models.create(name, num_classes=num_classes, rngs=nnx.Rngs(7))
    return nitro.weights.save(tmp_path / "model.safetensors", source)


def test_pretrained_from_a_file_loads_every_leaf_and_a_new_classifier_starts_fresh(tmp_path):
    path = _timm_like_checkpoint(tmp_path, "convnextv2_atto", num_classes=1000)
    saved = load_file(path)
    model = nitro.models.create("convnextv2_atto", num_classes=9, pretrained=path)
    loaded = nitro.weights.to_torch(model)  # the model's weights in PyTorch's names and layout
    fresh = nitro.weights.to_torch(nitro.models.create("convnextv2_atto", num_classes=9))
    assert sorted(loaded) == sorted(saved)
    for key, array in loaded.items():
        expected = fresh[key] if key.startswith("head.fc.") else saved[key]
        assert np.array_equal(array, expected), key
    same = nitro.models.create("convnextv2_atto", num_classes=1000, pretrained=path)
    assert np.array_equal(nitro.weights.to_torch(same)["head.fc.weight"], saved["head.fc.weight"])


def test_a_run_whose_build_model_loads_pretrained_weights_names_the_file_as_their_origin(
    tmp_path,
):
    path = _timm_like_checkpoint(tmp_path, "resnet18", num_classes=1000)

    @nitro.experiment
    class Backbone:
        def build_data(self):
            x = np.zeros((4, 32, 32, 3), np.float32)
            return {"train": nitro.data.ArrayLoader({"x": x, "y": np.zeros(4, np.int32)}, 2)}

        def build_model(self, rngs):
            return nitro.models.create("resnet18", num_classes=2, pretrained=path)

        def forward(self, model, *, x):
            return model(x)

        def loss(self, outputs, *, y):
            return outputs.mean()

    n = nitro.Nitro(Backbone(), progress=False)
    assert n.weights_origin == (
        f"build_model: ResNet pretrained from {path} (100 leaves, 80 converted from PyTorch "
        f"layout; fc.bias, fc.kernel at initial values)"
    )
    assert dict(n.binding_report().sections)["weights"] == [n.weights_origin]

    # where the weights came from stays beside the model: the same architecture loaded from
    # another file is the same graph (one compiled program), and a fresh one names no file
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(open(path, "rb").read())
    other = nitro.models.create("resnet18", num_classes=2, pretrained=elsewhere)
    fresh = nitro.models.create("resnet18", num_classes=2)
    assert nnx.graphdef(other) == nnx.graphdef(n.model) == nnx.graphdef(fresh)


def test_pretrained_rgb_weights_fit_a_one_channel_input_by_summing_the_first_convolution(tmp_path):
    path = _timm_like_checkpoint(tmp_path, "resnet18", num_classes=1000)
    model = nitro.models.create("resnet18", num_classes=2, in_chans=1, pretrained=path)
    rgb = load_file(path)["conv1.weight"]
    assert np.allclose(nitro.weights.to_torch(model)["conv1.weight"], rgb.sum(1, keepdims=True))


def test_pretrained_weights_of_another_model_are_refused_naming_the_leaves(tmp_path):
    path = _timm_like_checkpoint(tmp_path, "resnet18", num_classes=1000)
    with pytest.raises(WeightsError, match="shape mismatch|fill no leaf|no weights"):
        nitro.models.create("resnet18d", pretrained=path)


def _hub_cache(tmp_path: Path, repo_id: str, weights: Path) -> tuple[Path, str]:
    """A Hugging Face cache holding `repo_id`'s model.safetensors at one commit, on `main`:
    the layout huggingface_hub documents (blobs/, snapshots/<commit>/, refs/main), checked
    by huggingface_hub's own scan."""
    cache = tmp_path / "hub"
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    commit = "0123456789abcdef0123456789abcdef01234567"
    blob = repo / "blobs" / "a1b2c3"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(weights.read_bytes())
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/a1b2c3"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    scanned = huggingface_hub.scan_cache_dir(cache)
    assert [(r.repo_id, [v.commit_hash for v in r.revisions]) for r in scanned.repos] == [
        (repo_id, [commit])
    ]
    assert huggingface_hub.try_to_load_from_cache(repo_id, "model.safetensors", cache_dir=cache)
    return cache, commit


def test_a_hub_id_loads_offline_from_the_cache_at_main_or_a_pinned_revision(tmp_path, monkeypatch):
    path = _timm_like_checkpoint(tmp_path, "convnextv2_atto", num_classes=1000)
    cache, commit = _hub_cache(tmp_path, "timm/convnextv2_atto.fcmae_ft_in1k", path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    saved = load_file(path)["stages.2.blocks.5.conv_dw.weight"]
    for revision in (None, commit):
        model = nitro.models.create(
            "convnextv2_atto",
            num_classes=9,
            pretrained="timm/convnextv2_atto.fcmae_ft_in1k",
            revision=revision,
            cache_dir=cache,
        )
        assert np.array_equal(
            nitro.weights.to_torch(model)["stages.2.blocks.5.conv_dw.weight"], saved
        )


def test_a_hub_id_offline_and_not_cached_names_the_id_and_the_fix(tmp_path, monkeypatch):
    path = _timm_like_checkpoint(tmp_path, "convnextv2_atto", num_classes=1000)
    cache, _ = _hub_cache(tmp_path, "timm/convnextv2_atto.fcmae_ft_in1k", path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsError) as refused:
        nitro.models.create("resnet18", pretrained="timm/resnet18.a1_in1k", cache_dir=cache)
    message = str(refused.value)
    assert "pretrained='timm/resnet18.a1_in1k'" in message
    assert "offline mode (HF_HUB_OFFLINE)" in message
    assert "hf download timm/resnet18.a1_in1k model.safetensors" in message
    with pytest.raises(WeightsError, match="at revision 'v2'"):
        nitro.models.create(
            "convnextv2_atto",
            pretrained="timm/convnextv2_atto.fcmae_ft_in1k",
            revision="v2",
            cache_dir=cache,
        )


def test_a_missing_file_is_refused_naming_it(tmp_path):
    with pytest.raises(WeightsError, match="no weights at .*absent.safetensors"):
        nitro.models.create("resnet18", pretrained=tmp_path / "absent.safetensors")
