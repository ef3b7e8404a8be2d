"""Bundles behind KServe's Python model server: the Open Inference Protocol over REST and gRPC.

```
client ─► uvicorn (REST) ─► body limit ─► KServe data plane ─► BundleModel.predict ─► Bundle
       └► grpc.aio        ─► max message ─┘   (decode V2)        (check, pad, run)     (jax)
```

KServe provides the protocol: health, readiness, model metadata (taken from each manifest),
inference and the model repository API. This module adapts bundles to it (the model, the
repository, the model server) and adds what a bundle needs on top:

- it binds 127.0.0.1 unless told otherwise (KServe's own servers bind every interface);
- a batch is padded to a power of two (at most `max_batch` rows, by repeating its last row, as
  `Nitro.predict` pads), so a bundle compiles at most log2(max_batch) + 1 programs; a bundle
  exported with `batch_sizes` is padded to the smallest of them that fits instead, each
  compiled when it loads;
- with `batching` on, concurrent requests for one model, each checked on its own first, are
  joined into one call of up to `max_batch` rows (`Batcher`) and the outputs sliced back;
  `GET /v2/models/NAME/stats` counts rows and calls as Triton's statistics extension does;
- bundles whose program has one digest and input signature share it, compiled once
  (`Programs`, which drops a program no served bundle uses any more); their weights are paged
  between disk, host and device within the budgets (`paging.py`);
- `POST /v2/repository/models/NAME/load` re-reads the bundle's directory, and `watch=True`
  reloads it when an export swaps the directory in (or a copy rewrites its manifest); with the
  program unchanged only the weights are replaced. A request holds the bundle and weights it
  started with, so a reload never fails a request in flight.

The wire's hardening (the body limit, the binary framing and request checks, the 4xx answers,
the gRPC server on one host) is in `transport.py`.

Imports nothing of Nitro beyond `nitro.bundle` and `paging` (which imports only `nitro.bundle`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nitro.serving import bundle as bundles
from nitro.serving.paging import Pager, WeightSet, device_memory, host_memory, parse_budget
from nitro.serving.transport import (
    BinaryDataPlane,
    HostGRPCServer,
    RequestGate,
    UntimedRESTServer,
    decode_inputs,
    kserve_imports,
    undecodable,
    wire_dtype,
    wire_spec,
)

with kserve_imports():
    import kserve
    from kserve.constants.constants import FASTAPI_APP_IMPORT_STRING
    from kserve.errors import InferenceError, InvalidInput, ModelNotFound
    from kserve.model_repository import ModelRepository
    from kserve.model_server import app as _kserve_app
    from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
    from kserve.utils.utils import generate_uuid

__all__ = ["Batcher", "BundleModel", "BundleRepository", "Programs", "Served", "Stats", "serve"]

log = logging.getLogger("nitro.serving.server")


@dataclass(frozen=True, eq=False)
class Served:
    """A bundle as served: its specs and (shared) program, and its weight set in the pager.
    A request holds the `Served` it started with: a reload swaps in a new one whole."""

    bundle: bundles.Bundle
    weights: WeightSet
    pager: Pager

    def __call__(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.pager.hold(self.weights) as placed:
            return self.bundle.run(placed, arrays)


class Programs(dict[str, bundles.Program]):
    """The compiled programs by key (`bundles.load` adds what it compiles), shared by the
    served bundles; a program that no served bundle uses any more is dropped."""

    def __init__(self):
        super().__init__()
        self.users: Counter[str] = Counter()
        self.lock = threading.Lock()

    def replace(self, old: bundles.Program | None, new: bundles.Program | None) -> None:
        """A model serves `new` instead of `old` (None: nothing, as at start or after a failed
        load); programs left unused, or compiled by a load that failed, are dropped."""
        with self.lock:
            if new is not None:
                self.users[new.key] += 1
                self.setdefault(new.key, new)
            if old is not None:
                self.users[old.key] -= 1
            for key in [k for k in self if self.users[k] <= 0]:
                del self[key]
                del self.users[key]


@dataclass
class _Waiting:
    """A checked request waiting for its batch, with the weights it started with."""

    served: Served
    arrays: dict[str, np.ndarray]
    rows: int
    answer: asyncio.Future
    arrived: float


@dataclass
class Stats:
    """What a model has served: rows (`inferences`), calls of its program (`executions`, fewer
    than rows when requests were batched together) and calls by padded width."""

    inferences: int = 0
    executions: int = 0
    last_ms: int = 0
    seconds: float = 0.0
    widths: Counter[int] = field(default_factory=Counter)

    def count(self, rows: int, width: int, seconds: float) -> None:
        self.inferences += rows
        self.executions += 1
        self.seconds += seconds
        self.widths[width] += 1
        self.last_ms = int(time.time() * 1000)

    def triton(self, name: str) -> dict[str, Any]:
        """As Triton's statistics extension answers `GET /v2/models/NAME/stats`."""
        total = {"count": self.executions, "ns": int(self.seconds * 1e9)}
        return {
            "model_stats": [
                {
                    "name": name,
                    "version": "1",
                    "last_inference": self.last_ms,
                    "inference_count": self.inferences,
                    "execution_count": self.executions,
                    "inference_stats": {"success": total, "compute_infer": total},
                    "batch_stats": [
                        {"batch_size": width, "compute_infer": {"count": n, "ns": 0}}
                        for width, n in sorted(self.widths.items())
                    ],
                }
            ]
        }


