"""`nitro serve` with bundles of one program: compiled once, weights paged within budgets."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

# test_serve skips the module without the serve extra (kserve) or Triton's clients
from test_serve import (
    X7,
    Hammer,
    InferenceServerException,
    Server,
    _wait_for,
    http_client,
    infer_grpc,
    infer_http,
)
from toys import Toy

import nitro
import nitro.bundle

SEEDS = {"first": 10, "second": 11, "third": 12}
WIDTHS = (1, 2, 4, 8, 16, 32, 64)


@pytest.fixture(scope="module")
def paged(tmp_path_factory):
    """Three bundles of one architecture from differently seeded runs, served with device
    room for two weight sets and host room for one."""
    root = tmp_path_factory.mktemp("paged")
    for name, seed in SEEDS.items():
        nitro.Nitro(Toy(), seed=seed, progress=False).export(str(root / name), name=name)
    size = nitro.bundle.load(str(root / "first")).weights_bytes
    budget = {"device": int(2.5 * size), "host": int(1.5 * size)}
    server = Server(
        [root / n for n in SEEDS],
        root / "server.log",
        *("--device-memory", str(budget["device"]), "--host-memory", str(budget["host"])),
    )
    server.root, server.budget = root, budget  # pyright: ignore[reportAttributeAccessIssue]
    yield server
    server.stop()


def _statistics(url: str, model: str) -> dict:
    return http_client.InferenceServerClient(url).get_inference_statistics(model)


def _answers_of(bundle, x: np.ndarray) -> list[np.ndarray]:
    """The bundle's outputs for x in a call of each width the server may pad it to."""
    out = []
    for width in (w for w in WIDTHS if w >= len(x)):
        rows = np.concatenate([x, np.repeat(x[-1:], width - len(x), axis=0)])
        out.append(bundle(x=rows)["output"][: len(x)])
    return out


def test_a_flood_across_paged_bundles_gets_each_its_own_weights_bitwise(paged):
    bundles = {name: nitro.bundle.load(str(paged.root / name)) for name in SEEDS}
    outputs = {name: bundles[name](x=X7)["output"] for name in SEEDS}
    assert all(  # each bundle's weights are told apart by its outputs
        not np.allclose(outputs[a], outputs[b], atol=1e-3) for a in SEEDS for b in SEEDS if a < b
    )
    answers, errors = [], []

    def client(index: int):
        rng = np.random.default_rng(300 + index)
        url, infer = (paged.url, infer_http) if index % 2 else (paged.grpc_url, infer_grpc)
        for _ in range(10):
            name = list(SEEDS)[int(rng.integers(0, 3))]
            x = rng.normal(size=(int(rng.integers(1, 5)), 5)).astype(np.float32)
            try:
                answers.append((name, x, infer(url, name, x)))
            except Exception as error:  # noqa: BLE001 - reported by the test
                errors.append(error)

    workers = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    assert errors == [] and len(answers) == 12 * 10
    for name, x, output in answers:
        assert any(np.array_equal(output, c) for c in _answers_of(bundles[name], x)), name
    stats = {name: _statistics(paged.url, name) for name in SEEDS}
    weights = {name: s["model_stats"][0]["weights"] for name, s in stats.items()}
    paging = stats["first"]["paging"]
    assert paging["swap_in_ms"]["count"] == sum(w["misses"] for w in weights.values())
    assert paging["programs"] == 1 and len({w["program"] for w in weights.values()}) == 1
    assert [w["program_loads"] for w in weights.values()] == [1, 0, 0]
    assert paging["device_budget"] == paged.budget["device"]
    assert paging["device_used"] <= paged.budget["device"] and len(paging["resident"]) <= 2
    assert paging["host_used"] <= paged.budget["host"]
    assert sum(w["evictions"] for w in weights.values()) > 0
    assert sum(w["disk_reads"] for w in weights.values()) > 0
    for w in weights.values():
        assert w["misses"] >= 1 and w["hits"] >= 1 and w["swap_in_ms"]["count"] == w["misses"]
        assert w["swap_in_ms"]["p50"] <= w["swap_in_ms"]["p99"]


