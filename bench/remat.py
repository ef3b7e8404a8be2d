"""What `remat=` saves and costs: the train step's scratch memory and steps/s, with and without.

The transformer LM of bench/peers.py (its blocks in an `nnx.List`, so `remat="full"` applies
to each block) trains in one process as two lean handles, one step per program call
(`steps_per_dispatch=1`, so each handle holds one train step), in alternating rounds. Printed:
the train step's scratch memory (XLA's `memory_analysis().temp_size_in_bytes`) with remat over
without, and the median steps/s with remat over without (the price of the recomputation).

    python bench/remat.py [--quick] [--rounds 5] [--epochs 2] [--scale 1] [--policy full]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

from loops import WithNitro, alternate_rounds, close_handles  # noqa: E402
from peers import MODELS  # noqa: E402

import nitro  # noqa: E402


def scratch_bytes(handle) -> int:
    """The scratch memory of the train step compiled for `handle` (its newest)."""
    handle.train(epochs=1)
    steps = [p for p in nitro.cache_stats().programs if p["program"] == "train step"]
    return steps[-1]["temp_bytes"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few, short rounds (smoke test)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--scale", type=int, default=1, help="data size multiplier")
    parser.add_argument("--policy", default="full", help="the remat= policy: full or dots")
    args = parser.parse_args(argv)
    rounds, epochs = (2, 1) if args.quick else (args.rounds, args.epochs)

    spec, data, _ = MODELS["lm"]
    arrays = data(args.scale)
    plain = WithNitro(spec, arrays, steps=1)
    plain_bytes = scratch_bytes(plain.handle)
    recomputed = WithNitro(spec, arrays, steps=1, remat=args.policy)
    remat_bytes = scratch_bytes(recomputed.handle)
    loops = {"without": plain, "remat": recomputed}
    print(f"lm: {spec.description}; remat={args.policy!r}, {rounds} rounds of {epochs} epochs")
    rates = alternate_rounds(loops, rounds, 1, epochs)
    speed = statistics.median(r / p for r, p in zip(rates["remat"], rates["without"], strict=True))
    close_handles(loops)
    memory = remat_bytes / plain_bytes
    print(
        f"  train step scratch: {remat_bytes / 2**20:.1f} MiB with remat, "
        f"{plain_bytes / 2**20:.1f} MiB without: {memory:.2f}x ({1 - memory:.0%} less)"
    )
    print(f"  steps/s with remat over without: {speed:.2f}x")
    return {"memory": memory, "speed": speed}


if __name__ == "__main__":
    main()
