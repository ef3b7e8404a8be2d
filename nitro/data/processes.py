"""Worker processes for sources whose batches cost Python time (`prefetch="processes"`).

Threads cannot run Python in parallel (the interpreter lock), so a `batch_at` that augments,
decodes or tokenizes in Python is built one batch at a time however many threads there are.
`WorkerPool` runs an index-addressable source's `batch_at` in a pool of worker processes
(`concurrent.futures.ProcessPoolExecutor`, started with "spawn": no fork of the threaded JAX
process). The source is sent once, by value (`cloudpickle`: a class defined in a notebook
travels too), through a file in a private temporary directory: through the spawn pipe, a
worker that died while starting (a script without a main guard) would leave the parent
blocked writing a source bigger than the pipe. Each worker calls `begin_epoch(epoch)` itself,
once per epoch, and builds the batches it is given by index. The prefetcher submits at most `host_batches` of them ahead and
takes them back in index order, as with threads.

Lifetime: the pool starts on the first epoch and lives until the run ends (`release()`), or,
with `persistent_workers=True`, from run to run (`park()` at a run's end): the first batch of
the next run compares the source's pickle and the modification times of its code's files
with those the workers started from, and starts fresh workers when they differ, so the
workers never build batches from a source or code the run no longer has. A worker ignores
Ctrl-C and SIGUSR1 and outlives SIGTERM by a second (a job's scheduler signals every process:
the run handles the signal, stops and closes the pool), and exits as soon as its
parent process is gone (killed, a kernel restart), so no worker outlives the process that
started it.

`gil_speedup` measures what decides between threads and processes for `prefetch="auto"`: how
much faster two threads build a few batches than one. `unguarded_script` says when worker
processes cannot start at all: each imports the script that runs, and one whose training is
not under `if __name__ == "__main__":` would train again in every worker. A pool that "auto"
chose and that dies before its first batch raises `WorkersDidNotStart`, on which the
prefetcher goes on with threads.
"""

from __future__ import annotations

import ast
import concurrent.futures
import concurrent.futures.process
import hashlib
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

from nitro.errors import DataWorkerError, SetupError

__all__ = ["WorkerPool", "WorkersDidNotStart", "gil_speedup", "pickled_source", "unguarded_script"]

TERM_GRACE = 1.0  # seconds a worker lives on after SIGTERM

# In a worker process: the source and the plan of the epoch it is building.
_worker_source: Any = None
_worker_plan: tuple[int, Any] | None = None


def pickled_source(source: Any, split: str) -> bytes:
    """The source as cloudpickle bytes, or a SetupError naming the split and what failed."""
    import cloudpickle

    try:
        return cloudpickle.dumps(source)
    except Exception as error:
        raise SetupError(
            f"prefetch='processes' sends the '{split}' source to worker processes, but it "
            f"does not pickle: {type(error).__name__}: {error}. Keep what cannot be pickled "
            f"(open files, locks, clients) out of the source's attributes and open it lazily "
            f"in batch_at, or use prefetch='threads'."
        ) from error


def _start_worker(path: str, parent: int) -> None:
    import cloudpickle

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle
    # SLURM signals every process of a job step: the run, signalled too, stops after its step
    # and closes the pool (`preemption=`), and must not lose the batch that step waits for
    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_soon)
    threading.Thread(target=_watch_parent, args=(parent, path), daemon=True).start()
    global _worker_source
    with open(path, "rb") as file:
        _worker_source = cloudpickle.load(file)


def _exit_soon(signum: int, frame: Any) -> None:
    """SIGTERM: exit `TERM_GRACE` seconds later, so a run that received it too has set its
    stop request (it needs no batch after that), while the pool's shutdown, which ends its
    workers with SIGTERM, still ends this one."""
    threading.Timer(TERM_GRACE, os._exit, (128 + signum,)).start()


def _watch_parent(parent: int, path: str) -> None:
    """Exit when the process that started this worker is gone: a worker is re-parented
    when its parent dies (SIGKILL, a kernel restart), and nothing else would tell it. The
    parent would have removed the source's file; the first worker to notice does."""
    while os.getppid() == parent:
        time.sleep(0.2)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    os._exit(0)


