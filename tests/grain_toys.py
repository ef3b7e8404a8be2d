"""Experiments over Grain and Hugging Face sources, and the child processes of
tests/test_data_grain.py's crash test:
`python -c "import grain_toys; grain_toys.main()" MODE RUN_DIR OUT` with modes `full` (train
`Augmented` 4 epochs, write its parameters and history to OUT), `crash` (SIGKILL itself in
the middle of epoch 3) and `resume` (resume RUN_DIR, finish, write OUT)."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import grain
import numpy as np
import optax
from flax import nnx
from lifecycle_toys import KillAt, write_result

import nitro

RNG = np.random.default_rng(5)
X = RNG.normal(size=(96, 5)).astype(np.float32)
Y = (X[:, 0] * X[:, 1] > 0).astype(np.int32)


def rows(lo: int, hi: int) -> list[dict[str, np.ndarray]]:
    return [{"x": X[i], "y": Y[i]} for i in range(lo, hi)]


def jitter(sample, rng: np.random.Generator):
    """A random augmentation: Gaussian noise and a random sign flip of each sample."""
    noise = rng.normal(scale=0.3, size=sample["x"].shape).astype(np.float32)
    sign = np.float32(rng.choice([-1.0, 1.0]))
    return {"x": sign * sample["x"] + noise, "y": sample["y"]}


def augmented(seed: int = 11):
    """64 training samples, randomly augmented by Grain (`random_map`, seeded)."""
    return grain.MapDataset.source(rows(0, 64)).random_map(jitter, seed=seed)


def _mark(folder: str, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A per-batch map that notes which process ran it: a line in a file named by its pid."""
    with open(Path(folder, str(os.getpid())), "a") as file:
        file.write("batch\n")
    return batch


def batched_marked(folder: str):
    """The 64 training samples in batches of 8, in order, through a Python map per batch that
    marks its process in `folder`."""
    return grain.MapDataset.source(rows(0, 64)).batch(8).map(functools.partial(_mark, folder))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(5, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.hidden(x))))


@nitro.experiment
class Augmented:
    """Eight batches of 8 an epoch from an unbatched, randomly augmented grain.MapDataset
    (Nitro batches it by `batch_size` and shuffles it by the run's seed); an unbatched
    'val' dataset, kept in order."""

    batch_size: int = 8
    max_epochs: int = 4

    def build_data(self):
        return {"train": augmented(), "val": grain.MapDataset.source(rows(64, 96))}

    def build_model(self, rngs):
        return MLP(rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(argv: list[str] | None = None) -> None:
    mode, run_dir, *rest = argv if argv is not None else sys.argv[1:]
    every_epoch = nitro.Checkpointer(budget=None)
    if mode == "full":
        n = nitro.Nitro(Augmented(), run_dir=run_dir, checkpointer=every_epoch, progress=False)
        write_result(n.train(), rest[0])
    elif mode == "crash":  # the middle of epoch 3, once epoch 2's checkpoint is on disk
        progress = KillAt(2 * 8 + 3, Path(run_dir) / "checkpoints" / "16")
        nitro.Nitro(
            Augmented(), run_dir=run_dir, checkpointer=every_epoch, progress=progress
        ).train()
        raise SystemExit("the run was not killed")
    elif mode == "resume":
        n = nitro.Nitro(
            Augmented(), run_dir=run_dir, checkpointer=every_epoch, resume="auto", progress=False
        )
        print(f"resumed at epoch {n.epoch}, step {n.step}", flush=True)
        write_result(n.train(), rest[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
