"""Preemption: a script's `train()` that receives SIGTERM or SIGUSR1 saves the step it is on,
finishes its logs and exits with code 75, and `resume="auto"` continues it bitwise. The
scripts are real child processes (tests/preemption_toys.py) signalled at random moments, in
validation and in the middle of a save; the resumes run here."""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from preemption_toys import EPOCHS, handle
from system import child_env

import nitro
from nitro.runner import PREEMPTED_EXIT_CODE, preemption_signals

TRIES = 20
EXIT = re.compile(r"(?P<signal>SIG\w+): exiting with code 75 at step (?P<step>\d+); .+")
STOPPED_IN = {"validating": "trained, before its validation", "checkpointing": "the end of epoch"}
LAST_STEP = EPOCHS * 39  # 1,258 training samples in batches of 32
COLUMNS = ["loss", "val_loss", "val_acc"]


class Zygote:
    """A process that has imported everything and forks the preempted scripts."""

    def __init__(self, cwd: Path):
        self.log = open(cwd / "zygote.log", "w")  # noqa: SIM115 - closed in close()
        code = "import preemption_toys; preemption_toys.zygote()"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=cwd,
            env=child_env(),
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.line() == "ready"

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def line(self, timeout: float = 180) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the zygote said nothing for {timeout} s") from None

    def start(self, run_dir: Path, kind: str, nth: int = 0) -> int:
        self.process.stdin.write(f"{run_dir} {kind} {nth}\n")
        self.process.stdin.flush()
        self.said: list[str] = []
        return int(self.line().removeprefix("child "))

    def until(self, prefix: str) -> str:
        """The child's first line starting with `prefix` (the lines before it are kept)."""
        while not (line := self.line()).startswith(prefix):
            self.said.append(line)
        return line

    def finish(self) -> tuple[int, list[str]]:
        """Let the zygote reap the child: its exit code and the lines it printed."""
        self.process.stdin.write("reap\n")
        self.process.stdin.flush()
        code = int(self.until("exit ").removeprefix("exit "))
        return code, self.said

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


def outcome(n: nitro.Nitro) -> tuple[dict, dict]:
    history = n.history()
    paths = n.setup.model.leaf_paths["parameter"]
    weights = {p: np.asarray(x) for p, x in zip(paths, n.state.variables.params, strict=True)}
    return {c: history[c].tolist() for c in COLUMNS}, weights


def plan(draw: random.Random) -> list[tuple[str, str, int, float]]:
    """Who signals each try, with what, when: (kind, signal, nth, delay after the first step)."""
    tries = [("outside", "SIGTERM", 0, draw.uniform(0.0, 0.6)) for _ in range(12)]
    tries += [("outside", "SIGUSR1", 0, draw.uniform(0.0, 0.6)) for _ in range(3)]
    tries += [("outside", "SIGTERM twice", 0, draw.uniform(0.0, 0.6))]
    tries += [("validating", "SIGTERM", nth, 0.0) for nth in (1, 3)]
    tries += [("checkpointing", "SIGTERM, SIGUSR1", nth, 0.0) for nth in (2, 4)]
    draw.shuffle(tries)
    assert len(tries) == TRIES
    return tries


def test_sigterm_at_random_moments_saves_exits_75_and_resume_auto_continues_bitwise(tmp_path):
    expected = outcome(handle(str(tmp_path / "whole")).train())
    zygote = Zygote(tmp_path)
    seen = []
    try:
        for attempt, (kind, sent, nth, delay) in enumerate(plan(random.Random(40))):
            run_dir = tmp_path / f"try{attempt}"
            pid = zygote.start(run_dir, kind, nth)
            if kind == "outside":
                assert zygote.until("training ") == f"training {pid}"
                time.sleep(delay)
                for name in sent.split()[:1] * (2 if "twice" in sent else 1):
                    os.kill(pid, getattr(signal, name))
                    time.sleep(0.005)
            code, said = zygote.finish()
            seen.append((kind, sent, code))
            where = f"try {attempt} ({kind}, {sent}): exit {code}\n" + "\n".join(said)
            # the logs are finished before the exit: the run's last record says how it ended
            records = (run_dir / "metrics.jsonl").read_text().splitlines()
            status = json.loads(records[-1])["status"]
            resumed = handle(str(run_dir), resume="auto")
            if code == PREEMPTED_EXIT_CODE:
                exit = EXIT.fullmatch(said[-1])
                assert exit is not None and exit["signal"] in sent, where
                step = int(exit["step"])
                assert resumed.step == step, where  # the step it was on is saved
                assert status == "requested" or (status, step) == ("completed", LAST_STEP), where
                if kind != "outside":  # stopped where the signal came
                    assert exit["signal"] == "SIGTERM", where
                    stop = next(line for line in said if line.startswith("stopped at step"))
                    assert STOPPED_IN[kind] in stop, where
            else:  # the run had ended: the signal came after train() returned, or never
                # (a process a signal ends then loses the saves still being written, and
                # resumes from an earlier one)
                assert kind == "outside" and code in (0, -getattr(signal, sent.split()[0])), where
                assert status == "completed", where
            resumed.train()
            assert resumed.epoch == EPOCHS
            history, weights = outcome(resumed)
            assert history == expected[0], where  # == on floats: bitwise
            assert all(np.array_equal(weights[k], v) for k, v in expected[1].items()), where
    finally:
        zygote.close()
    preempted = [s for s in seen if s[2] == PREEMPTED_EXIT_CODE]
    # every signal sent from inside the run preempted it; most from outside landed in it too
    assert all(s[2] == PREEMPTED_EXIT_CODE for s in seen if s[0] != "outside"), seen
    assert len(preempted) >= TRIES // 2, seen


def test_preemption_is_off_in_a_notebook_and_where_the_program_handles_the_signal():
    # this process is not interactive: "auto" takes both signals, False none
    assert preemption_signals("auto") == (signal.SIGTERM, signal.SIGUSR1)
    assert preemption_signals(False) == ()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:  # a handler of the program's own stays; True takes the signal anyway
        assert preemption_signals("auto") == (signal.SIGTERM,)
        assert preemption_signals(True) == (signal.SIGTERM, signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    off_main = []
    thread = threading.Thread(target=lambda: off_main.append(preemption_signals(True)))
    thread.start()
    thread.join()
    assert off_main == [()]


def test_a_bad_preemption_setting_is_refused_naming_the_choices():
    with pytest.raises(nitro.SetupError, match=r"preemption must be 'auto', True or False, got 1"):
        handle("unused", preemption=1)
