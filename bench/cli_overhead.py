"""What the `nitro train` command costs over a plain Python script that trains the same run.

Each round starts two fresh processes, each in a new empty directory, and times each from the
moment it is started to its first training step (the time the run's logger wrote step 1 in
metrics.jsonl):

- the command: `python -m nitro.cli train nitro.examples.digits:Digits --max-epochs 1` (what
  `nitro train` runs: reading its options, importing the experiment, the handle, the run);
- the script: `python -c` with `nitro.Nitro(Digits(max_epochs=1), resume="auto").train()`,
  the same run with the same keywords (the command's `--resume auto`), the baseline.

Printed: each contender's median and fastest time over rounds (alternating, the first round of
each dropped as the cold start of the machine's file cache), and the command's overhead: the
median of the rounds' differences, and the fastest command against the fastest script (the
figure least moved by busy neighbours).
Under 1 s is the goal (docs/command-line.md quotes the figure).

    python bench/cli_overhead.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMAND = ["-m", "nitro.cli", "train", "nitro.examples.digits:Digits", "--max-epochs", "1"]
SCRIPT = [
    "-c",
    "import nitro\n"
    "from nitro.examples.digits import Digits\n"
    "nitro.Nitro(Digits(max_epochs=1), resume='auto').train()\n",
]


def first_step(arguments: list[str]) -> float:
    """Seconds from starting `python ARGUMENTS` in a new directory to its first step."""
    with tempfile.TemporaryDirectory() as directory:
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")])
        )
        began = time.time()
        subprocess.run(
            [sys.executable, *arguments],
            cwd=directory,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        (metrics,) = Path(directory).glob("runs/Digits/*/metrics.jsonl")
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record["type"] == "metrics" and record["step"] == 1:
                return record["time"] - began
    raise AssertionError("no step 1 logged")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    command, script = [], []
    for _ in range(rounds + 1):
        command.append(first_step(COMMAND))
        script.append(first_step(SCRIPT))
    command, script = command[1:], script[1:]
    print(f"to the first step, over {rounds} rounds (median, fastest):")
    for name, times in (
        ("nitro train ... --max-epochs 1 ", command),
        ("the same run in a script", script),
    ):
        print(f"  {name}  {statistics.median(times):.2f} s, {min(times):.2f} s")
    overhead = statistics.median(c - s for c, s in zip(command, script, strict=True))
    print(
        f"the command's overhead: {overhead:+.2f} s (median of the rounds' differences), "
        f"{min(command) - min(script):+.2f} s (fastest against fastest)"
    )


if __name__ == "__main__":
    main()
