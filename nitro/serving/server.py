"""Bundles behind KServe's Python model server: the Open Inference Protocol over REST and gRPC.

```
client ─► uvicorn (REST) ─► body limit ─► KServe data plane ─► BundleModel.predict ─► Bundle
       └► grpc.aio        ─► max message ─┘   (decode V2)        (check, pad, run)     (jax)
```

KServe provides the protocol: health, readiness, model metadata (taken from each manifest),
inference and the model repository API. This module adds what a bundle needs on top:

- it binds 127.0.0.1 unless told otherwise (KServe's own servers bind every interface);
- request bodies over a limit get 413 before anything parses them; gRPC messages over the same
  limit are refused by gRPC;
- a malformed request gets a 4xx (400 for one KServe could not decode) naming the input and
  what was expected, and the server keeps answering;
- a batch is padded to a power of two (at most `max_batch` rows, by repeating its last row, as
  `Nitro.predict` pads), so a bundle compiles at most log2(max_batch) + 1 programs;
- `POST /v2/repository/models/NAME/load` re-reads the bundle's directory, and `watch=True`
  reloads it when its manifest changes. A request holds the bundle it started with, so a
  reload never fails a request in flight.

Imports nothing of Nitro beyond `nitro.bundle`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from nitro.serving import bundle as bundles

_argv, sys.argv = sys.argv, sys.argv[:1]  # kserve.model_server parses sys.argv when imported
try:
    import kserve
    from kserve.constants.constants import FASTAPI_APP_IMPORT_STRING
    from kserve.errors import InferenceError, InvalidInput, ModelNotFound
    from kserve.model_repository import ModelRepository
    from kserve.model_server import app as _kserve_app
    from kserve.protocol.grpc.server import GRPCServer
    from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
    from kserve.protocol.rest.server import RESTServer
    from kserve.utils.numpy_codec import from_np_dtype
    from kserve.utils.utils import generate_uuid
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"serving bundles needs KServe: pip install 'nitro[serve]' ({error})"
    ) from error
finally:
    sys.argv = _argv

__all__ = ["BundleModel", "BundleRepository", "serve"]

log = logging.getLogger("nitro.serving.server")


def _wire_dtype(dtype: str) -> str:
    return from_np_dtype(np.dtype(dtype)) or dtype.upper()


def _wire_spec(spec: bundles.TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": _wire_dtype(spec.dtype), "shape": list(spec.shape)}


def _bucket(rows: int, max_batch: int) -> int:
    return min(1 << (rows - 1).bit_length(), max_batch)


def _holds_null(data: Any) -> bool:
    """True when JSON data (nested lists) holds a null, which NumPy reads as NaN."""
    if isinstance(data, (list, tuple)):
        return any(_holds_null(v) for v in data)
    return data is None


class BundleModel(kserve.Model):
    """One bundle directory served under the bundle's name."""

    def __init__(self, directory: str, *, max_batch: int = 1024, name: str | None = None):
        self.directory = os.path.abspath(directory)
        self.max_batch = max_batch
        self.bundle = self._load()
        super().__init__(name or self.bundle.name)
        self._reloading = threading.Lock()
        self.ready = True

    def _load(self) -> bundles.Bundle:
        loaded = bundles.load(self.directory)
        # compile batch 1 now: a ready model answers its first request without compiling
        loaded({s.name: np.zeros((1, *s.shape[1:]), s.dtype) for s in loaded.inputs})
        return loaded

    def load(self) -> bool:
        self.reload()
        return self.ready

    def reload(self) -> bundles.Bundle:
        """Read the directory again and serve the new bundle; on error keep the old one."""
        with self._reloading:
            self.bundle = self._load()
            self.ready = True
            log.info("reloaded %s from %s", self.name, self.directory)
            return self.bundle

    def get_input_types(self) -> list[dict[str, Any]]:
        return [_wire_spec(s) for s in self.bundle.inputs]

    def get_output_types(self) -> list[dict[str, Any]]:
        return [_wire_spec(s) for s in self.bundle.outputs]

    async def predict(self, payload: Any, headers: Any = None, response_headers: Any = None):
        if not isinstance(payload, InferRequest):
            raise InvalidInput(
                f"{self.name} speaks the Open Inference Protocol (V2): POST "
                f"/v2/models/{self.name}/infer with {{'inputs': [...]}}"
            )
        current = self.bundle  # a reload swaps self.bundle; this request keeps its own
        arrays, rows = self._decode(payload, current)
        pad = all(s.shape[:1] == (bundles.BATCH,) for s in current.outputs)
        width = _bucket(rows, self.max_batch) if pad else rows
        if width > rows:
            arrays = {
                k: np.concatenate([v, np.repeat(v[-1:], width - rows, axis=0)])
                for k, v in arrays.items()
            }
        try:
            results = await asyncio.get_running_loop().run_in_executor(None, current, arrays)
        except bundles.BundleError as error:
            raise InvalidInput(str(error)) from None
        except Exception as error:  # noqa: BLE001 - not the client's fault: a 500
            raise InferenceError(f"{self.name} failed: {type(error).__name__}: {error}") from None
        outputs = []
        binary = payload.use_binary_outputs
        for spec in current.outputs:
            value = results[spec.name][:rows] if pad else results[spec.name]
            output = InferOutput(spec.name, list(value.shape), _wire_dtype(value.dtype.name))
            output.set_data_from_numpy(np.asarray(value, order="C"), binary_data=binary)
            outputs.append(output)
        return InferResponse(
            response_id=payload.id or generate_uuid(),
            model_name=self.name,
            infer_outputs=outputs,
            use_binary_outputs=binary,
            requested_outputs=payload.request_outputs,
        )

    def _decode(self, request: InferRequest, current: bundles.Bundle):
        specs = {s.name: s for s in current.inputs}
        takes = ", ".join(
            f"{s.name} {_wire_dtype(s.dtype)}{s.shape_text()}" for s in specs.values()
        )
        arrays: dict[str, np.ndarray] = {}
        for item in request.inputs:
            spec = specs.get(item.name)
            if spec is None:
                raise InvalidInput(f"{self.name} has no input {item.name!r}; it takes {takes}")
            if item.name in arrays:
                raise InvalidInput(f"input {item.name!r} is given twice")
            want = f"{_wire_dtype(spec.dtype)}{spec.shape_text()}"
            if item.datatype != _wire_dtype(spec.dtype):
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
            if not 1 <= shape[0] <= self.max_batch:
                raise InvalidInput(
                    f"input {item.name!r} has {shape[0]} rows; this server takes 1 to "
                    f"{self.max_batch} per request (nitro serve --max-batch)"
                )
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


