"""Per-step cost of logging: each backend on the train context, and training with it.

1. Microseconds per optimizer step that each logger adds on the event path the loop uses
   (`Events.step` -> `LoggingReporter` -> `LoggerGroup` -> the backend), against the same
   path with no reporter; and, for comparison, tensorboardX's `SummaryWriter.add_scalar`.
2. Steps/s of the digits MLP (64-256-256-10, batch 128, train split only) with each logger,
   relative to no logger, alternating rounds in one process (medians).

    python bench/loggers.py [--calls 20000] [--rounds 5] [--epochs 100]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import nitro
from nitro.events import Events
from nitro.examples.digits import Digits
from nitro.loggers import CSVLogger, JSONLinesLogger, LoggingReporter, TensorBoardLogger

BACKENDS = {
    "JSONLinesLogger": lambda d: JSONLinesLogger(Path(d) / "metrics.jsonl"),
    "CSVLogger": lambda d: CSVLogger(Path(d) / "metrics.csv"),
    "TensorBoardLogger": lambda d: TensorBoardLogger(d),
    "all three": lambda d: [
        JSONLinesLogger(Path(d) / "metrics.jsonl"),
        CSVLogger(Path(d) / "metrics.csv"),
        TensorBoardLogger(d),
    ],
}


def per_step(events: Events, calls: int) -> float:
    """Microseconds per `events.step`, the best of three runs."""
    best = float("inf")
    for run in range(3):
        begin = time.perf_counter()
        for step in range(calls):
            events.step(run * calls + step + 1, 0.25)
        best = min(best, time.perf_counter() - begin)
    return best / calls * 1e6


def event_path_costs(calls: int) -> None:
    baseline = per_step(Events(), calls)
    print(f"event path with no reporter: {baseline:.2f} us/step")
    print("extra us per step on the event path (Events.step -> LoggingReporter -> backend):")
    for name, make in BACKENDS.items():
        with tempfile.TemporaryDirectory() as directory:
            reporter = LoggingReporter(make(directory))
            reporter.logger.bind_run(directory, None)
            cost = per_step(Events([reporter]), calls) - baseline
            reporter.logger.finish("completed")
        print(f"  {name:18s} {cost:7.2f}")
    from tensorboardX import SummaryWriter

    with tempfile.TemporaryDirectory() as directory:
        writer = SummaryWriter(directory)
        best = float("inf")
        for _ in range(3):
            begin = time.perf_counter()
            for step in range(calls):
                writer.add_scalar("train/loss", 0.25, step)
            best = min(best, time.perf_counter() - begin)
        writer.close()
    print(f"  (tensorboardX SummaryWriter.add_scalar alone: {best / calls * 1e6:.2f})")


def steps_per_second(logger, epochs: int, directory: str) -> float:
    progress = False if logger is None else LoggingReporter(logger)
    n = nitro.Nitro(
        Digits(max_epochs=epochs), run_dir=directory, progress=progress, data=train_only()
    )
    n.train(epochs=1)  # compile and warm up
    begin, first = time.perf_counter(), n.step
    n.train()
    return (n.step - first) / (time.perf_counter() - begin)


def train_only():
    return {"train": nitro.datasets.digits(batch_size=128)["train"]}


def training_ratios(rounds: int, epochs: int) -> None:
    names = ["none", *BACKENDS]
    rates: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            with tempfile.TemporaryDirectory() as directory:
                logger = None if name == "none" else BACKENDS[name](directory)
                rates[name].append(steps_per_second(logger, epochs, directory))
    base = statistics.median(rates["none"])
    print(f"digits MLP, train split only: {base:.0f} steps/s with no logger")
    for name in names[1:]:
        rate = statistics.median(rates[name])
        print(f"  {name:18s} {rate:7.0f} steps/s  ratio {rate / base:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=100)
    args = parser.parse_args()
    event_path_costs(args.calls)
    training_ratios(args.rounds, args.epochs)


if __name__ == "__main__":
    main()
