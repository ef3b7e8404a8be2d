"""One writer per run directory: an advisory lock on `<run_dir>/run.lock`.

The handle that writes a run directory holds `fcntl.flock` on its `run.lock` from its first
write (or from `Nitro(...)`, for a run it resumes or a `run_dir=` it names) until the handle
is closed (`n.close()`), garbage-collected, or its process ends: the operating system
releases the lock of a process that dies, even by SIGKILL. The file says who holds it (pid,
host, run name, since when), for the refusal a second writer gets.

A flock conflicts between two open files of one process too, so a second handle in the
same process is refused like one in another process. One exception: a handle that continues
a run (it resumes it, or names its `run_dir=` before any checkpoint) takes it over from an
idle handle of the same process (the run finished, or stopped); that handle can no longer
write there.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import os
import socket
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nitro.errors import SetupError

__all__ = ["LOCK_FILE", "RunLock", "acquire", "check_free", "holder_of"]

LOCK_FILE = "run.lock"

# run directory -> the lock this process holds on it
_HELD: weakref.WeakValueDictionary[str, RunLock] = weakref.WeakValueDictionary()


class RunLock:
    """This process's hold on a run directory. `busy()`: whether the handle holding it is
    working (a resume takes over only an idle holder's lock)."""

    def __init__(self, run_dir: Path, fd: int, holder: Mapping[str, Any], busy: Callable[[], bool]):
        self.run_dir = run_dir
        self.holder = dict(holder)
        self.busy = busy
        self.taken_by: dict[str, Any] | None = None  # the holder that took this lock over
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        """Let go of the directory (closing the file releases the flock)."""
        self._finalizer()
        if _HELD.get(str(self.run_dir)) is self:
            del _HELD[str(self.run_dir)]

    def _write_holder(self) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(self.holder).encode(), 0)

    def _hand_over(self, holder: Mapping[str, Any], busy: Callable[[], bool]) -> RunLock:
        detached = self._finalizer.detach()  # (self, os.close, (fd,), {}): the fd moves on
        assert detached is not None  # a lock in _HELD is open
        successor = RunLock(self.run_dir, detached[2][0], holder, busy)
        successor._write_holder()
        self.taken_by = dict(holder)
        _HELD[str(self.run_dir)] = successor
        return successor


def holder_of(run_dir: Path) -> dict[str, Any]:
    """What the lock file of `run_dir` says of its holder ({} when unreadable)."""
    try:
        found = json.loads((run_dir / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def describe_holder(holder: Mapping[str, Any]) -> str:
    name = holder.get("name")
    parts = [
        f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}",
        f"run {holder.get('run_id', '?')}" + (f" named {name!r}" if name else ""),
        f"since {holder.get('since', '?')}",
    ]
    return ", ".join(parts)


def holder_record(run_id: str, name: str | None, owner: str) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "run_id": run_id,
        "name": name,
        "experiment": owner,
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _try_lock(run_dir: Path) -> int | None:
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def acquire(
    run_dir: Path,
    holder: Mapping[str, Any],
    busy: Callable[[], bool],
    *,
    take_over: bool = False,
) -> RunLock:
    """Hold `run_dir` for writing, or raise a SetupError naming who holds it and the fix.
    `take_over`: a resumed run may take the lock from an idle handle of this process."""
    run_dir = run_dir.absolute()
    for attempt in range(2):
        fd = _try_lock(run_dir)
        if fd is not None:
            lock = RunLock(run_dir, fd, holder, busy)
            lock._write_holder()
            _HELD[str(run_dir)] = lock
            return lock
        mine = _HELD.get(str(run_dir))
        if mine is not None and take_over and not mine.busy():
            return mine._hand_over(holder, busy)
        if mine is not None and attempt == 0:
            del mine
            gc.collect()  # a handle dropped (`del n`) but not collected yet lets go here
            continue
        break
    raise SetupError(_refusal(run_dir, _HELD.get(str(run_dir))))


def check_free(run_dir: Path) -> None:
    """Refuse (the SetupError `acquire` raises) when a writer holds `run_dir`: another process,
    or a working handle of this one (an idle one is taken over later). Called before a resume
    reads the run: a live writer's checkpoints change while they are read. Takes nothing."""
    run_dir = run_dir.absolute()
    if not (run_dir / LOCK_FILE).exists():
        return
    mine = _HELD.get(str(run_dir))
    if mine is not None:
        if mine.busy():
            raise SetupError(_refusal(run_dir, mine))
        return
    try:
        fd = _try_lock(run_dir)
    except OSError:  # a read-only run: nobody writes there
        return
    if fd is None:
        raise SetupError(_refusal(run_dir, None))
    os.close(fd)


def _refusal(run_dir: Path, mine: RunLock | None) -> str:
    start = f"run directory {str(run_dir)!r} has a writer already"
    one = "One run directory has one writer at a time"
    if mine is not None:
        doing = "and is working now" if mine.busy() else "and can still write there"
        return (
            f"{start}: another handle in this process holds it ({describe_holder(mine.holder)}) "
            f"{doing}. {one}: stop that handle if it runs, then `n.close()` it (or `del` it); "
            f"resume= takes the run over from an idle handle; or give this handle another "
            f"run_dir"
        )
    return (
        f"{start}: another process holds {LOCK_FILE} ({describe_holder(holder_of(run_dir))}). "
        f"{one}: let that run finish or stop it and close its handle (`n.close()`, or end the "
        f"process; a process that dies releases the lock), or give this handle another run_dir "
        f"(weights={str(run_dir)!r} starts a new run from its weights)"
    )
