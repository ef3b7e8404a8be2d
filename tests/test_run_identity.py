"""Which run a resume continues, and one writer per run directory: run.json records the
experiment's module, class, notebook and the run's name; `resume="auto"` takes only runs of
the same experiment, the name's own run first, then the furthest trained; a second writer of
a run directory, in this process or another, is refused, and a killed writer's lock is gone.
Real orbax, real files, real child processes (tests/lifecycle_toys.py)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from lifecycle_toys import Wide
from system import child_env
from toys import Toy

import nitro
from nitro.errors import SetupError


def other_module_toy():
    """A class named Toy like toys.Toy, defined in another module (another notebook's)."""
    namespace = {"__name__": "another_notebook"}
    exec("import toys, nitro\n@nitro.experiment\nclass Toy(toys.Toy):\n    pass\n", namespace)
    return namespace["Toy"]


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """This process as a script at a known path, the notebook a run records, whatever started
    the tests (pytest's own __main__ has a file; a pytest-xdist worker's has none)."""
    path = str(tmp_path / "train.py")
    Path(path).write_text("")  # a worker process (prefetch="processes") imports it
    monkeypatch.setattr(sys.modules["__main__"], "__file__", path, raising=False)
    return path


def test_run_json_records_the_experiment_the_notebook_and_the_name(script):
    n = nitro.Nitro(Toy(max_epochs=1), name="baseline", progress=False).train()
    info = json.loads((Path(n.run_dir) / "run.json").read_text())
    assert (info["module"], info["qualname"], info["name"]) == ("toys", "Toy", "baseline")
    assert info["notebook"] == script
    assert n.name == "baseline"
    assert nitro.saved_runs("Toy").loc[n.run_id, "name"] == "baseline"
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        nitro.Nitro(Toy(), name="", progress=False)


def test_resume_auto_takes_no_run_of_a_same_named_class_of_another_module(capsys):
    every_epoch = nitro.Checkpointer(budget=None)  # both epochs saved, however busy the machine
    theirs = nitro.Nitro(
        other_module_toy()(max_epochs=2), checkpointer=every_epoch, progress=False
    ).train()
    with pytest.warns(RuntimeWarning, match="found no checkpoint") as warned:
        n = nitro.Nitro(Toy(max_epochs=1), resume="auto", progress=False)
    assert warned[0].filename == __file__  # the warning points at the line above
    assert "1 run of other experiments named Toy there: another module or notebook" in str(
        warned[0].message
    )
    assert (n.epoch, n.run_id != theirs.run_id) == (0, True)
    n.train()
    assert saved_steps(theirs) == [4, 8]  # their run's checkpoints are theirs alone


def saved_steps(n: nitro.Nitro) -> list[int]:
    return sorted(n.checkpoints()["step"].tolist())


def test_resume_auto_prefers_the_names_run_then_the_furthest_trained_and_says_so(capsys, script):
    named = nitro.Nitro(Toy(max_epochs=1), name="exp", progress=False).train()
    furthest = nitro.Nitro(Toy(max_epochs=3), progress=False).train()
    nitro.Nitro(Toy(max_epochs=2), progress=False).train()  # started last, trained less
    capsys.readouterr()

    n = nitro.Nitro(Toy(max_epochs=4), name="exp", resume="auto", progress=False)
    assert (n.run_id, n.epoch) == (named.run_id, 1)
    said = capsys.readouterr().err  # said even with progress=False
    assert f"nitro: resume='auto' continues run {named.run_id}: the run 'exp' last trained" in said

    (Path("runs") / "Toy" / "handles.json").unlink()  # without the record: the run's name
    n = nitro.Nitro(Toy(max_epochs=4), name="exp", resume="auto", progress=False)
    assert n.run_id == named.run_id
    assert f"the only run named 'exp', a run of toys.Toy in {script}" in capsys.readouterr().err

    n = nitro.Nitro(Toy(max_epochs=4), resume="auto", progress=False)  # no name: the furthest
    assert (n.run_id, n.epoch) == (furthest.run_id, 3)
    said = capsys.readouterr().err
    assert f"continues run {furthest.run_id}: the furthest trained (epoch 3, step 12) of 3" in said


def test_a_run_of_an_older_nitro_resumes_by_class_name_with_a_note(capsys):
    old = nitro.Nitro(Toy(max_epochs=1), progress=False).train()
    path = Path(old.run_dir) / "run.json"
    info = json.loads(path.read_text())
    for key in ("module", "qualname", "notebook", "name"):
        del info[key]
    path.write_text(json.dumps(info))
    capsys.readouterr()

    n = nitro.Nitro(Toy(max_epochs=2), resume="auto", progress=False)
    assert (n.run_id, n.epoch) == (old.run_id, 1)
    assert "written by an older Nitro (it recorded no module or notebook" in capsys.readouterr().err
    n.train()
    assert json.loads(path.read_text())["qualname"] == "Toy"  # it records who it is now


def test_a_second_handle_on_a_run_dir_is_refused_naming_the_holder_until_the_first_closes():
    first = nitro.Nitro(Toy(max_epochs=1), run_dir="shared", name="first", progress=False)
    with pytest.raises(SetupError) as refused:
        nitro.Nitro(Toy(max_epochs=1), run_dir="shared", progress=False, seed=5)
    message = str(refused.value)
    assert f"run directory {str(Path('shared').absolute())!r} has a writer already" in message
    assert f"another handle in this process holds it (pid {os.getpid()} on " in message
    assert f"run {first.run_id} named 'first'" in message
    assert "`n.close()` it (or `del` it)" in message

    first.train()
    assert saved_steps(first) == [4]
    first.close()
    # the directory holds first's run now: a new run there is refused, a resume continues it
    with pytest.raises(SetupError, match="already holds checkpoints of run"):
        nitro.Nitro(Toy(max_epochs=1), run_dir="shared", progress=False)
    second = nitro.Nitro(Toy(max_epochs=2), run_dir="shared", resume="auto", progress=False)
    second.train()
    assert (second.run_id, saved_steps(second)) == (first.run_id, [4, 8])
    records = [json.loads(line) for line in (Path("shared") / "metrics.jsonl").open()]
    steps = [r["step"] for r in records if r["type"] == "metrics"]
    assert steps == sorted(steps) and steps[-1] == 8  # one run, written by one handle at a time


def test_a_resume_takes_an_idle_handles_run_over_and_the_first_handle_writes_no_more():
    first = nitro.Nitro(Toy(max_epochs=1), progress=False).train()
    second = nitro.Nitro(Toy(max_epochs=2), resume=first.run_dir, progress=False)
    second.train()
    with pytest.raises(SetupError, match=f"this handle no longer writes run {first.run_id}"):
        first.train(epochs=1)
    assert saved_steps(second) == [4, 8]
    assert first.epoch == 1


@contextlib.contextmanager
def _writer(run_dir: Path, saved: int) -> Iterator[subprocess.Popen]:
    """Another process training `Wide` into `run_dir` with a checkpoint every epoch, once
    `nitro.saved_runs` lists `saved` of its checkpoints; killed afterwards."""
    code = "import lifecycle_toys; lifecycle_toys.main()"
    writer = subprocess.Popen(
        [sys.executable, "-c", code, "saves", str(run_dir)],
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == f"training {writer.pid}"
        deadline = time.monotonic() + 120  # a generous wait for its saves
        while _listed(run_dir) < saved:
            assert time.monotonic() < deadline and writer.poll() is None
            time.sleep(0.05)
        yield writer
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=60)
        if writer.stdout is not None:
            writer.stdout.close()


def _listed(run_dir: Path) -> int:
    """How many checkpoints `nitro.saved_runs` lists for the run."""
    runs = nitro.saved_runs(run_dir)
    return int(runs["checkpoints"].iloc[0]) if len(runs) else 0


def test_another_process_writing_a_run_is_refused_and_its_lock_is_gone_once_it_is_killed(
    tmp_path,
):
    run_dir = tmp_path / "wide"
    with _writer(run_dir, saved=1) as writer:
        with pytest.raises(SetupError) as refused:
            nitro.Nitro(Wide(), run_dir=str(run_dir), resume="auto", progress=False)
        message = str(refused.value)
        assert "another process holds run.lock" in message
        assert f"(pid {writer.pid} on " in message
        assert "a process that dies releases the lock" in message

    n = nitro.Nitro(Wide(), run_dir=str(run_dir), resume="auto", progress=False, logger=None)
    assert n.step > 0  # the killed writer's lock went with it
    holder = json.loads((run_dir / "run.lock").read_text())
    assert (holder["pid"], holder["run_id"]) == (os.getpid(), n.run_id)


def test_a_run_another_process_is_writing_lists_its_checkpoints_without_warnings(tmp_path):
    """Its writer removes old steps (the keep policy) while they are listed: no listing warns
    of damage or comes back empty."""
    run_dir = tmp_path / "wide"
    with _writer(run_dir, saved=2) as writer:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(40):
                assert _listed(run_dir) >= 1
        assert writer.poll() is None  # it was writing all along


def test_handles_made_in_one_second_never_share_a_run_id_or_another_process_s_directory(
    monkeypatch,
):
    """A run id is the second plus 4 random hex digits: the draw is made to repeat, and to
    name a directory another process made in this second."""
    draws = iter(["aaaa", "aaaa", "bbbb", "cccc", "dddd"])
    real = secrets.token_hex
    monkeypatch.setattr(secrets, "token_hex", lambda nbytes=None: next(draws, None) or real(nbytes))
    first = nitro.Nitro(Toy(), progress=False)
    for second in {time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() + d)) for d in (0, 1)}:
        (Path("runs") / "Toy" / f"{second}-bbbb").mkdir(parents=True)  # another process's
        (Path("runs") / "Toy" / f"{second}-cccc").mkdir(parents=True)
    second = nitro.Nitro(Toy(), progress=False)
    assert first.run_id.endswith("-aaaa")
    assert second.run_id.endswith("-dddd") or second.run_id[:15] != first.run_id[:15]
    assert second.run_dir == str(Path.cwd() / "runs" / "Toy" / second.run_id)
    second.train()
    first.train()  # each writes its own directory
    assert {first.run_dir, second.run_dir} == {
        str(p.absolute()) for p in Path("runs/Toy").iterdir() if (p / "run.json").is_file()
    }
