"""persistent_workers=True: prefetch="processes" worker processes kept from one train() call
to the next on the same handle, with the batches of fresh workers; fresh workers once the
source or a file of its code changes; none left after close(), or after the owning process is
SIGKILLed while they wait for the next call."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from pipeline_toys import Pipe, params_of
from process_toys import Augmented
from worker_processes import gone, survivors_of_a_kill, workers_of

import nitro

TESTS = Path(__file__).parent
PROCESSES = {"prefetch": "processes", "prefetch_workers": 1, "progress": False, "logger": None}


def handle(source, **keywords) -> nitro.Nitro:
    return nitro.Nitro(
        Pipe(max_epochs=4),
        data={"train": source},
        steps_per_dispatch=1,
        **{**PROCESSES, **keywords},
    )


def pids() -> list[int]:
    return sorted(p.pid for p in workers_of(os.getpid()))


def test_persistent_workers_serve_every_train_call_of_a_handle_until_it_closes():
    kept = handle(Augmented(), persistent_workers=True)
    kept.train(epochs=2)
    first = pids()
    assert len(first) == 1  # kept after the call, waiting for the next
    kept.train(epochs=2)
    assert pids() == first and kept.runtime.prefetchers["train"].pool.starts == 1
    # the batches of workers started each call (threads give the same, bitwise)
    fresh = nitro.Nitro(
        Pipe(max_epochs=4),
        data={"train": Augmented()},
        steps_per_dispatch=1,
        **dict(PROCESSES, prefetch="threads"),
    )
    fresh.train(epochs=2)
    fresh.train(epochs=2)
    assert kept.history()["loss"].tolist() == fresh.history()["loss"].tolist()
    for a, b in zip(params_of(kept), params_of(fresh), strict=True):
        np.testing.assert_array_equal(a, b)

    workers = workers_of(os.getpid())
    kept.close()
    assert gone(workers) == [] and pids() == []


def test_a_populations_kept_workers_serve_its_next_call_until_it_closes():
    pop = nitro.Population(
        Pipe(max_epochs=4),
        learning_rate=[1e-3, 1e-2],
        data={"train": Augmented()},
        steps_per_dispatch=1,
        persistent_workers=True,
        checkpointer=None,
        **PROCESSES,
    )
    pop.train(epochs=1)
    first = pids()
    assert len(first) == 1  # the shared batches' worker, kept after the call
    pop.train(epochs=1)
    assert pids() == first
    workers = workers_of(os.getpid())
    pop.close()
    assert gone(workers) == [] and pids() == []


def test_a_changed_source_or_an_edited_file_of_its_code_gets_fresh_workers(tmp_path):
    module = tmp_path / "edited_source.py"
    module.write_text(
        "from process_toys import Augmented\n\n\nclass Edited(Augmented):\n    pass\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        source = importlib.import_module("edited_source").Edited()
        n = handle(source, persistent_workers=True)
        n.train(epochs=1)
        pool = n.runtime.prefetchers["train"].pool
        kept = pids()
        n.train(epochs=1)
        assert pids() == kept and pool.starts == 1  # nothing changed: the same worker

        source.work = 10  # the source changed between calls: its pickle differs
        n.train(epochs=1)
        assert pool.starts == 2 and pids() != kept and len(pids()) == 1

        stat = module.stat()  # an edit of the file its class comes from
        os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        n.train(epochs=1)
        assert pool.starts == 3
        n.close()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("edited_source", None)
    assert pids() == []


def test_no_kept_worker_outlives_its_parent_killed_between_calls():
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(TESTS)!r})
        import nitro
        from pipeline_toys import Pipe
        from process_toys import Augmented
        if __name__ == "__main__":
            n = nitro.Nitro(Pipe(max_epochs=1), data={{"train": Augmented()}},
                            prefetch="processes", prefetch_workers=1, persistent_workers=True,
                            progress=False, logger=None)
            n.train()
            print("trained", flush=True)
            time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "trained"
    except BaseException:
        parent.kill()
        raise
    assert survivors_of_a_kill(parent, 1) == []  # the kept worker, killed with its parent
