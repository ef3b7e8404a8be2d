"""What a live edit costs the run it lands in, with the defaults users run.

An experiment module is written to a temporary directory: a deep MLP (`--depth` Linear
layers of 128, unrolled, so its train step takes more than a second to compile) on digits
batches of 64. A handle trains it in the background with every default (checkpoints, the
JSONL logger, steps per call "auto"). Then, `--edits` times, the module's file is saved with
a new `loss` (a scale that alternates), reloaded, and `n.apply_edits()` compiles it beside the
run; the loop swaps it in at its next call. Each step's read-back is timed by a reporter.

Per edit it prints:

- compile: the seconds the new train step took to compile beside the run (the goal asks for
  at least 1 s, so the pause is not hidden by a short compile);
- pause: the longest interval between two calls around the swap (3 calls either side) minus
  the median interval between calls after it (the run's steady pace on the new code);
- swap: the time the loop spent in the swap itself (`pause_seconds` of the swap's record);
- save -> training: from the moment the file is saved to the swap (the first call on the new
  code), minus the compile: the reload, the checks, the hand-over and the wait for the next
  call boundary.

Then the medians over the edits. Steps of a fused call are read back together, so intervals
are taken between calls (gaps over 0.1 ms between consecutive step read-backs).

With `--notebook`, the run trains in a real IPython kernel (`%nitro train exp --background`)
and nothing but the file's save starts an edit: the notebook's watcher sees it, reloads the
module and swaps the edit in. It prints the compile and save -> training for each edit (the
kernel's swap record has the swap's time; the pause is the same engine's as above).

    python bench/live_edit.py [--depth 24] [--edits 5] [--notebook]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nitro
from nitro.core.progress import SilentReporter

MODULE = """
import optax
from flax import nnx

import nitro
from nitro.data import ArrayLoader
from nitro.datasets import digits_arrays

ARRAYS = digits_arrays()
DEPTH = {depth}


class Deep(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(64, 128, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(128, 128, rngs=rngs) for _ in range(DEPTH)])
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.first(x))
        for layer in self.layers:
            x = x + 0.1 * nnx.relu(layer(x))
        return self.out(x)


