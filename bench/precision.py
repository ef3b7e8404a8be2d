"""Mixed precision: steps/s and final accuracy of `precision="bfloat16"` and `"float16"`
against float32, on the models of bench/peers.py (the MLPs, the CNN, the transformer LM).

For each model, in one process, alternating rounds, one live Nitro handle per precision trains
the same model from the same seed on the same data, one `train(epochs=E)` call a round
(`steps_per_dispatch="auto"`, no logger or checkpointer, no validation). Ratios are medians
over rounds of each precision's steps/s over float32's in the same round; the warm-up calls
(compiles, until "auto" has chosen its K) are not counted. After the last round every handle has trained the same epochs:
its validation accuracy is the figure next to the speed. Data as in bench/peers.py (the
digits tiled, generated token walks for the LM); nothing is downloaded.

    python bench/precision.py [--models mlp,mlp256,cnn,lm] [--rounds 3] [--epochs 1]
                              [--scale 2] [--precisions float32,bfloat16,float16]

On a CPU, XLA has few native bfloat16/float16 kernels: it computes most operations in float32
and converts around them, so the lower precisions are usually slower there (docs/performance.md,
"Mixed precision"). On a GPU or TPU they use the tensor cores / MXU and move half the bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from loops import LEARNING_RATE, loss_of  # noqa: E402
from peers import MODELS, token_arrays  # noqa: E402

import nitro  # noqa: E402
from nitro.data import ArrayLoader  # noqa: E402

PRECISIONS = ("float32", "bfloat16", "float16")
WARMUP_CALLS = 8  # untimed train() calls at most, until "auto" has chosen its K


def validation_arrays(name: str) -> dict[str, np.ndarray]:
    if name == "lm":
        return token_arrays(256, seed=1)
    return dict(nitro.datasets.digits_arrays()["val"])


def experiment_for(spec, train, val):
    @nitro.experiment
    class Bench:
        model: nitro.GraphConst[str] = spec.name
        max_epochs: int = 1_000_000

        def build_data(self):
            return {
                "train": ArrayLoader(train, spec.batch, shuffle=True, drop_last=True, seed=0),
                "val": ArrayLoader(val, spec.batch, shuffle=False, drop_last=False),
            }

        def build_model(self, rngs):
            return spec.make(rngs)

        def forward(self, model, *, x):
            return model(x)

        def loss(self, logits, *, y):
            return loss_of(logits, y)

        def metrics(self, logits, *, y):
            return {"acc": (logits.argmax(-1) == y).mean()}

    return Bench()


def bench_model(name: str, precisions, rounds: int, epochs: int, scale: int) -> dict:
    spec, data, _ = MODELS[name]
    train, val = data(scale), validation_arrays(name)
    handles = {
        p: nitro.Nitro(
            experiment_for(spec, train, val),
            precision=p,
            learning_rate=LEARNING_RATE,
            eval_splits=(),  # the rounds time training; accuracy is evaluated at the end
            progress=False,
            logger=None,
            checkpointer=None,
        )
        for p in precisions
    }
    batches = len(handles[precisions[0]].splits["train"])
    print(
        f"\n{name}: {spec.description}; {len(train['x'])} samples, {batches} batches per "
        f"epoch, {epochs} epoch(s) per handle per round"
    )
    for handle in handles.values():  # warm-up: compiles, and "auto" decides its K
        for _ in range(WARMUP_CALLS):
            handle.train(epochs=epochs)
            if not (handle.dispatch.probing or handle.dispatch.checking):
                break
    trained = max(handle.epoch for handle in handles.values())
    for handle in handles.values():  # every handle the same epochs, for the accuracy
        if handle.epoch < trained:
            handle.train(epochs=trained - handle.epoch)
    rates: dict[str, list[float]] = {p: [] for p in precisions}
    for r in range(rounds):
        order = list(precisions) if r % 2 == 0 else list(reversed(precisions))
        for p in order:
            start = time.perf_counter()
            handles[p].train(epochs=epochs)
            rates[p].append(epochs * batches / (time.perf_counter() - start))
        line = "  ".join(f"{p} {rates[p][-1]:,.0f}" for p in precisions)
        print(f"  round {r + 1}: {line} steps/s")
    base = rates[precisions[0]]
    result: dict = {"steps/s": statistics.median(base), "epochs": trained + rounds * epochs}
    for p in precisions:
        history = handles[p].history()
        result[p] = {
            "ratio": statistics.median(v / b for v, b in zip(rates[p], base, strict=True)),
            "acc": float(handles[p].evaluate("val")["val_acc"]),
            "loss": float(history["loss"].iloc[-1]),
            "K": handles[p].dispatch.steps,
        }
        if "skipped_steps" in history:
            result[p]["skipped"] = int(history["skipped_steps"].sum())
            result[p]["scale"] = float(history["loss_scale"].iloc[-1])
    for handle in handles.values():
        handle.close()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="of " + ",".join(MODELS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="float32 first")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--epochs", type=int, default=1, help="train(epochs=) per round")
    parser.add_argument("--scale", type=int, default=2, help="data size multiplier (2)")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    precisions = tuple(p for p in args.precisions.split(",") if p)
    if not precisions or precisions[0] != "float32" or set(precisions) - set(PRECISIONS):
        parser.error(f"--precisions: float32 first, then any of {', '.join(PRECISIONS[1:])}")

    device = jax.devices()[0]
    print("bench/precision.py: steps/s of each precision as a ratio of float32's, same process")
    print(
        f"  jax {jax.__version__} on {device.platform} ({device.device_kind}), "
        f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}; adam({LEARNING_RATE:g}); "
        f"{args.rounds} timed rounds after the warm-up"
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="nitro-precision-") as runs, contextlib.chdir(runs):
        for name in names:
            results[name] = bench_model(name, precisions, args.rounds, args.epochs, args.scale)

    print(f"\nload average {os.getloadavg()[0]:.1f} (other processes on the machine add noise)")
    print(
        "steps/s as ratios of float32 (1.00x), medians over rounds; at the end, the val "
        "accuracy and the last epoch's training loss:\n"
    )
    header = ["model", "float32", *(p for p in precisions[1:])]
    rows = []
    for name, r in results.items():
        first = r["float32"]
        row = [
            name,
            f"{r['steps/s']:,.0f} steps/s, acc {first['acc']:.3f}, loss {first['loss']:.4f}",
        ]
        for p in precisions[1:]:
            cell = f"{r[p]['ratio']:.2f}x, acc {r[p]['acc']:.3f}, loss {r[p]['loss']:.4f}"
            if "skipped" in r[p]:
                cell += f" ({r[p]['skipped']} skipped, scale {r[p]['scale']:g})"
            row.append(cell)
        rows.append(row)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    for name, r in results.items():
        chosen = ", ".join(f"{p} {r[p]['K']}" for p in precisions)
        print(f"  {name}: {r['epochs']} epochs each; steps per dispatch (auto): {chosen}")


if __name__ == "__main__":
    main()