def test_a_reload_with_the_program_unchanged_swaps_only_the_weights_during_traffic(paged):
    before = nitro.bundle.load(str(paged.root / "second"))(x=X7)["output"]
    hammer = Hammer(paged.url, "second", X7, threads=4)
    try:
        _wait_for(lambda: len(hammer.outputs) > 5, "requests before the re-export")
        handle = nitro.Nitro(Toy(), seed=21, progress=False)
        handle.export(str(paged.root / "second"), name="second")
        after = nitro.bundle.load(str(paged.root / "second"))(x=X7)["output"]
        assert not np.allclose(after, before, atol=1e-3)
        http_client.InferenceServerClient(paged.url).load_model("second")
        _wait_for(lambda: np.allclose(hammer.outputs[-1], after, atol=1e-6), "the new weights")
        count = len(hammer.outputs)
        _wait_for(lambda: len(hammer.outputs) > count + 5, "requests after the reload")
    finally:
        hammer.finish()
    assert [str(e) for e in hammer.errors] == []
    old = sum(np.allclose(o, before, atol=1e-6) for o in hammer.outputs)
    new = sum(np.allclose(o, after, atol=1e-6) for o in hammer.outputs)
    assert old > 0 and new > 0 and old + new == len(hammer.outputs)  # never a mix
    stats = _statistics(paged.url, "second")
    weights = stats["model_stats"][0]["weights"]
    assert weights["weight_swaps"] == 1 and weights["program_loads"] == 0
    assert stats["paging"]["programs"] == 1

    # a new program (another constant offset) is a full reload: compiled, a program load
    nitro.Nitro(Toy(offset=0.5), seed=22, progress=False).export(
        str(paged.root / "third"), name="third"
    )
    client = http_client.InferenceServerClient(paged.url)
    client.load_model("third")
    shifted = nitro.bundle.load(str(paged.root / "third"))
    assert any(
        np.array_equal(infer_http(paged.url, "third", X7), c) for c in _answers_of(shifted, X7)
    )
    stats = _statistics(paged.url, "third")
    weights = stats["model_stats"][0]["weights"]
    assert weights["weight_swaps"] == 0 and weights["program_loads"] == 1
    assert stats["paging"]["programs"] == 2

    # weights over the device budget are refused with the figures; the model keeps serving
    nitro.Nitro(Toy(width=32), seed=23, progress=False).export(
        str(paged.root / "third"), name="third"
    )
    size = nitro.bundle.load(str(paged.root / "third")).weights_bytes
    with pytest.raises(InferenceServerException) as refused:
        client.load_model("third")
    assert (
        f"third's weights take {size} bytes, more than the --device-memory budget of "
        f"{paged.budget['device']} bytes on their own; raise --device-memory to at least {size}"
    ) in str(refused.value)
    assert any(
        np.array_equal(infer_http(paged.url, "third", X7), c) for c in _answers_of(shifted, X7)
    )


def test_a_model_larger_than_the_device_budget_is_refused_with_the_figures(paged):
    size = nitro.bundle.load(str(paged.root / "first")).weights_bytes
    done = subprocess.run(
        [sys.executable, "-m", "nitro.serve", str(paged.root / "first"), "--device-memory", "100"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert (
        f"first's weights take {size} bytes, more than the --device-memory budget of 100 "
        f"bytes on their own; raise --device-memory to at least {size}"
    ) in done.stderr


def test_a_device_budget_must_be_bytes_or_a_fraction(paged):
    done = subprocess.run(
        [sys.executable, "-m", "nitro.serve", str(paged.root / "first"), "--device-memory", "2 XB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert (
        "--device-memory must be bytes (2GB, 500MB, 1GiB, 123456) or a fraction of the memory "
        "(0.5), not '2 XB'"
    ) in done.stderr
