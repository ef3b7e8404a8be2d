"""Nitro with the defaults users run, against its peers: steps/s as ratios of a hand-written loop.

For each model, in one process, alternating rounds, every contender trains the same model on
the same data for the same number of steps per round:

- hand-written: a per-step `jax.jit` loop (params and optimizer state donated, numpy batches,
  the epoch's losses read back once per epoch), `optax.adam(1e-3)`: the 1.0x baseline;
- defaults: a live Nitro handle with its defaults (a JSON Lines logger and a checkpointer in a
  run directory, `steps_per_dispatch="auto"`), each round one `train(epochs=E)` call, the
  notebook pattern; only `progress=False` (the script prints its own table);
- lean: the same with `checkpointer=None, logger=None`;
- NNX loop: the Flax NNX tutorial loop (`nnx.Optimizer`, an `@nnx.jit` train step and
  `nnx.MultiMetric`);
- Keras: Keras 3 `fit` with the JAX backend, when keras is installed (optional);
- scan: a hand-written `lax.scan` of K steps per call (the ceiling of fusing steps).

Ratios are medians over rounds of each contender's steps/s over the hand-written loop's in the
same round; warm-up rounds (compiles, `"auto"` choosing its K) are not counted. Data: the
scikit-learn digits (shipped with Nitro) tiled, and generated token sequences for the language
model; nothing is downloaded. Run directories go to a temporary directory, removed at the end.

    python bench/peers.py [--quick] [--models mlp,mlp256,lm,cnn] [--rounds 5] [--epochs 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("KERAS_BACKEND", "jax")  # before anything imports keras

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
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
    alternate_rounds,
    close_handles,
    keras_available,
    keras_loop,
    keras_mlp,
)
from overhead import CNN, train_arrays  # noqa: E402

VOCAB, CONTEXT, WIDTH, LAYERS, HEADS = 64, 64, 64, 2, 4


class Block(nnx.Module):
    def __init__(self, width: int = WIDTH, heads: int = HEADS, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            heads, width, decode=False, deterministic=True, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class TinyLM(nnx.Module):
    """A decoder-only transformer: token and position embeddings, pre-norm causal blocks (the
    sizes default to this benchmark's; bench/sharding.py and the sharding tests use others)."""

    def __init__(
        self,
        vocab: int = VOCAB,
        context: int = CONTEXT,
        width: int = WIDTH,
        layers: int = LAYERS,
        heads: int = HEADS,
        *,
        rngs: nnx.Rngs,
    ):
        self.tokens = nnx.Embed(vocab, width, rngs=rngs)
        self.positions = nnx.Embed(context, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, heads, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.out = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, x):
        h = self.tokens(x) + self.positions(jnp.arange(x.shape[1]))
        mask = nnx.make_causal_mask(x)
        for block in self.blocks:
            h = block(h, mask)
        return self.out(self.norm(h))


def keras_lm():  # pragma: no cover - optional
    import keras

    tokens = keras.Input((CONTEXT,), dtype="int32")
    positions = keras.ops.arange(CONTEXT)
    h = keras.layers.Embedding(VOCAB, WIDTH)(tokens) + keras.layers.Embedding(CONTEXT, WIDTH)(
        positions
    )
    for _ in range(LAYERS):
        a = keras.layers.LayerNormalization(epsilon=1e-6)(h)
        a = keras.layers.MultiHeadAttention(HEADS, WIDTH // HEADS)(a, a, use_causal_mask=True)
        h = h + a
        f = keras.layers.LayerNormalization(epsilon=1e-6)(h)
        f = keras.layers.Dense(4 * WIDTH, activation="gelu")(f)
        h = h + keras.layers.Dense(WIDTH)(f)
    logits = keras.layers.Dense(VOCAB)(keras.layers.LayerNormalization(epsilon=1e-6)(h))
    return keras.Model(tokens, logits)


def keras_cnn():  # pragma: no cover - optional
    import keras

    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Reshape((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.AveragePooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )


def token_arrays(sequences: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Generated next-token data: each sequence walks the vocabulary by steps of 1-3, so the
    next token is learnable from the last two."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, (sequences, 1))
    walk = np.cumsum(rng.integers(1, 4, (sequences, CONTEXT)), axis=1)
    tokens = np.concatenate([start, start + walk], axis=1) % VOCAB
    tokens = tokens.astype(np.int32)
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


# name -> (spec, data at scale 1, K of the scan loop)
MODELS = {
    "mlp": (
        ModelSpec(
            "mlp",
            lambda rngs: MLP((64, 64, 10), rngs=rngs),
            32,
            "MLP 64-64-10, batch 32",
            keras=keras_mlp((64, 64, 10)),
        ),
        lambda scale: train_arrays(8 * scale),
        8,
    ),
    "mlp256": (
        ModelSpec(
            "mlp256",
            lambda rngs: MLP((64, 256, 256, 10), rngs=rngs),
            128,
            "MLP 64-256-256-10, batch 128",
            keras=keras_mlp((64, 256, 256, 10)),
        ),
        lambda scale: train_arrays(8 * scale),
        8,
    ),
    "lm": (
        ModelSpec(
            "lm",
            lambda rngs: TinyLM(rngs=rngs),
            32,
            f"transformer LM d {WIDTH}, {LAYERS} layers, T {CONTEXT}, batch 32",
            keras=keras_lm,
        ),
        lambda scale: token_arrays(32 * 8 * scale),
        8,
    ),
    "cnn": (
        ModelSpec(
            "cnn",
            lambda rngs: CNN(rngs=rngs),
            128,
            "the CNN of bench/overhead.py, batch 128",
            keras=keras_cnn,
        ),
        lambda scale: train_arrays(2 * scale),
        8,
    ),
}

COLUMNS = ["defaults", "lean", "NNX loop", "Keras", "scan"]


def bench_model(name: str, rounds: int, warmup: int, epochs: int, scale: int) -> dict:
    spec, data, k = MODELS[name]
    arrays = data(scale)
    loops = {
        "hand-written": HandWritten(spec, arrays),
        "defaults": WithNitro(spec, arrays, lean=False),
        "lean": WithNitro(spec, arrays),
        "NNX loop": NNXTutorial(spec, arrays),
        "scan": HandWritten(spec, arrays, scan=k),
    }
    keras = keras_loop(spec, arrays)
    if keras is not None:
        loops["Keras"] = keras
    steps = loops["hand-written"].batches // k * k
    print(
        f"\n{name}: {spec.description}; {len(arrays['x'])} samples, "
        f"{loops['hand-written'].batches} batches per epoch, {epochs} epochs per contender per "
        f"round ({epochs * steps} steps in the scan loop, {epochs} x {k} steps per call)"
    )

    def report(r, rates):
        line = "  ".join(f"{key} {rates[key][-1]:.0f}" for key in loops)
        print(f"  round {r + 1}: {line} steps/s")

    rates = alternate_rounds(loops, rounds, warmup, epochs, report)
    base = rates["hand-written"]
    result: dict = {"hand": statistics.median(base)}
    for key, values in rates.items():
        if key != "hand-written":
            result[key] = statistics.median(v / h for v, h in zip(values, base, strict=True))
    defaults = loops["defaults"].handle  # type: ignore[attr-defined]
    result["K"] = defaults.dispatch.describe()
    close_handles(loops)
    print(f"  defaults chose steps per dispatch: {result['K']}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few, short rounds (smoke test)")
    parser.add_argument("--models", default=",".join(MODELS), help="of " + ",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=None, help="rounds not timed (default 2)")
    parser.add_argument("--epochs", type=int, default=2, help="train(epochs=) per round")
    parser.add_argument("--scale", type=int, default=None, help="data size multiplier (2)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    scale = args.scale or (1 if args.quick else 2)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")

    print("bench/peers.py: steps/s as ratios of a hand-written per-step jax.jit loop")
    print(
        f"  jax {jax.__version__} ({jax.devices()[0].platform}), flax {flax.__version__}, "
        f"optax {optax.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
        f"load average {os.getloadavg()[0]:.1f}; adam({LEARNING_RATE:g}); {warmup} warm-up + "
        f"{rounds} timed rounds"
    )
    if not keras_available():
        print("  Keras: not installed (or not on the JAX backend); its column is skipped")
    results = {}
    with tempfile.TemporaryDirectory(prefix="nitro-peers-") as runs, contextlib.chdir(runs):
        for name in names:  # the defaults' run directories go under runs/ here
            results[name] = bench_model(name, rounds, warmup, args.epochs, scale)

    print(f"\nload average {os.getloadavg()[0]:.1f} (other processes on the machine add noise)")
    print("steps/s as ratios of the hand-written loop (1.00x), medians over rounds:\n")
    header = ["model", "hand-written", *COLUMNS]
    rows = [
        [
            name,
            f"{r['hand']:,.0f} steps/s",
            *(f"{r[c]:.2f}x" if c in r else "-" for c in COLUMNS),
        ]
        for name, r in results.items()
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    for name, r in results.items():
        print(f"  {name}: defaults' steps per dispatch {r['K']}")


if __name__ == "__main__":
    main()
