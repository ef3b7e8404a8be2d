"""Across models: does one call for K bundles of one program pay against K calls, on this CPU?

`nitro serve` shares one compiled program among bundles of one architecture and batches
requests per model. Requests for K different models that share the program could go in one
call instead of K. This measures it in process, without the server: K bundles of the digits
MLP (`--model digits`) or of the 25 MB CNN of `bench/serve.py` (`--model cnn`), differently
seeded, each called on `--rows` rows:

- K calls, one per weight set (what the server does now);
- one call of a program that runs the K (the exported program called K times inside one
  `jax.jit`: a bundle's program is a `jax.export` artifact, and JAX has no batching rule for
  it, so `jax.vmap` over stacked weight sets is refused, as the script shows);
- the cost of stacking the K weight sets along a leading axis, which a vmap would need on
  every call whose models differ.

Prints the time of each, their ratio, and whether the outputs are bitwise equal.

    python bench/serve_across_models.py [--model digits] [--models 2,4,8] [--rows 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np


def seconds_per_call(function, budget: float = 1.0) -> float:
    for _ in range(5):
        function()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        function()
        calls += 1
    return (time.perf_counter() - start) / calls


def export_digits(root: str, count: int) -> list[str]:
    import nitro
    from nitro.examples.digits import Digits

    directories = []
    for index in range(count):
        directory = os.path.join(root, f"digits{index:02d}")
        nitro.Nitro(Digits(), seed=index, progress=False).export(
            directory, name=f"digits{index:02d}"
        )
        directories.append(directory)
    return directories


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="digits", choices=("digits", "cnn"))
    parser.add_argument("--models", default="2,4,8", help="K: weight sets per call")
    parser.add_argument("--rows", type=int, default=1, help="rows per model")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import nitro.bundle

    sys.path.insert(0, os.path.dirname(__file__))
    from serve import export_cnns

    counts = [int(k) for k in args.models.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        exported = export_cnns if args.model == "cnn" else export_digits
        programs: dict = {}
        bundles = [nitro.bundle.load(d, programs=programs) for d in exported(root, max(counts))]
        assert len(programs) == 1, "the bundles share one program"
        program = bundles[0].program
        weights = [jax.device_put(b.weights) for b in bundles]
        x = np.random.default_rng(0).normal(size=(args.rows, 64)).astype(np.float32)
        try:
            stacked = jax.tree.map(lambda *t: jnp.stack(t), weights[0], weights[0])
            jax.vmap(program.exported.call)(stacked, {"x": np.stack([x, x])})
            print("jax.vmap over the exported program: works")
        except NotImplementedError as error:
            print(f"jax.vmap over the exported program: {error}")
        together = jax.jit(
            lambda sets, xs: [
                program.exported.call(w, {"x": v}) for w, v in zip(sets, xs, strict=True)
            ]
        )
        one = seconds_per_call(lambda: np.asarray(program.call(weights[0], {"x": x})["output"]))
        print(
            f"{args.model}: {bundles[0].weights_bytes / 1e6:.2f} MB of weights per model, "
            f"{args.rows} rows per model; one call of one model {one * 1e3:.3f} ms"
        )
        for count in counts:
            sets, xs = weights[:count], [x] * count

            def separate(sets=sets):
                return [np.asarray(program.call(w, {"x": x})["output"]) for w in sets]

            def joined(sets=sets, xs=xs):
                return [np.asarray(out["output"]) for out in together(sets, xs)]

            def stack(sets=sets):
                return jax.block_until_ready(jax.tree.map(lambda *t: jnp.stack(t), *sets))

            equal = all(np.array_equal(a, b) for a, b in zip(separate(), joined(), strict=True))
            row = {
                "models": count,
                "separate_ms": 1e3 * seconds_per_call(separate),
                "joined_ms": 1e3 * seconds_per_call(joined),
                "stack_ms": 1e3 * seconds_per_call(stack),
                "bitwise_equal": equal,
            }
            rows.append(row)
            print(
                f"  K={count}: {count} calls {row['separate_ms']:.3f} ms, one call of the "
                f"{count} {row['joined_ms']:.3f} ms ({row['separate_ms'] / row['joined_ms']:.2f}x); "
                f"stacking the weight sets {row['stack_ms']:.3f} ms; bitwise equal {equal}"
            )
    return rows


if __name__ == "__main__":
    main()
