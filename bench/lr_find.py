"""`n.lr_find()` against one epoch of one run, on the digits example (MLP 64-256-256-10,
batch 128, 9 steps an epoch).

Every figure is timed from a fresh handle (`nitro.Nitro(Digits(), ...)` built inside the
timing), in one process, in alternating rounds, medians printed:

- compile included: the in-memory compile cache emptied first (`nitro.cache_reset()`) and the
  persistent compilation cache off (`NITRO_COMPILATION_CACHE=0`, unless
  `--persistent-cache`), so each one compiles every program it needs: one epoch of one run
  compiles its train step(s) and eval step, `lr_find()` its one population train step;
- compile excluded: the same again right after, every program already in the cache.

For each: one epoch (`n.train(epochs=1)`), `n.lr_find()` (the grid, its defaults: 11 rates
from 1e-5 to 1, 50 steps rounded to 54) and `n.lr_find(method="ramp")` (the classic one-run
ramp, 100 steps from 1e-5 to 1, stopped at 4x the smoothed loss's minimum), with the
suggestions. The goal: lr_find under 3x the time of one epoch, both compile included.
Ratios mean something within one process on one machine only: other work on it moves every
figure.

    python bench/lr_find.py [--rounds 5] [--persistent-cache]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--persistent-cache", action="store_true")
    args = parser.parse_args(argv)
    if not args.persistent_cache:
        os.environ["NITRO_COMPILATION_CACHE"] = "0"

    import jax
    import jax.numpy as jnp

    import nitro
    from nitro.examples.digits import Digits

    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # start the backend first

    def fresh():
        return nitro.Nitro(Digits(), seed=0, progress=False, checkpointer=None, logger=None)

    tasks = {
        "one epoch": lambda: fresh().train(epochs=1),
        "lr_find": lambda: fresh().lr_find(),
        "lr_find ramp": lambda: fresh().lr_find(method="ramp"),
    }
    times: dict[tuple[str, bool], list[float]] = {(k, c): [] for k in tasks for c in (True, False)}
    misses: dict[tuple[str, bool], int] = {}
    found: dict[str, object] = {}
    fresh().train(epochs=1)  # imports and data loading out of the way
    for _ in range(args.rounds):
        for name, task in tasks.items():
            for compiled in (True, False):
                if compiled:
                    nitro.cache_reset()
                before = nitro.cache_stats().misses
                start = time.perf_counter()
                out = task()
                times[(name, compiled)].append(time.perf_counter() - start)
                misses[(name, compiled)] = nitro.cache_stats().misses - before
                if name != "one epoch":
                    found[name] = out
    median = {key: statistics.median(values) for key, values in times.items()}
    print(
        f"digits, MLP 64-256-256-10, batch 128; {args.rounds} rounds, medians; persistent "
        f"compilation cache {'on' if args.persistent_cache else 'off'}"
    )
    for compiled, title in ((True, "compile included"), (False, "compile excluded")):
        base = median[("one epoch", compiled)]
        print(f"\n{title} (from a fresh handle):")
        for name in tasks:
            seconds = median[(name, compiled)]
            print(
                f"  {name:<13} {seconds:7.3f} s  {seconds / base:5.2f}x one epoch  "
                f"({misses[(name, compiled)]} compiles)"
            )
    for name, result in found.items():
        print(f"\n{name}: {result!r}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
