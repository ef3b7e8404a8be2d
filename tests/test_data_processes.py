"""prefetch="processes": worker processes build an index-addressable source's batches; the
same batches in the same order as threads and inline, errors naming the batch, no worker left
behind (end of run, stop, Ctrl-C, a killed parent), and "auto" choosing from a measurement."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import numpy as np
import psutil
import pytest
from pipeline_toys import Pipe, PlainBatches, params_of
from process_toys import Augmented, StartsInNoWorker
from worker_processes import gone, survivors_of_a_kill, workers_of
from worker_processes import wait_for as _wait_for

import nitro
from nitro.errors import DataWorkerError, SetupError

TESTS = Path(__file__).parent


def train(source, **keywords) -> nitro.Nitro:
    n = nitro.Nitro(Pipe(max_epochs=2), data={"train": source}, progress=False, **keywords)
    n.train()
    return n


def test_processes_give_the_batches_of_threads_and_inline_bitwise_and_leave_no_worker():
    results = {}
    for mode in ("inline", "threads", "processes"):
        n = train(Augmented(), prefetch=mode, prefetch_workers=2, steps_per_dispatch=1)
        results[mode] = (n.history()["loss"].tolist(), params_of(n))
        if mode == "processes":
            assert "processes: 2 worker processes" in str(n.binding_report())
            assert workers_of(os.getpid()) == []  # the end of the run stopped them
    for mode in ("threads", "processes"):
        assert results[mode][0] == results["inline"][0], mode
        for a, b in zip(results[mode][1], results["inline"][1], strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_worker_error_names_the_batch_and_chains_the_original():
    n = nitro.Nitro(
        Pipe(max_epochs=1),
        data={"train": Augmented(fail_at=5)},
        prefetch="processes",
        progress=False,
    )
    with pytest.raises(DataWorkerError, match=r"'train'.*batch_at\(5\).*ValueError.*sample 60"):
        n.train()
    assert workers_of(os.getpid()) == []
    with pytest.raises(DataWorkerError) as again:  # the handle stays usable: a fresh pool
        n.train()
    original = again.value.__cause__
    assert isinstance(original, ValueError)
    assert "in batch_at" in str(original.__cause__)  # the worker's own traceback
    assert workers_of(os.getpid()) == []


def test_a_worker_that_dies_gives_a_data_worker_error_naming_the_split_and_a_fresh_pool_next():
    n = nitro.Nitro(
        Pipe(max_epochs=1),
        data={"train": Augmented(die_at=5)},
        prefetch="processes",
        prefetch_workers=2,
        progress=False,
    )
    for _ in range(2):  # the handle stays usable: the second call starts a fresh pool
        with pytest.raises(
            DataWorkerError, match=r"worker process building the 'train' split died"
        ):
            n.train()
        assert _wait_for(lambda: workers_of(os.getpid()) == [])
    assert n.stop_reason == "error" and n.step < 8


def test_a_source_that_does_not_pickle_or_has_no_index_is_refused_at_setup():
    source = Augmented()
    source.lock = threading.Lock()
    with pytest.raises(SetupError, match=r"'train' source.*does not pickle.*prefetch='threads'"):
        nitro.Nitro(Pipe(), data={"train": source}, prefetch="processes", progress=False)
    with pytest.raises(SetupError, match=r"index-addressable 'train' source.*begin_epoch"):
        nitro.Nitro(Pipe(), data={"train": PlainBatches()}, prefetch="processes", progress=False)


def test_no_worker_outlives_a_stop_or_an_interrupt():
    n = nitro.Nitro(
        Pipe(max_epochs=10_000),
        data={"train": Augmented(work=1_000)},
        prefetch="processes",
        progress=False,
    )
    n.train(background=True)
    assert _wait_for(lambda: len(workers_of(os.getpid())) == 2 and n.step >= 3)
    workers = workers_of(os.getpid())
    n.stop().wait()
    assert n.stop_reason == "requested"
    assert gone(workers) == []

    def interrupt_once_working():
        if _wait_for(lambda: len(workers_of(os.getpid())) == 2 and n.step >= 3):
            interrupted.extend(workers_of(os.getpid()))
        os.kill(os.getpid(), signal.SIGINT)

    interrupted: list[psutil.Process] = []
    timer = threading.Thread(target=interrupt_once_working)
    timer.start()
    try:
        n.train()
    except KeyboardInterrupt:
        pass
    timer.join()
    assert len(interrupted) == 2
    assert gone(interrupted) == []


def test_no_worker_outlives_its_parent_killed_mid_run():
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import nitro
        from pipeline_toys import Pipe
        from process_toys import Augmented, StartsInNoWorker
        n = nitro.Nitro(Pipe(max_epochs=100_000), data={{"train": Augmented(work=1_000)}},
                        prefetch="processes", prefetch_workers=2, progress=False)
        n.train()
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    assert survivors_of_a_kill(parent, 2) == []


@pytest.mark.serial  # auto's choice is a measurement of this machine
def test_auto_measures_and_the_binding_report_says_which_and_why():
    python_heavy = train(Augmented(work=10_000), steps_per_dispatch=1)
    report = str(python_heavy.binding_report())
    assert "prefetch processes: " in report
    assert "auto: 2 threads built batches" in report and "holds the interpreter lock" in report

    waiting = train(Augmented(sleep=0.02), steps_per_dispatch=1)
    report = str(waiting.binding_report())
    assert "prefetch fanout: " in report and "runs in parallel on threads" in report

    arrays = train(Pipe().build_data()["train"])
    assert "prefetch inline: a batch builds in" in str(arrays.binding_report())


@pytest.mark.serial  # auto's choice is a measurement of this machine
def test_auto_runs_a_script_without_a_main_guard_on_threads_with_one_note(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(TESTS)!r})
            import nitro
            from pipeline_toys import Pipe
            from process_toys import Augmented
            n = nitro.Nitro(Pipe(max_epochs=2), data={{"train": Augmented(work=10_000)}},
                            steps_per_dispatch=1, progress=False)
            n.train()
            print(n.step, n.stop_reason)
            print(n.binding_report())
            """
        )
    )
    for _ in range(3):  # a busy machine can make 2 threads look faster than 1: then again
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split()[:2] == ["16", "completed"]
        if "runs in parallel on threads" not in done.stdout:
            break
    notes = [line for line in done.stderr.splitlines() if "prefetch='auto' builds" in line]
    assert len(notes) == 1, done.stdout + done.stderr[-3000:]
    assert "on threads: 2 threads built batches" in notes[0]
    assert 'train.py again: it trains outside `if __name__ == "__main__":`' in notes[0]
    assert "prefetch fanout: " in done.stdout and "train.py again" in done.stdout


