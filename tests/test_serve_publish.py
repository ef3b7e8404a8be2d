"""`Nitro.publish`: a training handle's weights swapped into a running `nitro serve`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ports import free_port

# test_serve skips the module without the serve extra (kserve) or Triton's clients
from test_serve import X7, Counts, Labelled, Server, Tagged, http_client, infer_http
from test_serve_paging import _answers_of
from toys import Toy

import nitro
import nitro.bundle
from nitro.serving.publish import PublishError


@nitro.experiment
class Relabelled(Labelled):
    """The served hook's outputs from another source text."""

    def postprocess(self, outputs, **inputs):
        logits = np.asarray(outputs["output"])
        return {"label": np.argmax(logits, 1).astype(np.int32), "logit": np.max(logits, 1)}


LABELLED_AXES = {"x": ("batch", "feature")}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A one-epoch run's bundle served as "model", and with a postprocess hook as "labelled";
    the handle trains on in the tests."""
    root = tmp_path_factory.mktemp("publish")
    handle = nitro.Nitro(Toy(max_epochs=1), seed=3, progress=False)
    handle.train()
    handle.export(str(root / "model"), name="model", batch_sizes=(4, 8))
    labelled = nitro.Nitro(Labelled(), weights=handle, progress=False)
    labelled.export(str(root / "labelled"), name="labelled", echo=("id",), axes=LABELLED_AXES)
    server = Server([root / "model", root / "labelled"], root / "server.log", "--trust-code")
    server.root, server.handle = root, handle  # pyright: ignore[reportAttributeAccessIssue]
    yield server
    server.stop()


def _weights_stats(url: str, model: str = "model") -> dict:
    return http_client.InferenceServerClient(url).get_inference_statistics(model)


def _serves(served, directory) -> bool:
    """The served answers are the bundle's, bitwise at a width the server may pad to."""
    bundle = nitro.bundle.load(str(directory))
    answer = infer_http(served.url, "model", X7)
    return any(np.array_equal(answer, c) for c in _answers_of(bundle, X7))


def test_publish_swaps_the_served_weights_and_keeps_the_program(served):
    handle = served.handle
    before = _weights_stats(served.url)["model_stats"][0]["weights"]
    old = infer_http(served.url, "model", X7)
    handle.train(epochs=1)  # one more epoch than the served bundle has
    done = handle.publish("model", to=f"http://{served.url}")
    assert done["replaced"] == "weights" and done["model"] == "model"
    assert done["directory"] == str(served.root / "model")
    assert done["program"] == before["program"]
    assert done["manifest"]["program"]["batch_sizes"] == [4, 8]  # the served bundle's
    assert _serves(served, served.root / "model")
    assert not np.array_equal(infer_http(served.url, "model", X7), old)
    np.testing.assert_allclose(
        infer_http(served.url, "model", X7), handle.predict({"x": X7}), atol=1e-6
    )
    stats = _weights_stats(served.url)
    after = stats["model_stats"][0]["weights"]
    assert after["weight_swaps"] == before["weight_swaps"] + 1
    assert after["program_loads"] == before["program_loads"]
    assert stats["paging"]["programs"] == 2  # model's and labelled's: none added


def test_publishing_a_changed_program_reloads_it_whole(served):
    before = _weights_stats(served.url)["model_stats"][0]["weights"]
    shifted = nitro.Nitro(Toy(offset=0.5, max_epochs=1), seed=4, progress=False)
    done = shifted.publish("model", to=served.url)  # the scheme may be left out
    assert done["replaced"] == "program" and done["program"] != before["program"]
    assert _serves(served, served.root / "model")
    after = _weights_stats(served.url)["model_stats"][0]["weights"]
    assert after["program_loads"] == before["program_loads"] + 1
    assert after["weight_swaps"] == before["weight_swaps"]


def test_a_publish_the_server_cannot_take_names_the_fix_and_changes_nothing(served):
    manifest = (served.root / "model" / "manifest.json").read_bytes()
    answer = infer_http(served.url, "model", X7)
    handle = served.handle
    predicted = handle.predict({"x": X7})
    port = free_port()
    with pytest.raises(PublishError) as unreachable:
        handle.publish("model", to=f"http://127.0.0.1:{port}")
    assert f"cannot reach a model server at http://127.0.0.1:{port}" in str(unreachable.value)
    assert "start one with `nitro serve DIR`" in str(unreachable.value)
    with pytest.raises(PublishError) as unknown:
        handle.publish("nothing", to=served.url)
    assert f"http://{served.url} serves no model named 'nothing'" in str(unknown.value)
    assert "`nitro serve exports/nothing`" in str(unknown.value)
    counts = nitro.Nitro(Counts(), seed=5, progress=False)
    with pytest.raises(PublishError) as unfit:
        counts.publish("model", to=served.url)
    assert (
        "the export's inputs (counts: int32[batch, 5], levels: int8[batch, 5]) do not fit the "
        f"inputs 'model' is served with at http://{served.url} (x: float32[batch, 5]); nothing "
        "was written"
    ) in str(unfit.value)
    assert (served.root / "model" / "manifest.json").read_bytes() == manifest
    assert np.array_equal(infer_http(served.url, "model", X7), answer)
    assert np.array_equal(handle.predict({"x": X7}), predicted)


