"""Per-step overhead: Nitro against a hand-written `jax.jit` + optax loop.

Trains the digits MLP (64-256-256-10) and a small CNN (digits as 8x8x1 images) at batch 128
both ways in one process, alternating rounds, and prints steps/s of each and the ratio
Nitro / hand-written (median over rounds). Only training steps are timed: both loops are
warmed up (compiled) first, and the Nitro handle has a train split only, so no validation runs.

The hand-written loop is what a user would write: `nnx.split` once, a `jax.jit` step over
(params, opt_state) with both donated, batches indexed from numpy on the calling thread, and the
loss of every step kept on the device and read back once at the end of each epoch (to log the
epoch's mean loss). Both loops use `optax.adam(1e-3)`, Nitro's default.

A third loop, Nitro with `check_divergence=False`, measures what the divergence guard
(finiteness of the loss, every gradient and the fed hyperparameters, checked on the device)
costs.

    python bench/overhead.py [--rounds 9] [--seconds 1.5] [--models mlp,cnn]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import flax
import jax
import numpy as np
import optax
from flax import nnx

import nitro
from nitro.data import ArrayLoader
from nitro.examples.digits import MLP

BATCH = 128
LEARNING_RATE = 1e-3


class CNN(nnx.Module):
    """Two 3x3 convolutions, a 2x2 average pool and a dense layer, on 8x8x1 images."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
        self.out = nnx.Linear(4 * 4 * 32, 10, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], 8, 8, 1)
        x = nnx.relu(self.conv1(x))
        x = nnx.relu(self.conv2(x))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        return self.out(x.reshape(x.shape[0], -1))


MODELS = {
    "mlp": lambda rngs: MLP(64, 256, 10, rngs=rngs),
    "cnn": lambda rngs: CNN(rngs=rngs),
}


def train_arrays(tile: int) -> dict[str, np.ndarray]:
    """The digits train split repeated `tile` times, so an epoch is long enough to time."""
    train = nitro.datasets.digits_arrays()["train"]
    return {k: np.concatenate([v] * tile, axis=0) for k, v in train.items()}


# ---------------------------------------------------------------------------------------------
# hand-written loop


class HandWritten:
    def __init__(self, model_name: str, arrays: dict[str, np.ndarray], seed: int = 0):
        model = MODELS[model_name](nnx.Rngs(seed))
        graphdef, self.params, rest = nnx.split(model, nnx.Param, ...)
        tx = optax.adam(LEARNING_RATE)
        self.opt_state = tx.init(self.params)
        self.x, self.y = arrays["x"], arrays["y"]
        self.batches = len(self.x) // BATCH
        self.epoch = 0
        self.seed = seed

        def loss_fn(params, x, y):
            logits = nnx.merge(graphdef, params, rest)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        @jax.jit
        def _step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.step = jax.jit(_step, donate_argnums=(0, 1))

    def train_epoch(self) -> float:
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.x))
        losses = []
        for i in range(self.batches):
            rows = order[i * BATCH : (i + 1) * BATCH]
            self.params, self.opt_state, loss = self.step(
                self.params, self.opt_state, self.x[rows], self.y[rows]
            )
            losses.append(loss)
        self.epoch += 1
        return float(np.mean(jax.device_get(losses)))

    def run(self, epochs: int) -> tuple[int, float]:
        start = time.perf_counter()
        for _ in range(epochs):
            self.train_epoch()
        return epochs * self.batches, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Nitro


def make_experiment(model_name: str, arrays: dict[str, np.ndarray]):
    @nitro.experiment
    class Overhead:
        model: nitro.GraphConst[str] = model_name
        max_epochs: int = 10_000

        def build_data(self):
            return {"train": ArrayLoader(arrays, BATCH, shuffle=True, drop_last=True, seed=0)}

        def build_model(self, rngs: nnx.Rngs):
            return MODELS[self.model](rngs)

        def forward(self, model, *, x):
            return model(x)

        def loss(self, logits, *, y):
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Overhead()


class WithNitro:
    def __init__(
        self,
        model_name: str,
        arrays: dict[str, np.ndarray],
        seed: int = 0,
        guard: bool = True,
        steps_per_dispatch: int | str = "auto",
    ):
        self.handle = nitro.Nitro(
            make_experiment(model_name, arrays),
            seed=seed,
            steps_per_dispatch=steps_per_dispatch,
            progress=False,
            check_divergence=guard,
            logger=None,  # the hand-written loop writes no logs and saves no checkpoints;
            checkpointer=None,  # bench/loggers.py and bench/lifecycle.py measure those
        )
        self.batches = len(self.handle.splits["train"])

    def run(self, epochs: int) -> tuple[int, float, float]:
        """(steps, wall seconds of train(), seconds inside the loop's epochs)."""
        start = time.perf_counter()
        self.handle.train(epochs=epochs)
        wall = time.perf_counter() - start
        loop = self.handle.history()["epoch_seconds"].iloc[-epochs:].sum()
        return epochs * self.batches, wall, float(loop)


