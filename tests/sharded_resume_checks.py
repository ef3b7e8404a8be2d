"""Child processes for tests/test_sharded_resume.py, run with fake CPU devices (the test sets
XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts):

    python tests/sharded_resume_checks.py MODE WORK_DIR

The model is the digits demo's MLP: no model state (no Dropout, no BatchNorm), so its
checkpoints hold an empty `model_state`.

- `train` (8 devices): trains `Digits` sharded (`sharding="fsdp"`) for 2 epochs in
  WORK_DIR/trained (the default runs/ folder of that directory), and waits for its saves.
- `resume` (N devices): a new process, the same keywords and `resume="auto"`, on a copy in
  WORK_DIR/onN, trains one more epoch; then a model of another width asks to resume it.
  Before it, a replicated handle starts from the trained run's weights (`weights=`).

Each prints one JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import nitro
from nitro.errors import SetupError
from nitro.examples.digits import MLP, Digits


@nitro.experiment
class Narrow(Digits):
    """The digits MLP at half the width, a change of code: its checkpoints differ in shape."""

    def build_model(self, rngs: nnx.Rngs):
        return MLP(64, 128, 10, rngs=rngs)


def keywords() -> dict:
    return {"n_devs": jax.device_count(), "sharding": "fsdp", "progress": False}


def parameters(n) -> dict[str, list]:
    return {
        str(i): np.asarray(x).ravel()[:8].tolist() for i, x in enumerate(n.state.variables.params)
    }


def main(mode: str, work: Path) -> None:
    results: dict = {"devices": jax.device_count()}
    if mode == "train":
        os.chdir(work / "trained")
        n = nitro.Nitro(Digits(batch_size=96), **keywords())
        n.train(2)
        n.wait()
        results.update(step=n.step, run_dir=str(n.run_dir), params=parameters(n))
    elif mode == "resume":
        here = work / f"on{jax.device_count()}"
        shutil.copytree(work / "trained", here)
        os.chdir(here)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trained = next((here / "runs" / "Digits").iterdir())
            started = nitro.Nitro(
                Digits(batch_size=96), weights=trained, checkpointer=None, progress=False
            )
            results["weights"] = parameters(started)  # its weights, on one replicated layout
            n = nitro.Nitro(Digits(batch_size=96), resume="auto", **keywords())
            resumed_at = n.step
            resumed = parameters(n)
            n.train(1)
            n.wait()
            results.update(resumed_at=resumed_at, step=n.step, params=resumed)
            run_dir = n.run_dir
            n.close()
            try:
                nitro.Nitro(Narrow(batch_size=96), resume=str(run_dir), **keywords()).train(1)
                results["misfit"] = None
            except SetupError as error:
                results["misfit"] = str(error)
        results["warnings"] = [str(w.message) for w in caught]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
