"""The wire in front of KServe: what the server adds to its transports and its request checks.

- KServe is imported without letting it parse this process's command line;
- request bodies over a limit get 413 before anything parses them, and a request using the
  binary tensor extension whose framing does not add up gets 400 (KServe would slice it
  blindly); a body without a Content-Type is read as JSON, the protocol's default;
- a request KServe could not decode gets 400 naming the error, and the server keeps answering;
- each input is checked against the bundle's signature (name, datatype, shape, rows, nulls),
  and numbers sent as JSON or gRPC contents must fit its dtype exactly (1.7 for an INT32
  input, 300 for INT8 or 1e39 for FP32 are refused, not truncated, wrapped or made infinite);
- the gRPC server listens on one host, with the same message limit, instead of every
  interface;
- a REST request's binary tensors are read as arrays over its bytes (KServe makes Python lists
  of them), and the REST server does without KServe's per-request CPU timing, which fed only a
  log line.

The KServe adapters (the model, the repository, the model server) are in `server.py`.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from nitro.serving import bundle as bundles

__all__ = [
    "BinaryDataPlane",
    "HostGRPCServer",
    "RequestGate",
    "UntimedRESTServer",
    "binary_framing_problem",
    "decode_inputs",
    "kserve_imports",
    "undecodable",
    "wire_dtype",
    "wire_spec",
]


@contextmanager
def kserve_imports() -> Iterator[None]:
    """Around imports of KServe: `kserve.model_server` parses sys.argv when imported, so it
    sees none of this process's arguments; a missing KServe says how to install it."""
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        yield
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"serving bundles needs KServe: pip install 'nitro[serve]' ({error})"
        ) from error
    finally:
        sys.argv = argv


with kserve_imports():
    from kserve.errors import InvalidInput
    from kserve.protocol.dataplane import DataPlane
    from kserve.protocol.grpc.server import GRPCServer
    from kserve.protocol.infer_type import InferInput, InferRequest, RequestedOutput
    from kserve.protocol.rest.server import RESTServer
    from kserve.utils.numpy_codec import from_np_dtype, to_np_dtype


def wire_dtype(dtype: str) -> str:
    """The protocol's datatype name of a NumPy dtype ("float32" -> "FP32")."""
    return from_np_dtype(np.dtype(dtype)) or dtype.upper()