def _build(epoch: int, index: int) -> Any:
    global _worker_plan
    if _worker_plan is None or _worker_plan[0] != epoch:
        _worker_plan = (epoch, _worker_source.begin_epoch(epoch))
    return _worker_source.batch_at(index, _worker_plan[1])


class WorkersDidNotStart(DataWorkerError):
    """A pool that `prefetch="auto"` chose died before it built its first batch."""


def _is_main_guard(test: ast.expr) -> bool:
    if not isinstance(test, ast.Compare) or len(test.comparators) != 1:
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    mains = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return isinstance(test.ops[0], ast.Eq) and len(names) == 1 and len(mains) == 1


def unguarded_script() -> str | None:
    """The script this process runs when its main thread is in the script's own top-level
    code outside an `if __name__ == "__main__":` block: a worker process started with
    "spawn" imports that script, so it would run that code (train) again. None in a
    notebook, a REPL, `python -c`, or under the guard."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str) or not os.path.isfile(path):
        return None
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    while frame is not None:
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            break
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            if node.lineno <= line <= (node.end_lineno or node.lineno):
                return None
    return path


class WorkerPool:
    """`workers` processes building one split's batches; started on first use. `fallback`:
    "auto" chose it, so a pool that dies before its first batch raises `WorkersDidNotStart`."""

    def __init__(self, source: Any, workers: int, split: str, fallback: bool = False):
        pickled_source(source, split)  # refuse what does not pickle now, at setup
        self.source, self.workers, self.split = source, workers, split
        self.fallback = fallback
        self.delivered = 0  # batches the workers built: none means they never started
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None
        self._key: bytes | None = None  # what the running workers were started from
        self._parked = False  # kept from an earlier run: check the key before using them
        self.starts = 0  # pools started: a persistent pool is started once

    @property
    def running(self) -> bool:
        return self._executor is not None

    def pids(self) -> list[int]:
        """The worker processes' ids (empty before the first epoch and after release)."""
        executor = self._executor
        processes = getattr(executor, "_processes", None) or {}
        return sorted(p.pid for p in list(processes.values()) if p.pid is not None)

    def submit(self, epoch: int, index: int) -> concurrent.futures.Future:
        with self._lock:
            if self._executor is not None and self._parked:
                self._parked = False
                pickled = pickled_source(self.source, self.split)
                if _key(self.source, pickled) != self._key:  # changed since: fresh workers
                    self._stop_locked()
            if self._executor is None:
                script = unguarded_script()
                if script is not None:  # each worker would run it, and fail to start its own
                    raise DataWorkerError(
                        f"prefetch='processes' starts worker processes for the '{self.split}' "
                        f"split, and each imports {script}, which trains outside "
                        f"`if __name__ == '__main__':`, so each would train again. Put the "
                        f"training under that guard, or use prefetch='threads'"
                    )
                folder = tempfile.mkdtemp(prefix="nitro-workers-")
                path = os.path.join(folder, "source.pkl")
                pickled = pickled_source(self.source, self.split)
                self._key = _key(self.source, pickled)
                with open(path, "wb") as file:  # the source as it is now, each train()
                    file.write(pickled)
                self.starts += 1
                self._executor = concurrent.futures.ProcessPoolExecutor(
                    max_workers=self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_worker,
                    initargs=(path, os.getpid()),
                )
                self._finalizer = weakref.finalize(self, _shut_down, self._executor, folder)
            executor = self._executor
        try:
            return executor.submit(_build, epoch, index)
        except concurrent.futures.process.BrokenProcessPool as error:
            # a worker died since the last submit: the error is the batch's, read by result()
            broken: concurrent.futures.Future = concurrent.futures.Future()
            broken.set_exception(error)
            return broken

    def result(self, future: concurrent.futures.Future, epoch: int, index: int) -> Any:
        """The batch a worker built, or its error, re-raised naming the batch."""
        try:
            batch = future.result()
        except concurrent.futures.process.BrokenProcessPool as error:
            self.release()  # the next epoch starts a fresh pool
            if self.fallback and not self.delivered:
                raise WorkersDidNotStart(
                    f"the worker processes for the '{self.split}' split died before they "
                    f"built a batch ({error})"
                ) from error
            raise DataWorkerError(
                f"a worker process building the '{self.split}' split died by batch {index} "
                f"of epoch {epoch}: killed, out of memory, crashed, or it failed "
                f"to start (a script that trains needs `if __name__ == '__main__':` around "
                f"it: each worker imports the main module; its error is above). The pool was "
                f"shut down: {error}"
            ) from error
        except Exception as error:
            raise DataWorkerError(
                f"the '{self.split}' split's batch_at({index}) (epoch {epoch}) raised in a "
                f"worker process: {type(error).__name__}: {error} (the worker's traceback is "
                f"chained below)"
            ) from error
        self.delivered += 1
        return batch

    def park(self) -> None:
        """Keep the workers for the next run (`persistent_workers=True`), which checks first
        that they have the source and code it has."""
        with self._lock:
            self._parked = self._executor is not None

    def release(self) -> None:
        """Stop the workers and wait for them (idempotent)."""
        with self._lock:
            finalizer = self._detach()
        if finalizer is not None:
            finalizer()

    def _detach(self) -> weakref.finalize | None:
        self._executor, self._key, self._parked = None, None, False
        finalizer, self._finalizer = self._finalizer, None
        return finalizer

    def _stop_locked(self) -> None:
        finalizer = self._detach()
        if finalizer is not None:
            finalizer()


