"""Successive halving inside one population against the same members trained to the end.

The task: the digits MLP of `nitro.examples.digits` (`--width`, batch 128), its train split
tiled `--tile` times, validated on its val split; 16 members on a log grid of learning rates.

- grid: `nitro.Population(e, learning_rate=[16 values])`, every member trained `--epochs`
  epochs;
- halving: the same members with `search=nitro.Halving(rungs=[1, 2, 3])`: 16 members for an
  epoch, 8 for the next, 4 for the next, and the best 2 to the end. At each rung the
  population shrinks and compiles its programs once for the smaller count.

Both keep Nitro's defaults (a checkpointer and a JSON Lines logger per member, in a
temporary directory; `steps_per_dispatch="auto"`). Printed, for each round (alternating, the
compile cache emptied before each run, so each pays its compiles as a fresh process would):
wall seconds, compile seconds, and the halving run's time against the grid's, with and
without compiles; then medians, and whether halving's winner (best `val_loss` at the end) is
the grid's. Ratios only mean something within one process on one machine.

    python bench/search.py [--rounds 3] [--epochs 12] [--tile 4] [--width 256] [--members 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

import nitro
from nitro.data import ArrayLoader


@nitro.experiment
class Tiled:
    """The digits MLP on its train split tiled `tile` times."""

    width: nitro.GraphConst[int] = 256
    tile: int = 4
    max_epochs: int = 12

    def build_data(self):
        arrays = nitro.datasets.digits_arrays()
        train = {k: np.concatenate([v] * self.tile) for k, v in arrays["train"].items()}
        return {
            "train": ArrayLoader(train, 128, shuffle=True, drop_last=True),
            "val": ArrayLoader(arrays["val"], 128),
        }

    def build_model(self, rngs):
        from nitro.examples.digits import MLP

        return MLP(64, self.width, 10, rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        import optax

        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def rates(members: int) -> list[float]:
    """`members` learning rates on a log grid from 1e-5 to 3e-4: Adam's rates below the best
    one for this MLP, so that the grid's ranking holds from the first epoch to the last."""
    return [float(x) for x in np.geomspace(1e-5, 3e-4, members)]


def run(experiment, members: int, search=None) -> tuple[float, float, int]:
    """Wall and compile seconds of one population trained to the end, and its winner."""
    nitro.cache_reset()
    with tempfile.TemporaryDirectory() as directory:
        pop = nitro.Population(
            experiment,
            learning_rate=rates(members),
            search=search,
            run_dir=f"{directory}/run",
            progress=False,
        )
        begin = time.perf_counter()
        pop.train().wait()
        wall = time.perf_counter() - begin
        compiles = sum(r.seconds for r in nitro.explain_compiles())
        winner = pop.ranking("val_loss")[1][0][0]
        pop.close()
    return wall, compiles, winner


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--tile", type=int, default=4, help="data size multiplier")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--members", type=int, default=16)
    args = parser.parse_args(argv)
    experiment = Tiled(width=args.width, tile=args.tile, max_epochs=args.epochs)
    halving = nitro.Halving(rungs=[1, 2, 3])
    sizes = " -> ".join(map(str, halving.sizes(args.members)))
    print(
        f"MLP 64-{args.width}-{args.width}-10 on digits x{args.tile}, {args.members} learning "
        f"rates, {args.epochs} epochs; halving {sizes} at epochs 1, 2, 3"
    )
    grid_runs, halving_runs = [], []
    for index in range(args.rounds):
        grid_runs.append(run(experiment, args.members))
        halving_runs.append(run(experiment, args.members, halving))
        (gw, gc, gwin), (hw, hc, hwin) = grid_runs[-1], halving_runs[-1]
        print(
            f"  round {index + 1}: grid {gw:6.2f} s ({gc:5.2f} s compiling), halving {hw:6.2f} s "
            f"({hc:5.2f} s compiling): {hw / gw:.2f}x, without compiles "
            f"{(hw - hc) / (gw - gc):.2f}x; winners: grid {gwin}, halving {hwin}"
        )
    grid = statistics.median(r[0] for r in grid_runs)
    half = statistics.median(r[0] for r in halving_runs)
    grid_train = statistics.median(r[0] - r[1] for r in grid_runs)
    half_train = statistics.median(r[0] - r[1] for r in halving_runs)
    same = all(g[2] == h[2] for g, h in zip(grid_runs, halving_runs, strict=True))
    print(
        f"median: grid {grid:.2f} s, halving {half:.2f} s: halving / grid {half / grid:.2f}x "
        f"(goal < 0.6x); without compiles {half_train / grid_train:.2f}x"
    )
    print(
        f"halving's winner is the grid's in {'every' if same else 'not every'} round "
        f"(grid: member {grid_runs[-1][2]}, learning_rate {rates(args.members)[grid_runs[-1][2]]:.3g})"
    )


if __name__ == "__main__":
    main()
