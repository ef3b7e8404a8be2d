"""What recording where a run comes from adds to a run's start.

A run's run.json records the git state of its code (two git commands side by side, the
uncommitted diff written beside it) and the packages' versions (read once per process). The
git commands run on a thread started when the handle is built (`OriginProbe`), beside its
setup. This script measures, in one process, alternating rounds, a warm process (the
programs compiled by a first round):

- the start of a run: `nitro.Nitro(Digits(...)).train(steps=1)`, from `Nitro(...)` to the
  return of `train()`, run.json written: what a user waits for before the first step;
- the record in line: `provenance(Digits)`, the git state and the packages as run.json
  records them, for the work tree holding nitro/examples/digits.py (this checkout, dirty or
  clean as it is now): what the start would take longer if it ran before the first step;
- what the start waits for it: a probe started as a handle begins building, and the time its
  `result()` still takes once the handle is built.

    python bench/run_origin.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import nitro  # noqa: E402
from nitro.examples.digits import Digits  # noqa: E402
from nitro.runs.run_origin import (  # noqa: E402
    OriginProbe,
    code_directory,
    git_state,
    provenance,
)


def start_of_a_run() -> float:
    began = time.perf_counter()
    n = nitro.Nitro(Digits(width=32, max_epochs=1), checkpointer=None, progress=False)
    n.train(steps=1)
    took = time.perf_counter() - began
    n.close()
    return took


def the_record() -> float:
    began = time.perf_counter()
    provenance(Digits)
    return time.perf_counter() - began


def the_wait() -> float:
    probe = OriginProbe(Digits)
    n = nitro.Nitro(Digits(width=32, max_epochs=1), checkpointer=None, progress=False)
    began = time.perf_counter()
    probe.result()
    took = time.perf_counter() - began
    n.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    os.chdir(tempfile.mkdtemp(prefix="run-origin-"))  # the runs' directories go there
    start_of_a_run()  # compiles the programs: the rounds measure a warm process
    starts, records, waits = [], [], []
    for _ in range(args.rounds):
        starts.append(start_of_a_run())
        records.append(the_record())
        waits.append(the_wait())
    state = git_state(code_directory(Digits))
    where = (
        "no git work tree"
        if state is None
        else f"{state.root}: {'dirty, a diff of ' + format(len(state.diff), ',') + ' bytes' if state.dirty else 'clean'}"
    )
    start, record = statistics.median(starts), statistics.median(records)
    wait = statistics.median(waits)
    print(f"code of the run: {where}")
    print(f"start of a run (warm, to its first step):  {start * 1000:8.1f} ms (median)")
    print(f"git state and packages, in line:           {record * 1000:8.1f} ms (median)")
    print(f"  its share of the start, were it in line: {record / start:8.1%}")
    print(f"what the start waits for it (on a thread): {wait * 1000:8.1f} ms (median)")
    print(f"  its share of the start:                  {wait / start:8.1%}")


if __name__ == "__main__":
    main()
