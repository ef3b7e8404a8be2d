"""Finding a run's worker processes, for the tests that no worker outlives its run
(tests/test_data_processes.py, tests/test_data_workers_persist.py)."""

from __future__ import annotations

import signal
import subprocess
import time

import psutil


def workers_of(pid: int) -> list[psutil.Process]:
    """The live worker processes (multiprocessing's spawned children) below `pid`."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if "spawn_main" in " ".join(child.cmdline()) and child.status() != "zombie":
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def gone(processes: list[psutil.Process], seconds: float = 30.0) -> list[psutil.Process]:
    """Those of `processes` still alive after waiting up to `seconds`."""
    _, alive = psutil.wait_procs(processes, timeout=seconds)
    return [p for p in alive if p.is_running() and p.status() != "zombie"]


def wait_for(condition, seconds: float = 120.0) -> bool:
    """Whether `condition()` held within `seconds` (polled)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def survivors_of_a_kill(parent: subprocess.Popen, count: int) -> list[psutil.Process]:
    """SIGKILL `parent` once it runs `count` workers; those still alive afterwards (none, as
    every worker exits with its parent). Killed either way."""
    try:
        assert wait_for(lambda: len(workers_of(parent.pid)) == count), "no workers started"
        workers = workers_of(parent.pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=120)
        return gone(workers)
    finally:
        if parent.poll() is None:
            parent.kill()
