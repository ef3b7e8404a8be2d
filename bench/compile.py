"""Compile control: what a new process, a big dataset and a host-side edit cost.

Prints, in one run, each against a baseline measured in the same run:

(a) time to first step in a fresh process, cold versus with the persistent compilation cache
    warmed by an earlier process (both spawned with NITRO_COMPILATION_CACHE pointing to a new
    temporary directory). Goal: warm <= 0.3 x cold.
(b) compile time of the train step for an experiment holding a 500 MB numpy array in a Host
    field versus the same experiment without it. Goal: ratio within 1.1.
(c) time from an edit of a host hook (`build_data`, by re-running the cell that defines the
    experiment) to the first step of `Nitro(new, weights=old)`, beyond the data set-up.
    Goal: no compile (cache misses do not grow) and under 0.2 s beyond data set-up.

The digits MLP (64-256-256-10, batch 128) is the experiment throughout. "First step" is the
moment its loss is read back; the run is stopped there.

    python bench/compile.py [--repeats 3] [--pairs 5] [--blob-mb 500]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CELL = """
import time
import optax
import nitro
from nitro.examples.digits import MLP

@nitro.experiment
class {name}:
    blob: object = None
    max_epochs: int = 1

    def build_data(self):
        began = time.perf_counter()
        {build_data}
        splits = nitro.datasets.digits(batch_size=128)
        DATA_SECONDS.append(time.perf_counter() - began)
        return splits

    def build_model(self, rngs):
        return MLP(64, 256, 10, rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def metrics(self, logits, *, y):
        return {{"acc": (logits.argmax(-1) == y).mean()}}
"""


class Cell:
    """Runs the cell that defines an experiment class in one namespace, as a notebook does."""

    def __init__(self):
        self.namespace = {"__name__": "__main__", "DATA_SECONDS": []}

    def run(self, name: str = "Digits", build_data: str = "pass"):
        source = CELL.format(name=name, build_data=build_data)
        exec(compile(source, f"<cell {name}>", "exec"), self.namespace)
        return self.namespace[name]

    @property
    def data_seconds(self) -> float:
        return self.namespace["DATA_SECONDS"][-1]


def first_step_reporter(nitro):
    """A progress reporter that notes when the first step's loss is read back, then stops.
    (Built on demand: this script imports nitro only where it times the import.)"""

    class FirstStep(nitro.progress.SilentReporter):
        def __init__(self):
            self.at = None
            self.handle = None

        def start_run(self, handle, epochs):
            self.handle = handle

        def step(self, step, loss):
            if self.at is None:
                self.at = time.perf_counter()
                self.handle.stop()

    return FirstStep()


def train_to_first_step(nitro, experiment, **keywords) -> tuple[object, float, float]:
    """(handle, seconds to build it, seconds from train() to the first step's loss)."""
    reporter = first_step_reporter(nitro)
    began = time.perf_counter()
    handle = nitro.Nitro(experiment, progress=reporter, **keywords)
    built = time.perf_counter()
    handle.train()
    return handle, built - began, reporter.at - built


# ---------------------------------------------------------------------------------------------
# (a) a fresh process, cold and warm


def child() -> None:
    """Spawned by (a): set up, train to the first step, print timings as JSON."""
    began = time.perf_counter()
    import nitro

    imported = time.perf_counter()
    _, setup, first = train_to_first_step(nitro, Cell().run()())
    compiles = nitro.cache_stats().compiles
    print(
        json.dumps(
            {
                "import": imported - began,
                "setup": setup,
                "first_step": first,
                "compile": sum(r.seconds for r in compiles),
                "compiles": len(compiles),
                "process": time.perf_counter() - began,
            }
        )
    )


def spawn(cache_dir: str) -> dict:
    env = dict(os.environ, NITRO_COMPILATION_CACHE=cache_dir)
    out = subprocess.run(
        [sys.executable, __file__, "--child"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_persistent_cache(repeats: int) -> float:
    print("\n(a) time to first step in a new process, cold vs warm persistent compilation cache")
    print(
        f"  {'process':<12} {'import':>8} {'setup':>8} {'compile':>8} {'1st step':>9} {'total':>8}"
    )
    cold, warm = [], []
    for r in range(repeats):
        with tempfile.TemporaryDirectory(prefix="nitro-bench-cache-") as cache_dir:
            for label, runs in (("cold", cold), ("warm", warm)):
                t = spawn(cache_dir)
                runs.append(t)
                print(
                    f"  {label} #{r + 1:<6} {t['import']:>7.2f}s {t['setup']:>7.2f}s "
                    f"{t['compile']:>7.3f}s {t['first_step']:>8.3f}s {t['process']:>7.2f}s"
                )
    ratio = statistics.median(
        w["first_step"] / c["first_step"] for c, w in zip(cold, warm, strict=True)
    )
    compile_ratio = statistics.median(
        w["compile"] / c["compile"] for c, w in zip(cold, warm, strict=True)
    )
    process_ratio = statistics.median(
        w["process"] / c["process"] for c, w in zip(cold, warm, strict=True)
    )
    print(
        f"  median time to first step: cold {statistics.median(c['first_step'] for c in cold):.3f}"
        f" s, warm {statistics.median(w['first_step'] for w in warm):.3f} s"
    )
    print(
        f"  ratio warm / cold: first step {ratio:.2f} (goal <= 0.3), compile {compile_ratio:.2f}, "
        f"whole process {process_ratio:.2f}"
    )
    return ratio


# ---------------------------------------------------------------------------------------------
# (b) a 500 MB Host field


def bench_host_blob(pairs: int, blob_mb: int) -> float:
    import numpy as np

    import nitro

    print(f"\n(b) train-step compile time with and without a {blob_mb} MB array in a Host field")
    blob = np.ones(blob_mb * 2**20 // 4, dtype=np.float32)
    cell = Cell()
    train_to_first_step(nitro, cell.run(name="BlobWarmUp")())  # the process's first compile
    rows = {"without": [], "with": []}
    print(f"  {'experiment':<22} {'setup':>8} {'compile':>8} {'1st step':>9}")
    for r in range(pairs):
        for label in ("without", "with") if r % 2 == 0 else ("with", "without"):
            # a new class each time, so the program cache misses and compiles for real
            cls = cell.run(name=f"Blob{label.title()}{r}")
            experiment = cls(blob=blob if label == "with" else None)
            _, setup, first = train_to_first_step(nitro, experiment)
            compiled = nitro.explain_compiles()[-1]
            assert compiled.owner.endswith(cls.__name__), compiled
            rows[label].append(compiled.seconds)
            print(
                f"  {label + ' array #' + str(r + 1):<22} {setup:>7.2f}s "
                f"{compiled.seconds:>7.3f}s {first:>8.3f}s"
            )
    # compile times drift with the machine's load: compare each pair, run back to back
    ratio = statistics.median(w / wo for w, wo in zip(rows["with"], rows["without"], strict=True))
    print(
        f"  median compile: without {statistics.median(rows['without']):.3f} s, with "
        f"{statistics.median(rows['with']):.3f} s; median of the paired ratios with / without "
        f"{ratio:.2f} (goal within 1.1)"
    )
    return ratio


# ---------------------------------------------------------------------------------------------
# (c) an edit of build_data


def bench_host_edit(repeats: int) -> float:
    import nitro

    print("\n(c) edit build_data (re-run the cell), then Nitro(new, weights=old) to its first step")
    cell = Cell()
    old, _, _ = train_to_first_step(nitro, cell.run()())
    beyond, misses = [], []
    print(
        f"  {'edit':<8} {'re-run':>8} {'setup':>8} {'data':>8} {'1st step':>9} {'beyond':>8}  new"
    )
    for r in range(repeats):
        before = nitro.cache_stats().misses
        began = time.perf_counter()
        cls = cell.run(build_data=f"edits = {r + 1}")  # the edited host hook
        rerun = time.perf_counter() - began
        new, setup, first = train_to_first_step(nitro, cls(), weights=old)
        total = time.perf_counter() - began
        data = cell.data_seconds
        misses.append(nitro.cache_stats().misses - before)
        beyond.append(total - data)
        print(
            f"  #{r + 1:<7} {rerun:>7.3f}s {setup:>7.3f}s {data:>7.3f}s {first:>8.3f}s "
            f"{total - data:>7.3f}s  {misses[-1]} compiles"
        )
        old = new
    result = statistics.median(beyond)
    print(
        f"  median from the edit to the first step, beyond data set-up: {result:.3f} s (goal "
        f"< 0.2 s); new compiles per edit: {max(misses)} (goal 0)"
    )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blob-mb", type=int, default=500)
    parser.add_argument("--pairs", type=int, default=5, help="with/without pairs in (b)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child()
        return
    # This process measures in-process compiles ((b) and (c)): keep JAX's persistent cache out
    # of it, so every compile is a real one. The processes spawned for (a) get their own.
    os.environ["NITRO_COMPILATION_CACHE"] = "off"
    import jax

    print("bench/compile.py: compile control on the digits MLP")
    print(
        f"  jax {jax.__version__} ({jax.devices()[0].platform}), python "
        f"{sys.version.split()[0]}, {os.cpu_count()} cpus, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    a = bench_persistent_cache(args.repeats)
    b = bench_host_blob(args.pairs, args.blob_mb)
    c = bench_host_edit(args.repeats)
    print("\nsummary:")
    print(f"  (a) warm / cold time to first step in a new process: {a:.2f} (goal <= 0.3)")
    print(f"  (b) compile with / without a {args.blob_mb} MB Host array: {b:.2f} (goal within 1.1)")
    print(
        f"  (c) host-hook edit to first step, beyond data set-up: {c:.3f} s (goal < 0.2 s, 0 compiles)"
    )


if __name__ == "__main__":
    main()