class Batcher:
    """Joins concurrent requests for one model into one call of at most `max_batch` rows.

    A request arriving while nothing else waits and no call runs is sent at once. Requests that
    arrive while a call runs wait for it and go together in the next; with `delay` > 0 s, a
    batch of several that is not yet full waits up to `delay` after its oldest request arrived
    for more (Triton's `max_queue_delay_microseconds`, which Triton applies to a lone request
    too). A batch holds requests of one `Served`, so a reload flushes the old weights'
    requests first and never mixes two weight sets in a call.
    """

    def __init__(self, name: str, max_batch: int, delay: float, stats: Stats):
        self.name, self.max_batch, self.delay, self.stats = name, max_batch, delay, stats
        self.waiting: deque[_Waiting] = deque()
        self.arrived = asyncio.Event()
        self.worker: asyncio.Task | None = None

    async def __call__(self, current: Served, arrays: dict[str, np.ndarray], rows: int):
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self.waiting.append(_Waiting(current, arrays, rows, answer, loop.time()))
        self.arrived.set()
        if self.worker is None or self.worker.done():
            self.worker = loop.create_task(self._drain())
        return await answer

    def _rows_waiting(self) -> int:
        return sum(w.rows for w in self.waiting)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self.waiting:
            await asyncio.sleep(0)  # requests already read join this batch
            if self.delay > 0 and len(self.waiting) > 1:
                deadline = self.waiting[0].arrived + self.delay
                while self._rows_waiting() < self.max_batch and loop.time() < deadline:
                    self.arrived.clear()
                    try:
                        await asyncio.wait_for(self.arrived.wait(), deadline - loop.time())
                    except TimeoutError:
                        break
            batch = [self.waiting.popleft()]
            rows = batch[0].rows
            while (
                self.waiting
                and self.waiting[0].served is batch[0].served
                and rows + self.waiting[0].rows <= self.max_batch
            ):
                rows += self.waiting[0].rows
                batch.append(self.waiting.popleft())
            await self._run(loop, batch, rows)

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Waiting], rows: int):
        current = batch[0].served
        width = current.bundle.width(rows, self.max_batch)
        start = time.perf_counter()
        try:
            arrays = {
                name: np.concatenate(
                    [w.arrays[name] for w in batch]
                    + [np.repeat(batch[-1].arrays[name][-1:], width - rows, axis=0)]
                )
                for name in batch[0].arrays
            }
            results = await loop.run_in_executor(None, current, arrays)
        except Exception as error:  # noqa: BLE001 - every request of the batch gets it
            for waiting in batch:
                if not waiting.answer.done():
                    waiting.answer.set_exception(_failure(self.name, error))
            return
        self.stats.count(rows, width, time.perf_counter() - start)
        first = 0
        for waiting in batch:
            if not waiting.answer.done():  # a client that went away leaves a cancelled answer
                part = {k: v[first : first + waiting.rows] for k, v in results.items()}
                waiting.answer.set_result(part)
            first += waiting.rows


