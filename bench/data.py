"""Data pipeline: prefetch throughput against its ideal, and live arrays over a long run.

A source sleeps `t` per batch (reading and decoding, say) and a train step takes `s`. With
`w` prefetch workers building batches of an index-addressable source in parallel, the best a
loop can do is one step every max(t / w, s). This script measures, in one run:

- `s`: Nitro's step time on the same model with batches already in memory;
- Nitro with the sleeping source and `w` workers, as a ratio of the ideal max(t / w, s), for a
  step-bound case (t / w < s) and a data-bound case (t / w > s);
- the same source under `NoPrefetch` (one batch at a time, built inline; since a step runs
  asynchronously while the host builds the next batch, this lies between max(t, s) and t + s);
- `len(jax.live_arrays())` sampled at every batch of a 2,000-step run.

With `--processes` it measures worker processes instead: the digits (8x8) upsampled to 64x64
and augmented per sample in numpy (a shift, a flip, noise, a blur: about 1 ms a sample of
small-array calls, which hold the interpreter lock), steps/s with `prefetch="processes"`
against `prefetch="threads"` (same workers) and against the data-free speed (the same model
on batches augmented beforehand, in memory), and what `prefetch="auto"` picks.

With `--persistent` it times `train(epochs=1)` calls after the first on one handle with
`prefetch="processes"`, with and without `persistent_workers=True`: what starting the worker
processes costs each call.

It prints ratios, not pass or fail; timings vary by ~20 % between runs on a shared machine.

    python bench/data.py [--sleep-ms 16] [--width 512] [--batches 120] [--epochs 3]
    python bench/data.py --processes [--workers 2] [--blur 32] [--width 512] [--epochs 3]
    python bench/data.py --persistent [--workers 2] [--blur 32] [--width 512] [--epochs 3]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import jax
import numpy as np
import optax
from flax import nnx

import nitro
from nitro.data import ArrayLoader, NoPrefetch

BATCH = 128
FEATURES = 256


class MLP(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(FEATURES, width, rngs=rngs)
        self.hidden2 = nnx.Linear(width, width, rngs=rngs)
        self.out = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden2(nnx.relu(self.hidden1(x)))))


@nitro.experiment
class Synthetic:
    width: int = 512

    def build_data(self):
        raise NotImplementedError("the benchmark passes its splits with Nitro(..., data=...)")

    def build_model(self, rngs: nnx.Rngs):
        return MLP(self.width, rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def arrays(batches: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = batches * BATCH
    return {
        "x": rng.normal(size=(n, FEATURES)).astype(np.float32),
        "y": rng.integers(0, 10, size=n).astype(np.int32),
    }


class SleepingLoader(ArrayLoader):
    """An index-addressable loader that takes `sleep` seconds to build each batch."""

    def __init__(self, data, sleep: float):
        super().__init__(data, BATCH)
        self.sleep = sleep

    def batch_at(self, index, plan=None):
        time.sleep(self.sleep)
        return super().batch_at(index, plan)


class LiveArrayCounter(ArrayLoader):
    def __init__(self, data):
        super().__init__(data, BATCH)
        self.live: list[int] = []

    def batch_at(self, index, plan=None):
        self.live.append(len(jax.live_arrays()))
        return super().batch_at(index, plan)


def step_time(source, args, **keywords) -> tuple[float, float]:
    n = nitro.Nitro(
        Synthetic(width=args.width),
        data={"train": source},
        max_epochs=args.epochs,
        progress=False,
        **keywords,
    )
    n.train()
    warm = n.history().iloc[1:]  # the first epoch compiles
    return float(warm["epoch_seconds"].sum() / (len(warm) * args.batches)), float(
        warm["data_wait_frac"].mean()
    )


BLUR_ROUNDS = 32  # --blur: about 1 ms a sample on one core


def augment(image: np.ndarray, rng: np.random.Generator, blur: int = BLUR_ROUNDS) -> np.ndarray:
    """One 8x8 digit to an augmented 64x64 one: upsample, shift, maybe flip, blur, noise."""
    big = np.kron(image.reshape(8, 8), np.ones((8, 8), np.float32))
    big = np.roll(big, tuple(rng.integers(-4, 5, size=2)), axis=(0, 1))
    if rng.random() < 0.5:
        big = big[:, ::-1]
    for _ in range(blur):  # a 3x3 box blur, `blur` times
        padded = np.pad(big, 1, mode="edge")
        big = sum(padded[i : i + 64, j : j + 64] for i in range(3) for j in range(3)) / 9.0
    big = big + rng.normal(scale=0.05, size=big.shape)
    return np.clip(big, 0.0, 1.0).astype(np.float32).reshape(-1)


class AugmentedDigits(ArrayLoader):
    """The digits, each sample augmented in `batch_at` from (seed, epoch, batch)."""

    def __init__(self, arrays, batch_size: int, blur: int = BLUR_ROUNDS):
        super().__init__(arrays, batch_size)
        self.blur = blur

    def begin_epoch(self, epoch):
        return epoch, super().begin_epoch(epoch)

    def batch_at(self, index, plan=None):
        epoch, rows = plan if plan is not None else (0, None)
        batch = super().batch_at(index, rows)
        rng = np.random.default_rng((0, epoch, index))
        images = [augment(x, rng, self.blur) for x in batch["x"]]
        return {"x": np.stack(images), "y": batch["y"]}


@nitro.experiment
class Digits64(Synthetic):
    def build_model(self, rngs: nnx.Rngs):
        return MLP64(self.width, rngs=rngs)


class MLP64(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64 * 64, width, rngs=rngs)
        self.out = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def processes(args) -> None:
    digits = nitro.datasets.digits_arrays()["train"]
    source = AugmentedDigits(digits, 64, args.blur)
    batches = len(source)
    begin = time.perf_counter()
    plan = source.begin_epoch(0)
    for index in range(4):
        source.batch_at(index, plan)
    per_sample = (time.perf_counter() - begin) / (4 * 64)
    print(
        f"jax {jax.__version__}, {os.cpu_count()} cores, load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; digits 8x8 -> 64x64, "
        f"{batches} batches of 64 per epoch, augment {per_sample * 1e3:.2f} ms/sample, "
        f"MLP width {args.width}, {args.workers} workers, {args.epochs} epochs (the first "
        f"not counted)"
    )

    def steps_per_second(data, **keywords) -> tuple[float, str]:
        n = nitro.Nitro(
            Digits64(width=args.width),
            data={"train": data},
            max_epochs=args.epochs,
            progress=False,
            steps_per_dispatch=1,
            **keywords,
        )
        n.train()
        warm = n.history().iloc[1:]  # the first epoch compiles and starts the workers
        path = str(n.binding_report()).split("prefetch ", 1)[1].split("\n", 1)[0]
        return len(warm) * batches / float(warm["epoch_seconds"].sum()), path

    fixed = [source.batch_at(i, plan) for i in range(batches)]
    free, _ = steps_per_second(
        ArrayLoader({k: np.concatenate([b[k] for b in fixed]) for k in ("x", "y")}, 64)
    )
    print(f"data-free (augmented beforehand, in memory): {free:7.1f} steps/s")
    measured = {}
    for mode in ("threads", "processes"):
        measured[mode], path = steps_per_second(
            AugmentedDigits(digits, 64, args.blur), prefetch=mode, prefetch_workers=args.workers
        )
        print(
            f"prefetch={mode!r:12} {measured[mode]:7.1f} steps/s, "
            f"{measured[mode] / free:.2f} of data-free ({path})"
        )
    print(f"processes / threads: {measured['processes'] / measured['threads']:.2f}x")
    auto, path = steps_per_second(AugmentedDigits(digits, 64, args.blur))
    print(f"prefetch='auto'      {auto:7.1f} steps/s ({path})")


def persistent(args) -> None:
    digits = nitro.datasets.digits_arrays()["train"]
    print(
        f"jax {jax.__version__}, {os.cpu_count()} cores, load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.workers} worker processes, "
        f"{len(AugmentedDigits(digits, 64))} augmented batches of 64 a call"
    )
    for kept in (False, True):
        n = nitro.Nitro(
            Digits64(width=args.width),
            data={"train": AugmentedDigits(digits, 64, args.blur)},
            max_epochs=args.epochs + 1,
            prefetch="processes",
            prefetch_workers=args.workers,
            persistent_workers=kept,
            progress=False,
            checkpointer=None,
        )
        n.train(epochs=1)  # compiles (and starts the workers)
        seconds = []
        for _ in range(args.epochs):
            begin = time.perf_counter()
            n.train(epochs=1)
            seconds.append(time.perf_counter() - begin)
        n.close()
        print(
            f"persistent_workers={kept!s:5}: train(epochs=1) after the first: "
            f"{', '.join(f'{x:.2f}' for x in seconds)} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", action="store_true", help="worker processes instead")
    parser.add_argument(
        "--persistent", action="store_true", help="train() calls with persistent_workers"
    )
    parser.add_argument("--workers", type=int, default=2, help="--processes: workers")
    parser.add_argument(
        "--blur", type=int, default=BLUR_ROUNDS, help="--processes: blur rounds (the cost)"
    )
    parser.add_argument("--sleep-ms", type=float, default=16.0, help="t: sleep per batch")
    parser.add_argument("--width", type=int, default=512, help="MLP width (sets s)")
    parser.add_argument("--batches", type=int, default=120, help="batches per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per measurement")
    args = parser.parse_args()

    warnings.filterwarnings("ignore", message="the training loop waited for data")
    if args.processes:
        processes(args)
        return
    if args.persistent:
        persistent(args)
        return
    data = arrays(args.batches)
    t = args.sleep_ms / 1000
    print(
        f"jax {jax.__version__}, {os.cpu_count()} cores, batch {BATCH}x{FEATURES}, "
        f"MLP width {args.width}, {args.batches} batches/epoch, t = {args.sleep_ms:.1f} ms"
    )

    s, _ = step_time(ArrayLoader(data, BATCH), args)
    print(f"s (step, batches in memory):     {1000 * s:6.2f} ms/step")

    inline, inline_wait = step_time(NoPrefetch(SleepingLoader(data, t)), args)
    print(
        f"NoPrefetch, sleeping source:     {1000 * inline:6.2f} ms/step "
        f"(max(t, s) = {1000 * max(t, s):.2f}, t + s = {1000 * (t + s):.2f}; "
        f"data_wait_frac {inline_wait:.2f})"
    )

    # step-bound: enough workers that t / w < s; data-bound: t / w > s
    step_bound = max(2, int(np.ceil(1.25 * t / s)))
    data_bound = max(1, int(t / (1.5 * s)))
    for label, workers in (("step-bound", step_bound), ("data-bound", data_bound)):
        ideal = max(t / workers, s)
        measured, wait = step_time(SleepingLoader(data, t), args, prefetch_workers=workers)
        print(
            f"Nitro, {workers} worker{'s' * (workers != 1)} ({label}): "
            f"{1000 * measured:6.2f} ms/step, ideal max(t/w, s) = {1000 * ideal:.2f}: "
            f"{ideal / measured:.2f} of ideal, {inline / measured:.2f}x NoPrefetch "
            f"(data_wait_frac {wait:.2f})"
        )

    counter = LiveArrayCounter(arrays(250))
    n = nitro.Nitro(Synthetic(width=64), data={"train": counter}, max_epochs=8, progress=False)
    baseline = len(jax.live_arrays())
    began = time.perf_counter()
    n.train()
    live = counter.live[1:]  # the first is the setup probe
    print(
        f"live arrays over {n.step} steps ({time.perf_counter() - began:.1f} s): "
        f"{baseline} before, min {min(live)}, max {max(live)}, "
        f"last 250 max {max(live[-250:])}, {len(jax.live_arrays())} after "
        f"(max - before = {max(live) - baseline})"
    )


if __name__ == "__main__":
    main()