def _labelled(served) -> dict:
    """The labelled model's answer for X7's rows (ids 0 to 6)."""
    client = http_client.InferenceServerClient(served.url)
    inputs = [
        http_client.InferInput("x", [7, 5], "FP32"),
        http_client.InferInput("id", [7], "INT32"),
    ]
    inputs[0].set_data_from_numpy(X7)
    inputs[1].set_data_from_numpy(np.arange(7, dtype=np.int32))
    result = client.infer("labelled", inputs)
    return {name: result.as_numpy(name) for name in ("label", "logit", "id")}


def test_publish_keeps_the_served_hook_outputs_and_axis_names(served):
    stats = _weights_stats(served.url, "labelled")["model_stats"][0]["bundle"]
    assert stats["inputs"][0]["axes"] == ["batch", "feature"]
    assert [o["name"] for o in stats["outputs"]] == ["label", "logit", "id"]
    hook = json.loads((served.root / "labelled" / "manifest.json").read_text())["postprocess"]
    assert stats["postprocess"] == {"sha256": hook["sha256"], "source": hook["source"]}
    handle = served.handle
    handle.train(epochs=1)
    done = nitro.Nitro(Labelled(), weights=handle, progress=False).publish(
        "labelled", to=served.url
    )
    assert done["replaced"] == "weights"
    assert done["manifest"]["inputs"][0]["axes"] == ["batch", "feature"]  # the served names
    assert done["manifest"]["postprocess"]["sha256"] == hook["sha256"]
    answer = _labelled(served)
    np.testing.assert_array_equal(answer["label"], handle.predict({"x": X7}).argmax(1))
    np.testing.assert_array_equal(answer["id"], np.arange(7))


def test_a_publish_that_changes_the_hook_the_outputs_or_the_axis_names_writes_nothing(served):
    manifest = (served.root / "labelled" / "manifest.json").read_bytes()
    served_hook = json.loads(manifest)["postprocess"]["sha256"][:12]
    answer = _labelled(served)
    where = f"'labelled' is served with at http://{served.url}"
    handle = served.handle
    with pytest.raises(PublishError) as hook:
        nitro.Nitro(Relabelled(), weights=handle, progress=False).publish("labelled", to=served.url)
    message = str(hook.value)
    assert message.startswith("the export's postprocess hook (sha256 ")
    assert f"is not the one {where} (sha256 {served_hook}); nothing was written" in message
    assert "or give the experiment the served postprocess hook (its source is under " in message
    assert str(served.root / "labelled" / "manifest.json") in message
    with pytest.raises(PublishError) as none:
        nitro.Nitro(Tagged(), weights=handle, progress=False).publish("labelled", to=served.url)
    message = str(none.value)
    assert message.startswith(
        f"the export has no postprocess hook and 'labelled' is served with one (sha256 "
        f"{served_hook}) at http://{served.url}; the export's outputs (output: float32[batch, 2], "
        f"id: int32[batch] (echoes id)) are not the outputs {where} (label: int32[batch], "
        f"logit: float32[batch], id: int32[batch] (echoes id)); nothing was written"
    )
    assert "the served outputs and their axes (export_outputs, postprocess, axes=)" in message
    with pytest.raises(PublishError) as renamed:
        nitro.Nitro(Labelled(), weights=handle, progress=False).publish(
            "labelled", to=served.url, axes={"x": ("batch", "cell")}
        )
    assert str(renamed.value).startswith(
        f"the export's inputs (x: float32[batch, cell=5], id: int32[batch]) do not fit the "
        f"inputs {where} (x: float32[batch, feature=5], id: int32[batch]); nothing was written"
    )
    with pytest.raises(PublishError, match="the export has a postprocess hook"):
        nitro.Nitro(Labelled(), weights=handle, progress=False).publish("model", to=served.url)
    assert (served.root / "labelled" / "manifest.json").read_bytes() == manifest
    for name, value in _labelled(served).items():
        np.testing.assert_array_equal(value, answer[name])