@nitro.experiment
class LiveBench:
    max_epochs: int = 100_000

    def build_data(self):
        return {{
            "train": ArrayLoader(ARRAYS["train"], 64),
            "val": ArrayLoader(ARRAYS["val"], 128, shuffle=False),
        }}

    def build_model(self, rngs):
        return Deep(rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, outputs, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(outputs, y).mean() * 1.0
"""

GAP = 1e-4  # seconds: step read-backs closer than this belong to one fused call


class Clock(SilentReporter):
    """The time each step was read back."""

    def __init__(self):
        self.times: dict[int, float] = {}

    def step(self, step, loss):
        self.times[step] = time.perf_counter()


def call_times(clock: Clock) -> list[tuple[int, float]]:
    """(last step, time) of each call: consecutive read-backs closer than GAP are one call."""
    calls: list[tuple[int, float]] = []
    for step in sorted(clock.times):
        at = clock.times[step]
        if calls and at - calls[-1][1] < GAP:
            calls[-1] = (step, at)
        else:
            calls.append((step, at))
    return calls


def measure(clock: Clock, swap_step: int, after: int) -> tuple[float, float]:
    """(the longest interval between calls around the swap, the median one after it)."""
    calls = call_times(clock)
    index = next(i for i, (step, _) in enumerate(calls) if step > swap_step)
    around = [calls[i][1] - calls[i - 1][1] for i in range(max(1, index - 3), index + 4)]
    steady = [
        calls[i][1] - calls[i - 1][1]
        for i in range(index + 4, len(calls))
        if calls[i][0] <= swap_step + after
    ]
    return max(around), statistics.median(steady)


def save_edit(path: Path, text: str, current: str, i: int) -> tuple[str, str, float]:
    """Save edit `i` of the loss's scale: (the new text, its scale, when it was saved)."""
    new = f"* {1.0 + 0.25 * (i + 1)}"
    text = text.replace(current, new)
    saved = time.time()
    path.write_text(text)
    return text, new, saved


def in_a_kernel(args) -> None:
    """The notebook path: a real kernel trains; the bench only saves the file."""
    import json
    import os

    import jupyter_client

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "live_bench_module.py"
        text = MODULE.format(depth=args.depth)
        path.write_text(text)
        repo = str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
        }
        manager = jupyter_client.KernelManager(kernel_name="python3")
        manager.start_kernel(cwd=directory, env=env)
        client = manager.client()
        client.start_channels()
        client.wait_for_ready(timeout=120)

        def run(code: str) -> None:
            client.execute_interactive(code, timeout=600, output_hook=lambda message: None)

        def value(expression: str):
            reply = client.execute(
                "", silent=True, store_history=False, user_expressions={"v": expression}
            )
            answer = client.get_shell_msg(timeout=60)
            while answer["parent_header"].get("msg_id") != reply:
                answer = client.get_shell_msg(timeout=60)
            result = answer["content"]["user_expressions"]["v"]
            if result["status"] != "ok":
                raise SystemExit(f"{expression}: {result['evalue']}")
            return json.loads(eval(result["data"]["text/plain"]))  # a repr of a JSON string

        try:
            run(
                f"%load_ext nitro\nimport json, sys\nsys.path.insert(0, {directory!r})\n"
                "import live_bench_module\nexp = live_bench_module.LiveBench()\n"
                f"%nitro train exp --background"
            )
            while not value("json.dumps(exp_run.step >= 200 and not exp_run.dispatch.probing)"):
                time.sleep(0.1)
            print(f"in a kernel: deep MLP, {args.depth} layers; the watcher applies each save")
            print(f"{'edit':>4} {'compile s':>10} {'swap ms':>8} {'save->train ms':>15}")
            current, overheads = "* 1.0", []
            for i in range(args.edits):
                text, current, saved = save_edit(path, text, current, i)
                while value("json.dumps(len(exp_run.state.swaps))") < i + 1:
                    time.sleep(0.02)
                row = value("json.dumps(exp_run.state.swaps[-1])")
                if row["status"] != "swapped":
                    raise SystemExit(f"edit {i + 1}: {row}")
                overhead = row["at"] - saved - row["compile_seconds"]
                overheads.append(overhead)
                print(
                    f"{i + 1:>4} {row['compile_seconds']:>10.2f} {row['pause_seconds'] * 1e3:>8.1f} "
                    f"{overhead * 1e3:>15.1f}"
                )
            print(
                f"median: save -> new code training = compile + "
                f"{statistics.median(overheads) * 1e3:.1f} ms (goal < 100)"
            )
            run("exp_run.stop().wait()")
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--edits", type=int, default=5)
    parser.add_argument("--after", type=int, default=300, help="steps timed after each swap")
    parser.add_argument("--notebook", action="store_true", help="train in a real kernel")
    args = parser.parse_args()
    if args.notebook:
        in_a_kernel(args)
        return

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "live_bench_module.py"
        text = MODULE.format(depth=args.depth)
        path.write_text(text)
        sys.path.insert(0, directory)
        module = importlib.import_module("live_bench_module")
        clock = Clock()
        n = nitro.Nitro(
            module.LiveBench(), max_epochs=100_000, run_dir=f"{directory}/run", progress=clock
        )
        n.train(background=True)
        while n.step < 200 or n.dispatch.probing:  # compiled, and "auto" has decided
            time.sleep(0.05)
        print(
            f"deep MLP, {args.depth} layers of 128, batch 64; steps per call: "
            f"{n.dispatch.steps} (auto), checkpoints and JSONL logging on"
        )
        print(
            f"{'edit':>4} {'compile s':>10} {'pause ms':>9} {'swap ms':>8} {'call ms':>8} "
            f"{'save->train ms':>15}"
        )
        pauses, overheads, compiles = [], [], []
        current = "* 1.0"
        for i in range(args.edits):
            text, current, saved = save_edit(path, text, current, i)
            importlib.invalidate_caches()
            importlib.reload(module)
            edit = n.apply_edits().wait(600)
            if edit.status != "swapped" or edit.record is None:
                raise SystemExit(f"edit {i + 1}: {edit}")
            record = edit.record
            while n.step < record["step"] + args.after:
                time.sleep(0.01)
            longest, median = measure(clock, record["step"], args.after)
            pause = longest - median
            overhead = record["at"] - saved - record["compile_seconds"]
            pauses.append(pause)
            overheads.append(overhead)
            compiles.append(record["compile_seconds"])
            print(
                f"{i + 1:>4} {record['compile_seconds']:>10.2f} {pause * 1e3:>9.1f} "
                f"{record['pause_seconds'] * 1e3:>8.1f} {median * 1e3:>8.2f} "
                f"{overhead * 1e3:>15.1f}"
            )
        n.stop().wait()
        print(
            f"median: compile {statistics.median(compiles):.2f} s, pause at the swap "
            f"{statistics.median(pauses) * 1e3:.1f} ms (goal < 50), save -> new code training "
            f"= compile + {statistics.median(overheads) * 1e3:.1f} ms (goal < 100)"
        )


if __name__ == "__main__":
    main()
