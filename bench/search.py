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

`--pbt`: population-based training against a grid, at equal wall time, on a task where the
good learning rate changes during training. The task (`Noisy`): linear regression by plain
SGD (batch 32) on `--samples` generated points in `--dim` dimensions whose input scales span a
condition number of `--cond`, with label noise of standard deviation `--noise` in the train
split; the val split's labels are noiseless, so `val_loss` is the model's error against the
true function. A high learning rate is good early (it fits the low-variance directions fast)
and bad late (the gradient noise keeps the weights `~ learning_rate * noise**2` away from the
optimum): a decaying rate is needed, and no constant one is best throughout.

- grid: `nitro.Population(e, learning_rate=[8 values on a log grid from --low to --high])`;
- PBT: the same 8 members with `search=nitro.PBT(every=1, seed=...)`: at every epoch's end the
  worst 2 members take the state of 2 of the best 2 and their learning rate times 0.8 or 1.2.

Both train every member `--epochs` epochs (the same steps: one program of the same shape, so
equal wall time), with Nitro's defaults (a checkpointer and a JSON Lines logger per member);
round `r` uses `seed=--seed + r` for the members' initialisation, data order and PBT's draws.
Printed per round: both wall times, each population's best final `val_loss` and their ratio;
then the medians. `--plot PATH` draws the first round's curves (val_loss per epoch of the
grid's best member and of PBT's best member, and their learning rates) to a PNG.

    python bench/search.py --pbt [--rounds 5] [--seed 0] [--epochs 20] [--plot out.png]
