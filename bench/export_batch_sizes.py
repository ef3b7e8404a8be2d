"""Batch sizes in a bundle: one program with a symbolic batch axis, or one program per size?

`n.export(dir, batch_sizes=(1, 8, 32))` keeps one program with a symbolic batch axis and pads
each call to the smallest size that fits. This measures what one program per size would
change, for a 64-256-256-10 MLP on this machine: the serialized bytes, the compile time of
each size, and the time of a call (the fastest and the median of 10 runs of 1,000 calls,
the symbolic program measured before and after the concrete one).

    python bench/export_batch_sizes.py [--sizes 1,8,32]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import export


def forward(weights, x):
    hidden = jax.nn.relu(x @ weights["w1"])
    hidden = jax.nn.relu(hidden @ weights["w2"])
    return hidden @ weights["w3"]


def main() -> None:
    parser = argparse.ArgumentParser(description="one bundle program or one per batch size")
    parser.add_argument("--sizes", default="1,8,32")
    sizes = [int(s) for s in parser.parse_args().sizes.split(",")]
    rng = np.random.default_rng(0)
    shapes = {"w1": (64, 256), "w2": (256, 256), "w3": (256, 10)}
    weights = jax.device_put(
        {k: rng.normal(size=shape).astype(np.float32) for k, shape in shapes.items()}
    )
    specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in weights.items()}

    def exported(batch) -> bytes:
        x = jax.ShapeDtypeStruct((batch, 64), jnp.float32)
        return bytes(export.export(jax.jit(forward), platforms=("cpu",))(specs, x).serialize())

    (symbol,) = export.symbolic_shape("batch")
    blobs = {"symbolic": exported(symbol), **{n: exported(n) for n in sizes}}
    concrete = sum(len(blobs[n]) for n in sizes)
    print(f"bytes: symbolic {len(blobs['symbolic']):,}; {len(sizes)} concrete {concrete:,}")
    symbolic = jax.jit(export.deserialize(bytearray(blobs["symbolic"])).call)

    def timed(call, x, calls=1000) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            call(weights, x).block_until_ready()
        return (time.perf_counter() - start) / calls * 1e6

    def compiled(call, x) -> float:
        start = time.perf_counter()
        call(weights, x).block_until_ready()
        return (time.perf_counter() - start) * 1e3

    for n in sizes:
        x = np.zeros((n, 64), np.float32)
        fixed = jax.jit(export.deserialize(bytearray(blobs[n])).call)
        compile_s, compile_c = compiled(symbolic, x), compiled(fixed, x)
        runs_s = [timed(symbolic, x) for _ in range(5)]
        runs_c = [timed(fixed, x) for _ in range(10)]
        runs_s += [timed(symbolic, x) for _ in range(5)]
        print(
            f"batch {n}: compile symbolic {compile_s:.0f} ms, concrete {compile_c:.0f} ms; "
            f"call symbolic {min(runs_s):.1f} us (median {np.median(runs_s):.1f}), "
            f"concrete {min(runs_c):.1f} us (median {np.median(runs_c):.1f})"
        )


if __name__ == "__main__":
    main()