def wire_spec(spec: bundles.TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": wire_dtype(spec.dtype), "shape": list(spec.shape)}


# ---------------------------------------------------------------------------------------------
# request checks


def _holds_null(data: Any) -> bool:
    """True when JSON data (nested lists) holds a null, which NumPy reads as NaN."""
    if isinstance(data, (list, tuple)):
        return any(_holds_null(v) for v in data)
    return data is None


def decode_inputs(
    request: InferRequest, current: bundles.Bundle, *, model: str, max_batch: int
) -> tuple[dict[str, np.ndarray], int]:
    """The request's inputs as arrays checked against the bundle's signature, and their rows;
    `InvalidInput` (a 400) names the input and what was expected."""
    specs = {s.name: s for s in current.inputs}
    arrays: dict[str, np.ndarray] = {}
    for item in request.inputs:
        spec = specs.get(item.name)
        if spec is None:
            takes = ", ".join(
                f"{s.name} {wire_dtype(s.dtype)}{s.shape_text()}" for s in specs.values()
            )
            raise InvalidInput(f"{model} has no input {item.name!r}; it takes {takes}")
        if item.name in arrays:
            raise InvalidInput(f"input {item.name!r} is given twice")
        want = f"{wire_dtype(spec.dtype)}{spec.shape_text()}"
        if item.datatype != wire_dtype(spec.dtype):
            raise InvalidInput(
                f"input {item.name!r} must be {want}; got datatype {item.datatype!r}"
            )
        shape = item.shape
        valid = (
            isinstance(shape, (list, tuple))
            and len(shape) == len(spec.shape)
            and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
            and all(w in (bundles.BATCH, d) for w, d in zip(spec.shape, shape, strict=True))
        )
        if not valid:
            raise InvalidInput(f"input {item.name!r} must be {want}; got shape {shape!r}")
        if not 1 <= shape[0] <= max_batch:
            raise InvalidInput(
                f"input {item.name!r} has {shape[0]} rows; this server takes 1 to "
                f"{max_batch} per request (nitro serve --max-batch)"
            )
        if isinstance(item.data, (list, tuple)):  # numbers, not binary data
            problem = bundles.value_problem(item.data, np.dtype(spec.dtype), item.datatype)
            if problem is not None:
                raise InvalidInput(f"input {item.name!r}: {problem}")
        try:
            array = np.asarray(item.as_numpy(), dtype=spec.dtype)
        except (ValueError, TypeError, OverflowError, IndexError) as error:
            raise InvalidInput(
                f"input {item.name!r}: its data does not fill {item.datatype}{list(shape)} "
                f"({error})"
            ) from None
        if array.dtype.kind == "f" and np.isnan(array).any() and _holds_null(item.data):
            raise InvalidInput(f"input {item.name!r}: its data holds null; send numbers")
        arrays[item.name] = array
    try:
        checked = current.check_inputs(arrays)
    except bundles.BundleError as error:
        raise InvalidInput(str(error)) from None
    return checked, next(iter(checked.values())).shape[0]  # inputs share a batch axis


# ---------------------------------------------------------------------------------------------
# transports


class RequestGate:
    """ASGI middleware in front of KServe's routes.

    It refuses request bodies over `limit` bytes with 413 before anything parses them, and
    marks a body sent without a Content-Type and without the binary extension's
    Inference-Header-Content-Length as JSON, the protocol's default (newer FastAPI reads such a
    body as bytes, which KServe then rejects).
    """

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._answer(send, 413, self._too_large)
        if b"content-type" not in headers and b"inference-header-content-length" not in headers:
            scope = dict(scope, headers=[*scope["headers"], (b"content-type", b"application/json")])
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None  # the client went away
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._answer(send, 413, self._too_large)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        declared = headers.get(b"inference-header-content-length")
        if declared is not None and scope["method"] == "POST":
            problem = binary_framing_problem(body, declared)
            if problem is not None:
                return await self._answer(send, 400, f"malformed binary request: {problem}")

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    @property
    def _too_large(self) -> str:
        return f"request body over the limit of {self.limit} bytes"

    async def _answer(self, send, status: int, message: str) -> None:
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps({"error": message}).encode()})


ITEM_BYTES = {
    "BOOL": 1, "INT8": 1, "UINT8": 1, "INT16": 2, "UINT16": 2, "FP16": 2, "BF16": 2,
    "INT32": 4, "UINT32": 4, "FP32": 4, "INT64": 8, "UINT64": 8, "FP64": 8,
}  # fmt: skip


def binary_framing_problem(body: bytes, declared: bytes) -> str | None:
    """What is wrong with the framing of a request using the binary tensor extension, or None.

    KServe slices the binary part by each input's binary_data_size without checking that the
    sizes add up, and answers some inconsistent requests or fails on them with a 500.
    """
    if not declared.isdigit() or not 0 < int(declared) <= len(body):
        return (
            f"Inference-Header-Content-Length {declared.decode(errors='replace')!r} must be the "
            f"length of the JSON header, at most the body's {len(body)} bytes"
        )
    size = int(declared)
    try:
        header = json.loads(body[:size])
    except ValueError as error:
        return f"the JSON header is not valid JSON ({error})"
    inputs = header.get("inputs") if isinstance(header, dict) else None
    if not isinstance(inputs, list) or not all(isinstance(i, dict) for i in inputs):
        return 'the JSON header needs "inputs": a list of objects'
    total = 0
    for item in inputs:
        parameters = item.get("parameters") or {}
        if not isinstance(parameters, dict) or "binary_data_size" not in parameters:
            continue
        name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
        given = parameters["binary_data_size"]
        if datatype not in ITEM_BYTES:
            return f"input {name!r}: binary data must be numeric, not {datatype!r}"
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            return f"input {name!r}: shape must be a list of non-negative integers, not {shape!r}"
        expected = math.prod(shape) * ITEM_BYTES[datatype]
        if type(given) is not int or given != expected:
            return (
                f"input {name!r}: binary_data_size is {given!r}, but {datatype}{shape} takes "
                f"{expected} bytes"
            )
        total += given
    if total != len(body) - size:
        return (
            f"{len(body) - size} bytes follow the JSON header, but the inputs' binary_data_size "
            f"add up to {total}"
        )
    return None


