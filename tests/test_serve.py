"""`nitro serve`: bundles behind KServe's model server, tested with Triton's own clients.

The servers run in subprocesses on free loopback ports and are always stopped.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toys import Tagged, Toy

import nitro
import nitro.bundle

# kserve and tritonclient.grpc register the same protobuf messages: only the server imports kserve
if importlib.util.find_spec("kserve") is None:
    pytest.skip(
        "serving needs the serve extra: pip install 'nitro[serve]'", allow_module_level=True
    )
http_client = pytest.importorskip("tritonclient.http")
grpc_client = pytest.importorskip("tritonclient.grpc")
from ports import free_port  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

RNG = np.random.default_rng(2)
X7 = RNG.normal(size=(7, 5)).astype(np.float32)


@nitro.experiment
class Counts(Toy):
    """Integer inputs on the wire (INT32 counts, INT8 levels), added into forward's x."""

    def export_inputs(self):
        return {
            "counts": jax.ShapeDtypeStruct((5,), jnp.int32),
            "levels": jax.ShapeDtypeStruct((5,), jnp.int8),
        }

    def export_preprocess(self, *, counts, levels):
        return {"x": counts.astype(jnp.float32) + levels.astype(jnp.float32)}


@nitro.experiment
class Labelled(Tagged):
    """A host hook after the program: the label and its logit instead of the logits."""

    def postprocess(self, outputs, **inputs):
        logits = outputs["output"]
        return {"label": logits.argmax(1).astype(np.int32), "logit": logits.max(1)}


class Server:
    """`python -m nitro.serve DIR ...` in a subprocess, stopped by `stop()`."""

    root: Any  # where the fixture exported the served bundles

    def __init__(self, directories, log_path, *extra: str):
        self.port, self.grpc_port = free_port(), free_port()
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nitro.serve", *map(str, directories)]
            + ["--port", str(self.port), "--grpc-port", str(self.grpc_port)]
            + ["--log-level", "error", *extra],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.url, self.grpc_url = f"127.0.0.1:{self.port}", f"127.0.0.1:{self.grpc_port}"
        deadline = time.monotonic() + 90
        client = http_client.InferenceServerClient(self.url)
        while True:
            assert self.process.poll() is None, open(log_path).read()[-3000:]
            try:
                if client.is_server_ready():
                    break
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            assert time.monotonic() < deadline, "the server did not become ready in 90 s"
            time.sleep(0.1)

    def request(self, method: str, path: str, body: bytes = b"", headers=None):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def infer_http(url: str, model: str, x: np.ndarray, binary: bool = True) -> np.ndarray:
    client = http_client.InferenceServerClient(url)
    tensor = http_client.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    wanted = [http_client.InferRequestedOutput("output", binary_data=binary)]
    return client.infer(model, [tensor], outputs=wanted).as_numpy("output")


def infer_grpc(url: str, model: str, x: np.ndarray) -> np.ndarray:
    client = grpc_client.InferenceServerClient(url)
    tensor = grpc_client.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor]).as_numpy("output")


@pytest.fixture(scope="module")
def handles():
    toy = nitro.Nitro(Toy(), seed=0, progress=False)
    toy.train()
    wide = nitro.Nitro(Toy(width=32), seed=1, progress=False)
    reloaded = nitro.Nitro(Toy(max_epochs=1), seed=2, progress=False)
    counts = nitro.Nitro(Counts(), weights=toy, progress=False)
    tagged = nitro.Nitro(Tagged(), weights=toy, progress=False)
    labelled = nitro.Nitro(Labelled(), weights=toy, progress=False)
    return {
        **{"toy": toy, "wide": wide, "reload": reloaded, "counts": counts},
        **{"tagged": tagged, "labelled": labelled},
    }


EXPORTS = {
    "tagged": {"echo": ("id",), "batch_sizes": (2, 4), "axes": {"x": ("batch", "feature")}},
    "labelled": {"echo": ("id",)},
}