def _key(source: Any, pickled: bytes) -> bytes:
    """What a pool of workers is started from: the source's pickle, and the path, size and
    modification time of the file of every module the parent has loaded outside the Python
    installation (the source's classes and functions travel by reference when they live in
    a module: a worker imported that file as it was then)."""
    digest = hashlib.sha256(pickled)
    for name, module in sorted(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or _installed(path):
            continue
        try:
            stat = os.stat(path)
        except OSError:
            continue
        digest.update(f"{name}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.digest()


_INSTALLED = tuple(
    {q for p in (sys.prefix, sys.base_prefix, sys.exec_prefix) for q in (p, os.path.realpath(p))}
)


def _installed(path: str) -> bool:
    """A file of the Python installation or its packages (site-packages), not the user's."""
    return "site-packages" in path or "dist-packages" in path or path.startswith(_INSTALLED)


def _shut_down(executor: concurrent.futures.ProcessPoolExecutor, folder: str) -> None:
    """Cancel what has not started, let idle workers exit, and terminate the busy ones after
    a grace period (a long batch_at would otherwise hold the run's end); remove the source's
    file."""
    shutil.rmtree(folder, ignore_errors=True)  # the workers read it when they started
    processes = list((getattr(executor, "_processes", None) or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + 2.0
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5.0)
        if process.is_alive():
            process.kill()
            process.join()
    executor.shutdown(wait=True)


def gil_speedup(source: Any, batches: int = 4) -> tuple[float, float]:
    """How much faster 2 threads build `batches` batches than 1 (about 1 for work that holds
    the interpreter lock, about 2 for work that releases it), and one batch's build time.

    >>> import numpy as np
    >>> from nitro.data import ArrayLoader
    >>> speedup, seconds = gil_speedup(ArrayLoader({"x": np.zeros((64, 2))}, 8))
    >>> speedup > 0 and seconds > 0
    True
    """
    plan = source.begin_epoch(0)
    count = max(2, min(batches, len(source)))
    times = []
    for index in range(count):
        start = time.perf_counter()
        source.batch_at(index % len(source), plan)
        times.append(time.perf_counter() - start)
    # the fastest batch stands for all: a pause of a busy machine must not read as speedup
    serial = min(times) * count
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="nitro-measure") as pool:
        start = time.perf_counter()
        list(pool.map(lambda i: source.batch_at(i % len(source), plan), range(count)))
        parallel = time.perf_counter() - start
    return serial / max(parallel, 1e-9), min(times)
