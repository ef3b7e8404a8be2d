"""Models and training loops shared by the benchmark scripts (bench/dispatch.py, bench/peers.py).

A `ModelSpec` names a model factory and its batch size; each loop class trains it on a dict of
arrays (`x`, `y`) and has `run(epochs) -> (steps, seconds)`:

- `HandWritten`: `nnx.split` once, a `jax.jit` step over (params, opt_state) with both donated,
  numpy batches, the epoch's losses read back once per epoch; `scan=K` runs K steps per call
  in a `lax.scan`;
- `NNXTutorial`: the Flax NNX tutorial loop (`nnx.jit` over the model, an `nnx.Optimizer` and
  `nnx.MultiMetric`);
- `WithNitro`: a live Nitro handle, `train(epochs=...)` once per run;
- `keras_loop(...)`: Keras 3 `fit` with the JAX backend, or None when keras is not installed.

Every loop uses `optax.adam(1e-3)` (Keras: `Adam(1e-3)`) and the mean softmax cross-entropy of
integer labels, which covers both classifiers (`y` of shape (B,)) and language models (`y` of
shape (B, T)).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import nitro
from nitro.data import ArrayLoader

LEARNING_RATE = 1e-3


def loss_of(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    make: Callable[[nnx.Rngs], nnx.Module]
    batch: int
    description: str
    keras: Callable[[], Any] | None = None  # builds the same model in Keras (optional)


class MLP(nnx.Module):
    def __init__(self, widths, *, rngs):
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths[:-1], widths[1:], strict=True)]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def keras_mlp(widths):  # pragma: no cover - optional
    def build():
        import keras

        hidden = [keras.layers.Dense(w, activation="relu") for w in widths[1:-1]]
        return keras.Sequential(
            [keras.Input((widths[0],)), *hidden, keras.layers.Dense(widths[-1])]
        )

    return build


# ---------------------------------------------------------------------------------------------
# hand-written loops


class HandWritten:
    """Per-step `jax.jit`, or K steps per call with `lax.scan` (`scan=K`)."""

    def __init__(self, spec: ModelSpec, arrays, scan: int = 1, seed: int = 0):
        self.batch = spec.batch
        graphdef, self.params, rest = nnx.split(spec.make(nnx.Rngs(seed)), nnx.Param, ...)
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
        x, y = self.x[rows], self.y[rows]
        if self.scan == 1:
            return x, y
        lead = (self.scan, self.batch)
        return x.reshape(*lead, *x.shape[1:]), y.reshape(*lead, *y.shape[1:])

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
    `nnx.MultiMetric`, the metrics updated every step and read back once per epoch."""

    def __init__(self, spec: ModelSpec, arrays, seed: int = 0):
        self.batch = spec.batch
        self.model = spec.make(nnx.Rngs(seed))
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
            # the tutorial logs the epoch's metrics; reading them back also waits for the
            # epoch's steps, which `nnx.jit` dispatches asynchronously
            float(self.metrics.compute()["loss"])
            self.metrics.reset()
            self.epoch += 1
        return epochs * self.batches, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Nitro


def experiment_for(spec: ModelSpec, arrays):
    @nitro.experiment
    class Bench:
        model: nitro.GraphConst[str] = spec.name
        max_epochs: int = 1_000_000

        def build_data(self):
            return {"train": ArrayLoader(arrays, spec.batch, shuffle=True, drop_last=True, seed=0)}

        def build_model(self, rngs):
            return spec.make(rngs)

        def forward(self, model, *, x):
            return model(x)

        def loss(self, logits, *, y):
            return loss_of(logits, y)

    return Bench()


class WithNitro:
    """A live handle; each `run(epochs)` is one `train(epochs=epochs)` call (then, untimed,
    `wait()` for its background save, so it does not slow the next contender). Lean by default
    (`logger=None, checkpointer=None`); `lean=False` keeps Nitro's defaults (a JSON Lines
    logger and a checkpointer in a run directory under the working directory). `keywords` go
    to `nitro.Nitro`; `progress=False` unless given."""

    def __init__(
        self,
        spec: ModelSpec,
        arrays,
        steps: int | str = "auto",
        seed: int = 0,
        lean: bool = True,
        **keywords,
    ):
        keywords = {
            "progress": False,
            **({"logger": None, "checkpointer": None} if lean else {}),
            **keywords,
        }
        self.handle = nitro.Nitro(
            experiment_for(spec, arrays), seed=seed, steps_per_dispatch=steps, **keywords
        )
        self.batches = len(self.handle.splits["train"])

    def run(self, epochs: int) -> tuple[int, float]:
        start = time.perf_counter()
        self.handle.train(epochs=epochs)
        took = time.perf_counter() - start
        # its end-of-call save, written in the background, is finished before the next
        # contender starts (not timed): no contender's round carries another's writes.
        # What back-to-back calls of one handle pay for overlapping saves, bench/lifecycle.py
        # measures.
        self.handle.wait()
        return epochs * self.batches, took


# ---------------------------------------------------------------------------------------------
# Keras (optional; never a dependency)


def keras_available() -> bool:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    try:
        import keras
    except ImportError:
        return False
    return keras.backend.backend() == "jax"


def keras_loop(spec: ModelSpec, arrays):  # pragma: no cover - optional
    """Keras 3 `fit` over the same arrays, or None (keras missing, another backend, or no
    Keras version of this model)."""
    if spec.keras is None or not keras_available():
        return None
    import keras

    model = spec.keras()
    model.compile(
        optimizer=keras.optimizers.Adam(LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    batches = len(arrays["x"]) // spec.batch
    # fit keeps a last partial batch; drop it so every loop runs the same steps
    x, y = arrays["x"][: batches * spec.batch], arrays["y"][: batches * spec.batch]

    class Keras:
        def __init__(self):
            self.batches = batches

        def run(self, epochs):
            start = time.perf_counter()
            model.fit(x, y, batch_size=spec.batch, epochs=epochs, verbose=0, shuffle=True)
            return epochs * batches, time.perf_counter() - start

    return Keras()


def alternate_rounds(loops: dict, rounds: int, warmup: int, epochs: int, after_round=None):
    """Steps/s of each loop, round after round in alternating order (forward, then
    reversed), `epochs` a run; the first `warmup` rounds are not counted. `after_round(r,
    rates)` runs after each counted round (r from 0)."""
    rates: dict[str, list[float]] = {key: [] for key in loops}
    for r in range(warmup + rounds):
        order = list(loops) if r % 2 == 0 else list(reversed(loops))
        for key in order:
            done, wall = loops[key].run(epochs)
            if r >= warmup:
                rates[key].append(done / wall)
        if r >= warmup and after_round is not None:
            after_round(r - warmup, rates)
    return rates


def close_handles(loops: dict) -> None:
    """Close the Nitro handles among `loops`: their saves finish before their run
    directories go."""
    for loop in loops.values():
        if isinstance(loop, WithNitro):
            loop.handle.close()


@contextlib.contextmanager
def busy_neighbours(count: int, script: str, runs: str) -> Iterator[None]:
    """`count` CPU-bound processes beside the benchmark (each a Python busy loop), killed when
    it ends, and a temporary working directory for its run directories (`runs`: its prefix);
    prints the machine's cores and load first."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        print(
            f"{script}: {os.cpu_count()} cpus, {count} busy processes beside it, "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        with tempfile.TemporaryDirectory(prefix=runs) as directory, contextlib.chdir(directory):
            yield
    finally:
        for process in busy:
            process.kill()