def _failure(model: str, error: Exception) -> Exception:
    if isinstance(error, bundles.BundleError):
        return InvalidInput(str(error))
    return InferenceError(f"{model} failed: {type(error).__name__}: {error}")


def _hook_of(manifest: dict[str, Any]) -> dict[str, str] | None:
    """The served postprocess hook's fingerprint and source, or None without one."""
    hook = manifest.get("postprocess")
    return None if hook is None else {"sha256": hook["sha256"], "source": hook["source"]}


class BundleModel(kserve.Model):
    """One bundle directory served under the bundle's name; with `batching`, concurrent
    requests are joined into one call (`Batcher`), waiting at most `batch_delay` seconds.
    Models that share `programs` compile a program once; their weights are paged by `pager`."""

    def __init__(
        self,
        directory: str,
        *,
        max_batch: int = 1024,
        name: str | None = None,
        batching: bool = False,
        batch_delay: float = 0.0,
        pager: Pager | None = None,
        programs: Programs | None = None,
        trust_code: bool = False,
    ):
        self.directory = os.path.abspath(directory)
        self.trust_code = trust_code  # run a bundle's postprocess hook (nitro serve --trust-code)
        self.max_batch = max_batch
        self.pager = pager if pager is not None else Pager()
        self.programs = programs if programs is not None else Programs()
        self.program_loads = self.weight_swaps = 0
        self.served = self._load(name)
        self.programs.replace(None, self.served.bundle.program)
        super().__init__(name or self.served.bundle.name)
        self._reloading = threading.Lock()
        self.stats = Stats()
        self.batching, self.batch_delay = batching, batch_delay
        self.batcher = Batcher(self.name, max_batch, batch_delay, self.stats) if batching else None
        self.ready = True

    @property
    def bundle(self) -> bundles.Bundle:
        return self.served.bundle

    def _load(self, name: str | None) -> Served:
        """Read the directory; a program the server has not compiled is compiled for batch 1
        now, so a ready model answers its first request without compiling."""
        known = {id(p) for p in self.programs.values()}
        loaded = bundles.load(self.directory, programs=self.programs, trust_code=self.trust_code)
        compiled = id(loaded.program) not in known
        weights = WeightSet(name or loaded.name, loaded)
        try:
            self.pager.add(weights)  # refuses weights larger than a budget alone
            loaded.weights = {}  # the pager holds them from here on, within its budgets
            served = Served(loaded, weights, self.pager)
            if compiled:  # batch 1, or each of the bundle's batch sizes
                self.program_loads += 1
                for rows in loaded.batch_sizes or (1,):
                    served({s.name: np.zeros((rows, *s.shape[1:]), s.dtype) for s in loaded.inputs})
        except BaseException:
            self.pager.remove(weights)
            self.programs.replace(None, None)  # drops a program only this load compiled
            raise
        return served

    def load(self) -> bool:
        self.reload()
        return self.ready

    def reload(self) -> bundles.Bundle:
        """Read the directory again and serve the new bundle; on error keep the old one. With
        the program unchanged only the weights are replaced (nothing compiles)."""
        with self._reloading:
            old = self.served
            self.served = self._load(self.name)
            self.programs.replace(old.bundle.program, self.served.bundle.program)
            if self.served.bundle.program is old.bundle.program:
                self.weight_swaps += 1
            self.pager.remove(old.weights)  # calls holding the old weights still finish
            self.ready = True
            log.info("reloaded %s from %s", self.name, self.directory)
            return self.served.bundle

    def stop(self) -> None:
        """Unloaded (`POST /v2/repository/models/NAME/unload`): its weights leave the pager
        (calls holding them finish) and a program no other model serves is dropped."""
        with self._reloading:
            self.ready = False
            self.pager.remove(self.served.weights)
            self.programs.replace(self.served.bundle.program, None)

    def statistics(self) -> dict[str, Any]:
        """Triton's statistics for this model, with its weights' paging under `weights`."""
        answer = self.stats.triton(self.name)
        answer["model_stats"][0]["weights"] = self.served.weights.stats() | {
            "program": self.served.bundle.program.key,
            "program_loads": self.program_loads,
            "weight_swaps": self.weight_swaps,
        }
        answer["model_stats"][0]["bundle"] = {  # what `Nitro.publish` exports into
            "directory": self.directory,
            "inputs": self.bundle.manifest["inputs"],  # with their axes' names
            "outputs": self.bundle.manifest["outputs"],
            "postprocess": _hook_of(self.bundle.manifest),
            "platforms": self.bundle.manifest["program"]["platforms"],
            "echo": [spec.echo for spec in self.bundle.outputs if spec.echo is not None],
            "batch_sizes": list(self.bundle.batch_sizes),
        }
        answer["paging"] = self.pager.stats() | {"programs": len(self.programs)}
        return answer

    def get_input_types(self) -> list[dict[str, Any]]:
        return [wire_spec(s) for s in self.bundle.inputs]

    def get_output_types(self) -> list[dict[str, Any]]:
        return [wire_spec(s) for s in self.bundle.outputs]

    async def predict(self, payload: Any, headers: Any = None, response_headers: Any = None):
        if not isinstance(payload, InferRequest):
            raise InvalidInput(
                f"{self.name} speaks the Open Inference Protocol (V2): POST "
                f"/v2/models/{self.name}/infer with {{'inputs': [...]}}"
            )
        current = self.served  # a reload swaps self.served; this request keeps its own
        arrays, rows = decode_inputs(
            payload, current.bundle, model=self.name, max_batch=self.max_batch
        )
        pad = all(s.shape[:1] == (bundles.BATCH,) for s in current.bundle.outputs)
        with self.pager.request(current.weights):
            if self.batcher is not None and pad:  # checked above: a bad request fails alone
                results = await self.batcher(current, arrays, rows)
            else:
                results = await self._call(current, arrays, rows, pad)
        outputs = []
        binary = payload.use_binary_outputs
        for spec in current.bundle.outputs:
            value = np.asarray(results[spec.name][:rows] if pad else results[spec.name], order="C")
            output = InferOutput(spec.name, list(value.shape), wire_dtype(value.dtype.name))
            if payload.from_grpc:
                output.set_data_from_numpy(value, binary_data=binary)
            else:  # encoded once, as each requested output asks (binary or JSON)
                output.data = value
            outputs.append(output)
        return InferResponse(
            response_id=payload.id or generate_uuid(),
            model_name=self.name,
            infer_outputs=outputs,
            use_binary_outputs=binary,
            requested_outputs=payload.request_outputs,
        )

    async def _call(
        self, current: Served, arrays: dict[str, np.ndarray], rows: int, pad: bool
    ) -> dict[str, np.ndarray]:
        """One request as its own call, padded to its power of two."""
        width = current.bundle.width(rows, self.max_batch) if pad else rows
        if width > rows:
            arrays = {
                k: np.concatenate([v, np.repeat(v[-1:], width - rows, axis=0)])
                for k, v in arrays.items()
            }
        start = time.perf_counter()
        try:
            results = await asyncio.get_running_loop().run_in_executor(None, current, arrays)
        except Exception as error:  # noqa: BLE001 - BundleError a 400, the rest a 500
            raise _failure(self.name, error) from None
        self.stats.count(rows, width, time.perf_counter() - start)
        return results


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
        first = models[0] if models else None
        self.options: dict[str, Any] = (
            {"max_batch": first.max_batch, "batching": first.batching}
            | {"batch_delay": first.batch_delay, "pager": first.pager, "programs": first.programs}
            if first
            else {}
        )

    async def load(self, name: str) -> bool:  # pyright: ignore[reportIncompatibleMethodOverride]
        """Read the model's directory again, off the event loop: requests go on meanwhile."""
        model = self.get_model(name)
        loop = asyncio.get_running_loop()
        if model is None:
            if name not in self.directories:
                raise ModelNotFound(name)
            directory = self.directories[name]
            model = await loop.run_in_executor(
                None, lambda: BundleModel(directory, name=name, **self.options)
            )
            self.update(model)
            return model.ready
        return await loop.run_in_executor(None, model.load)

    def model_for(self, directory: str) -> BundleModel | None:
        for model in self.get_models().values():
            if isinstance(model, BundleModel) and model.directory == directory:
                return model
        return None


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
        self.dataplane = BinaryDataPlane(model_registry=repository)
        self.host = host
        self.max_request_bytes = max_request_bytes
        self.watch = watch

    def start(self, models: Sequence[BundleModel]) -> None:
        # a list of the base class, as kserve declares it (it only reads the list)
        self._register_and_check_atleast_one_model_is_ready(list(models))
        _kserve_app.add_middleware(RequestGate, limit=self.max_request_bytes)
        _kserve_app.add_api_route("/v2/models/{model_name}/stats", self.stats, methods=["GET"])
        for kind in (ValueError, KeyError, TypeError, IndexError, AttributeError):
            _kserve_app.add_exception_handler(kind, undecodable)
        self._rest_server = UntimedRESTServer(
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
            self._grpc_server = HostGRPCServer(
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

    async def stats(self, model_name: str) -> dict[str, Any]:
        model = self.repository.get_model(model_name)
        if not isinstance(model, BundleModel):
            raise ModelNotFound(model_name)
        return model.statistics()

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
        """Reload a bundle when it is exported again: an export swaps the whole directory in
        (seen in its parent), a copy writes its manifest in place (seen in the directory)."""
        from contextlib import aclosing

        from watchfiles import awatch

        models = {os.path.realpath(d): d for d in self.repository.directories.values()}
        parents = sorted({os.path.dirname(p) for p in models})
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            watched = [p for p in (*parents, *models) if os.path.isdir(p)]
            changes_seen = awatch(*watched, recursive=False, watch_filter=None, stop_event=stop)
            swapped = False
            async with aclosing(changes_seen) as batches:
                async for changes in batches:
                    changed = set()
                    for _, path in changes:
                        if path in models:  # the directory itself was replaced
                            changed.add(path)
                            swapped = True
                        elif os.path.basename(path) == bundles.MANIFEST:
                            changed.add(os.path.dirname(path))
                    for real in changed & set(models):
                        await self._reload(loop, models[real])
                    if swapped:  # watch the new directory, not the replaced one
                        break

    async def _reload(self, loop: asyncio.AbstractEventLoop, directory: str) -> None:
        model = self.repository.model_for(directory)
        if model is None:
            return
        try:
            await loop.run_in_executor(None, model.reload)
        except Exception as error:  # noqa: BLE001 - keep serving the bundle it had
            log.error("kept the previous %s: reloading %s failed: %s", model.name, directory, error)


def serve(
    directories: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    grpc_port: int | None = 8081,
    max_request_bytes: int = 16 << 20,
    max_batch: int = 1024,
    batching: bool = True,
    batch_delay_ms: float = 0.0,
    device_memory_budget: str | None = None,
    host_memory_budget: str | None = None,
    watch: bool = False,
    log_level: str = "info",
    trust_code: bool = False,
) -> None:
    """Serve the bundles in `directories` until interrupted (SIGINT or SIGTERM).

    With `batching`, concurrent requests for one model are joined into one call of at most
    `max_batch` rows; a batch of several that is not full waits up to `batch_delay_ms` for more.
    Bundles of one program compile it once; their weights move to the device on demand within
    `device_memory_budget` (bytes as '2GB' or a fraction as '0.5'; None: no limit) and are held
    on the host within `host_memory_budget`, least recently used out first. A bundle with a
    postprocess hook (Python recorded in the bundle) is served only with `trust_code`.

    >>> serve(["exports/digits"], port=8080, grpc_port=8081)   # doctest: +SKIP
    """
    if not directories:
        raise ValueError("name at least one bundle directory to serve")
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    if not 0 <= batch_delay_ms <= 60_000:
        raise ValueError(
            f"batch_delay_ms (nitro serve --batch-delay) must be 0 to 60000 milliseconds, "
            f"got {batch_delay_ms}"
        )
    pager = Pager(
        None
        if device_memory_budget is None
        else parse_budget(device_memory_budget, total=device_memory()),
        None
        if host_memory_budget is None
        else parse_budget(host_memory_budget, total=host_memory(), option="--host-memory"),
    )
    options = {
        "batching": batching,
        "batch_delay": batch_delay_ms / 1000,
        "pager": pager,
        "trust_code": trust_code,
    }
    programs = Programs()
    models = [
        BundleModel(d, max_batch=max_batch, programs=programs, **options) for d in directories
    ]
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
