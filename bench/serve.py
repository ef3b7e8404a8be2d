"""Serving throughput: `nitro serve` on loopback against calling the same bundle in-process.

Exports the digits MLP (64-256-256-10; `--model cnn`: the CNN of `--paging` below, whose call costs more),
starts `python -m nitro.serve` on free loopback ports, and drives it with Triton's clients
(`tritonclient`): `--clients` threads, each with its own client, send `--requests` requests in
all (after a short warm-up) for each protocol and batch size. Prints p50 and p99 latency,
requests/s, rows/s, the error count, the CPU time per request of the server process and of
this process (the clients), and the ratio of the served requests/s to calls/s of the loaded
bundle called in this process, one call at a time, on the same batches. Clients, server and
baseline share this machine's cores.

`--batching on,off` starts a server with the dynamic batching on and one with it off, both up
for the whole run, and measures each configuration on one then the other, so load from
elsewhere on the machine hits both alike; `--repeat 2` runs the whole list twice. The summary
gives served rows/s with batching on over off, the CPU per request and the rows served per CPU
second of server and clients together (what rows/s would be with cores of their own, which a
shared machine does not give); each row gives the rows per program call and the mean time of
a call as the server's event loop sees it (from its start to its result back on the loop),
from the server's statistics (`GET /v2/models/NAME/stats`).

`--paging M,K` measures paging instead: M bundles of one CNN (about 25 MB of weights each,
differently seeded), served with `--device-memory` room for K weight sets, gRPC clients sending
batch-1 requests over the models with Zipf(`--zipf`) popularity. Prints the swap-in p50 and
p99 from the server's statistics, request latency, hits and evictions, and the time of
`POST .../load` after a weight-only re-export against one that changes the program.

    python bench/serve.py [--clients 16] [--requests 2000] [--batches 1,32] [--protocols http,grpc]
    python bench/serve.py --batches 1 --batching on,off --repeat 2 [--model cnn]
    python bench/serve.py --paging 50,5 --clients 8 --requests 2000
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_digits(directory: str) -> None:
    import nitro
    from nitro.examples.digits import Digits

    nitro.Nitro(Digits(), seed=0, progress=False).export(directory, name="digits")


def export_cnns(root: str, count: int, scale: float = 1.0) -> list[str]:
    """`count` bundles of one CNN on 8x8 digits (conv 64, conv 128, dense 8192 -> 768 -> 10:
    about 6.3 M parameters, 25 MB), each from its own seed."""
    import optax
    from flax import nnx

    import nitro
    from nitro import Device

    class CNN(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.conv1 = nnx.Conv(1, 64, (3, 3), rngs=rngs)
            self.conv2 = nnx.Conv(64, 128, (3, 3), rngs=rngs)
            self.hidden = nnx.Linear(8 * 8 * 128, 768, rngs=rngs)
            self.out = nnx.Linear(768, 10, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.conv1(x.reshape(x.shape[0], 8, 8, 1)))
            x = nnx.relu(self.conv2(x))
            return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))

    @nitro.experiment
    class DigitsCNN:
        scale: Device[float] = 1.0

        def build_data(self):
            return nitro.datasets.digits(batch_size=64)

        def build_model(self, rngs: nnx.Rngs):
            return CNN(rngs=rngs)

        def forward(self, model, *, x):
            return model(x * self.scale)

        def loss(self, logits, *, y):
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    directories = []
    for index in range(count):
        directory = os.path.join(root, f"cnn{index:02d}")
        handle = nitro.Nitro(DigitsCNN(scale=scale), seed=index, progress=False)
        handle.export(directory, name=f"cnn{index:02d}")
        directories.append(directory)
    return directories


def paging(args) -> dict:
    """Zipf traffic over M CNN bundles with room for K on the device (see the docstring)."""
    import tritonclient.grpc as grpc_client
    import tritonclient.http as http_client

    import nitro.bundle

    models, resident = (int(v) for v in args.paging.split(","))
    with tempfile.TemporaryDirectory() as root:
        began = time.perf_counter()
        directories = export_cnns(root, models)
        size = nitro.bundle.load(directories[0]).weights_bytes
        print(f"exported {models} CNN bundles of {size / 1e6:.1f} MB weights in "
              f"{time.perf_counter() - began:.0f} s")  # fmt: skip
        budget = int(size * (resident + 0.5))
        log = open(os.path.join(root, "server.log"), "w")  # noqa: SIM115 - closed below
        try:
            process, port, grpc_port = start_server(
                directories, log, "--device-memory", str(budget)
            )
        except RuntimeError:
            log.close()
            print(open(os.path.join(root, "server.log")).read()[-3000:])
            raise
        try:
            ranks = np.arange(1, models + 1, dtype=np.float64)
            popularity = ranks**-args.zipf / (ranks**-args.zipf).sum()
            remaining, lock = [args.requests], threading.Lock()
            latencies: list[float] = []
            errors: list[str] = []

            def worker(index: int):
                rng = np.random.default_rng(index)
                client = grpc_client.InferenceServerClient(f"127.0.0.1:{grpc_port}")
                x = rng.normal(size=(1, 64)).astype(np.float32)
                tensor = grpc_client.InferInput("x", [1, 64], "FP32")
                tensor.set_data_from_numpy(x)
                mine = []
                while True:
                    with lock:
                        if remaining[0] == 0:
                            break
                        remaining[0] -= 1
                    name = f"cnn{int(rng.choice(models, p=popularity)):02d}"
                    start = time.perf_counter()
                    try:
                        client.infer(name, [tensor])
                        mine.append(time.perf_counter() - start)
                    except Exception as error:  # noqa: BLE001 - counted and reported
                        errors.append(f"{type(error).__name__}: {error}")
                with lock:
                    latencies.extend(mine)

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.clients)]
            start = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            seconds = time.perf_counter() - start
            http = http_client.InferenceServerClient(f"127.0.0.1:{port}")
            stats = [http.get_inference_statistics(f"cnn{i:02d}") for i in range(models)]
            weights = [s["model_stats"][0]["weights"] for s in stats]
            pager = stats[0]["paging"]
            q = statistics.quantiles(latencies, n=100)
            hits, misses = sum(w["hits"] for w in weights), sum(w["misses"] for w in weights)
            print(
                f"{args.requests} batch-1 gRPC requests from {args.clients} clients, Zipf("
                f"{args.zipf}) over {models} models, device room for {resident} "
                f"({budget / 1e6:.0f} MB): {len(latencies) / seconds:.0f} requests/s, "
                f"{len(errors)} errors"
            )
            print(
                f"  swap-in: p50 {pager['swap_in_ms']['p50']} ms, p99 {pager['swap_in_ms']['p99']}"
                f" ms over {pager['swap_in_ms']['count']} uploads; hits {hits}, misses {misses}, "
                f"evictions {sum(w['evictions'] for w in weights)}; programs "
                f"{pager['programs']}"
            )
            print(f"  request latency: p50 {1e3 * q[49]:.1f} ms, p99 {1e3 * q[98]:.1f} ms")
            if errors:
                print(f"  first error: {errors[0]}")
            # a weight-only re-export against one that changes the program (a Device value)
            reload_seconds = {}
            for kind, scale in (("weight-only", 1.0), ("program change", 2.0)):
                export_cnns(os.path.join(root, kind), 1, scale=scale)
                shutil.rmtree(directories[0])
                shutil.copytree(os.path.join(root, kind, "cnn00"), directories[0])
                start = time.perf_counter()
                http.load_model("cnn00")
                reload_seconds[kind] = time.perf_counter() - start
            print(
                f"  reload of cnn00: weight-only {1e3 * reload_seconds['weight-only']:.0f} ms, "
                f"program change {1e3 * reload_seconds['program change']:.0f} ms"
            )
        finally:
            stop_server(process)
            log.close()
    return {"swap_in_ms": pager["swap_in_ms"], "errors": len(errors), "reload_s": reload_seconds}


def start_server(directory: str | list[str], log, *extra: str) -> tuple[subprocess.Popen, int, int]:
    import tritonclient.http as http_client

    port, grpc_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nitro.serve",
            *([directory] if isinstance(directory, str) else directory),
        ]
        + ["--port", str(port)]
        + ["--grpc-port", str(grpc_port), "--log-level", "error", *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = http_client.InferenceServerClient(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise RuntimeError("the server exited; see its log")
        try:
            if client.is_server_ready():
                return process, port, grpc_port
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not become ready in 120 s")
        time.sleep(0.1)


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()


def make_caller(protocol: str, port: int, grpc_port: int, x: np.ndarray, model: str):
    """A function sending one request with `x`, for one thread."""
    if protocol == "http":
        import tritonclient.http as module

        client = module.InferenceServerClient(f"127.0.0.1:{port}")
    else:
        import tritonclient.grpc as module

        client = module.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    tensor = module.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    wanted = [module.InferRequestedOutput("output")]

    def call():
        result = client.infer(model, [tensor], outputs=wanted)
        assert result is not None  # an answer or an exception
        return result.as_numpy("output")

    return call


def load(protocol, port, grpc_port, x, clients: int, requests: int, max_seconds: float, model: str):
    """Latencies (s), errors and wall time of `requests` requests from `clients` threads."""
    remaining = [requests]
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.monotonic() + max_seconds

    def worker():
        call = make_caller(protocol, port, grpc_port, x, model)
        for _ in range(3):  # warm up this client's connection
            call()
        mine = []
        while time.monotonic() < deadline:
            with lock:  # one counter shared by all threads bounds the total
                if remaining[0] == 0:
                    break
                remaining[0] -= 1
            start = time.perf_counter()
            try:
                call()
                mine.append(time.perf_counter() - start)
            except Exception as error:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(error).__name__}: {error}")
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, errors, time.perf_counter() - start


def in_process_rate(bundle, x: np.ndarray, seconds: float = 2.0) -> float:
    for _ in range(20):
        bundle(x=x)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        bundle(x=x)
        calls += 1
    return calls / (time.perf_counter() - start)


def statistics_of(port: int, model: str) -> tuple[int, int, int]:
    """Rows served, program calls and their nanoseconds (from the call's start to its result
    reaching the server's event loop), from the server's statistics."""
    import tritonclient.http as http_client

    stats = http_client.InferenceServerClient(f"127.0.0.1:{port}").get_inference_statistics(model)[
        "model_stats"
    ][0]
    ns = stats["inference_stats"]["compute_infer"]["ns"]
    return stats["inference_count"], stats["execution_count"], ns


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--batching", default="on", help="on, off or on,off")
    parser.add_argument(
        "--model", default="digits", choices=("digits", "cnn"), help="the served bundle"
    )
    parser.add_argument("--batch-delay", default="0", help="ms, passed to nitro serve")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the whole list")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="per configuration")
    parser.add_argument("--paging", help="M,K: M bundles of one CNN, room for K (see above)")
    parser.add_argument("--zipf", type=float, default=1.1, help="popularity exponent, --paging")
    args = parser.parse_args(argv)
    if args.paging:
        return [paging(args)]

    import nitro.bundle

    rows = []
    batches = [int(b) for b in args.batches.split(",")]
    protocols, batchings = args.protocols.split(","), args.batching.split(",")
    with tempfile.TemporaryDirectory() as root:
        if args.model == "cnn":
            directory, model = export_cnns(root, 1)[0], "cnn00"
        else:
            directory, model = os.path.join(root, "digits"), "digits"
            export_digits(directory)
        bundle = nitro.bundle.load(directory)
        inputs = {
            b: np.random.default_rng(b).normal(size=(b, 64)).astype(np.float32) for b in batches
        }
        baselines = {b: in_process_rate(bundle, x) for b, x in inputs.items()}
        print(
            f"{model} bundle, {args.clients} clients, {args.requests} requests per row, "
            f"loopback, {os.cpu_count()} cores shared by clients and server"
        )
        print(
            f"{'batching':>8} {'protocol':>8} {'batch':>5} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'req/s':>7} {'rows/s':>8} {'errors':>6} {'rows/call':>9} {'call ms':>7} {'server us':>9} "
            f"{'client us':>9} {'in-process calls/s':>18} {'served/in-process':>17}"
        )
        log = open(os.path.join(root, "server.log"), "a")  # noqa: SIM115 - closed below
        servers = {}
        try:
            for batching in batchings:  # up at once: the runs alternate, so drift hits both
                flags = ["--batching" if batching == "on" else "--no-batching"]
                servers[batching] = start_server(
                    directory, log, *flags, "--batch-delay", args.batch_delay
                )
            for _ in range(args.repeat):
                for batch in batches:
                    for protocol in protocols:
                        for batching in batchings:
                            process, port, grpc_port = servers[batching]
                            before = statistics_of(port, model)
                            row = measure(
                                args, protocol, process, port, grpc_port, inputs[batch], model
                            )
                            after = statistics_of(port, model)
                            served, calls, ns = (a - b for a, b in zip(after, before, strict=True))
                            row |= {"batching": batching, "batch": batch}
                            row["rows_per_call"] = served / max(calls, 1)
                            row["call_ms"] = ns / 1e6 / max(calls, 1)
                            row["in_process_calls_per_s"] = baselines[batch]
                            row["ratio"] = row["requests_per_s"] / baselines[batch]
                            rows.append(row)
                            print(
                                f"{batching:>8} {protocol:>8} {batch:>5} "
                                f"{row['p50_ms']:7.2f} {row['p99_ms']:7.2f} "
                                f"{row['requests_per_s']:7.0f} "
                                f"{row['requests_per_s'] * batch:8.0f} {row['errors']:>6} "
                                f"{row['rows_per_call']:9.1f} {row['call_ms']:7.2f} "
                                f"{row['server_us']:9.0f} "
                                f"{row['client_us']:9.0f} {baselines[batch]:18.0f} "
                                f"{row['ratio']:17.3f}"
                            )
                            for line in row.pop("notes"):
                                print(f"         {line}")
        finally:
            for process, _, _ in servers.values():
                stop_server(process)
            log.close()
        if "on" in batchings and "off" in batchings:
            print(
                "batching on / off (mean over repeats): served rows/s; CPU per request of the "
                "server and the clients; rows per CPU second of both (what rows/s would be on "
                "cores of their own)"
            )
            for batch in batches:
                for protocol in protocols:
                    mean = {
                        (b, key): statistics.mean(
                            r[key]
                            for r in rows
                            if (r["batching"], r["protocol"], r["batch"]) == (b, protocol, batch)
                        )
                        for b in ("on", "off")
                        for key in ("requests_per_s", "server_us", "client_us")
                    }
                    on, off = mean["on", "requests_per_s"], mean["off", "requests_per_s"]
                    per_cpu = {
                        b: 1e6 * batch / (mean[b, "server_us"] + mean[b, "client_us"])
                        for b in ("on", "off")
                    }
                    print(
                        f"  {protocol} batch {batch}: {on * batch:.0f} / {off * batch:.0f} = "
                        f"{on / off:.2f}x; server {mean['on', 'server_us']:.0f} / "
                        f"{mean['off', 'server_us']:.0f} us, clients "
                        f"{mean['on', 'client_us']:.0f} / {mean['off', 'client_us']:.0f} us; "
                        f"{per_cpu['on']:.0f} / {per_cpu['off']:.0f} rows per CPU second = "
                        f"{per_cpu['on'] / per_cpu['off']:.2f}x"
                    )
    return rows


def measure(args, protocol: str, process, port: int, grpc_port: int, x, model: str) -> dict:
    """One load; with the CPU seconds per request of the server and of this process (the
    clients), which share the machine's cores."""
    import psutil

    server = psutil.Process(process.pid)
    server_before, clients_before = sum(server.cpu_times()[:2]), sum(os.times()[:2])
    latencies, errors, seconds = load(
        protocol, port, grpc_port, x, args.clients, args.requests, args.max_seconds, model
    )
    sent = len(latencies) + len(errors) + 3 * args.clients  # and each client's warm-up
    server_us = 1e6 * (sum(server.cpu_times()[:2]) - server_before) / sent
    client_us = 1e6 * (sum(os.times()[:2]) - clients_before) / sent
    done = len(latencies)
    q = statistics.quantiles(latencies, n=100) if done > 1 else [0.0] * 99
    notes = [f"first error: {errors[0]}"] if errors else []
    if done + len(errors) < args.requests:
        notes.append(f"stopped after {args.max_seconds:.0f} s: {done} done")
    return {
        "protocol": protocol,
        "p50_ms": 1e3 * q[49],
        "p99_ms": 1e3 * q[98],
        "requests_per_s": done / seconds,
        "errors": len(errors),
        "completed": done,
        "server_us": server_us,
        "client_us": client_us,
        "notes": notes,
    }


if __name__ == "__main__":
    main()
