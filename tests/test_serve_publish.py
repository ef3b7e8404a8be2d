"""`Nitro.publish`: a training handle's weights swapped into a running `nitro serve`."""

from __future__ import annotations

import numpy as np
import pytest
from ports import free_port

# test_serve skips the module without the serve extra (kserve) or Triton's clients
from test_serve import X7, Counts, Server, http_client, infer_http
from test_serve_paging import _answers_of
from toys import Toy

import nitro
import nitro.bundle
from nitro.serving.publish import PublishError


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A one-epoch run's bundle served as "model"; the handle trains on in the tests."""
    root = tmp_path_factory.mktemp("publish")
    handle = nitro.Nitro(Toy(max_epochs=1), seed=3, progress=False)
    handle.train()
    handle.export(str(root / "model"), name="model", batch_sizes=(4, 8))
    server = Server([root / "model"], root / "server.log")
    server.root, server.handle = root, handle  # pyright: ignore[reportAttributeAccessIssue]
    yield server
    server.stop()


def _weights_stats(url: str) -> dict:
    return http_client.InferenceServerClient(url).get_inference_statistics("model")


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
    assert stats["paging"]["programs"] == 1


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