class BundleRepository(ModelRepository):
    """The served bundles; `load(name)` (the model repository API) re-reads one from disk."""

    def __init__(self, models: Sequence[BundleModel]):
        super().__init__()
        self.directories: dict[str, str] = {}
        for model in models:
            if model.name in self.directories:
                raise ValueError(
                    f"two bundles are named {model.name!r} ({self.directories[model.name]} and "
                    f"{model.directory}); export one under another name: n.export(dir, name=...)"
                )
            self.directories[model.name] = model.directory
        self.max_batch = models[0].max_batch if models else 1024

    def load(self, name: str) -> bool:
        model = self.get_model(name)
        if model is None:
            if name not in self.directories:
                raise ModelNotFound(name)
            model = BundleModel(self.directories[name], max_batch=self.max_batch, name=name)
            self.update(model)
            return model.ready
        return model.load()

    def model_for(self, directory: str) -> BundleModel | None:
        for model in self.get_models().values():
            if isinstance(model, BundleModel) and model.directory == directory:
                return model
        return None


class _RequestGate:
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
            problem = _binary_framing_problem(body, declared)
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


_ITEM_BYTES = {
    "BOOL": 1, "INT8": 1, "UINT8": 1, "INT16": 2, "UINT16": 2, "FP16": 2, "BF16": 2,
    "INT32": 4, "UINT32": 4, "FP32": 4, "INT64": 8, "UINT64": 8, "FP64": 8,
}  # fmt: skip


def _binary_framing_problem(body: bytes, declared: bytes) -> str | None:
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
        if datatype not in _ITEM_BYTES:
            return f"input {name!r}: binary data must be numeric, not {datatype!r}"
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            return f"input {name!r}: shape must be a list of non-negative integers, not {shape!r}"
        expected = math.prod(shape) * _ITEM_BYTES[datatype]
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


