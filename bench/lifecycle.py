"""What checkpoints cost, and what a resume costs, on the digits demo (`Digits`: the MLP
64-256-256-10, ~85 k parameters, 1 MB saved with Adam's moments; about 10 steps an epoch).

1. Checkpoint cost per epoch, as a fraction of epoch time: the seconds the loop spends in the
   "checkpointing" phase after an epoch (a phase monitor times it: the save call, which waits
   for the previous save's background write, then hands the arrays to orbax) over the seconds
   it spends training and validating, with the default `Checkpointer()` (a 5% budget) and
   with `Checkpointer(budget=None)` (a save every epoch); the end-of-run save apart (the
   newest epoch is saved, and train() returns once every write is on disk); and each run's
   wall time against `checkpointer=None`. Configurations alternate, round by round, in one
   process; medians.
2. Time to resume: `Nitro(Digits(), resume=run_dir)` (setup, then reading the newest
   checkpoint and placing it) against `Nitro(Digits())` (a fresh setup), alternating; medians.
3. Short calls: milliseconds per `train(epochs=1)` on a live handle with the defaults (its
   end-of-call save is written in the background, overlapping its next calls) against
   `checkpointer=None`: blocks of `--calls` calls back to back on one handle, the blocks
   alternating between the two handles; medians, and their ratio.

    python bench/lifecycle.py [--epochs 60] [--rounds 5] [--calls 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import nitro
from nitro.examples.digits import Digits

CONFIGS = {
    "checkpointer=None": None,
    "Checkpointer() (5% budget)": nitro.Checkpointer(),
    "Checkpointer(budget=None)": nitro.Checkpointer(budget=None),
}


class PhaseClock:
    """The phases of a run and the seconds spent in each, from a phase monitor."""

    def __init__(self) -> None:
        self.segments: list[tuple[str, float]] = []  # (phase, seconds), in order
        self._since = time.perf_counter()

    def __call__(self, change) -> None:
        now = time.perf_counter()
        self.segments.append((change.previous, now - self._since))
        self._since = now


def one_run(checkpointer, epochs: int, directory: Path) -> dict[str, float]:
    n = nitro.Nitro(
        Digits(max_epochs=epochs + 1),
        run_dir=str(directory),
        checkpointer=checkpointer,
        logger=None,
        progress=False,
    )
    n.train(epochs=1)  # compiles, and saves the first epoch; not measured
    clock = PhaseClock()
    n.on_phase(clock)
    begin = time.perf_counter()
    n.train()
    wall = time.perf_counter() - begin
    saving = [seconds for phase, seconds in clock.segments if phase == "checkpointing"]
    # a run that ends at an epoch boundary saves that epoch: the last checkpointing phase is
    # that save's handing over (its write goes on in the background, after train() returns)
    at_end = saving.pop() if clock.segments[-1][0] == "checkpointing" else 0.0
    training = wall - sum(saving) - at_end
    n.close()  # its last write finishes before the next run starts (and before cleanup)
    return {
        "wall": wall / epochs,
        "during": sum(saving) / training,
        "saves": len(saving),
        "at_end": at_end,
    }


def checkpoint_costs(epochs: int, rounds: int) -> None:
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as root:
        for round_ in range(rounds):
            for index, (name, checkpointer) in enumerate(CONFIGS.items()):
                directory = Path(root) / f"{round_}-{index}"
                results[name].append(one_run(checkpointer, epochs, directory))
    median = lambda name, key: statistics.median(r[key] for r in results[name])  # noqa: E731
    mean = lambda name, key: statistics.mean(r[key] for r in results[name])  # noqa: E731
    base = median("checkpointer=None", "wall")
    print(
        f"checkpoint cost on the digits demo ({epochs} epochs a run, {rounds} rounds; medians, "
        f"saves: mean)"
    )
    print(f"  epoch (training and validation) without checkpoints: {base * 1e3:.1f} ms")
    print(
        f"  {'':28s} {'saves during':>12s} {'their cost':>11s} {'end-of-run':>11s} "
        f"{'wall a run':>11s}"
    )
    print(f"  {'':28s} {'the run':>12s} {'/ training':>11s} {'save':>11s} {'vs none':>11s}")
    for name in CONFIGS:
        print(
            f"  {name:28s} {mean(name, 'saves'):12.1f} {median(name, 'during'):11.1%} "
            f"{median(name, 'at_end') * 1e3:8.0f} ms {median(name, 'wall') / base:10.2f}x"
        )


def resume_cost(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        run_dir = str(Path(root) / "run")
        nitro.Nitro(Digits(max_epochs=2), run_dir=run_dir, logger=None, progress=False).train()
        nitro.Nitro(Digits(), progress=False, logger=None)  # warm: the dataset, imports
        fresh, resumed = [], []
        for _ in range(rounds):
            begin = time.perf_counter()
            nitro.Nitro(Digits(), run_dir=str(Path(root) / "fresh"), logger=None, progress=False)
            fresh.append(time.perf_counter() - begin)
            begin = time.perf_counter()
            n = nitro.Nitro(Digits(max_epochs=3), resume=run_dir, logger=None, progress=False)
            resumed.append(time.perf_counter() - begin)
            assert n.epoch == 2
    a, b = statistics.median(fresh), statistics.median(resumed)
    print(f"time to resume ({rounds} rounds, medians)")
    print(f"  fresh setup {a * 1e3:.0f} ms, setup + restore {b * 1e3:.0f} ms: {b / a:.2f}x")


BLOCKS = 6  # blocks of back-to-back calls per handle, in alternation


def short_calls(calls: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        handles = {
            name: nitro.Nitro(
                Digits(max_epochs=calls + 2),
                run_dir=str(Path(root) / name),
                checkpointer=checkpointer,
                logger=None,
                progress=False,
            )
            for name, checkpointer in (("defaults", nitro.Checkpointer()), ("none", None))
        }
        times: dict[str, list[float]] = {name: [] for name in handles}
        for n in handles.values():
            n.train(epochs=1)  # compiles; not measured
            n.wait()
        for block in range(BLOCKS):  # a handle's calls back to back: its saves overlap them
            for name, n in handles.items() if block % 2 else reversed(handles.items()):
                for _ in range(calls):
                    begin = time.perf_counter()
                    n.train(epochs=1)
                    times[name].append(time.perf_counter() - begin)
                n.wait()  # its last save does not overlap the other handle's calls
        for n in handles.values():
            n.close()
    a, b = (statistics.median(times[name]) for name in ("defaults", "none"))
    print(
        f"one-epoch train() on a live handle ({BLOCKS} blocks of {calls} calls back to back "
        f"each, alternating; medians)"
    )
    print(f"  defaults {a * 1e3:.1f} ms, checkpointer=None {b * 1e3:.1f} ms: {a / b:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    short_calls(args.calls)
    checkpoint_costs(args.epochs, args.rounds)
    resume_cost(max(args.rounds, 5))


if __name__ == "__main__":
    main()
