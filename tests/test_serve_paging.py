"""`nitro serve` with bundles of one program: compiled once, weights paged within budgets."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import defaultdict

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

# test_serve skips the module without the serve extra (kserve) or Triton's clients
from test_serve import (
    X7,
    Hammer,
    InferenceServerException,
    Server,
    _wait_for,
    grpc_client,
    http_client,
    infer_grpc,
    infer_http,
)
from toys import TinyMLP, Toy

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
    # host copies live in the device's pinned host memory (XLA's CPU client has one too)
    assert paging["host_memory_kind"] == "pinned_host"
    assert paging["device_used"] <= paged.budget["device"] and len(paging["resident"]) <= 2
    assert paging["host_used"] <= paged.budget["host"]
    assert sum(w["evictions"] for w in weights.values()) > 0
    assert sum(w["disk_reads"] for w in weights.values()) > 0
    for w in weights.values():
        assert w["misses"] >= 1 and w["hits"] >= 1 and w["swap_in_ms"]["count"] == w["misses"]
        assert w["swap_in_ms"]["p50"] <= w["swap_in_ms"]["p99"]


def test_requests_for_a_model_evicted_while_they_wait_still_answer(paged):
    """Three models, device room for two: requests that arrive while their weights are
    resident find them evicted by the time their call runs, wait for the upload, and answer."""
    bundles = {name: nitro.bundle.load(str(paged.root / name)) for name in SEEDS}

    def evicted_in_flight() -> int:
        weights = [_statistics(paged.url, n)["model_stats"][0]["weights"] for n in SEEDS]
        return sum(w["evicted_in_flight"] for w in weights)

    before, answers, errors = evicted_in_flight(), [], []

    def client(index: int):
        url, infer = (paged.url, infer_http) if index % 2 else (paged.grpc_url, infer_grpc)
        for turn in range(10):
            name = list(SEEDS)[(index + turn) % 3]
            try:
                answers.append((name, infer(url, name, X7)))
            except Exception as error:  # noqa: BLE001 - reported by the test
                errors.append(error)

    for _ in range(20):  # waves until one evicted a set with requests waiting for it
        workers = [threading.Thread(target=client, args=(i,)) for i in range(9)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=300)
        if evicted_in_flight() > before:
            break
    assert evicted_in_flight() > before
    assert errors == [] and answers and len(answers) % 90 == 0
    for name, output in answers:
        assert any(np.array_equal(output, c) for c in _answers_of(bundles[name], X7)), name
    paging = _statistics(paged.url, "first")["paging"]
    assert paging["device_peak"] <= paged.budget["device"]
    assert paging["host_peak"] <= paged.budget["host"]


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

    # unloaded, its weights leave the pager and its program, which no other model serves, goes
    client.unload_model("third")
    assert not client.is_model_ready("third")
    paging = _statistics(paged.url, "first")["paging"]
    assert paging["programs"] == 1 and "third" not in paging["resident"]


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


# ---------------------------------------------------------------------------------------------
# a flood over many models


@nitro.experiment
class Marked(Toy):
    """Toy whose output bias is 100 x (model, version): each answer names the weights that
    computed it, and only those weights give its exact bits."""

    model: int = 0
    version: int = 0

    def build_model(self, rngs: nnx.Rngs):
        net = TinyMLP(5, self.width, 2, rngs=rngs)
        assert net.out.bias is not None
        net.out.bias[...] = jnp.asarray([100.0 * self.model, 100.0 * self.version])
        return net


MODELS, RESIDENT, REQUESTS, CLIENTS = 50, 5, 10_000, 8
POOL = [
    np.random.default_rng(40 + i).normal(size=(1 + i % 4, 5)).astype(np.float32) for i in range(8)
]


class Versions:
    """Every bundle each model has served, by version, loaded in this process (one compiled
    program per architecture), and their outputs for the pool's inputs at each width."""

    def __init__(self, root):
        self.root, self.programs = root, {}
        self.bundles: dict[str, dict[int, nitro.bundle.Bundle]] = defaultdict(dict)
        self.outputs: dict[tuple[str, int, int], list[np.ndarray]] = {}

    def add(self, name: str, version: int) -> None:
        bundle = nitro.bundle.load(str(self.root / name), programs=self.programs)
        self.bundles[name][version] = bundle

    def is_exactly(self, name: str, version: int, index: int, output: np.ndarray) -> bool:
        key = (name, version, index)
        if key not in self.outputs:
            self.outputs[key] = _answers_of(self.bundles[name][version], POOL[index])
        return any(np.array_equal(output, c) for c in self.outputs[key])


def _marked(root, model: int, version: int, offset: float = 0.0):
    experiment = Marked(model=model, version=version, offset=offset)
    return nitro.Nitro(experiment, seed=1000 * version + model, progress=False)


