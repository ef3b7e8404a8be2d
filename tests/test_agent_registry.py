"""The registry of agent runs: results, errors, and how many finished runs it keeps."""

from __future__ import annotations

import threading

from nitro.mcp.registry import MAX_FINISHED_RUNS, RunRegistry, RunStatus

WAIT = 120  # seconds: a bound for a thread's run, reached only if the code is wrong


def test_a_run_records_its_result_or_its_error_text():
    registry = RunRegistry()
    good = registry.start("validate", lambda record: {"val_loss": 0.5}, experiment="Toy")
    bad = registry.start("evaluate", lambda record: {}["test"], experiment="Toy")

    assert registry.wait(good.run_id, timeout=WAIT).result == {"val_loss": 0.5}
    assert good.status is RunStatus.DONE and good.error is None
    assert registry.wait(bad.run_id, timeout=WAIT).status is RunStatus.FAILED
    assert bad.error == "KeyError: 'test'"
    assert len(good.run_id) == 8 and good.run_id != bad.run_id


def test_at_most_twenty_finished_runs_are_kept_and_running_ones_never_go():
    registry = RunRegistry()
    release = threading.Event()
    running = registry.start("train", lambda record: release.wait(WAIT), experiment="Long")
    finished = []
    for i in range(MAX_FINISHED_RUNS + 5):
        record = registry.start("validate", lambda record, i=i: i, experiment="Toy")
        registry.wait(record.run_id, timeout=WAIT)
        finished.append(record.run_id)

    kept = [r.run_id for r in registry.records()]
    assert MAX_FINISHED_RUNS == 20
    assert kept == [running.run_id, *finished[5:]]  # the five oldest finished runs went
    assert registry.get(finished[0]) is None

    release.set()  # the long run finishes last: now the oldest finished run goes
    registry.wait(running.run_id, timeout=WAIT)
    assert [r.run_id for r in registry.records()] == [running.run_id, *finished[6:]]


def test_the_registry_lists_the_handles_its_runs_built():
    registry = RunRegistry()
    marker = object()

    def build(record):
        record.handle = marker

    record = registry.start("train", build, experiment="Toy")
    registry.wait(record.run_id, timeout=WAIT)
    assert registry.handles() == {record.run_id: marker}
