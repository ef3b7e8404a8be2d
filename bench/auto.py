"""Steps per dispatch: `"auto"` against every fixed K, with Nitro's defaults, quiet or loaded.

For each model (those of `bench/peers.py`), in one process, alternating rounds: a hand-written
per-step `jax.jit` loop (the 1.00x baseline), Nitro with `steps_per_dispatch=K` for each K of
`--ks` that fits in an epoch, and `--autos` separate Nitro handles with `"auto"` (each measures
and decides on its own, in the warm-up rounds, under the same load; the warm-up goes on,
up to 20 rounds, until every auto handle has decided, and the steps that took are printed, so
the timed rounds judge the K kept, not the measuring). Every Nitro handle keeps
the defaults users run (a JSON Lines logger and a checkpointer; run directories in a
temporary directory). Printed: each contender's steps/s ratio over the hand-written loop
(medians over rounds), each auto handle's choice and reason, and the worst auto over the best
fixed K, the figure "auto" is judged by.

`--load N` starts N CPU-bound processes beside the benchmark for its whole length (each a
Python busy loop), the busy neighbours a shared machine has.

    python bench/auto.py [--models mlp,mlp256,lm,cnn] [--ks 1,2,4,8,16,32,64] [--load 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

from loops import (  # noqa: E402
    HandWritten,
    WithNitro,
    alternate_rounds,
    busy_neighbours,
    close_handles,
)
from peers import MODELS  # noqa: E402

MAX_WARMUP = 20  # warm-up rounds at most, while an auto handle is still deciding


def bench_model(
    name: str, ks: list[int], autos: int, rounds: int, warmup: int, epochs: int, scale: int
) -> dict:
    spec, data, _ = MODELS[name]
    arrays = data(scale)
    loops: dict = {"hand-written": HandWritten(spec, arrays)}
    batches = loops["hand-written"].batches
    for k in ks:
        if k <= batches:
            loops[f"K={k}"] = WithNitro(spec, arrays, k, lean=False)
    for a in range(autos):
        loops[f"auto #{a + 1}"] = WithNitro(spec, arrays, "auto", lean=False)
    print(f"\n{name}: {spec.description}; {batches} batches per epoch, {epochs} epochs a round")
    autos_ = [loops[key].handle for key in loops if key.startswith("auto")]

    def deciding() -> bool:
        return any(h.dispatch.steps is None or h.dispatch.checking for h in autos_)

    # warm-up rounds until every auto handle has decided (at most MAX_WARMUP): the timed
    # rounds judge the K it keeps; the steps it took to decide are printed apart
    extra = 0
    alternate_rounds(loops, 0, warmup, epochs)
    while deciding() and warmup + extra < MAX_WARMUP:
        alternate_rounds(loops, 0, 1, epochs)
        extra += 1
    steps = ", ".join(str(h.step) for h in autos_)
    print(
        f"  warm-up: {warmup + extra} rounds; the auto handles had trained {steps} steps once "
        f"decided{' (still deciding)' if deciding() else ''}"
    )
    rates = alternate_rounds(loops, rounds, 0, epochs)
    base = rates["hand-written"]
    ratios = {
        key: statistics.median(v / h for v, h in zip(values, base, strict=True))
        for key, values in rates.items()
        if key != "hand-written"
    }
    for key, ratio in ratios.items():
        line = f"  {key:<9} {ratio:5.2f}x"
        if key.startswith("auto"):
            line += f"   {loops[key].handle.dispatch.describe()}"
        print(line)
    close_handles(loops)
    fixed = {k: v for k, v in ratios.items() if k.startswith("K=")}
    best = max(fixed, key=fixed.get)
    worst_auto = min(v for k, v in ratios.items() if k.startswith("auto"))
    print(
        f"  best fixed {best} {fixed[best]:.2f}x; worst auto {worst_auto:.2f}x = "
        f"{worst_auto / fixed[best]:.2f} of the best"
    )
    return {"best": best, "best_ratio": fixed[best], "auto_share": worst_auto / fixed[best]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="of " + ",".join(MODELS))
    parser.add_argument("--ks", default="1,2,4,8,16,32,64", help="fixed K values")
    parser.add_argument("--autos", type=int, default=2, help="auto handles, each deciding")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="rounds not timed (auto decides)")
    parser.add_argument("--epochs", type=int, default=2, help="train(epochs=) per round")
    parser.add_argument("--scale", type=int, default=2, help="data size multiplier")
    parser.add_argument("--load", type=int, default=0, help="CPU-bound processes beside it")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",") if k]
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    with busy_neighbours(args.load, "bench/auto.py", "nitro-auto-"):
        results = {
            name: bench_model(
                name, ks, args.autos, args.rounds, args.warmup, args.epochs, args.scale
            )
            for name in names
        }
    print("\nworst auto handle as a share of the best fixed K:")
    for name, r in results.items():
        print(f"  {name}: {r['auto_share']:.2f} (best {r['best']}, {r['best_ratio']:.2f}x)")


if __name__ == "__main__":
    main()