@pytest.fixture(scope="module")
def served(handles, tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    for name, handle in handles.items():
        handle.export(str(root / name), name=name, **EXPORTS.get(name, {}))
    server = Server(
        [root / n for n in handles], root / "server.log", "--max-request-mb", "1", "--trust-code"
    )
    server.root = root
    yield server
    server.stop()


def test_http_and_grpc_clients_get_the_outputs_of_predict(handles, served):
    for rows in (1, 7, 300):
        x = RNG.normal(size=(rows, 5)).astype(np.float32)
        expected = handles["toy"].predict({"x": x})
        np.testing.assert_allclose(infer_http(served.url, "toy", x), expected, atol=1e-6)
        np.testing.assert_allclose(
            infer_http(served.url, "toy", x, binary=False), expected, atol=1e-6
        )
        np.testing.assert_allclose(infer_grpc(served.grpc_url, "toy", x), expected, atol=1e-6)


def test_health_readiness_and_metadata_come_from_the_manifest(served):
    client = http_client.InferenceServerClient(served.url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("toy")
    metadata = client.get_model_metadata("toy")
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 5]}]
    assert metadata["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 2]}]
    grpc_metadata = grpc_client.InferenceServerClient(served.grpc_url).get_model_metadata("toy")
    assert [(t.name, t.datatype, list(t.shape)) for t in grpc_metadata.inputs] == [
        ("x", "FP32", [-1, 5])
    ]
    status, body = served.request("GET", "/v2/models/nothing")
    assert status == 404 and b"nothing" in body


def test_an_echoed_id_comes_back_with_the_outputs_and_the_metadata_names_it(handles, served):
    x, ids = RNG.normal(size=(3, 5)).astype(np.float32), np.array([11, 7, -3], np.int32)
    inputs = [
        grpc_client.InferInput("x", [3, 5], "FP32"),
        grpc_client.InferInput("id", [3], "INT32"),
    ]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(ids)
    result = grpc_client.InferenceServerClient(served.grpc_url).infer("tagged", inputs)
    np.testing.assert_array_equal(result.as_numpy("id"), ids)
    np.testing.assert_allclose(
        result.as_numpy("output"), handles["toy"].predict({"x": x}), atol=1e-6
    )
    assert _stats(served.url, "tagged")[2] == {4: 1}  # 3 rows: the bundle's batch size 4
    client = http_client.InferenceServerClient(served.url)
    metadata = client.get_model_metadata("tagged")
    assert metadata["outputs"] == [
        {"name": "output", "datatype": "FP32", "shape": [-1, 2]},
        {"name": "id", "datatype": "INT32", "shape": [-1]},
    ]
    # KServe V2 metadata has no field for axis names: the statistics' bundle entry has them
    bundle = client.get_inference_statistics("tagged")["model_stats"][0]["bundle"]
    assert [(e["name"], e["axes"]) for e in bundle["inputs"]] == [
        ("x", ["batch", "feature"]),
        ("id", ["batch"]),
    ]
    assert bundle["outputs"][1] == {
        "name": "id",
        "dtype": "int32",
        "shape": [-1],
        "axes": ["batch"],
        "echo": "id",
    }
    assert bundle["postprocess"] is None


def test_a_postprocess_hook_names_the_outputs_and_runs_only_with_trust_code(handles, served):
    x, ids = RNG.normal(size=(3, 5)).astype(np.float32), np.array([4, 5, 6], np.int32)
    inputs = [
        http_client.InferInput("x", [3, 5], "FP32"),
        http_client.InferInput("id", [3], "INT32"),
    ]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(ids)
    client = http_client.InferenceServerClient(served.url)
    result = client.infer("labelled", inputs)
    logits = handles["toy"].predict({"x": x})
    np.testing.assert_array_equal(result.as_numpy("label"), logits.argmax(1))
    np.testing.assert_allclose(result.as_numpy("logit"), logits.max(1), atol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("id"), ids)
    assert [o["name"] for o in client.get_model_metadata("labelled")["outputs"]] == [
        "label",
        "logit",
        "id",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "nitro.serve", str(served.root / "labelled"), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "holds a postprocess hook" in done.stderr
    assert "nitro serve --trust-code" in done.stderr


def test_several_bundles_are_served_at_once(handles, served):
    status, body = served.request("GET", "/v2/models")
    assert status == 200 and sorted(json.loads(body)["models"]) == [
        "counts",
        "labelled",
        "reload",
        "tagged",
        "toy",
        "wide",
    ]
    np.testing.assert_allclose(
        infer_grpc(served.grpc_url, "wide", X7), handles["wide"].predict({"x": X7}), atol=1e-6
    )


def test_a_wrong_input_name_shape_or_dtype_is_a_4xx_naming_the_input(served):
    cases = [
        (("y", [7, 5], "FP32"), "toy has no input 'y'; it takes x FP32[batch, 5]"),
        (("x", [7, 4], "FP32"), "input 'x' must be FP32[batch, 5]; got shape [7, 4]"),
        (("x", [7, 5], "FP64"), "input 'x' must be FP32[batch, 5]; got datatype 'FP64'"),
    ]
    for (name, shape, datatype), message in cases:
        data = np.zeros(shape, np.float64 if datatype == "FP64" else np.float32)
        for module, url, status in (
            (http_client, served.url, "400"),
            (grpc_client, served.grpc_url, "StatusCode.INVALID_ARGUMENT"),
        ):
            tensor = module.InferInput(name, shape, datatype)
            tensor.set_data_from_numpy(data)
            with pytest.raises(InferenceServerException) as raised:
                module.InferenceServerClient(url).infer("toy", [tensor])
            assert raised.value.status() == status and message in raised.value.message()


def _infer_json(served, model: str, inputs: dict) -> tuple[int, dict]:
    """A JSON inference request: {name: (datatype, shape, flat data)}."""
    body = {
        "inputs": [
            {"name": name, "datatype": datatype, "shape": shape, "data": data}
            for name, (datatype, shape, data) in inputs.items()
        ]
    }
    status, text = served.request(
        "POST", f"/v2/models/{model}/infer", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    return status, json.loads(text)


def test_integer_inputs_refuse_fractions_and_values_out_of_range(handles, served):
    counts, levels = [1, 2, 3, 4, 5], [-1, 0, 1, 2, 127]
    good = {"counts": ("INT32", [1, 5], counts), "levels": ("INT8", [1, 5], levels)}
    status, answer = _infer_json(served, "counts", good)
    x = np.asarray([counts], np.float32) + np.asarray([levels], np.float32)
    assert status == 200
    np.testing.assert_allclose(
        answer["outputs"][0]["data"], handles["counts"].predict({"x": x}).ravel(), atol=1e-5
    )
    cases = [
        ({"counts": ("INT32", [1, 5], [1.7, 2, 3, 4, 5])},
         "input 'counts': 1.7 is not a whole number, and INT32 takes integers only"),
        ({"counts": ("INT32", [1, 5], [1, 2, 3, 4, float("inf")])},
         "input 'counts': inf is not a whole number"),
        ({"counts": ("INT32", [1, 5], [1, 2, 2**31, 4, 5])},
         "input 'counts': 2147483648 is out of the range of INT32 (-2147483648 to 2147483647)"),
        ({"levels": ("INT8", [1, 5], [1, 2, 300, 4, 5])},
         "input 'levels': 300 is out of the range of INT8 (-128 to 127)"),
        ({"levels": ("INT8", [1, 5], [1, 2, 3, 4, 2**70])},
         "input 'levels': 1180591620717411303424 is out of the range of INT8"),
        ({"levels": ("INT8", [1, 5], [1.0, 2.0, -129.0, 4.0, 5.0])},
         "input 'levels': -129.0 is out of the range of INT8"),
    ]  # fmt: skip
    for change, message in cases:
        status, answer = _infer_json(served, "counts", {**good, **change})
        assert status == 400 and message in answer["error"], answer
    status, answer = _infer_json(served, "toy", {"x": ("FP32", [1, 5], [0.5, 1e39, 0, 0, 0])})
    assert status == 400
    assert "input 'x': 1e+39 is out of the range of FP32 (largest 3.4028235e+38)" in answer["error"]
    status, answer = _infer_json(served, "toy", {"x": ("FP32", [1, 5], [0.5, 10**400, 0, 0, 0])})
    assert status == 400 and "... (401 digits) is out of the range of FP32" in answer["error"]

    # gRPC carries INT8 values in 32-bit int_contents: the same checks apply
    import grpc
    from tritonclient.grpc import service_pb2 as _pb2
    from tritonclient.grpc import service_pb2_grpc

    service_pb2: Any = _pb2  # generated messages, unknown to the type checker

    def request(levels_values):
        tensors = [
            service_pb2.ModelInferRequest().InferInputTensor(
                name=name, datatype=datatype, shape=[1, 5],
                contents=service_pb2.InferTensorContents(int_contents=values),
            )
            for name, datatype, values in (
                ("counts", "INT32", counts), ("levels", "INT8", levels_values)
            )
        ]  # fmt: skip
        return service_pb2.ModelInferRequest(model_name="counts", inputs=tensors)

    channel = grpc.insecure_channel(served.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    try:
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request([1, 2, 300, 4, 5]), timeout=120)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input 'levels': 300 is out of the range of INT8 (-128 to 127)" in (
            str(raised.value.details())
        )
        answer = stub.ModelInfer(request(levels), timeout=120)
        assert list(answer.outputs[0].shape) == [1, 2]
    finally:
        channel.close()
    # Triton's client sends integer arrays as they are, binary or JSON
    for binary in (True, False):
        client = http_client.InferenceServerClient(served.url)
        tensors = []
        for name, datatype, values, dtype in (
            ("counts", "INT32", counts, np.int32), ("levels", "INT8", levels, np.int8)
        ):  # fmt: skip
            tensor = http_client.InferInput(name, [1, 5], datatype)
            tensor.set_data_from_numpy(np.asarray([values], dtype), binary_data=binary)
            tensors.append(tensor)
        np.testing.assert_allclose(
            client.infer("counts", tensors).as_numpy("output"),
            handles["counts"].predict({"x": x}),
            atol=1e-5,
        )


def test_request_bodies_over_the_limit_are_refused(served):
    limit = 1 << 20
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    connection.putrequest("POST", "/v2/models/toy/infer")
    connection.putheader("Content-Length", str(limit + 1))
    connection.endheaders()  # the declared length alone is refused, before any body is sent
    response = connection.getresponse()
    assert response.status == 413 and b"over the limit of 1048576 bytes" in response.read()
    connection.close()
    with socket.create_connection(("127.0.0.1", served.port), timeout=120) as raw:
        chunk = b"0" * (limit + 10)  # no length declared: counted while it arrives
        raw.sendall(
            b"POST /v2/models/toy/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(chunk):x}\r\n".encode()
            + chunk
            + b"\r\n0\r\n\r\n"
        )
        assert raw.recv(4096).startswith(b"HTTP/1.1 413")
    big = np.zeros((60_000, 5), np.float32)  # 1.2 MB of raw tensor data
    with pytest.raises(InferenceServerException) as raised:
        infer_grpc(served.grpc_url, "toy", big)
    assert raised.value.status() == "StatusCode.RESOURCE_EXHAUSTED"


def test_the_server_listens_on_loopback_only_by_default(served):
    psutil = pytest.importorskip("psutil")
    process = psutil.Process(served.process.pid)
    sockets = getattr(process, "net_connections", process.connections)(kind="inet")
    listening = {c.laddr.ip for c in sockets if c.status == psutil.CONN_LISTEN}
    assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening


# ---------------------------------------------------------------------------------------------
# malformed requests


def _good_body(rows: int = 2) -> dict:
    return {
        "inputs": [
            {"name": "x", "shape": [rows, 5], "datatype": "FP32", "data": [0.5] * (rows * 5)}
        ]
    }


def _binary(header: dict, raw: bytes, length: int | str | None = None) -> tuple[bytes, dict]:
    text = json.dumps(header).encode()
    headers = {"Inference-Header-Content-Length": str(len(text) if length is None else length)}
    headers["Content-Type"] = "application/octet-stream"
    return text + raw, headers


def malformed_requests() -> list[tuple[str, str, bytes, dict]]:
    """(method, path, body, headers) of requests that are all wrong, in many ways."""
    infer = "/v2/models/toy/infer"
    json_headers = {"Content-Type": "application/json"}
    good = json.dumps(_good_body()).encode()
    cases = []
    # bad JSON: truncated bodies and random bytes, with and without a content type
    for cut in range(1, len(good) - 1, max(1, len(good) // 45)):
        cases.append(("POST", infer, good[:cut], json_headers))
    noise = np.random.default_rng(7)
    for size in noise.integers(1, 400, size=30):
        raw = bytes(noise.integers(0, 256, size=int(size), dtype=np.uint8))
        cases.append(("POST", infer, b"\xff" + raw, {} if size % 2 else json_headers))

    # wrong types and missing fields
    def mutate(change) -> bytes:
        body = _good_body()
        change(body, body["inputs"][0])
        return json.dumps(body).encode()

    for value in (5, "x", None, {}, [5], [[1]], ["x"], [None]):
        cases.append(
            ("POST", infer, mutate(lambda b, i, v=value: b.update(inputs=v)), json_headers)
        )
    for key in ("name", "shape", "datatype", "data"):
        cases.append(("POST", infer, mutate(lambda b, i, k=key: i.pop(k)), json_headers))
    for key, value in [
        ("name", 5), ("name", None), ("name", ["x"]), ("name", "z"), ("name", ""),
        ("shape", "2,5"), ("shape", ["2", "x"]), ("shape", [2.5, 5]), ("shape", [[2], 5]),
        ("shape", [2, 5, 1]), ("shape", [10]), ("shape", []), ("shape", None), ("shape", [True, 5]),
        ("datatype", 3), ("datatype", "FP33"), ("datatype", "BYTES"), ("datatype", "FP16"),
        ("datatype", "INT32"), ("datatype", "F32"), ("datatype", None),
        ("data", "0.5"), ("data", {"a": 1}), ("data", [0.5] * 9), ("data", [0.5] * 11),
        ("data", ["a"] * 10), ("data", [None] * 10), ("data", [[0.5] * 5, [0.5] * 4]),
        ("data", [{"v": 1}] * 10), ("data", []), ("data", None), ("parameters", 5),
        ("parameters", "binary"),
    ]:  # fmt: skip
        cases.append(
            ("POST", infer, mutate(lambda b, i, k=key, v=value: i.update({k: v})), json_headers)
        )
    for key, value in [
        ("id", {}),
        ("parameters", [1]),
        ("outputs", [{"name": "nope"}]),
        ("outputs", 7),
    ]:
        cases.append(
            ("POST", infer, mutate(lambda b, i, k=key, v=value: b.update({k: v})), json_headers)
        )
    cases.append(
        (
            "POST",
            infer,
            json.dumps({"inputs": [_good_body()["inputs"][0]] * 2}).encode(),
            json_headers,
        )
    )
    # huge, empty and negative shapes
    for shape in ([10**12, 5], [2**63, 5], [2**64, 5], [10**6, 5], [1, 10**9], [2000, 5],
                  [0, 5], [-1, 5], [-(2**63), 5], [3, 5, 5], [5, 2]):  # fmt: skip
        cases.append(("POST", infer, mutate(lambda b, i, s=shape: i.update(shape=s)), json_headers))
    # truncated and inconsistent binary payloads
    raw = np.ones((2, 5), np.float32).tobytes()
    header = {
        "inputs": [
            {
                "name": "x",
                "shape": [2, 5],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 40},
            }
        ]
    }
    for cut in (0, 1, 3, 4, 17, 20, 36, 39):
        cases.append(("POST", infer, *_binary(header, raw[:cut])))
    text_length = len(json.dumps(header))
    for length in (0, 1, text_length - 1, text_length + 1, 10**9, -5, "abc", "", "1e3"):
        cases.append(("POST", infer, *_binary(header, raw, length)))
    for size in (39, 41, 0, -8, 10**12, "40", None, 4.5):
        changed = json.loads(json.dumps(header))
        changed["inputs"][0]["parameters"]["binary_data_size"] = size
        cases.append(("POST", infer, *_binary(changed, raw)))
    for shape in ([10**12, 5], [2, 6], [2, 5, 1], ["2", 5], [2.0, 5], [-2, -5], None, "x"):
        changed = json.loads(json.dumps(header))
        changed["inputs"][0]["shape"] = shape
        cases.append(("POST", infer, *_binary(changed, raw)))
    for datatype in ("FP64", "INT8", "BOOL", "BYTES", "NOPE", 1):
        changed = json.loads(json.dumps(header))
        changed["inputs"][0]["datatype"] = datatype
        cases.append(("POST", infer, *_binary(changed, raw)))
    cases.append(("POST", infer, *_binary({"inputs": 5}, raw)))
    cases.append(("POST", infer, *_binary([1, 2], raw)))  # pyright: ignore[reportArgumentType]
    cases.append(("POST", infer, *_binary({"inputs": [{"name": "x"}]}, raw)))
    cases.append(("POST", infer, *_binary({"inputs": ["x"]}, raw)))
    # wrong routes, methods and protocol versions
    cases += [
        ("GET", infer, b"", {}),
        ("PUT", infer, good, json_headers),
        ("POST", "/v2/models/nothing/infer", good, json_headers),
        ("POST", "/v2/models/toy/infer?x=1", b"{}", json_headers),
        (
            "POST",
            "/v1/models/toy:predict",
            b'{"instances": [[0.5, 0.5, 0.5, 0.5, 0.5]]}',
            json_headers,
        ),
        ("POST", "/v2/repository/models/nothing/unload", b"", {}),
        ("GET", "/v2/models/toy/ready/extra", b"", {}),
    ]
    return cases


def test_a_run_of_malformed_requests_gets_4xx_each_and_good_requests_still_work(handles, served):
    cases = malformed_requests()
    assert len(cases) >= 200
    good = json.dumps(_good_body()).encode()
    expected = handles["toy"].predict({"x": np.full((2, 5), 0.5, np.float32)})
    answers = []
    for index, (method, path, body, headers) in enumerate(cases):
        status, text = served.request(method, path, body, headers)
        answers.append(status)
        assert 400 <= status < 500, (index, method, path, body[:200], headers, status, text[:500])
        if index % 25 == 0:
            status, text = served.request(
                "POST", "/v2/models/toy/infer", good, {"Content-Type": "application/json"}
            )
            assert status == 200, text
            output = json.loads(text)["outputs"][0]
            np.testing.assert_allclose(
                np.reshape(output["data"], output["shape"]), expected, atol=1e-6
            )
    assert served.process.poll() is None
    assert set(answers) <= {400, 404, 405, 422} and answers.count(400) > len(answers) // 2
    np.testing.assert_allclose(
        infer_http(served.url, "toy", X7), handles["toy"].predict({"x": X7}), atol=1e-6
    )


def test_malformed_grpc_requests_get_invalid_argument(served):
    import grpc
    from tritonclient.grpc import service_pb2 as _pb2
    from tritonclient.grpc import service_pb2_grpc

    service_pb2: Any = _pb2  # generated messages, unknown to the type checker

    channel = grpc.insecure_channel(served.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    raw = np.ones((2, 5), np.float32).tobytes()

    def request(shape, datatype="FP32", contents=raw, name="x"):
        tensor = service_pb2.ModelInferRequest().InferInputTensor(
            name=name, datatype=datatype, shape=shape
        )
        return service_pb2.ModelInferRequest(
            model_name="toy", inputs=[tensor], raw_input_contents=[contents]
        )

    cases = [
        request([2, 5], contents=raw[:17]),
        request([2, 5], contents=b""),
        request([10**12, 5]),
        request([2, 5, 1]),
        request([2, 5], datatype="FP64"),
        request([2, 5], datatype="NOPE"),
        request([2, 5], name="y"),
        request([-1, 5]),
    ]
    for case in cases:
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(case, timeout=120)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    answer = stub.ModelInfer(request([2, 5]), timeout=120)
    assert list(answer.outputs[0].shape) == [2, 2]
    channel.close()


# ---------------------------------------------------------------------------------------------
# dynamic batching


def _stats(url: str, model: str) -> tuple[int, int, dict[int, int]]:
    """Rows served, program calls and calls by padded width, from Triton's statistics API."""
    stats = http_client.InferenceServerClient(url).get_inference_statistics(model)
    model_stats = stats["model_stats"][0]
    widths = {b["batch_size"]: b["compute_infer"]["count"] for b in model_stats["batch_stats"]}
    return model_stats["inference_count"], model_stats["execution_count"], widths


def _flood(served, model: str, requests: int, threads: int = 16, bad=None):
    """`threads` clients (half REST, half gRPC) each sending `requests` requests of 1 to 4
    random rows, and `bad()` (a failing request) between them; (x, output) pairs, errors."""
    answers, errors, refusals = [], [], []

    def client(index: int):
        rng = np.random.default_rng(100 + index)
        url, infer = (served.url, infer_http) if index % 2 else (served.grpc_url, infer_grpc)
        for _ in range(requests):
            x = rng.normal(size=(int(rng.integers(1, 5)), 5)).astype(np.float32)
            try:
                answers.append((x, infer(url, model, x)))
            except Exception as error:  # noqa: BLE001 - reported by the test
                errors.append(error)
            if bad is not None and index == 0:
                refusals.append(bad())

    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    return answers, errors, refusals


def _padded(bundle, x: np.ndarray, width: int) -> np.ndarray:
    """The bundle run on `x` padded to `width` rows (its last row repeated), sliced back."""
    rows = np.concatenate([x, np.repeat(x[-1:], width - len(x), axis=0)])
    return bundle(x=rows)["output"][: len(x)]


def test_concurrent_requests_are_batched_and_each_gets_the_bundles_outputs(served):
    bundle = nitro.bundle.load(str(served.root / "toy"))
    rows_before, calls_before, _ = _stats(served.url, "toy")
    answers, errors, _ = _flood(served, "toy", requests=12)
    rows_after, calls_after, widths = _stats(served.url, "toy")
    assert errors == [] and len(answers) == 16 * 12
    # every row was served once; fewer calls than requests: requests were joined
    assert rows_after - rows_before == sum(len(x) for x, _ in answers)
    assert calls_after - calls_before < len(answers)
    assert max(widths) > 4  # a call wider than any single request's padding
    # XLA's results on CPU depend on the width of the call (batch 1 and batch 8 of the same
    # row differ in the last bits), not on the other rows: each answer is bitwise the bundle's
    # outputs for its rows in a call of one of the widths the server pads to
    for x, output in answers:
        candidates = [_padded(bundle, x, w) for w in (1, 2, 4, 8, 16, 32, 64) if w >= len(x)]
        assert any(np.array_equal(output, c) for c in candidates)


def test_a_bad_request_in_a_flood_of_good_ones_fails_alone(served):
    bundle = nitro.bundle.load(str(served.root / "toy"))

    def bad():
        tensor = http_client.InferInput("x", [3, 4], "FP32")
        tensor.set_data_from_numpy(np.zeros((3, 4), np.float32))
        try:
            http_client.InferenceServerClient(served.url).infer("toy", [tensor])
        except InferenceServerException as error:
            return error.status(), error.message()
        return None

    answers, errors, refusals = _flood(served, "toy", requests=10, bad=bad)
    assert errors == [] and len(answers) == 16 * 10
    assert refusals == [("400", "input 'x' must be FP32[batch, 5]; got shape [3, 4]")] * 10
    for x, output in answers:
        candidates = [_padded(bundle, x, w) for w in (1, 2, 4, 8, 16, 32, 64) if w >= len(x)]
        assert any(np.array_equal(output, c) for c in candidates)


def test_with_batching_off_each_request_is_its_own_call(served, tmp_path):
    server = Server([served.root / "toy"], tmp_path / "server.log", "--no-batching")
    try:
        bundle = nitro.bundle.load(str(served.root / "toy"))
        answers, errors, _ = _flood(server, "toy", requests=6)
        rows, calls, widths = _stats(server.url, "toy")
        assert errors == [] and calls == len(answers) == 16 * 6
        assert rows == sum(len(x) for x, _ in answers) and set(widths) <= {1, 2, 4}
        for x, output in answers:  # padded to its own power of two, as before batching
            assert np.array_equal(output, _padded(bundle, x, 1 << (len(x) - 1).bit_length()))
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------
# reloading


class Hammer:
    """Threads that send the same request over and over, recording outputs and errors."""

    def __init__(self, url: str, model: str, x: np.ndarray, threads: int = 3):
        self.outputs, self.errors, self.stop = [], [], threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(url, model, x), daemon=True)
            for _ in range(threads)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, url, model, x):
        while not self.stop.is_set():
            try:
                self.outputs.append(infer_http(url, model, x))
            except Exception as error:  # noqa: BLE001 - reported by the test
                self.errors.append(error)

    def finish(self):
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


def _wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_reexported_bundle_reloads_through_the_repository_api_without_failing_requests(
    handles, served
):
    handle = handles["reload"]
    before = handle.predict({"x": X7})
    hammer = Hammer(served.url, "reload", X7, threads=8)  # joined into batches
    try:
        _wait_for(lambda: len(hammer.outputs) > 5, "requests before the re-export")
        handle.train()
        handle.export(str(served.root / "reload"), name="reload")
        after = handle.predict({"x": X7})
        assert np.abs(after - before).max() > 1e-3
        time.sleep(0.3)
        np.testing.assert_allclose(
            infer_http(served.url, "reload", X7), before, atol=1e-6
        )  # no watch
        http_client.InferenceServerClient(served.url).load_model("reload")
        _wait_for(
            lambda: np.allclose(hammer.outputs[-1], after, atol=1e-6), "the new bundle's outputs"
        )
        count = len(hammer.outputs)
        _wait_for(lambda: len(hammer.outputs) > count + 5, "requests after the reload")
    finally:
        hammer.finish()
    assert hammer.errors == []
    old = sum(np.allclose(o, before, atol=1e-6) for o in hammer.outputs)
    new = sum(np.allclose(o, after, atol=1e-6) for o in hammer.outputs)
    assert old > 0 and new > 0 and old + new == len(hammer.outputs)


def test_watch_reloads_a_bundle_exported_again_to_its_directory(tmp_path):
    handle = nitro.Nitro(Toy(max_epochs=1), seed=4, progress=False)
    handle.export(str(tmp_path / "watched"))
    before = handle.predict({"x": X7})
    server = Server([tmp_path / "watched"], tmp_path / "server.log", "--watch", "--no-grpc")
    try:
        hammer = Hammer(server.url, "toy", X7, threads=2)
        try:
            _wait_for(lambda: len(hammer.outputs) > 5, "requests before the re-export")
            seen = [before]
            for _ in range(2):  # an export swaps the directory: the new one is watched too
                handle.train()
                handle.export(str(tmp_path / "watched"))
                after = handle.predict({"x": X7})
                seen.append(after)
                _wait_for(
                    lambda a=after: np.allclose(hammer.outputs[-1], a, atol=1e-6), "the reload"
                )
        finally:
            hammer.finish()
        assert hammer.errors == []
        assert all(any(np.allclose(o, s, atol=1e-6) for s in seen) for o in hammer.outputs)
    finally:
        server.stop()


def test_nitro_serve_names_a_directory_that_holds_no_bundle(tmp_path):
    command = os.path.join(os.path.dirname(sys.executable), "nitro")
    done = subprocess.run(
        [command, "serve", str(tmp_path / "missing")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert f"no bundle at {tmp_path / 'missing'}: the directory does not exist" in done.stderr


def test_nitro_serve_refuses_a_negative_batch_delay(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "nitro.serve", str(tmp_path), "--batch-delay", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "(nitro serve --batch-delay) must be 0 to 60000 milliseconds, got -1.0" in done.stderr