def test_a_flood_over_fifty_models_with_five_resident_and_swaps_never_mixes_weights(tmp_path):
    names = [f"m{m:02d}" for m in range(MODELS)]
    versions = Versions(tmp_path)
    for model, name in enumerate(names):
        _marked(tmp_path, model, 0).export(str(tmp_path / name), name=name)
        versions.add(name, 0)
    size = versions.bundles["m00"][0].weights_bytes
    budget = {"device": int((RESIDENT + 0.5) * size), "host": int(4 * RESIDENT * size)}
    server = Server(
        [tmp_path / n for n in names],
        tmp_path / "server.log",
        *("--device-memory", str(budget["device"]), "--host-memory", str(budget["host"])),
    )
    answers, errors, memory, programs = [], [], [], []
    sent, lock, swapped = [0], threading.Lock(), threading.Event()

    def client(index: int):
        module, url = (http_client, server.url) if index % 2 else (grpc_client, server.grpc_url)
        connection = module.InferenceServerClient(url)
        rng = np.random.default_rng(500 + index)
        while True:
            with lock:  # at least REQUESTS in all, and on until the swaps are done
                if sent[0] >= REQUESTS and swapped.is_set():
                    return
                sent[0] += 1
            model, pool = int(rng.integers(MODELS)), int(rng.integers(len(POOL)))
            tensor = module.InferInput("x", list(POOL[pool].shape), "FP32")
            tensor.set_data_from_numpy(POOL[pool])
            try:
                output = connection.infer(names[model], [tensor]).as_numpy("output")
                answers.append((index, names[model], pool, output))
            except Exception as error:  # noqa: BLE001 - reported by the test
                errors.append(error)

    def swaps():
        """Weight-only publishes, and reloads that change the program and change it back."""
        loader = http_client.InferenceServerClient(server.url)
        steps = [("publish", 10, 1), ("program", 20, 1), ("publish", 11, 1), ("publish", 12, 1),
                 ("program", 20, 2), ("publish", 10, 2), ("program", 21, 1), ("publish", 13, 1),
                 ("publish", 14, 1), ("program", 21, 2), ("publish", 15, 1), ("publish", 11, 2)]  # fmt: skip
        try:
            for step, (kind, model, version) in enumerate(steps):
                _wait_for(lambda s=step: len(answers) >= 600 * (s + 1), "the flood", 300)
                handle, name = _marked(tmp_path, model, version), names[model]
                if kind == "publish":
                    done = handle.publish(name, to=server.url)
                    assert done["replaced"] == "weights", done
                else:  # an odd version has another offset: another program
                    handle = _marked(tmp_path, model, version, offset=0.5 * (version % 2))
                    handle.export(str(tmp_path / name), name=name)
                    loader.load_model(name)
                    programs.append(_statistics(server.url, name)["paging"]["programs"])
                versions.add(name, version)
        except Exception as error:  # noqa: BLE001 - reported by the test
            errors.append(error)
        finally:
            swapped.set()

    def watch():
        while not (swapped.is_set() and all(not w.is_alive() for w in workers)):
            memory.append(_statistics(server.url, "m00")["paging"])
            time.sleep(0.05)

    try:
        workers = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        others = [threading.Thread(target=swaps), threading.Thread(target=watch)]
        for thread in workers + others:
            thread.start()
        for thread in workers + others:
            thread.join(timeout=600)
        assert [str(e) for e in errors] == [] and len(answers) >= REQUESTS
        assert programs == [2, 1, 2, 1]  # a program no bundle serves any more is dropped
        latest: dict[tuple[int, str], int] = {}
        for index, name, pool, output in answers:
            marker = np.round(output[0] / 100).astype(int)  # (model, version)
            version = int(marker[1])
            assert names[int(marker[0])] == name and version in versions.bundles[name], marker
            assert versions.is_exactly(name, version, pool, output), (name, version)
            # a client's requests for a model see its versions in order: swaps are atomic
            assert version >= latest.get((index, name), 0), (index, name)
            latest[index, name] = version
        for model, version in ((10, 2), (11, 2), (15, 1), (20, 2), (21, 2)):
            name = names[model]  # the last swap of each model is served from then on
            output = infer_grpc(server.grpc_url, name, POOL[3])
            assert versions.is_exactly(name, version, 3, output), (name, version)
        stats = {name: _statistics(server.url, name)["model_stats"][0] for name in names}
        paging = _statistics(server.url, "m00")["paging"]
    finally:
        server.stop()
    assert max(m["device_used"] for m in memory) <= budget["device"]
    assert max(len(m["resident"]) for m in memory) <= RESIDENT
    assert max(m["host_used"] for m in memory) <= budget["host"]
    assert paging["device_peak"] <= budget["device"] and paging["host_peak"] <= budget["host"]
    assert paging["programs"] == 1 and paging["device_budget"] == budget["device"]
    weights = {name: s["weights"] for name, s in stats.items()}
    assert sum(s["inference_count"] for s in stats.values()) >= sum(
        len(POOL[p]) for *_, p, _ in answers
    )
    assert sum(w["evictions"] for w in weights.values()) > MODELS
    assert sum(w["evicted_in_flight"] for w in weights.values()) > 0
    assert sum(w["disk_reads"] for w in weights.values()) > 0
    assert [weights[n]["weight_swaps"] for n in ("m10", "m11", "m12", "m20")] == [2, 2, 1, 0]
    assert [weights[n]["program_loads"] for n in ("m00", "m20", "m21", "m30")] == [1, 1, 1, 0]
