"""What importing a PyTorch-layout safetensors file into a Flax NNX model costs against
reading the file alone.

A ConvNeXt-T-sized NNX model (a 4x4 stem, four stages of 3, 3, 9, 3 blocks of a depthwise
7x7 convolution, LayerNorm and two Linears, LayerNorm and 2x2 convolutions between stages:
28 M parameters, about 110 MB in float32) is saved in PyTorch layout with
`nitro.weights.save`. In one process, alternating rounds (the file in the page cache for
both), the script times:

- the baseline: `safetensors.numpy.load_file` of the file, alone;
- the import: `nitro.weights.load(file, model)`: the same read, every Conv and Linear kernel
  transposed from PyTorch's layout, each leaf put on the device and written into the model.

The goal is an import under 2x the baseline.

    python bench/weights.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from flax import nnx  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import nitro.weights  # noqa: E402

DEPTHS = (3, 3, 9, 3)
DIMS = (96, 192, 384, 768)


class Block(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.dwconv = nnx.Conv(dim, dim, (7, 7), feature_group_count=dim, rngs=rngs)
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.pwconv1 = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.pwconv2 = nnx.Linear(4 * dim, dim, rngs=rngs)


class ConvNeXtSized(nnx.Module):
    """ConvNeXt-T's layers and sizes (timm's names: stem, stages.i.downsample, blocks)."""

    def __init__(self, rngs: nnx.Rngs, classes: int = 1000):
        self.stem = nnx.Sequential(
            nnx.Conv(3, DIMS[0], (4, 4), strides=4, rngs=rngs), nnx.LayerNorm(DIMS[0], rngs=rngs)
        )
        self.stages = nnx.List()
        for i, (depth, dim) in enumerate(zip(DEPTHS, DIMS, strict=True)):
            stage = nnx.Dict()
            if i:
                stage["downsample"] = nnx.Sequential(
                    nnx.LayerNorm(DIMS[i - 1], rngs=rngs),
                    nnx.Conv(DIMS[i - 1], dim, (2, 2), strides=2, rngs=rngs),
                )
            stage["blocks"] = nnx.List([Block(dim, rngs) for _ in range(depth)])
            self.stages.append(stage)
        self.norm = nnx.LayerNorm(DIMS[-1], rngs=rngs)
        self.head = nnx.Linear(DIMS[-1], classes, rngs=rngs)


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    path = os.path.join(tempfile.mkdtemp(prefix="weights-"), "convnext.safetensors")
    nitro.weights.save(path, ConvNeXtSized(nnx.Rngs(0)))
    model = ConvNeXtSized(nnx.Rngs(1))
    report = nitro.weights.load(path, model)  # a first round: imports and page cache warm
    reads, imports = [], []
    for _ in range(args.rounds):
        reads.append(timed(lambda: load_file(path)))
        imports.append(timed(lambda: nitro.weights.load(path, model)))
    read, load = statistics.median(reads), statistics.median(imports)
    size = os.path.getsize(path) / 1e6
    print(f"file: {size:.0f} MB, {len(report.loaded)} leaves, {len(report.converted)} converted")
    print(f"safetensors.numpy.load_file: {read * 1e3:8.1f} ms (median of {args.rounds})")
    print(f"nitro.weights.load:          {load * 1e3:8.1f} ms")
    print(f"ratio load / load_file: {load / read:.2f}x (goal < 2x)")


if __name__ == "__main__":
    main()
