"""Runs with 4 fake CPU devices (tests/test_export.py sets XLA_FLAGS before JAX starts): trains
a BatchNorm + Dropout model on a 4-device mesh, exports it to argv[1]/bundle and saves its
predictions, for the test to compare with the bundle loaded on one device."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
from mesh_checks import MeshToy

import nitro


def main(out: str) -> None:
    n = nitro.Nitro(MeshToy(max_epochs=1), n_devs=4, progress=False)
    n.train()
    x = np.random.default_rng(5).normal(size=(13, 6)).astype(np.float32)
    np.save(os.path.join(out, "x.npy"), x)
    np.save(os.path.join(out, "predicted.npy"), n.predict({"x": x}))
    n.export(os.path.join(out, "bundle"))
    json.dump({"devices": jax.device_count(), "n_devs": n.placement.n_devs}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
