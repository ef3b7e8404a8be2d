"""A fresh handle's whole run with the defaults, against a hand-written loop started afresh.

What a user pays for the first run of a model: for each model (those of `bench/peers.py`, on
the digits train split as it ships: about 11 steps an epoch), in one process, alternating
rounds, each contender starts from nothing and trains `--epochs` epochs:

- hand-written: a new per-step `jax.jit` loop (`bench/loops.py`'s `HandWritten`: params and
  optimizer state donated, numpy batches, the epoch's losses read back once per epoch), timed
  from building the model to the last epoch's read-back, its compile included: the 1.00x
  baseline;
- defaults: `nitro.Nitro(experiment, max_epochs=epochs)` with every default (a JSON Lines
  logger, a checkpointer in a run directory, `steps_per_dispatch="auto"` with its probe,
  `progress=False` only so the script prints its own table), then one `train()`, timed from `Nitro(...)` to
  the return of `train()`, its setup, compiles and probe included. Nitro's compile cache is
  emptied before each round (`nitro.cache_reset()`, which also forgets "auto"'s choices), so
  every round is a first run, as a new process's would be.

Printed: the ratio of the hand-written loop's wall time over Nitro's (above 1: Nitro is
faster), medians over rounds, with each handle's dispatch choice. `--load N` starts N
CPU-bound processes beside it (each a Python busy loop), a shared machine's neighbours.

    python bench/fresh.py [--models mlp256,cnn] [--epochs 60] [--rounds 5] [--load 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
from loops import HandWritten, WithNitro, busy_neighbours  # noqa: E402
from peers import MODELS  # noqa: E402

import nitro  # noqa: E402


def hand_written(spec, arrays, epochs: int) -> float:
    start = time.perf_counter()
    loop = HandWritten(spec, arrays)
    loop.run(epochs)
    jax.block_until_ready(loop.params)
    return time.perf_counter() - start


def with_defaults(spec, arrays, epochs: int) -> tuple[float, str]:
    nitro.cache_reset()
    start = time.perf_counter()
    # Nitro(...) with the defaults, for a run of `epochs` (what "auto" bounds its probe by)
    loop = WithNitro(spec, arrays, lean=False, max_epochs=epochs)
    loop.handle.train()
    took = time.perf_counter() - start
    choice = loop.handle.dispatch.describe()
    loop.handle.close()  # its last save is written before the next contender starts
    return took, choice


def bench_model(name: str, epochs: int, rounds: int) -> float:
    spec, _, _ = MODELS[name]
    arrays = nitro.datasets.digits_arrays()["train"]  # the digits as they ship: short epochs
    steps = len(arrays["x"]) // spec.batch
    print(f"\n{spec.description}: {epochs} epochs of {steps} steps, {rounds} rounds")
    ratios = []
    for r in range(rounds):
        first = r % 2 == 0  # alternate who goes first
        if first:
            ours, choice = with_defaults(spec, arrays, epochs)
            theirs = hand_written(spec, arrays, epochs)
        else:
            theirs = hand_written(spec, arrays, epochs)
            ours, choice = with_defaults(spec, arrays, epochs)
        ratios.append(theirs / ours)
        print(
            f"  round {r + 1}: hand-written {theirs:.2f} s, defaults {ours:.2f} s "
            f"({theirs / ours:.2f}x), {choice}"
        )
    median = statistics.median(ratios)
    print(f"  {name}: defaults {median:.2f}x the hand-written loop (median)")
    return median


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp256,cnn", help="of " + ",".join(MODELS))
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--load", type=int, default=0, help="CPU-bound processes beside it")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    with busy_neighbours(args.load, "bench/fresh.py", "nitro-fresh-"):
        results = {name: bench_model(name, args.epochs, args.rounds) for name in names}
    print("\na fresh handle's whole run over the hand-written loop's (goal >= 0.95):")
    for name, ratio in results.items():
        print(f"  {name}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
