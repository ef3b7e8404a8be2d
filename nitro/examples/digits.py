"""The main job: an MLP on scikit-learn's bundled digits, end to end.

Run it with `make demo` or `python -m nitro.examples.digits`.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import optax
from flax import nnx

import nitro
from nitro import Device, GraphConst


class MLP(nnx.Module):
    def __init__(self, din: int, width: int, dout: int, *, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(din, width, rngs=rngs)
        self.hidden2 = nnx.Linear(width, width, rngs=rngs)
        self.out = nnx.Linear(width, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.hidden1(x))
        x = nnx.relu(self.hidden2(x))
        return self.out(x)


@nitro.experiment
class Digits:
    """Classify 8x8 handwritten digits with a two-hidden-layer MLP."""

    width: GraphConst[int] = 256
    "hidden width; bakes into the program (changing it recompiles)"
    scale: Device[float] = 1.0
    "input scale; a traced input (changing it never recompiles)"
    batch_size: int = 128
    "samples per batch (Host: read by the driver only)"
    max_epochs: int = 30
    "epochs train() runs to"

    @classmethod
    def presets(cls):
        """Named configurations: `Digits.from_preset("small")`, `Nitro(Digits, preset="small")`."""
        return {
            "small": {"width": 32, "batch_size": 64, "max_epochs": 2},
            "large": {"width": 1024, "max_epochs": 60},
        }

    def build_data(self):
        return nitro.datasets.digits(batch_size=self.batch_size)

    def build_model(self, rngs: nnx.Rngs):
        return MLP(64, self.width, 10, rngs=rngs)

    def forward(self, model, *, x):
        return model(x * self.scale)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def visualize(self, sample, output=None):
        """One digit as its 8x8 image (`n.render()`, `n.top_losses()`)."""
        return sample["x"].reshape(8, 8)

    def metrics(self, logits, *, y):
        return {"acc": (logits.argmax(-1) == y).mean()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--plot", default="digits_history.png", help="where to write the plot")
    args = parser.parse_args(argv)

    began = time.perf_counter()
    n = nitro.Nitro(Digits(max_epochs=args.epochs), seed=0)
    print(n)
    n.train()
    print("\nhistory:")
    print(n.history().round(4).to_string())
    val = n.validate()
    test = n.evaluate(split="test")
    print(f"\nvalidation: {_fmt(val)}")
    print(f"test:       {_fmt(test)}")
    samples = nitro.datasets.digits_arrays()["test"]
    logits = n.predict({"x": samples["x"][:8]})
    print(f"\npredicted {logits.argmax(-1).tolist()}")
    print(f"actual    {samples['y'][:8].tolist()}")
    n.plot(args.plot)
    print(f"\nwrote {args.plot}")
    print(nitro.cache_stats())
    print(f"\ndone in {time.perf_counter() - began:.1f} s")
    if test["test_acc"] < 0.95:
        print(f"test accuracy {test['test_acc']:.3f} is below 0.95", file=sys.stderr)
    return {"val": val, "test": test, "predicted": np.asarray(logits.argmax(-1))}


def _fmt(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


if __name__ == "__main__":
    main()