"""

from __future__ import annotations

import argparse
import contextlib
import io
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


@nitro.experiment
class Noisy:
    """Linear regression by SGD with label noise: a decaying learning rate is needed."""

    dim: nitro.GraphConst[int] = 32
    samples: int = 4096
    noise: float = 1.0
    cond: float = 100.0
    max_epochs: int = 20

    def build_data(self):
        rng = np.random.default_rng(0)
        scales = np.geomspace(1.0, 1.0 / np.sqrt(self.cond), self.dim)
        weights = rng.normal(size=self.dim)

        def split(count: int, noise: float) -> dict[str, np.ndarray]:
            x = (rng.normal(size=(count, self.dim)) * scales).astype(np.float32)
            y = x @ weights + noise * rng.normal(size=count)
            return {"x": x, "y": y.astype(np.float32)[:, None]}

        return {
            "train": ArrayLoader(split(self.samples, self.noise), 32, shuffle=True, drop_last=True),
            "val": ArrayLoader(split(2048, 0.0), 512),
        }

    def build_model(self, rngs):
        from flax import nnx

        return nnx.Linear(self.dim, 1, rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, outputs, *, y):
        return ((outputs - y) ** 2).mean()

    def optimizer(self):
        import optax

        return optax.sgd


def pbt_run(experiment, learning_rates: list[float], seed: int, search=None) -> dict:
    """One population of `learning_rates` trained to the end: its wall seconds, its best
    member's final val_loss, that member's val_loss per epoch and learning rate per step."""
    nitro.cache_reset()
    with tempfile.TemporaryDirectory() as directory:
        pop = nitro.Population(
            experiment,
            learning_rate=learning_rates,
            search=search,
            seed=seed,
            run_dir=f"{directory}/run",
            progress=False,
        )
        begin = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()):  # PBT's note at every exploit
            pop.train().wait()
        wall = time.perf_counter() - begin
        history = pop.history()
        final = history.xs(history.index.get_level_values("epoch").max(), level="epoch")
        best = int(final.index.to_numpy()[np.argmin(final["val_loss"].to_numpy())])
        if search is None:
            schedule = [(0, learning_rates[best])]
        else:
            schedule = [(int(s), float(v)) for s, v in pop.schedule(best)["learning_rate"]]
        compiles = sum(r.seconds for r in nitro.explain_compiles())
        # the val_loss of the weights the best member ends with, epoch by epoch: before an
        # exploit at the end of epoch e, those weights were the donor's
        lineage = pop.lineage()
        donors = {}
        if not lineage.empty:
            for epoch, taker, donor in lineage[["epoch", "member", "copied_from"]].to_numpy():
                donors[int(epoch), int(taker)] = int(donor)
        curve, member = [], best
        for epoch in sorted(history.index.get_level_values("epoch").unique(), reverse=True):
            member = donors.get((int(epoch), member), member)
            curve.insert(0, float(history.loc[(member, epoch), "val_loss"]))
        pop.close()
    return {
        "wall": wall,
        "best": float(final["val_loss"].min()),
        "member": best,
        "compiles": compiles,
        "curve": curve,
        "schedule": schedule,
        "steps": experiment.samples // 32 * experiment.max_epochs,
    }


def plot(grid: dict, pbt: dict, path: str) -> None:
    """val_loss per epoch of the grid's best member and PBT's, and their learning rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (losses, rates_axis) = plt.subplots(1, 2, figsize=(8, 3), dpi=80)
    for result, label in ((grid, "grid's best member"), (pbt, "PBT's best member")):
        epochs = range(1, len(result["curve"]) + 1)
        losses.plot(epochs, result["curve"], marker=".", label=label)
        steps = [s for s, _ in result["schedule"]] + [result["steps"]]
        values = [v for _, v in result["schedule"]]
        rates_axis.step(steps, values + values[-1:], where="post", label=label)
    losses.set(xlabel="epoch", ylabel="val_loss", yscale="log", title="validation loss")
    rates_axis.set(xlabel="step", ylabel="learning_rate", yscale="log", title="learning rate")
    losses.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def pbt_main(args: argparse.Namespace) -> None:
    """PBT with 8 members against an 8-point grid of constant learning rates."""
    experiment = Noisy(
        dim=args.dim,
        samples=args.samples,
        noise=args.noise,
        cond=args.cond,
        max_epochs=args.epochs,
    )
    grid_rates = [float(x) for x in np.geomspace(args.low, args.high, 8)]
    print(
        f"SGD on noisy linear regression (dim {args.dim}, {args.samples} samples, condition "
        f"{args.cond:g}, noise {args.noise:g}), {args.epochs} epochs of "
        f"{args.samples // 32} steps; 8 learning rates {args.low:g} .. {args.high:g}"
    )
    rounds = []
    for index in range(args.rounds):
        seed = args.seed + index
        grid = pbt_run(experiment, grid_rates, seed)
        pbt = pbt_run(experiment, grid_rates, seed, nitro.PBT(every=1, seed=seed))
        rounds.append((grid, pbt))
        print(
            f"  round {index + 1} (seed {seed}): grid {grid['wall']:5.2f} s "
            f"({grid['compiles']:.2f} s compiling), best val_loss "
            f"{grid['best']:.4g} (learning_rate {grid['schedule'][0][1]:.3g}); PBT "
            f"{pbt['wall']:5.2f} s ({pbt['compiles']:.2f} s compiling), best val_loss "
            f"{pbt['best']:.4g} (learning_rate "
            f"{pbt['schedule'][0][1]:.3g} -> {pbt['schedule'][-1][1]:.3g}): "
            f"PBT / grid {pbt['best'] / grid['best']:.2f}"
        )
    grid_best = statistics.median(g["best"] for g, _ in rounds)
    pbt_best = statistics.median(p["best"] for _, p in rounds)
    wins = sum(p["best"] < g["best"] for g, p in rounds)
    print(
        f"median: grid {statistics.median(g['wall'] for g, _ in rounds):.2f} s, best val_loss "
        f"{grid_best:.4g}; PBT {statistics.median(p['wall'] for _, p in rounds):.2f} s, best "
        f"val_loss {pbt_best:.4g}; PBT / grid "
        f"{statistics.median(p['best'] / g['best'] for g, p in rounds):.2f} (goal < 1); "
        f"PBT lower in {wins} of {len(rounds)} rounds"
    )
    if args.plot:
        plot(rounds[0][0], rounds[0][1], args.plot)
        print(f"curves of round 1: {args.plot}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, help="12; with --pbt, 20")
    parser.add_argument("--tile", type=int, default=4, help="data size multiplier")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--members", type=int, default=16)
    parser.add_argument("--pbt", action="store_true", help="PBT against a grid (see above)")
    parser.add_argument("--seed", type=int, default=0, help="--pbt: the first round's seed")
    parser.add_argument("--dim", type=int, default=32, help="--pbt: input dimensions")
    parser.add_argument("--samples", type=int, default=4096, help="--pbt: train samples")
    parser.add_argument("--noise", type=float, default=1.0, help="--pbt: label noise std")
    parser.add_argument("--cond", type=float, default=100.0, help="--pbt: condition number")
    parser.add_argument("--low", type=float, default=1e-3, help="--pbt: the grid's lowest rate")
    parser.add_argument("--high", type=float, default=0.3, help="--pbt: the grid's highest")
    parser.add_argument("--plot", help="--pbt: a PNG of the first round's curves")
    args = parser.parse_args(argv)
    if args.pbt:
        args.epochs = args.epochs or 20
        pbt_main(args)
        return
    args.epochs = args.epochs or 12
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
