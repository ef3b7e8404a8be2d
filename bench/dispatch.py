"""Fused multi-step dispatch: Nitro with K steps per program call against hand-written loops.

For each model, in one process, alternating rounds, medians of steps/s, as ratios against a
hand-written per-step `jax.jit` loop (params and optimizer state donated, numpy batches, the
epoch's losses read back once per epoch):

- nitro K=1 (one step per call) and nitro "auto" (the default: it measures the first steps
  and picks K), nitro K=8;
- a hand-written `lax.scan` loop, 8 steps per call (what fusing can reach by hand);
- the Flax NNX tutorial loop (`nnx.jit` over the model, an `nnx.Optimizer` and
  `nnx.MultiMetric`), the baseline most Flax users start from;
- Keras 3 `fit` with the JAX backend, when keras is installed (optional).

Also printed: the compile time of the K=8 program against the K=1 program, and for evaluation
(not fused) batches/s of `n.evaluate` over the tiled split against a hand-written per-batch
`jax.jit` evaluation and a hand-written `lax.scan` of 8 batches per call (what fusing
evaluation could gain).

    python bench/dispatch.py [--rounds 7] [--seconds 1.0] [--models small,medium,cnn]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import flax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from loops import (  # noqa: E402
    LEARNING_RATE,
    MLP,
    HandWritten,
    ModelSpec,
    NNXTutorial,
    WithNitro,
    keras_loop,
    keras_mlp,
    loss_of,
)
from overhead import CNN, train_arrays  # noqa: E402

import nitro  # noqa: E402

MODELS = {
    "small": ModelSpec(
        "small",
        lambda rngs: MLP((64, 64, 10), rngs=rngs),
        32,
        "MLP 64-64-10, batch 32",
        keras=keras_mlp((64, 64, 10)),
    ),
    "medium": ModelSpec(
        "medium",
        lambda rngs: MLP((64, 256, 256, 10), rngs=rngs),
        128,
        "MLP 64-256-256-10, batch 128",
        keras=keras_mlp((64, 256, 256, 10)),
    ),
    "cnn": ModelSpec(
        "cnn", lambda rngs: CNN(rngs=rngs), 128, "the CNN of bench/overhead.py, batch 128"
    ),
}


def compile_seconds(name, arrays, steps) -> float:
    nitro.cache_reset()
    nitro.set_compilation_cache(None)  # time real compiles, not cache reads
    loop = WithNitro(MODELS[name], arrays, steps)
    loop.run(1)
    seconds = sum(r.seconds for r in nitro.explain_compiles() if "train" in r.program)
    return seconds


def bench_model(name: str, rounds: int, seconds: float, tile: int) -> dict[str, float]:
    arrays = train_arrays(tile)
    spec = MODELS[name]
    description = spec.description
    loops = {
        "hand-written": HandWritten(spec, arrays),
        "nitro K=1": WithNitro(spec, arrays, 1),
        "nitro auto": WithNitro(spec, arrays, "auto"),
        "nitro K=8": WithNitro(spec, arrays, 8),
        "hand-written scan 8": HandWritten(spec, arrays, scan=8),
        "NNX tutorial": NNXTutorial(spec, arrays),
    }
    keras = keras_loop(spec, arrays)
    if keras is not None:
        loops["Keras fit"] = keras
    for loop in loops.values():  # compile, settle; auto measures and decides here
        loop.run(3)
    steps, elapsed = loops["hand-written"].run(1)
    epochs = max(1, round(seconds * steps / elapsed / loops["hand-written"].batches))
    plan = loops["nitro auto"].handle.dispatch
    print(
        f"\n{name}: {description}; {len(arrays['x'])} samples, "
        f"{loops['hand-written'].batches} batches per epoch, {epochs} epochs per loop per "
        f"round; auto chose {plan.describe()}"
    )
    rates: dict[str, list[float]] = {key: [] for key in loops}
    for r in range(rounds):
        order = list(loops) if r % 2 == 0 else list(reversed(loops))
        for key in order:
            done, wall = loops[key].run(epochs)
            rates[key].append(done / wall)
    base = statistics.median(rates["hand-written"])
    result = {}
    for key, values in rates.items():
        rate = statistics.median(values)
        ratio = statistics.median(v / h for v, h in zip(values, rates["hand-written"], strict=True))
        result[key] = ratio
        print(f"  {key:<20} {rate:>9.0f} steps/s  {ratio:>6.2f}x")
    k1 = compile_seconds(name, arrays, 1)
    k8 = compile_seconds(name, arrays, 8)
    print(f"  compile: K=8 {k8:.2f} s, K=1 {k1:.2f} s ({k8 / k1:.2f}x)")
    result["compile ratio"] = k8 / k1
    evaluation = bench_eval(name, loops["nitro auto"].handle, arrays, rounds)
    result["eval nitro"], result["eval scan"] = evaluation["nitro"], evaluation["hand scan 8"]
    del base
    return result


def bench_eval(name: str, handle, arrays, rounds: int) -> dict[str, float]:
    """Batches/s of evaluation over `arrays`: Nitro's `evaluate` (one call per batch), a
    hand-written per-batch jit and a hand-written scan over 8 batches per call."""
    batch = MODELS[name].batch
    graphdef, params, rest = nnx.split(handle.model, nnx.Param, ...)
    batches = len(arrays["x"]) // batch
    x = arrays["x"][: batches * batch].reshape(batches, batch, -1)
    y = arrays["y"][: batches * batch].reshape(batches, batch)

    def one(params, x, y):
        return loss_of(nnx.merge(graphdef, params, rest)(x), y)

    per_batch = jax.jit(one)
    scanned = jax.jit(lambda p, xs, ys: jax.lax.scan(lambda c, b: (c, one(p, *b)), 0, (xs, ys))[1])

    def hand(scan):
        losses = []
        if scan == 1:
            for i in range(batches):
                losses.append(per_batch(params, x[i], y[i]))
        else:
            for i in range(0, batches - scan + 1, scan):
                losses.append(scanned(params, x[i : i + scan], y[i : i + scan]))
        float(np.mean([np.mean(v) for v in jax.device_get(losses)]))
        return batches // scan * scan

    def nitro_eval():
        handle.evaluate(split="train")
        return batches

    loops = {"hand-written": lambda: hand(1), "hand scan 8": lambda: hand(8), "nitro": nitro_eval}
    for run in loops.values():
        run()
    rates: dict[str, list[float]] = {key: [] for key in loops}
    for _ in range(rounds):
        for key, run in loops.items():
            start = time.perf_counter()
            done = run()
            rates[key].append(done / (time.perf_counter() - start))
    base = statistics.median(rates["hand-written"])
    result = {key: statistics.median(v) / base for key, v in rates.items()}
    print(
        f"  evaluation ({batches} batches): hand-written {base:.0f} batches/s, nitro "
        f"{result['nitro']:.2f}x, hand scan 8 {result['hand scan 8']:.2f}x"
    )
    return result


GOALS = {"small": 3.0, "medium": 1.3, "cnn": 1.0}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.0, help="per loop per round")
    parser.add_argument("--tile", type=int, default=8, help="repeat the train split this often")
    parser.add_argument("--models", default="small,medium,cnn")
    args = parser.parse_args(argv)
    print("bench/dispatch.py: steps/s against a hand-written per-step jax.jit loop")
    print(
        f"  jax {jax.__version__} ({jax.devices()[0].platform}), flax {flax.__version__}, "
        f"optax {optax.__version__}, {os.cpu_count()} cpus, load average "
        f"{os.getloadavg()[0]:.1f}; adam({LEARNING_RATE:g}), digits tiled {args.tile}x"
    )
    results = {
        name: bench_model(name, args.rounds, args.seconds, args.tile)
        for name in args.models.split(",")
    }
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    print("nitro auto / hand-written (goal), nitro K=1 / hand-written (goal 0.95 on small):")
    for name, r in results.items():
        print(
            f"  {name}: auto {r['nitro auto']:.2f}x (goal >= {GOALS[name]:g}), "
            f"K=1 {r['nitro K=1']:.2f}x, K=8 {r['nitro K=8']:.2f}x, hand scan 8 "
            f"{r['hand-written scan 8']:.2f}x, NNX tutorial {r['NNX tutorial']:.2f}x; "
            f"evaluation: nitro {r['eval nitro']:.2f}x, hand scan 8 {r['eval scan']:.2f}x"
        )


if __name__ == "__main__":
    main()
