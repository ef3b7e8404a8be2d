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
from overhead import CNN, train_arrays  # noqa: E402

import nitro  # noqa: E402
from nitro.data import ArrayLoader  # noqa: E402

LEARNING_RATE = 1e-3


class MLP(nnx.Module):
    def __init__(self, widths, *, rngs):
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths[:-1], widths[1:], strict=True)]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


MODELS = {  # name -> (model factory, batch size, description)
    "small": (lambda rngs: MLP((64, 64, 10), rngs=rngs), 32, "MLP 64-64-10, batch 32"),
    "medium": (
        lambda rngs: MLP((64, 256, 256, 10), rngs=rngs),
        128,
        "MLP 64-256-256-10, batch 128",
    ),
    "cnn": (lambda rngs: CNN(rngs=rngs), 128, "the CNN of bench/overhead.py, batch 128"),
}


def loss_of(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# ---------------------------------------------------------------------------------------------
# hand-written loops


class HandWritten:
    """Per-step `jax.jit`, or K steps per call with `lax.scan` (`scan=K`)."""

    def __init__(self, name, arrays, scan: int = 1, seed: int = 0):
        make, self.batch, _ = MODELS[name]
        graphdef, self.params, rest = nnx.split(make(nnx.Rngs(seed)), nnx.Param, ...)
        tx = optax.adam(LEARNING_RATE)
        self.opt_state = tx.init(self.params)
        self.x, self.y = arrays["x"], arrays["y"]
        self.batches = len(self.x) // self.batch
        self.scan, self.epoch, self.seed = scan, 0, seed

        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(lambda p: loss_of(nnx.merge(graphdef, p, rest)(x), y))(
                params
            )
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        def steps(params, opt_state, xs, ys):
            def body(carry, batch):
                params, opt_state, loss = step(*carry, *batch)
                return (params, opt_state), loss

            (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), (xs, ys))
            return params, opt_state, losses

        self.fn = jax.jit(step if scan == 1 else steps, donate_argnums=(0, 1))

    def args_for(self, rows):
        if self.scan == 1:
            return self.x[rows], self.y[rows]
        shape = (self.scan, self.batch)
        return self.x[rows].reshape(*shape, -1), self.y[rows].reshape(shape)

    def run(self, epochs: int) -> tuple[int, float]:
        start = time.perf_counter()
        per_call = self.batch * self.scan
        calls = self.batches // self.scan
        for _ in range(epochs):
            order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.x))
            losses = []
            for i in range(calls):
                rows = order[i * per_call : (i + 1) * per_call]
                self.params, self.opt_state, loss = self.fn(
                    self.params, self.opt_state, *self.args_for(rows)
                )
                losses.append(loss)
            float(np.mean(jax.device_get(losses)))
            self.epoch += 1
        return epochs * calls * self.scan, time.perf_counter() - start


class NNXTutorial:
    """The Flax NNX tutorial loop: `nnx.jit` over the model, an `nnx.Optimizer` and
    `nnx.MultiMetric`, the metrics computed every step."""

    def __init__(self, name, arrays, seed: int = 0):
        make, self.batch, _ = MODELS[name]
        self.model = make(nnx.Rngs(seed))
        self.optimizer = nnx.Optimizer(self.model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
        self.metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
        self.x, self.y = arrays["x"], arrays["y"]
        self.batches = len(self.x) // self.batch
        self.epoch, self.seed = 0, seed

        @nnx.jit
        def train_step(model, optimizer, metrics, x, y):
            def loss_fn(model):
                return loss_of(model(x), y)

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            metrics.update(loss=loss)
            optimizer.update(model, grads)

        self.train_step = train_step

    def run(self, epochs: int) -> tuple[int, float]:
        start = time.perf_counter()
        for _ in range(epochs):
            order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.x))
            for i in range(self.batches):
                rows = order[i * self.batch : (i + 1) * self.batch]
                self.train_step(
                    self.model, self.optimizer, self.metrics, self.x[rows], self.y[rows]
                )
            self.metrics.compute()
            self.metrics.reset()
            self.epoch += 1
        return epochs * self.batches, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Nitro


def experiment_for(name, arrays):
    make, batch, _ = MODELS[name]

    @nitro.experiment
    class Dispatch:
        model: nitro.GraphConst[str] = name
        max_epochs: int = 1_000_000

        def build_data(self):
            return {"train": ArrayLoader(arrays, batch, shuffle=True, drop_last=True, seed=0)}

        def build_model(self, rngs):
            return make(rngs)

        def forward(self, model, *, x):
            return model(x)

        def loss(self, logits, *, y):
            return loss_of(logits, y)

    return Dispatch()


class WithNitro:
    def __init__(self, name, arrays, steps, seed: int = 0):
        self.handle = nitro.Nitro(
            experiment_for(name, arrays),
            seed=seed,
            progress=False,
            steps_per_dispatch=steps,
            logger=None,
            checkpointer=None,
        )
        self.batches = len(self.handle.splits["train"])

    def run(self, epochs: int) -> tuple[int, float]:
        start = time.perf_counter()
        self.handle.train(epochs=epochs)
        return epochs * self.batches, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------


def keras_loop(name, arrays):  # pragma: no cover - optional
    try:
        os.environ.setdefault("KERAS_BACKEND", "jax")
        import keras
    except ImportError:
        return None
    if keras.backend.backend() != "jax" or name == "cnn":
        return None
    _, batch, _ = MODELS[name]
    widths = (64, 64, 10) if name == "small" else (64, 256, 256, 10)
    layers = [keras.layers.Dense(w, activation="relu") for w in widths[1:-1]]
    model = keras.Sequential([keras.Input((64,)), *layers, keras.layers.Dense(widths[-1])])
    model.compile(
        optimizer=keras.optimizers.Adam(LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )

    class Keras:
        batches = len(arrays["x"]) // batch

        def run(self, epochs):
            start = time.perf_counter()
            model.fit(
                arrays["x"],
                arrays["y"],
                batch_size=batch,
                epochs=epochs,
                verbose=0,
                shuffle=True,
            )
            return epochs * self.batches, time.perf_counter() - start

    return Keras()


def compile_seconds(name, arrays, steps) -> float:
    nitro.cache_reset()
    nitro.set_compilation_cache(None)  # time real compiles, not cache reads
    loop = WithNitro(name, arrays, steps)
    loop.run(1)
    seconds = sum(r.seconds for r in nitro.explain_compiles() if "train" in r.program)
    return seconds


def bench_model(name: str, rounds: int, seconds: float, tile: int) -> dict[str, float]:
    arrays = train_arrays(tile)
    _, batch, description = MODELS[name]
    loops = {
        "hand-written": HandWritten(name, arrays),
        "nitro K=1": WithNitro(name, arrays, 1),
        "nitro auto": WithNitro(name, arrays, "auto"),
        "nitro K=8": WithNitro(name, arrays, 8),
        "hand-written scan 8": HandWritten(name, arrays, scan=8),
        "NNX tutorial": NNXTutorial(name, arrays),
    }
    keras = keras_loop(name, arrays)
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
    _, batch, _ = MODELS[name]
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
