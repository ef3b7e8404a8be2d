"""Child processes for tests/test_preemption.py: scripts that train the digits demo and are
preempted with SIGTERM or SIGUSR1.

`zygote()` has imported JAX, Flax, Optax, orbax and Nitro (no JAX backend started) and forks
one child per line of stdin, `RUN_DIR KIND N`, so each starts training in about a second
instead of the seconds importing JAX takes. A child trains `Digits` in RUN_DIR as a job
script would (`resume="auto"`, the default `preemption="auto"`), printing "training <pid>" at
its first step, its notes, and "trained" if `train()` returns. KIND says who signals it:

- `outside`: nobody here; the test sends the signal.
- `validating`: the child sends itself SIGTERM when its N-th validation begins.
- `checkpointing`: the child sends itself SIGTERM when its N-th save begins, and SIGUSR1
  while that save is being written, 60 ms later.

A child that `train()` ends with `SystemExit` exits at once with its code, skipping the
interpreter's exit (a second or more): the save and the logs must be on disk before
`train()` raises. One that trains to the end ends as a script ends, the interpreter's exit
waiting for the saves still being written. The zygote prints "child <pid>", waits for a
line on stdin (so the test can signal the pid while it is certainly this child's, a zombie
at worst), reaps the child and prints "exit <code>" (`os.waitstatus_to_exitcode`: 75, 0, or -15 for a process SIGTERM ended).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import nitro
from nitro.examples.digits import Digits

EPOCHS = 5


def handle(run_dir: str, progress: Any = False, **keywords: Any) -> nitro.Nitro:
    """The digits demo as the children and the test train it: 39 steps an epoch, a checkpoint
    after every epoch."""
    return nitro.Nitro(
        Digits(max_epochs=EPOCHS, batch_size=32),
        run_dir=run_dir,
        checkpointer=nitro.Checkpointer(budget=None),
        progress=progress,
        **keywords,
    )


class Script:
    """The child's reporter: says when training starts and what the run notes, and sends the
    signals its kind asks for."""

    def __init__(self, kind: str, nth: int):
        self.kind, self.nth = kind, nth
        self.started = False
        self.last = None
        self.seen = 0

    def step(self, step, loss):
        if not self.started:
            self.started = True
            print(f"training {os.getpid()}", flush=True)

    def note(self, message, done=False):
        print(message, flush=True)

    def phase(self, phase):
        if phase == self.last:
            return
        self.last = phase
        if phase != self.kind:
            return
        self.seen += 1
        if self.seen == self.nth:
            os.kill(os.getpid(), signal.SIGTERM)
            if phase == "checkpointing":  # a second signal, while the save is written
                threading.Timer(0.06, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            # the main thread handles the signal meanwhile (this thread holds the interpreter
            # lock, and validation's few batches would be over before it could)
            time.sleep(0.05)


def script(run_dir: str, kind: str, nth: int) -> None:
    n = handle(run_dir, progress=Script(kind, nth), resume="auto")
    n.train()
    print("trained", flush=True)


def zygote() -> None:
    import orbax.checkpoint  # noqa: F401

    import nitro.handle  # noqa: F401 - load the engine before forking

    nitro.datasets.digits_arrays()  # read scikit-learn's file once
    print("ready", flush=True)
    for line in sys.stdin:
        run_dir, kind, nth = line.split()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                script(run_dir, kind, int(nth))
            except SystemExit as exit:  # preempted
                sys.stdout.flush()
                os._exit(exit.code if isinstance(exit.code, int) else 1)
            return  # the interpreter's exit waits for the saves still being written
        print(f"child {pid}", flush=True)
        sys.stdin.readline()  # the test is done signalling it
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)