async def undecodable(request, error):
    """KServe's request decoding raises plain Python errors on malformed input (a missing key,
    a truncated binary tensor); BundleModel.predict turns its own errors into InvalidInput or
    InferenceError, so these come from a request KServe could not decode."""
    from fastapi.responses import JSONResponse

    message = f"malformed inference request ({type(error).__name__}: {error})"
    return JSONResponse(status_code=400, content={"error": message})


class BinaryDataPlane(DataPlane):
    """KServe's data plane, with REST requests in the binary tensor extension decoded to arrays
    over their bytes: KServe turns each such tensor into a Python list, one number at a time,
    which took 40% of the server's CPU for 32-row requests of a 64-wide input. The framing was
    checked by `RequestGate` before."""

    def decode_inference_request(self, body, headers, model_name):
        length = headers.get("inference-header-content-length")
        if not isinstance(body, bytes) or length is None:
            return super().decode_inference_request(body, headers, model_name)
        size = int(length)
        header = json.loads(body[:size])
        inputs, start = [], size
        for entry in header["inputs"]:
            parameters = entry.get("parameters") or None
            if entry.get("data") is not None or not (
                parameters and "binary_data_size" in parameters
            ):
                data = entry.get("data")  # JSON numbers: checked and converted as KServe does
                if data is None:
                    raise InvalidInput(f"'data' field is missing for input {entry['name']!r}")
            else:
                end = start + parameters["binary_data_size"]
                dtype = to_np_dtype(entry["datatype"])
                data = np.frombuffer(body[start:end], dtype=dtype).reshape(entry["shape"])
                start = end
            inputs.append(
                InferInput(entry["name"], entry["shape"], entry["datatype"], data, parameters)
            )
        wanted = header.get("outputs")
        return InferRequest(
            model_name=model_name,
            request_id=header.get("id"),
            parameters=header.get("parameters"),
            infer_inputs=inputs,
            request_outputs=None
            if wanted is None
            else [RequestedOutput(name=o["name"], parameters=o.get("parameters")) for o in wanted],
        )


class UntimedRESTServer(RESTServer):
    """KServe's REST server without its TimingMiddleware. That middleware times every request
    for the `kserve.trace` log line, which this server does not write (latency logging is
    off), with four getrusage(RUSAGE_SELF) calls that walk every thread of the process (XLA
    starts many): a third of the server's CPU under 16 clients of a small model."""

    def _add_middlewares(self, app) -> None:
        return None


class HostGRPCServer(GRPCServer):
    """KServe's gRPC server, listening on one host instead of every interface."""

    def __init__(self, host: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._host = host

    async def start(self, max_workers):
        from concurrent import futures

        from grpc import aio
        from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc
        from kserve.protocol.grpc.interceptors import ExceptionToStatusInterceptor
        from kserve.protocol.grpc.servicer import InferenceServicer

        servicer = InferenceServicer(self._data_plane, self._model_repository_extension)
        limit = self._kwargs["grpc_max_receive_message_length"]
        self._server = aio.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            interceptors=(ExceptionToStatusInterceptor(),),
            options=[
                ("grpc.max_send_message_length", self._kwargs["grpc_max_send_message_length"]),
                ("grpc.max_receive_message_length", limit),
            ],
        )
        grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self._server)
        host = f"[{self._host}]" if ":" in self._host else self._host
        if self._server.add_insecure_port(f"{host}:{self._port}") == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{self._port}")
        await self._server.start()
        await self._server.wait_for_termination()
