"""Memory per device and steps/s of a sharded model: replicated vs FSDP vs tensor-parallel rules.

One process, every visible device in one mesh. On a CPU the script asks XLA for 8 fake devices
(`--xla_force_host_platform_device_count=8`) before JAX starts, so the layouts are real but the
"devices" are threads of one CPU: the memory figures are what a real 8-device run holds, the
speed is not the point there (every collective is a memcpy, and the 8 devices share the same
cores). On a GPU host it uses the GPUs it finds.

The model is the transformer of `bench/peers.py`, wider (d 256, 4 layers): every contender
trains it with Nitro's defaults except that checkpoints and logs are off (this measures the
layout, not the lifecycle). For each layout it prints the parameter and optimizer-state bytes
held by one device (measured from the arrays' shardings: the shard on the first device), their
ratio to replicated, and the steps/s of `train(epochs=1)` calls after a warm-up call.

    python bench/sharding.py [--width 256] [--layers 4] [--rounds 3] [--devices 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--help" not in sys.argv and "-h" not in sys.argv:  # before JAX starts: fake CPU devices
    devices = "8"
    if "--devices" in sys.argv:
        devices = sys.argv[sys.argv.index("--devices") + 1]
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import nitro  # noqa: E402
from nitro.data import ArrayLoader  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import TinyLM  # noqa: E402  (the transformer of bench/peers.py, wider)

VOCAB, CONTEXT, HEADS = 256, 64, 8

# Megatron-style tensor parallelism over "model": the first matmul of each pair column-split,
# the second row-split, so each pair needs one all-reduce; everything else FSDP-like over "data".
RULES = {
    r"attention\.(query|key|value)\.kernel": P("data", "model", None),
    r"attention\.out\.kernel": P("model", None, "data"),
    r"\.up\.kernel": P("data", "model"),
    r"\.down\.kernel": P("model", "data"),
    r"tokens\.embedding": P(None, "data"),
    r"^out\.kernel": P("data", None),
}


def tokens(sequences: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, (sequences, 1))
    walk = np.cumsum(rng.integers(1, 4, (sequences, CONTEXT)), axis=1)
    seq = (np.concatenate([start, start + walk], axis=1) % VOCAB).astype(np.int32)
    return {"x": seq[:, :-1], "y": seq[:, 1:]}


def experiment(width: int, layers: int, batch: int, arrays):
    @nitro.experiment
    class ShardedLM:
        width_: nitro.GraphConst[int] = width
        layers_: nitro.GraphConst[int] = layers
        max_epochs: int = 1_000_000

        def build_data(self):
            return {"train": ArrayLoader(arrays, batch, shuffle=True, drop_last=True, seed=0)}

        def build_model(self, rngs):
            return TinyLM(VOCAB, CONTEXT, self.width_, self.layers_, HEADS, rngs=rngs)

        def forward(self, model, *, x):
            return model(x)

        def loss(self, logits, *, y):
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return ShardedLM()


def bytes_on_first_device(leaves) -> int:
    """What one device holds of these arrays: the shard on the mesh's first device."""
    total = 0
    for x in leaves:
        shard = x.addressable_shards[0]
        total += int(np.prod(shard.data.shape)) * x.dtype.itemsize
    return total


def layouts(devices: int) -> dict[str, dict]:
    model_axis = 2 if devices % 2 == 0 and devices > 1 else 1
    return {
        "replicated": {"sharding": "replicated"},
        "fsdp": {"sharding": "fsdp"},
        f"rules ({devices // model_axis}x{model_axis})": {
            "sharding": RULES,
            "mesh": {"data": devices // model_axis, "model": model_axis},
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (CPU only)")
    args = parser.parse_args(argv)
    devices = jax.device_count()
    platform = jax.devices()[0].platform
    arrays = tokens(args.batch * 8)
    print(
        f"transformer LM d {args.width}, {args.layers} layers, T {CONTEXT}, batch {args.batch}; "
        f"{devices} {platform} devices"
        + (" (fake: threads of one CPU, so steps/s is not the point)" if platform == "cpu" else "")
    )
    rows = []
    base_bytes = None
    for label, keywords in layouts(devices).items():
        n = nitro.Nitro(
            experiment(args.width, args.layers, args.batch, arrays),
            progress=False,
            logger=None,
            checkpointer=None,
            **keywords,
        )
        n.train(epochs=1)  # compiles, and "auto" picks its steps per dispatch
        rates = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            n.train(epochs=1)
            rates.append(len(n.splits["train"]) / (time.perf_counter() - start))
        variables = n.state.variables
        params = bytes_on_first_device(variables.params)
        opt = bytes_on_first_device(variables.opt_state or [])
        if base_bytes is None:
            base_bytes = params + opt
        rows.append((label, params, opt, (params + opt) / base_bytes, statistics.median(rates)))
        n.close()
    print(f"{'layout':<16}{'params/dev':>14}{'opt/dev':>14}{'vs replicated':>15}{'steps/s':>10}")
    for label, params, opt, ratio, rate in rows:
        print(
            f"{label:<16}{params / 2**20:>11.2f} MiB{opt / 2**20:>11.2f} MiB"
            f"{ratio:>14.3f}x{rate:>10.1f}"
        )


if __name__ == "__main__":
    main()
