"""Population runs: 8 members trained by one vmapped program against 8 sequential Nitro runs
and against one run.

For each model, in one process, alternating rounds, medians of the seconds one epoch takes
(compiles excluded: every program is warmed by an epoch first):

- one run: `nitro.Nitro(e)` with its defaults (`steps_per_dispatch="auto"`);
- 8 sequential runs: 8 handles at 8 learning rates, one epoch each, one after another (they
  share one compiled program);
- a population: `nitro.Population(e, learning_rate=[8 values])`, one epoch of all 8.

Printed: seconds per epoch, the population's time against one run's (8 members for the cost
of that many runs) and the sequential runs' against the population's, and members x epochs
per second. Ratios only mean something within one process on one machine: other work on it
moves every figure.

    python bench/population.py [--rounds 5] [--members 8] [--tile 4] [--models small,medium]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from dispatch import MODELS  # noqa: E402
from loops import WithNitro, experiment_for  # noqa: E402
from overhead import train_arrays  # noqa: E402

import nitro  # noqa: E402


def rates(members: int) -> list[float]:
    """`members` learning rates on a log grid from 1e-4 to 1e-2."""
    if members == 1:
        return [1e-3]
    return [float(10 ** (-4 + 2 * i / (members - 1))) for i in range(members)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_model(name: str, members: int, rounds: int, tile: int) -> None:
    nitro.cache_reset()  # count this model's programs alone
    spec = MODELS[name]
    arrays = train_arrays(tile)
    one = WithNitro(spec, arrays)
    sequential = [WithNitro(spec, arrays, learning_rate=lr) for lr in rates(members)]
    population = nitro.Population(
        experiment_for(spec, arrays), learning_rate=rates(members), progress=False
    )
    # warm every program (and the "auto" measurement) with one epoch each
    one.run(1)
    for run in sequential:
        run.run(1)
    population.train(epochs=1)
    times: dict[str, list[float]] = {"one": [], "sequential": [], "population": []}
    for _ in range(rounds):
        times["one"].append(timed(lambda: one.run(1)))
        times["sequential"].append(timed(lambda: [run.run(1) for run in sequential]))
        times["population"].append(timed(lambda: population.train(epochs=1)))
    median = {k: statistics.median(v) for k, v in times.items()}
    batches = one.batches
    print(f"\n{spec.description}: {batches} steps an epoch, {members} members, {rounds} rounds")
    print(
        f"  steps per call: one run {one.handle.dispatch.steps}, "
        f"population {population.steps_per_call}"
    )
    for key, label in (
        ("one", "one run"),
        ("sequential", f"{members} sequential Nitro runs"),
        ("population", f"population of {members}"),
    ):
        runs = 1 if key == "one" else members
        print(
            f"  {label:<28} {median[key] * 1e3:8.1f} ms an epoch, "
            f"{runs / median[key]:7.1f} member-epochs/s"
        )
    print(
        f"  population / one run: {median['population'] / median['one']:.2f}x the time for "
        f"{members} members"
    )
    print(
        f"  sequential / population: {median['sequential'] / median['population']:.2f}x "
        f"(the population's speed-up over {members} runs one after another)"
    )
    kinds = [p["kind"] for p in nitro.cache_stats().programs]
    print(f"  population train-step programs compiled: {kinds.count('population train step')}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--tile", type=int, default=4, help="digits train split repeats")
    parser.add_argument("--models", default="small")
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        bench_model(name, args.members, args.rounds, args.tile)


if __name__ == "__main__":
    main()
