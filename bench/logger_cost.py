"""What the default logger costs a live handle: `train(epochs=2)` on the digits demo with the
default `JSONLinesLogger` against `logger=None` (no checkpoints either way).

1. Per step on the event path the loop uses (`Events.step` -> `LoggingReporter` ->
   `JSONLinesLogger`): microseconds a train line adds, the best of three runs.
2. Whole calls: the median wall time of `train(epochs=2)` on two live handles (warm: compiled
   once), alternating calls, and the ratio logger on / logger off, per call and per step.

    python bench/logger_cost.py [--calls 20] [--lines 20000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def line_cost(lines: int) -> tuple[float, float]:
    """(us per step with no reporter, extra us per step with a JSON Lines logger)."""
    from loggers import per_step

    from nitro.events import Events
    from nitro.loggers import JSONLinesLogger, LoggingReporter

    baseline = per_step(Events(), lines)
    with tempfile.TemporaryDirectory() as directory:
        reporter = LoggingReporter(JSONLinesLogger(Path(directory) / "metrics.jsonl"))
        reporter.logger.bind_run(directory, None)
        cost = per_step(Events([reporter]), lines) - baseline
        reporter.logger.finish("completed")
    return baseline, cost


def call_times(calls: int) -> dict[str, tuple[float, int]]:
    """Median seconds of `train(epochs=2)` and the steps a call runs, logger off and on."""
    import nitro
    from nitro.examples.digits import Digits

    with tempfile.TemporaryDirectory() as root:
        handles = {
            "off": nitro.Nitro(
                Digits(), run_dir=f"{root}/off", logger=None, checkpointer=None, progress=False
            ),
            "on": nitro.Nitro(Digits(), run_dir=f"{root}/on", checkpointer=None, progress=False),
        }
        for n in handles.values():
            n.train(epochs=1)  # compile and warm up
        seconds: dict[str, list[float]] = {name: [] for name in handles}
        steps = {}
        for call in range(calls):
            order = list(handles.items())
            for name, n in order if call % 2 else order[::-1]:  # neither always goes first
                first = n.step
                begin = time.perf_counter()
                n.train(epochs=2)
                seconds[name].append(time.perf_counter() - begin)
                steps[name] = n.step - first
        return {name: (statistics.median(seconds[name]), steps[name]) for name in handles}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--lines", type=int, default=20000)
    args = parser.parse_args()
    baseline, cost = line_cost(args.lines)
    print(f"event path: {baseline:.2f} us/step alone, JSONLinesLogger adds {cost:.2f} us/step")
    times = call_times(args.calls)
    (off, steps), (on, _) = times["off"], times["on"]
    print(f"train(epochs=2), {steps} steps, median of {args.calls} calls on a live handle:")
    print(f"  logger=None        {off * 1e3:8.2f} ms  ({off / steps * 1e6:7.1f} us/step)")
    print(f"  JSONLinesLogger    {on * 1e3:8.2f} ms  ({on / steps * 1e6:7.1f} us/step)")
    print(f"  ratio on/off       {on / off:8.3f}  (extra {(on - off) / steps * 1e6:.1f} us/step)")


if __name__ == "__main__":
    main()