@pytest.mark.serial  # auto's choice is a measurement of this machine
def test_auto_goes_on_with_threads_when_its_worker_processes_die_before_their_first_batch():
    for _ in range(3):  # a busy machine can make 2 threads look faster than 1: then again
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            n = train(StartsInNoWorker(work=10_000), steps_per_dispatch=1)
        if "runs in parallel on threads" not in str(n.binding_report()):
            break
    notes = [str(w.message) for w in caught if "prefetch='auto'" in str(w.message)]
    assert len(notes) == 1 and "died before they built a batch" in notes[0], notes
    assert n.stop_reason == "completed" and n.step == 16
    assert "prefetch fanout: 2 workers" in str(n.binding_report())
    assert "threads instead" in str(n.binding_report())
    threads = train(StartsInNoWorker(work=10_000), prefetch="threads", steps_per_dispatch=1)
    assert n.history()["loss"].tolist() == threads.history()["loss"].tolist()
    assert workers_of(os.getpid()) == []


def test_a_script_without_a_main_guard_fails_naming_the_guard_instead_of_hanging(tmp_path):
    # each worker imports the main module, which here trains again and fails to start a pool
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(TESTS)!r})
            import nitro
            from pipeline_toys import Pipe
            from process_toys import Augmented, StartsInNoWorker
            n = nitro.Nitro(Pipe(max_epochs=1), data={{"train": Augmented()}},
                            prefetch="processes", progress=False)
            n.train()
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "DataWorkerError" in done.stderr
    assert "if __name__ == '__main__':" in done.stderr
    assert "so each would train again" in done.stderr
    assert "bootstrapping phase" not in done.stderr  # refused before any worker ran the script


def test_a_population_on_worker_processes_trains_as_on_threads_and_leaves_no_worker():
    def population(mode):
        pop = nitro.Population(
            Pipe(max_epochs=2),
            learning_rate=[1e-3, 1e-2],
            data={"train": Augmented()},
            prefetch=mode,
            prefetch_workers=2,
            progress=False,
            checkpointer=None,
            logger=None,
        )
        return pop.train()

    threads, processes = population("threads"), population("processes")
    assert workers_of(os.getpid()) == []  # the end of the run stopped them
    np.testing.assert_array_equal(processes.history()["loss"], threads.history()["loss"])