async def _undecodable(request, error):
    """KServe's request decoding raises plain Python errors on malformed input (a missing key,
    a truncated binary tensor); BundleModel.predict turns its own errors into InvalidInput or
    InferenceError, so these come from a request KServe could not decode."""
    from fastapi.responses import JSONResponse

    message = f"malformed inference request ({type(error).__name__}: {error})"
    return JSONResponse(status_code=400, content={"error": message})


class _GRPCServer(GRPCServer):
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


class _Server(kserve.ModelServer):
    def __init__(
        self,
        repository: BundleRepository,
        *,
        host: str,
        port: int,
        grpc_port: int | None,
        max_request_bytes: int,
        watch: bool,
    ):
        super().__init__(
            http_port=port,
            grpc_port=grpc_port or 0,
            enable_grpc=grpc_port is not None,
            registered_models=repository,
            enable_latency_logging=False,
            grace_period=5,
        )
        self.repository = repository
        self.host = host
        self.max_request_bytes = max_request_bytes
        self.watch = watch

    def start(self, models: list[BundleModel]) -> None:
        self._register_and_check_atleast_one_model_is_ready(models)
        _kserve_app.add_middleware(_RequestGate, limit=self.max_request_bytes)
        for kind in (ValueError, KeyError, TypeError, IndexError, AttributeError):
            _kserve_app.add_exception_handler(kind, _undecodable)
        self._rest_server = RESTServer(
            FASTAPI_APP_IMPORT_STRING,
            self.dataplane,
            self.model_repository_extension,
            self.http_port,
            grace_period=self.grace_period,
            timeout_keep_alive=self.timeout_keep_alive,
        )
        self._rest_server.config.host = self.host
        self.servers.append(self._rest_server.start())
        if self.enable_grpc:
            self._grpc_server = _GRPCServer(
                self.host,
                self.grpc_port,
                self.dataplane,
                self.model_repository_extension,
                kwargs={
                    "grpc_max_send_message_length": self.max_request_bytes,
                    "grpc_max_receive_message_length": self.max_request_bytes,
                },
                grace_period=self.grace_period,
            )
            self.servers.append(self._grpc_server.start(self.max_threads))
        self.setup_event_loop()
        self.register_signal_handler()
        asyncio.run(self._serve())

    async def _serve(self):
        stop = asyncio.Event()
        watcher = asyncio.create_task(self._watch(stop)) if self.watch else None
        try:
            await asyncio.gather(*self.servers)
        finally:
            stop.set()
            if watcher is not None:
                await watcher

    async def _watch(self, stop: asyncio.Event) -> None:
        """Reload a bundle when its manifest (written last by an export) changes."""
        from watchfiles import awatch

        directories = list(self.repository.directories.values())
        loop = asyncio.get_running_loop()
        async for changes in awatch(*directories, stop_event=stop):
            changed = {
                os.path.dirname(p) for _, p in changes if os.path.basename(p) == bundles.MANIFEST
            }
            for directory in changed:
                model = self.repository.model_for(directory)
                if model is None:
                    continue
                try:
                    await loop.run_in_executor(None, model.reload)
                except Exception as error:  # noqa: BLE001 - keep serving the bundle it had
                    log.error(
                        "kept the previous %s: reloading %s failed: %s",
                        model.name,
                        directory,
                        error,
                    )


def serve(
    directories: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    grpc_port: int | None = 8081,
    max_request_bytes: int = 16 << 20,
    max_batch: int = 1024,
    watch: bool = False,
    log_level: str = "info",
) -> None:
    """Serve the bundles in `directories` until interrupted (SIGINT or SIGTERM).

    >>> serve(["exports/digits"], port=8080, grpc_port=8081)   # doctest: +SKIP
    """
    if not directories:
        raise ValueError("name at least one bundle directory to serve")
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    models = [BundleModel(d, max_batch=max_batch) for d in directories]
    repository = BundleRepository(models)
    server = _Server(
        repository,
        host=host,
        port=port,
        grpc_port=grpc_port,
        max_request_bytes=max_request_bytes,
        watch=watch,
    )
    level = getattr(logging, log_level.upper())
    for name in ("kserve", "kserve.trace", "uvicorn", "uvicorn.error", "uvicorn.access", "nitro"):
        logging.getLogger(name).setLevel(level)
    server.start(models)
