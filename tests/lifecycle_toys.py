"""Experiments and child processes for tests/test_lifecycle.py.

The children run `python -c "import lifecycle_toys; lifecycle_toys.main()" MODE RUN_DIR OUT`
with this folder and the checkout on PYTHONPATH, so the experiments they train are the same
classes (`lifecycle_toys.Wide`, ...) the test process resumes:

- `saves`: trains `Wide` with a checkpoint every epoch until killed; prints "training <pid>"
  at its first step. A RUN_DIR given as `named:<dir>` names the checkpoints `wide-<step>`. `zygote()` forks such children from one process that has imported
  everything already (no JAX backend is started before the fork), so each starts in a
  fraction of a second instead of the seconds importing JAX takes.
- `full`: trains `Dropped` for 5 epochs, writes its parameters and history to OUT.
- `crash`: trains `Dropped` and SIGKILLs itself in the middle of epoch 3.
- `resume`: resumes `Dropped` from RUN_DIR (`resume="auto"`), finishes the 5 epochs, writes OUT.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import optax
from flax import nnx

import nitro
from nitro import GraphConst

RNG = np.random.default_rng(1)
X = RNG.normal(size=(96, 5)).astype(np.float32)
Y = (X[:, 0] * X[:, 1] > 0).astype(np.int32)


def splits(batch_size: int):
    return {
        "train": nitro.data.ArrayLoader({"x": X[:64], "y": Y[:64]}, batch_size, seed=3),
        "val": nitro.data.ArrayLoader(
            {"x": X[64:], "y": Y[64:]}, 16, shuffle=False, drop_last=False
        ),
    }


class WideMLP(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(5, width, rngs=rngs)
        self.hidden2 = nnx.Linear(width, width, rngs=rngs)
        self.out = nnx.Linear(width, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden2(nnx.relu(self.hidden1(x)))))


@nitro.experiment
class Wide:
    """Two steps an epoch on a model whose saves take a while (width 512: 0.27 M parameters,
    3 MB with Adam's moments)."""

    width: GraphConst[int] = 512
    max_epochs: int = 10_000

    def build_data(self):
        return splits(32)

    def build_model(self, rngs):
        return WideMLP(self.width, rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class DropoutMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(5, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.hidden(x))))


@nitro.experiment
class Dropped:
    """Eight shuffled batches an epoch through a dropout layer: the data order and the dropout
    masks both have to replay exactly after a resume."""

    max_epochs: int = 5

    def build_data(self):
        return splits(8)

    def build_model(self, rngs):
        return DropoutMLP(rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def parameters(n: nitro.Nitro) -> dict[str, np.ndarray]:
    """The handle's parameters by dotted path, as numpy arrays."""
    paths = n.setup.model.leaf_paths["parameter"]
    return {
        path: np.asarray(leaf) for path, leaf in zip(paths, n.state.variables.params, strict=True)
    }


def write_result(n: nitro.Nitro, out: str) -> None:
    np.savez(out + ".npz", **parameters(n))
    history = n.history()
    with open(out + ".json", "w") as file:
        json.dump(
            {
                "loss": history["loss"].tolist(),
                "val_loss": history["val_loss"].tolist(),
                "step": n.step,
                "epoch": n.epoch,
                "run_id": n.run_id,
            },
            file,
        )


class KillAt:
    """A reporter that SIGKILLs its own process once `step` steps are read back, after the
    checkpoint `saved` has landed (orbax writes it in the background meanwhile)."""

    def __init__(self, step: int, saved: Path):
        self.at, self.saved = step, saved

    def step(self, step, loss):
        if step >= self.at:
            deadline = time.monotonic() + 300
            while not self.saved.is_dir() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)


class SayTraining:
    def __init__(self):
        self.said = False

    def step(self, step, loss):
        if not self.said:
            self.said = True
            print(f"training {os.getpid()}", flush=True)


def zygote() -> None:
    """Read run directories from stdin; for each, fork a child that trains `Wide` there with a
    checkpoint every epoch (mode `saves`) and print "child <pid>". Children are reaped by the
    kernel (SIGCHLD ignored), so a killed one disappears at once."""
    import orbax.checkpoint  # noqa: F401

    import nitro.handle  # noqa: F401 - load the engine before forking

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    for line in sys.stdin:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                main(["saves", line.strip()])
            finally:
                os._exit(0)
        print(f"child {pid}", flush=True)


def main(argv: list[str] | None = None) -> None:
    mode, run_dir, *rest = argv if argv is not None else sys.argv[1:]
    every_epoch = nitro.Checkpointer(budget=None)
    if mode == "saves":
        named = run_dir.startswith("named:")
        n = nitro.Nitro(
            Wide(),
            run_dir=run_dir.removeprefix("named:"),
            checkpointer=nitro.Checkpointer(
                k=2, budget=None, name="wide-{step:05d}" if named else None
            ),
            progress=SayTraining(),
            logger=None,
        )
        n.train()
    elif mode == "full":
        n = nitro.Nitro(Dropped(), run_dir=run_dir, checkpointer=every_epoch, progress=False)
        write_result(n.train(), rest[0])
    elif mode == "crash":
        # the middle of epoch 3 (8 steps an epoch), once epoch 2's checkpoint is on disk
        progress = KillAt(2 * 8 + 3, Path(run_dir) / "checkpoints" / "16")
        nitro.Nitro(Dropped(), run_dir=run_dir, checkpointer=every_epoch, progress=progress).train()
        raise SystemExit("the run was not killed")
    elif mode == "resume":
        n = nitro.Nitro(
            Dropped(), run_dir=run_dir, checkpointer=every_epoch, resume="auto", progress=False
        )
        print(f"resumed at epoch {n.epoch}, step {n.step}", flush=True)
        write_result(n.train(), rest[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