# ---------------------------------------------------------------------------------------------


def bench_model(name: str, tile: int, rounds: int, seconds: float) -> dict[str, float]:
    arrays = train_arrays(tile)
    hand = HandWritten(name, arrays)
    framed = WithNitro(name, arrays)
    # warm up: compile each, and let each run an epoch at speed
    hand.run(2)
    framed.run(2)
    # the guard's cost is measured at the steps per call Nitro chose with it
    plan = framed.handle.dispatch
    unguarded = WithNitro(name, arrays, guard=False, steps_per_dispatch=plan.steps or 1)
    unguarded.run(2)
    steps, elapsed = hand.run(1)
    epochs = max(1, round(seconds * steps / elapsed / hand.batches))
    print(
        f"\n{name}: {len(arrays['x'])} samples, {hand.batches} batches of {BATCH} per epoch, "
        f"{epochs} epochs ({epochs * hand.batches} steps) per loop per round; steps per "
        f"dispatch {plan.describe()}"
    )
    print(
        f"  {'round':>5}  {'hand-written':>13}  {'nitro':>13}  {'nitro (loop)':>13}  "
        f"{'no guard':>13}  ratio"
    )
    ratios, loop_ratios, hand_rates, nitro_rates, guard_ratios = [], [], [], [], []
    for r in range(rounds):
        first_nitro = r % 2 == 1  # alternate which loop goes first
        if first_nitro:
            n_steps, n_wall, n_loop = framed.run(epochs)
            u_steps, u_wall, _ = unguarded.run(epochs)
        h_steps, h_time = hand.run(epochs)
        if not first_nitro:
            u_steps, u_wall, _ = unguarded.run(epochs)
            n_steps, n_wall, n_loop = framed.run(epochs)
        h_rate, n_rate, n_loop_rate = h_steps / h_time, n_steps / n_wall, n_steps / n_loop
        u_rate = u_steps / u_wall
        hand_rates.append(h_rate)
        nitro_rates.append(n_rate)
        ratios.append(n_rate / h_rate)
        loop_ratios.append(n_loop_rate / h_rate)
        guard_ratios.append(n_rate / u_rate)
        print(
            f"  {r + 1:>5}  {h_rate:>9.0f} st/s  {n_rate:>9.0f} st/s  {n_loop_rate:>9.0f} st/s"
            f"  {u_rate:>9.0f} st/s  {ratios[-1]:.3f}"
        )
    result = {
        "hand": statistics.median(hand_rates),
        "nitro": statistics.median(nitro_rates),
        "ratio": statistics.median(ratios),
        "loop_ratio": statistics.median(loop_ratios),
        "guard": statistics.median(guard_ratios),
    }
    print(
        f"  median: hand-written {result['hand']:.0f} steps/s, nitro {result['nitro']:.0f} "
        f"steps/s, ratio nitro / hand-written {result['ratio']:.3f} (loop time only: "
        f"{result['loop_ratio']:.3f}); with / without the divergence guard "
        f"{result['guard']:.3f}"
    )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.8, help="per loop per round")
    parser.add_argument("--tile", type=int, default=8, help="repeat the train split this often")
    parser.add_argument("--models", default="mlp,cnn")
    args = parser.parse_args(argv)

    print("bench/overhead.py: Nitro vs a hand-written jax.jit + optax loop")
    print(
        f"  jax {jax.__version__} ({jax.devices()[0].platform}, {jax.device_count()} device), "
        f"flax {flax.__version__}, optax {optax.__version__}, "
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(
        f"  batch {BATCH}, optax.adam({LEARNING_RATE:g}); hand-written: params/opt_state "
        f"donated, numpy batches, loss read back once per epoch (device_get of the epoch's "
        f"losses); nitro: train split only (no validation), progress=False, no logger, no "
        f"checkpointer, defaults otherwise"
    )
    print("  'nitro' times the whole train() call; 'nitro (loop)' sums the loop's epoch times")
    results = {}
    for name in args.models.split(","):
        results[name] = bench_model(name, args.tile, args.rounds, args.seconds)
    print(f"\nload average {os.getloadavg()[0]:.1f} (other processes on the machine add noise)")
    print("ratio nitro / hand-written, median over rounds (goal: >= 0.97 on both):")
    for name, r in results.items():
        print(
            f"  {name}: {r['ratio']:.3f}  ({r['nitro']:.0f} vs {r['hand']:.0f} steps/s; "
            f"loop time only {r['loop_ratio']:.3f}); the guard costs "
            f"{(1 - r['guard']) * 100:.1f}% (goal: < 3%)"
        )


if __name__ == "__main__":
    main()
