"""What going back costs: snapshots while training, a rewind, a fork and its first step.

For the digits MLP (64-256-256-10) and the CNN of bench/overhead.py, batch 128, in one process,
alternating rounds, medians of steps/s:

- a hand-written per-step `jax.jit` loop (params and optimizer state donated, numpy batches,
  the epoch's losses read back once per epoch), as bench/dispatch.py's;
- Nitro with `snapshots=False` (none kept), with the default (`snapshots=True`: "auto", as
  often as 1% of training time allows, at most one a second) and with a snapshot at every
  call boundary (`nitro.Snapshots(every=1)`, the most there can be);

each Nitro handle lean (no logger, no checkpointer, no validation), "auto" steps per call.
The default's cost is the time its snapshots took (the loop's part and the copies') as a share
of its training time, and its steps/s against `snapshots=False`'s (goal: at most 3%; on a
shared machine the second moves by a few percent from round to round either way).

Then, on the CNN: `n.rewind(step)` to a snapshot in memory (goal: under 50 ms), and
`n.fork(step)` plus the fork's first step, `fork.train(steps=1)`, against one `train(steps=1)`
of a warm handle (goal: under that plus 50 ms when nothing changes the program).

    python bench/time_travel.py [--rounds 7] [--seconds 1.0] [--models mlp,cnn]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
from loops import MLP, HandWritten, ModelSpec, WithNitro  # noqa: E402
from overhead import CNN, train_arrays  # noqa: E402

import nitro  # noqa: E402

MODELS = {
    "mlp": ModelSpec(
        "mlp", lambda rngs: MLP((64, 256, 256, 10), rngs=rngs), 128, "MLP 64-256-256-10"
    ),
    "cnn": ModelSpec("cnn", lambda rngs: CNN(rngs=rngs), 128, "the CNN of bench/overhead.py"),
}
CONTENDERS = {
    "snapshots=False": False,
    "default (auto)": True,
    "every call": nitro.Snapshots(every=1),
}


def cadence(name: str, rounds: int, seconds: float, tile: int) -> float:
    """Prints each loop's steps/s and ratios; returns the default's cost (a fraction)."""
    spec, arrays = MODELS[name], train_arrays(tile)
    loops = {"hand-written": HandWritten(spec, arrays)}
    loops.update({key: WithNitro(spec, arrays, snapshots=v) for key, v in CONTENDERS.items()})
    for loop in loops.values():  # compile; "auto" decides its steps per call
        loop.run(3)
    steps, elapsed = loops["hand-written"].run(1)
    epochs = max(1, round(seconds * steps / elapsed / loops["hand-written"].batches))
    print(f"\n{name}: {spec.description}, batch {spec.batch}; {epochs} epochs a loop a round")
    rates: dict[str, list[float]] = {key: [] for key in loops}
    trained = {key: 0.0 for key in loops}
    ring = loops["default (auto)"].handle.runtime.snapshots
    before = ring.seconds
    for r in range(rounds):
        for key in list(loops) if r % 2 == 0 else list(reversed(loops)):
            done, wall = loops[key].run(epochs)
            rates[key].append(done / wall)
            trained[key] += wall
    base = rates["snapshots=False"]
    for key, values in rates.items():
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"  {key:<18} {statistics.median(values):>9.0f} steps/s  {ratio:>6.3f}x")
    default = statistics.median(v / b for v, b in zip(rates["default (auto)"], base, strict=True))
    share = (ring.seconds - before) / trained["default (auto)"]
    print(
        f"  the default's snapshots took {share:.2%} of its training time (their loop and copy "
        f"time); its steps/s {1 - default:+.1%} under snapshots=False's (noise included)"
    )
    return share


def going_back(rounds: int, tile: int) -> tuple[float, float, float]:
    """Median seconds of a rewind to a snapshot in memory, of a fork plus its first step, and
    of one step of a warm handle (`train(steps=1)`), on the CNN."""
    spec, arrays = MODELS["cnn"], train_arrays(tile)
    loop = WithNitro(spec, arrays, snapshots=nitro.Snapshots(every=1, keep=64))
    handle = loop.handle
    loop.run(2)
    rewinds, forks, steps = [], [], []
    with contextlib.redirect_stderr(io.StringIO()):  # the notes each rewind and fork say
        for _ in range(rounds):
            handle.train(steps=4)
            target = handle.snapshots.index[-3]
            began = time.perf_counter()
            handle.rewind(int(target))
            rewinds.append(time.perf_counter() - began)
            began = time.perf_counter()
            handle.train(steps=1)
            steps.append(time.perf_counter() - began)
            began = time.perf_counter()
            fork = handle.fork()  # its state now
            fork.train(steps=1)
            forks.append(time.perf_counter() - began)
            fork.close()
    return statistics.median(rewinds), statistics.median(forks), statistics.median(steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.0, help="per loop per round")
    parser.add_argument("--tile", type=int, default=8, help="repeat the train split this often")
    parser.add_argument("--models", default="mlp,cnn")
    args = parser.parse_args(argv)
    print(
        f"bench/time_travel.py: jax {jax.__version__} ({jax.devices()[0].platform}), "
        f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}"
    )
    costs = {
        name: cadence(name, args.rounds, args.seconds, args.tile) for name in args.models.split(",")
    }
    rewind, fork, step = going_back(args.rounds, args.tile)
    print("\ngoals:")
    for name, cost in costs.items():
        print(f"  default snapshots on the {name}: {cost:.2%} of training time (goal <= 3%)")
    print(f"  rewind to a snapshot in memory, CNN: {rewind * 1e3:.1f} ms (goal < 50 ms)")
    print(
        f"  fork + its first step, CNN: {fork * 1e3:.1f} ms; one train(steps=1) of a warm "
        f"handle {step * 1e3:.1f} ms (goal: fork + step < step + 50 ms = {step * 1e3 + 50:.1f} ms)"
    )


if __name__ == "__main__":
    main()
