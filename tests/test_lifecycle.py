"""A run's life on disk: run directories, orbax checkpoints, crashes, exact resume, weights,
early stopping, phases and monitors. Real orbax throughout; the crash tests kill real child
processes (tests/lifecycle_toys.py) with SIGKILL."""

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
import warnings
from pathlib import Path

import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from lifecycle_toys import Wide, parameters
from system import child_env, mounted
from toys import TinyMLP, Toy, ToyWithMetrics, X

import nitro

EVERY_EPOCH = nitro.Checkpointer(budget=None)


def child(mode: str, *args: str, **popen) -> subprocess.Popen:
    """A child process running `lifecycle_toys.main([mode, *args])`."""
    code = "import lifecycle_toys; lifecycle_toys.main()"
    return subprocess.Popen(
        [sys.executable, "-c", code, mode, *args], env=child_env(), text=True, **popen
    )


def saved_epochs(n: nitro.Nitro) -> list[int]:
    return sorted(n.checkpoints()["epoch"].tolist())


def read_plain(directory: Path, step: int) -> dict:
    """One saved step, restored by orbax alone (no nitro code involved)."""
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(directory.absolute(), options=options) as manager:
        return manager.restore(step)


def flat(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        out.update(flat(value, path) if isinstance(value, dict) else {path: np.asarray(value)})
    return out


class Recorder:
    """A progress reporter that keeps the notes and phases a run reports."""

    def __init__(self):
        self.notes: list[str] = []
        self.phases: list[str] = []

    def note(self, message, done=False):
        self.notes.append(message)

    def phase(self, phase):
        self.phases.append(phase)


# ---------------------------------------------------------------------------------------------
# run directories


def test_every_run_gets_a_directory_named_by_a_sortable_run_id_and_its_first_line_names_it(
    capsys,
):
    before = int(time.time())
    n = nitro.Nitro(Toy(max_epochs=1), progress="lines")
    after = time.time()
    n.train()

    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", n.run_id)
    started = time.mktime(time.strptime(n.run_id[:15], "%Y%m%d-%H%M%S"))
    assert before <= started <= after  # the timestamp (when the handle was built) sorts runs
    assert Path(n.run_dir) == Path.cwd() / "runs" / "Toy" / n.run_id
    info = json.loads((Path(n.run_dir) / "run.json").read_text())
    assert (info["run_id"], info["experiment"]) == (n.run_id, n.owner)
    assert info["graphconst"] == {"width": 8, "offset": 0.0}
    assert info["nitro"] == nitro.__version__  # the one version; pyproject reads it too
    first = capsys.readouterr().err.splitlines()[0]
    assert first == f"nitro: run {n.run_id} in {n.run_dir}"


def test_run_dir_moves_the_run_and_a_directory_holding_checkpoints_is_refused_unless_resuming():
    n = nitro.Nitro(Toy(max_epochs=1), run_dir="elsewhere/first", progress=False).train()
    n.wait()  # train() returns while its save is written: wait() waits for it
    assert n.run_dir == str(Path.cwd() / "elsewhere" / "first")
    assert (Path(n.run_dir) / "checkpoints" / "4").is_dir()
    assert not Path("runs").exists()

    with pytest.raises(nitro.SetupError) as refused:
        nitro.Nitro(Toy(max_epochs=2), run_dir="elsewhere/first", progress=False)
    assert f"already holds checkpoints of run {n.run_id} (steps 4..4)" in str(refused.value)
    assert "resume='auto' continues it; choose another run_dir" in str(refused.value)

    resumed = nitro.Nitro(Toy(max_epochs=2), run_dir="elsewhere/first", resume="auto")
    assert (resumed.run_id, resumed.step, resumed.epoch) == (n.run_id, 4, 1)
    resumed.train()
    assert sorted(resumed.checkpoints()["step"]) == [4, 8]


def test_a_train_that_cannot_write_its_run_directory_lets_go_of_it(tmp_path):
    # a tmpfs of 3 inodes: itself, the run directory and its run.lock; run.json finds none
    with mounted(tmp_path / "full", "size=1m,nr_inodes=3") as disk:
        run_dir = disk / "run"
        n = nitro.Nitro(Toy(), run_dir=run_dir, logger=None, progress=False)
        with pytest.raises(nitro.SetupError, match="cannot create the run directory"):
            n.train()
        assert (n.step, n.epoch) == (0, 0)
        # nothing was written: the directory is free for another handle, n still open
        other = nitro.Nitro(Toy(), run_dir=run_dir, logger=None, progress=False)
        with pytest.raises(nitro.SetupError) as refused:
            nitro.Nitro(Toy(), run_dir=run_dir, logger=None, progress=False)
        assert "another handle in this process holds it" in str(refused.value)
        assert "`n.close()`" in str(refused.value)
        other.close()
        n.close()


# ---------------------------------------------------------------------------------------------
# which checkpoints are kept


def test_checkpoints_keep_the_best_k_by_the_metric_plus_the_newest():
    keep = nitro.Checkpointer(k=2, metric="val_loss", mode="max", budget=None)
    n = nitro.Nitro(ToyWithMetrics(max_epochs=5), checkpointer=keep, progress=False).train()
    val_loss = n.history()["val_loss"].tolist()
    assert val_loss == sorted(val_loss, reverse=True)  # falls every epoch on this toy

    # mode="max": the two highest val_loss are the first two epochs; the newest is kept too
    assert saved_epochs(n) == [1, 2, 5]
    assert n.checkpoints()["val_loss"].tolist() == pytest.approx([*val_loss[:2], val_loss[4]])


def test_checkpointer_none_writes_no_checkpoints():
    n = nitro.Nitro(Toy(max_epochs=2), checkpointer=None, progress=False).train()
    git = json.loads((Path(n.run_dir) / "run.json").read_text())["git"]
    patch = ["working_tree.patch"] if git is not None and git["dirty"] else []  # as it develops
    assert sorted(os.listdir(n.run_dir)) == ["metrics.jsonl", "run.json", "run.lock", *patch]
    assert n.checkpoints().empty


def test_the_budget_skips_saves_on_tiny_epochs_and_still_leaves_the_newest_epoch_saved():
    # one step a call: no save waits for "auto" to finish timing its call sizes, which takes
    # longer on a busy machine (that wait has its own test, below)
    keywords = {"progress": False, "steps_per_dispatch": 1}
    budgeted = nitro.Nitro(
        Toy(max_epochs=6), checkpointer=nitro.Checkpointer(k=10), **keywords
    ).train()
    every = nitro.Nitro(
        Toy(max_epochs=6), checkpointer=nitro.Checkpointer(k=10, budget=None), **keywords
    ).train()

    # a save costs tens of milliseconds, an epoch of this toy a few: at 5% of training time,
    # the first epoch is saved, most later ones are skipped, and the run's end saves the last
    epochs = saved_epochs(budgeted)
    assert epochs[0] == 1 and epochs[-1] == 6 and len(epochs) < 6
    assert saved_epochs(every) == [1, 2, 3, 4, 5, 6]


def test_while_auto_times_its_call_sizes_no_save_is_written_mid_call(monkeypatch):
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", float("inf"))  # fused sizes timed on a toy
    budgeted = nitro.Checkpointer(k=10)
    timed = nitro.Nitro(Toy(batch_size=4, max_epochs=9), checkpointer=budgeted, progress=False)
    timed.train(epochs=3)  # epochs of 16 batches: three rounds of timing take more than three
    assert timed.dispatch.checking, timed.dispatch
    # no write shared the cores with the calls compared; the call's end saved its newest epoch
    assert saved_epochs(timed) == [3]
    timed.train(epochs=6)  # (timing may end in it or not: up to 11 rounds)
    assert saved_epochs(timed)[-1] == 9
    nitro.cache_reset()  # forget the choice `timed` made: a handle of its program would reuse it
    every = nitro.Nitro(Toy(batch_size=4, max_epochs=3), checkpointer=EVERY_EPOCH, progress=False)
    every.train()  # budget=None saves every epoch, timing or not
    assert every.dispatch.checking and saved_epochs(every) == [1, 2, 3]


# ---------------------------------------------------------------------------------------------
# the files are plain orbax

PLAIN_READER = """
import json, sys
import numpy as np
import orbax.checkpoint as ocp

directory, expected = sys.argv[1], np.load(sys.argv[2])
manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
steps = list(manager.all_steps())
saved = manager.restore(steps[-1])
manager.close()

def flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        out.update(flat(value, path) if isinstance(value, dict) else {path: value})
    return out

params = flat(saved["state"]["params"])
print(json.dumps({
    "steps": steps,
    "epoch": saved["meta"]["epoch"],
    "equal": sorted(k for k in expected if np.array_equal(params[k], expected[k])),
    "leaves": sorted(params),
    "modules": sorted(m for m in ("nitro", "flax", "optax") if m in sys.modules),
}))
"""


def test_the_files_are_plain_orbax_read_by_a_process_without_nitro_flax_or_optax(tmp_path):
    n = nitro.Nitro(ToyWithMetrics(max_epochs=3), checkpointer=EVERY_EPOCH, progress=False)
    n.train()
    np.savez(tmp_path / "params.npz", **parameters(n))

    done = subprocess.run(
        [sys.executable, "-c", PLAIN_READER, f"{n.run_dir}/checkpoints", "params.npz"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=child_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    read = json.loads(done.stdout)
    assert read["modules"] == []
    assert read["steps"] == sorted(n.checkpoints()["step"]) == [4, 8, 12]
    assert read["epoch"] == 3
    assert read["leaves"] == read["equal"] == sorted(parameters(n))


# ---------------------------------------------------------------------------------------------
# crashes

KILL_TRIES = 20


class Zygote:
    """A process that has imported JAX, Flax, Optax, orbax and nitro and forks children that
    train `Wide` with a checkpoint every epoch (tests/lifecycle_toys.py)."""

    def __init__(self, cwd: Path):
        self.log = open(cwd / "zygote.log", "w")  # noqa: SIM115 - closed in close()
        code = "import lifecycle_toys; lifecycle_toys.zygote()"
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
        assert self.line(120) == "ready"

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def line(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the zygote said nothing for {timeout} s") from None

    def train(self, run_dir: Path) -> int:
        """Start a child training in `run_dir`; returns its pid once it is training."""
        self.process.stdin.write(f"{run_dir}\n")
        self.process.stdin.flush()
        pid = int(self.line(60).removeprefix("child "))
        assert self.line(60) == f"training {pid}"
        return pid

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # gone (the zygote ignores SIGCHLD, so it is reaped at once)
        time.sleep(0.005)
    raise AssertionError(f"child {pid} outlived SIGKILL")


def wait_for_a_checkpoint(run_dir: Path, pid: int, bound: float = 300.0) -> None:
    """Until the child `pid` has a finished checkpoint in `run_dir` (orbax renames a step's
    directory to its number once it is whole); minutes at most."""
    directory, deadline = run_dir / "checkpoints", time.monotonic() + bound
    while time.monotonic() < deadline:
        if directory.is_dir() and any(name.isdigit() for name in os.listdir(directory)):
            return
        time.sleep(0.01)
    raise AssertionError(f"child {pid} wrote no checkpoint in {bound:.0f} s")


def check_after_kill(run_dir: Path) -> tuple[int, str | None]:
    """Every step orbax lists restores and is consistent; a new handle resumes from the newest.
    Returns the number of steps listed, and what the kill cut short: "save" (an unfinished
    step directory is left), "deletion" (steps moved aside, not yet removed) or None."""
    directory = run_dir / "checkpoints"
    names = os.listdir(directory) if directory.is_dir() else []
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(directory.absolute(), options=options) as manager:
        steps = list(manager.all_steps())
        # the manifest: orbax lists exactly the finished step directories
        assert sorted(steps) == sorted(int(name) for name in names if name.isdigit())
        restored = {step: manager.restore(step) for step in steps}
    epochs = []
    for step, saved in restored.items():
        meta = saved["meta"]
        assert meta["step"] == step and len(meta["history"]) == meta["epoch"]
        assert meta["history"][-1]["step"] == step
        assert flat(saved["state"]["params"])["hidden2.kernel"].shape == (512, 512)
        assert set(saved["state"]) == {"params", "model_state", "opt_state"}
        epochs.append(meta["epoch"])
    assert epochs == sorted(epochs)
    cut = "save" if any("tmp" in name for name in names) else None
    cut = cut or ("deletion" if "deleting" in names else None)

    if not steps:  # killed before the first save finished: nothing to resume from
        with pytest.warns(RuntimeWarning, match="found no checkpoint"):
            n = nitro.Nitro(Wide(), run_dir=str(run_dir), resume="auto", progress=False)
        assert n.step == 0
        return 0, cut
    listed = nitro.saved_runs(str(run_dir))
    assert listed["checkpoints"].tolist() == [len(steps)]
    assert listed["latest epoch"].tolist() == [epochs[-1]]
    n = nitro.Nitro(Wide(), run_dir=str(run_dir), resume="auto", progress=False, logger=None)
    assert (n.step, n.epoch) == (steps[-1], epochs[-1])
    newest = flat(restored[steps[-1]]["state"]["params"])
    assert all(np.array_equal(newest[k], v) for k, v in parameters(n).items())
    return len(steps), cut


def test_sigkill_at_random_moments_during_saves_leaves_earlier_checkpoints_restorable(tmp_path):
    """Each child saves a 3 MB state every epoch (an epoch is two steps, so it spends most of
    its time saving, and deleting what the best-2-plus-newest policy drops). Every other
    child is killed between 0 and 1.2 s after its first step (some before any save); the
    others between 0 and 1.2 s after their first checkpoint is listed, so they have saved,
    however busy the machine. Measured on 2 shared cores: a try takes 2-2.5 s, and most kills
    after a save cut the next save short or land between a deletion and the removal of what
    it moved aside."""
    zygote = Zygote(tmp_path)
    draw = random.Random(12)
    tries = []
    try:
        for attempt in range(KILL_TRIES):
            run_dir = tmp_path / f"try{attempt}"
            pid = zygote.train(run_dir)
            if attempt % 2:
                wait_for_a_checkpoint(run_dir, pid)
            time.sleep(draw.uniform(0.0, 1.2))
            kill(pid)
            tries.append((run_dir, *check_after_kill(run_dir)))
    finally:
        zygote.close()
    saved = tries[1::2]  # killed after a first checkpoint: it stays restorable
    assert all(count > 0 for _, count, _ in saved), saved
    # a child spends most of its time saving: kills land in the middle of a save or deletion
    assert sum(cut is not None for _, _, cut in saved) >= len(saved) // 4, saved

    # a resumed run removes what the killed process left unfinished, and saves on
    run_dir = next(run_dir for run_dir, count, cut in tries if count and cut)
    n = nitro.Nitro(
        Wide(), run_dir=str(run_dir), resume="auto", checkpointer=EVERY_EPOCH, progress=False
    )
    n.train(epochs=1).wait()
    assert all(name.isdigit() for name in os.listdir(run_dir / "checkpoints"))
    assert n.checkpoints()["epoch"].max() == n.epoch


def test_a_run_killed_in_epoch_3_resumes_to_parameters_and_losses_bitwise_equal(tmp_path):
    """Five epochs of shuffled batches through a dropout layer, uninterrupted, against a run
    SIGKILLed in the middle of epoch 3 and resumed with resume='auto' in a new process."""
    full = child("full", str(tmp_path / "full"), str(tmp_path / "full"))
    crash = child("crash", str(tmp_path / "crashed"), stderr=subprocess.PIPE)
    _, crash_err = crash.communicate(timeout=180)
    assert crash.returncode == -signal.SIGKILL, crash_err
    resumed = child(
        "resume", str(tmp_path / "crashed"), str(tmp_path / "resumed"), stdout=subprocess.PIPE
    )
    said, _ = resumed.communicate(timeout=180)
    assert full.wait(timeout=180) == 0 and resumed.returncode == 0

    assert said.splitlines()[0] == "resumed at epoch 2, step 16"  # epoch 3 is replayed
    a, b = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("full", "resumed"))
    assert a["loss"] == b["loss"] and a["val_loss"] == b["val_loss"]  # bitwise: == on floats
    assert (b["step"], b["epoch"]) == (40, 5)
    crashed_id = json.loads((tmp_path / "crashed" / "run.json").read_text())["run_id"]
    assert b["run_id"] == crashed_id  # the resumed run keeps its id
    pa, pb = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(pa) == sorted(pb) == ["hidden.bias", "hidden.kernel", "out.bias", "out.kernel"]
    for name in pa:
        assert np.array_equal(pa[name], pb[name]), name


# ---------------------------------------------------------------------------------------------
# what resume refuses and what it notes


def versions(kind: str, version: int):
    """Two versions of one experiment class (same name and GraphConst fields), as an edit in
    a notebook produces them."""

    class Deeper(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(5, 8, rngs=rngs)
            self.extra = nnx.Linear(8, 8, rngs=rngs)
            self.out = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.out(self.extra(nnx.relu(self.hidden(x))))

    if kind == "loss":

        @nitro.experiment
        class Edited(Toy):
            def loss(self, logits, *, y):
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
                return ce.mean() if version == 1 else ce.mean() * 1.0

    else:

        @nitro.experiment
        class Edited(Toy):
            def build_model(self, rngs):
                return TinyMLP(5, 8, 2, rngs=rngs) if version == 1 else Deeper(rngs)

    return Edited


def test_resume_refuses_a_graphconst_change_and_shows_the_difference():
    n = nitro.Nitro(Toy(max_epochs=1), progress=False).train()
    with pytest.raises(nitro.SetupError) as refused:
        nitro.Nitro(Toy(width=16, offset=0.5), resume=n.run_dir, progress=False)
    message = str(refused.value)
    assert "cannot resume: GraphConst fields differ from the checkpoint's" in message
    assert "  offset: checkpoint 0.0, now 0.5\n  width: checkpoint 8, now 16" in message
    assert "start a new run from its weights with weights=" in message


def test_resume_with_changed_code_resumes_and_notes_the_hooks_that_changed():
    first = nitro.Nitro(versions("loss", 1)(max_epochs=1), progress=False).train()
    recorder = Recorder()
    n = nitro.Nitro(versions("loss", 2)(max_epochs=2), resume="auto", progress=recorder)
    assert (n.run_id, n.step, n.epoch) == (first.run_id, 4, 1)
    assert any(
        note.startswith("resuming with changed code: loss differ") for note in recorder.notes
    ), recorder.notes
    n.train()
    assert n.history()["step"].tolist() == [4, 8]


def test_resume_refuses_a_different_model_structure_naming_the_leaves():
    nitro.Nitro(versions("model", 1)(max_epochs=1), progress=False).train()
    with pytest.raises(nitro.SetupError) as refused:
        nitro.Nitro(versions("model", 2)(), resume="auto", progress=False)
    message = str(refused.value)
    assert "the checkpoint's parameters do not fit this model" in message
    assert "  extra.kernel: missing from the checkpoint" in message
    assert "  extra.bias: missing from the checkpoint" in message


def test_resume_auto_continues_the_newest_run_or_warns_and_starts_fresh():
    with pytest.warns(RuntimeWarning, match=r"resume='auto' found no checkpoint under .*Toy"):
        fresh = nitro.Nitro(Toy(max_epochs=1), resume="auto", progress=False)
    assert (fresh.step, fresh.epoch) == (0, 0)
    fresh.train()
    time.sleep(1.01)  # run ids sort by the second they started
    newest = nitro.Nitro(Toy(max_epochs=2), progress=False).train()

    n = nitro.Nitro(Toy(max_epochs=3), resume="auto", progress=False)
    assert (n.run_id, n.run_dir, n.step, n.epoch) == (newest.run_id, newest.run_dir, 8, 2)
    assert n.weights_checkpoint["step"] == 8
    n.train()
    assert n.history()["step"].tolist() == [4, 8, 12]
    assert n.history()["loss"].tolist()[:2] == newest.history()["loss"].tolist()


def test_resume_auto_picks_the_newest_run_with_the_same_graphconst_values():
    narrow = nitro.Nitro(Toy(width=8, max_epochs=1), progress=False).train()
    time.sleep(1.01)
    nitro.Nitro(Toy(width=16, max_epochs=2), progress=False).train()

    n = nitro.Nitro(Toy(width=8, max_epochs=2), resume="auto", progress=False)
    assert (n.run_id, n.epoch) == (narrow.run_id, 1)
    with pytest.raises(nitro.SetupError, match="  width: checkpoint 16, now 32"):
        nitro.Nitro(Toy(width=32), resume="auto", progress=False)  # none fits: the newest


def test_resume_and_weights_together_are_refused():
    n = nitro.Nitro(Toy(max_epochs=1), progress=False).train()
    with pytest.raises(nitro.SetupError, match="resume= and weights= are exclusive"):
        nitro.Nitro(Toy(), resume="auto", weights=n.run_dir, progress=False)


def test_resuming_from_an_earlier_checkpoint_continues_in_a_new_run_directory():
    keep = nitro.Checkpointer(k=1, mode="max", budget=None)  # keeps epoch 1 and the newest
    first = nitro.Nitro(Toy(max_epochs=3), checkpointer=keep, progress=False).train()
    recorder = Recorder()
    n = nitro.Nitro(Toy(max_epochs=3), resume=(first.run_dir, "best"), progress=recorder)
    assert (n.step, n.epoch) == (4, 1)
    assert n.run_dir != first.run_dir  # the original run's later checkpoints stay as they were
    assert any(f"from run {first.run_id}" in note for note in recorder.notes), recorder.notes
    n.train()
    assert saved_epochs(first) == [1, 3]
    assert n.history()["step"].tolist() == [4, 8, 12]
    assert 3 in saved_epochs(n)


# ---------------------------------------------------------------------------------------------
# weights only


def test_weights_from_a_path_or_a_run_load_the_checkpoints_weights_and_start_at_step_0():
    keep = nitro.Checkpointer(k=1, mode="max", budget=None)  # best: epoch 1; latest: epoch 3
    source = nitro.Nitro(ToyWithMetrics(max_epochs=3), checkpointer=keep, progress=False)
    source.train().wait()
    checkpoints = Path(source.run_dir) / "checkpoints"
    assert sorted(int(p) for p in os.listdir(checkpoints)) == [4, 12]
    expected = {step: flat(read_plain(checkpoints, step)["state"]["params"]) for step in (4, 12)}

    for weights, step in [
        ((source.run_dir, "best"), 4),
        ((source.run_dir, "latest"), 12),
        (source.run_dir, 12),
        (str(checkpoints / "4"), 4),
        (os.path.relpath(checkpoints / "4"), 4),
    ]:
        n = nitro.Nitro(ToyWithMetrics(), weights=weights, progress=False)
        loaded = parameters(n)
        assert all(np.array_equal(loaded[k], v) for k, v in expected[step].items()), weights
        assert (n.step, n.epoch, n.history().empty) == (0, 0, True)
        assert n.weights_checkpoint["step"] == step
        assert n.weights_checkpoint["run_id"] == source.run_id
        assert n.weights_checkpoint["epoch"] == step // 4
        assert n.run_id != source.run_id


def test_restore_best_loads_the_best_weights_and_keeps_counters_and_history():
    keep = nitro.Checkpointer(k=1, mode="max", budget=None)
    n = nitro.Nitro(ToyWithMetrics(max_epochs=3), checkpointer=keep, progress=False).train()
    best = flat(read_plain(Path(n.run_dir) / "checkpoints", 4)["state"]["params"])
    assert n.weights_checkpoint is None

    n.restore_best()
    assert all(np.array_equal(parameters(n)[k], v) for k, v in best.items())
    assert (n.step, n.epoch, len(n.history())) == (12, 3, 3)
    assert (n.weights_checkpoint["step"], n.weights_checkpoint["epoch"]) == (4, 1)
    assert n.validate()["val_loss"] == pytest.approx(n.history()["val_loss"].iloc[0])


def test_the_best_epoch_off_the_save_schedule_is_saved_and_restore_best_gives_it():
    # every=2 saves epochs 2 and 4; by mode="max" the best val_loss is epoch 1's (it falls
    # every epoch on this toy): held on the host, written with epoch 2's save
    keep = nitro.Checkpointer(k=1, mode="max", every=2, budget=None)
    n = nitro.Nitro(ToyWithMetrics(max_epochs=4), checkpointer=keep, progress=False).train()
    history = n.history()
    best_epoch = int(history["val_loss"].idxmax())  # indexed by epoch
    assert best_epoch % 2  # not on the schedule
    n.wait()

    directory = Path(n.run_dir) / "checkpoints"
    saved = read_plain(directory, best_epoch * 4)  # 4 steps an epoch
    assert saved["meta"]["epoch"] == best_epoch
    assert saved["meta"]["metrics"]["val_loss"] == pytest.approx(
        history["val_loss"].iloc[best_epoch - 1]
    )
    n.restore_best()
    assert n.weights_checkpoint["epoch"] == best_epoch
    best = flat(saved["state"]["params"])
    assert all(np.array_equal(parameters(n)[k], v) for k, v in best.items())
    assert n.validate()["val_loss"] == pytest.approx(history["val_loss"].iloc[best_epoch - 1])


def test_a_best_epoch_waiting_to_be_written_is_not_replaced_by_a_newer_save():
    # back-to-back calls under the budget: a call's end save waits while the one before is
    # written (and the writer rests), and a newer one takes its place; the best is written
    # all the same. val_loss falls each epoch at scale 1; at scale 0 the model sees no input
    # and its val_loss is higher than any of those: epoch 3 is the best
    n = nitro.Nitro(
        ToyWithMetrics(max_epochs=50), checkpointer=nitro.Checkpointer(k=1), progress=False
    )
    for epoch in range(1, 7):
        if epoch == 4:
            n.set_device(scale=0.0)
        n.train(epochs=1)
    n.close()
    history = n.history()
    assert int(history["val_loss"].idxmin()) == 3  # indexed by epoch
    assert 3 in saved_epochs(n) and 6 in saved_epochs(n)  # the best k=1, and the newest
    n.restore_best()
    assert n.weights_checkpoint["epoch"] == 3


def test_a_completed_or_early_stopped_run_records_its_stop_reason_in_its_last_checkpoint():
    directory = lambda n: Path(n.run_dir) / "checkpoints"  # noqa: E731
    done = nitro.Nitro(ToyWithMetrics(max_epochs=3), checkpointer=EVERY_EPOCH, progress=False)
    done.train()
    done.wait()
    assert read_plain(directory(done), done.step)["meta"]["stop_reason"] == "completed"
    assert read_plain(directory(done), 4)["meta"]["stop_reason"] is None  # mid-run

    stop = nitro.EarlyStopping(patience=2, min_delta=10.0)  # nothing improves by 10
    stopped = nitro.Nitro(
        ToyWithMetrics(max_epochs=20), checkpointer=EVERY_EPOCH, early_stop=stop, progress=False
    ).train()
    stopped.wait()
    assert stopped.stop_reason == "early_stop"
    assert read_plain(directory(stopped), stopped.step)["meta"]["stop_reason"] == "early_stop"

    steps = nitro.Nitro(
        ToyWithMetrics(max_epochs=9), checkpointer=EVERY_EPOCH, max_steps=8, progress=False
    )
    steps.train()  # step 8 ends epoch 2
    steps.wait()
    assert (steps.stop_reason, steps.epoch) == ("max_steps", 2)
    assert read_plain(directory(steps), 8)["meta"]["stop_reason"] == "max_steps"

    # a stop that comes while epoch 2 is saved: the run stops between epochs, that save its last
    between = nitro.Nitro(ToyWithMetrics(max_epochs=9), checkpointer=EVERY_EPOCH, progress=False)
    between.on_phase(lambda c: between.stop() if (c.phase, c.epoch) == ("checkpointing", 2) else 0)
    between.train()
    assert (between.stop_reason, between.epoch, between.step) == ("requested", 2, 8)
    assert read_plain(directory(between), 8)["meta"]["stop_reason"] == "requested"
    assert read_plain(directory(between), 4)["meta"]["stop_reason"] is None


# ---------------------------------------------------------------------------------------------
# early stopping


def test_early_stopping_stops_after_validation_and_the_checkpoint():
    recorder = Recorder()
    stop = nitro.EarlyStopping(patience=2, min_delta=10.0)  # nothing improves by 10
    n = nitro.Nitro(ToyWithMetrics(max_epochs=20), early_stop=stop, progress=recorder)
    n.train()

    assert (n.stop_reason, n.epoch, n.phase) == ("early_stop", 3, "done")
    assert recorder.phases[-3:] == ["validating", "checkpointing", "done"]
    history = n.history()
    best_step = int(history["step"][history["val_loss"].idxmin()])
    assert best_step in n.checkpoints()["step"].tolist()
    assert 3 in saved_epochs(n)  # the epoch that stopped is saved, whatever the budget


@pytest.mark.parametrize(
    "experiment, stop, message",
    [
        (
            Toy(with_val=False),
            nitro.EarlyStopping(),
            "early_stop watches 'val_loss', but this run has no 'val' split (splits: train, "
            "test); add one in build_data, or watch a train metric such as 'loss'",
        ),
        (
            ToyWithMetrics(),
            nitro.EarlyStopping(metric="val_f1"),
            "early_stop watches 'val_f1', which this run does not produce; its metrics are "
            "loss, val_acc, val_loss",
        ),
    ],
)
def test_early_stopping_that_could_never_stop_is_refused_at_setup(experiment, stop, message):
    with pytest.raises(nitro.SetupError) as refused:
        nitro.Nitro(experiment, early_stop=stop, progress=False)
    assert str(refused.value) == message


def test_a_checkpointer_ranking_by_a_metric_the_run_does_not_produce_is_refused():
    with pytest.raises(nitro.SetupError) as refused:
        nitro.Nitro(Toy(), checkpointer=nitro.Checkpointer(metric="val_acc"), progress=False)
    assert str(refused.value) == (
        "Checkpointer(metric='val_acc') ranks checkpoints by a column this run does not "
        "produce; its metrics are loss, val_loss"
    )
    keep = nitro.Checkpointer(metric="val_acc", mode="max", k=1, budget=None)
    n = nitro.Nitro(ToyWithMetrics(max_epochs=2), checkpointer=keep, progress=False).train()
    assert n.checkpoints().columns.tolist() == ["step", "epoch", "val_acc", "name", "path"]


def test_early_stopping_refuses_patience_below_1_and_a_bad_mode():
    with pytest.raises(nitro.SetupError, match=r"patience=0\): patience counts epochs"):
        nitro.EarlyStopping(patience=0)
    with pytest.raises(nitro.SetupError, match=r"mode='lowest'\): mode must be 'min' or 'max'"):
        nitro.EarlyStopping(mode="lowest")


# ---------------------------------------------------------------------------------------------
# phases and monitors


def test_phases_arrive_in_order_and_monitors_get_counters_and_the_epochs_metrics(fresh_cache):
    n = nitro.Nitro(ToyWithMetrics(max_epochs=2), checkpointer=EVERY_EPOCH, progress=False)
    changes = []
    n.on_phase(changes.append)
    n.train()

    assert [(c.previous, c.phase) for c in changes] == [
        ("ready", "training"),
        ("training", "compiling train step"),
        ("compiling train step", "training"),
        ("training", "validating"),
        ("validating", "compiling eval forward"),
        ("compiling eval forward", "validating"),
        ("validating", "checkpointing"),
        ("checkpointing", "training"),
        ("training", "validating"),
        ("validating", "checkpointing"),
        ("checkpointing", "done"),
    ]
    assert all(c.handle is n for c in changes)
    assert [(c.step, c.epoch) for c in changes if c.phase == "checkpointing"] == [(4, 1), (8, 2)]
    with_metrics = [c for c in changes if c.metrics is not None]
    assert [c.phase for c in with_metrics] == ["checkpointing", "checkpointing"]
    assert [c.metrics["val_acc"] for c in with_metrics] == n.history()["val_acc"].tolist()
    assert set(nitro.events.PHASES) >= {"compiling <program>", "checkpointing", "done"}


def test_every_phase_a_handle_enters_is_one_of_the_documented_phases(tmp_path):
    seen = []

    @nitro.on_phase
    def watch(change):
        seen.extend([change.previous, change.phase])

    try:
        n = nitro.Nitro(ToyWithMetrics(max_epochs=1), progress=False)
        n.train()
        n.evaluate(split="val")
        n.predict({"x": X[:3]})
        n.export(tmp_path / "bundle")
    finally:
        nitro.events.remove_monitor(watch)
    patterns = [
        re.escape(p).replace("<program>", ".+").replace("<split>", ".+")
        for p in nitro.events.PHASES
    ]
    assert seen[0] == "setup" and seen[-1] == "done"  # predict and export change no phase
    assert all(any(re.fullmatch(p, phase) for p in patterns) for phase in seen), seen


def test_a_monitor_that_raises_is_warned_about_once_and_switched_off_and_the_run_goes_on():
    calls = []

    def broken(change):
        calls.append(change.phase)
        raise ValueError("monitor bug")

    n = nitro.Nitro(Toy(max_epochs=2), progress=False)
    n.on_phase(broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n.train()
    said = [str(w.message) for w in caught if "phase monitor" in str(w.message)]
    assert len(said) == 1 and said[0].endswith(
        "broken raised ValueError on 'ready' -> 'training': monitor bug; it is switched off, "
        "and the run goes on"
    )
    assert calls == ["training"]
    assert (n.stop_reason, n.epoch) == ("completed", 2)

    again = []
    n.on_phase(again.append)  # a new monitor on the same handle is called
    n.train(epochs=1)
    assert calls == ["training"] and again[-1].phase == "done"


def test_module_level_monitors_see_every_handle_from_its_setup_on():
    seen = []
    nitro.on_phase(seen.append)
    try:
        first = nitro.Nitro(Toy(max_epochs=1), progress=False).train()
        second = nitro.Nitro(ToyWithMetrics(max_epochs=1), checkpointer=None, progress=False)
    finally:
        nitro.events.remove_monitor(seen.append)
    nitro.Nitro(Toy(max_epochs=1), progress=False)  # removed: not seen

    # while a handle is built there is no handle yet, nor counters
    assert [(c.phase, c.handle, c.step) for c in seen[:3]] == [
        ("building data", None, None),
        ("building model", None, None),
        ("routing", None, None),
    ]
    of_first = [(c.phase, c.step) for c in seen if c.handle is first]
    assert of_first[0] == ("ready", 0) and of_first[-1] == ("done", 4)
    assert ("checkpointing", 4) in of_first
    assert [c.phase for c in seen if c.handle is second] == ["ready"]
    assert [c.phase for c in seen].count("building data") == 2


# ---------------------------------------------------------------------------------------------
# saves written in the background


def plain_latest(directory: Path) -> tuple[int | None, list[int]]:
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(directory.absolute(), options=options) as manager:
        return manager.latest_step(), list(manager.all_steps())


def test_after_train_returns_every_reader_sees_its_final_step(tmp_path):
    n = nitro.Nitro(ToyWithMetrics(max_epochs=3), progress=False)  # the default checkpointer
    n.train()
    directory = Path(n.run_dir) / "checkpoints"
    runs = nitro.saved_runs(ToyWithMetrics)
    assert runs.loc[n.run_id, "latest epoch"] == 3
    assert n.checkpoints()["step"].max() == n.step == 12

    more = nitro.Nitro(ToyWithMetrics(max_epochs=5), progress=False)
    more.train(epochs=1)  # its first save creates the checkpoints directory, in the background
    assert nitro.saved_runs(ToyWithMetrics).loc[more.run_id, "checkpoints"] == 1
    resumed = nitro.Nitro(ToyWithMetrics(max_epochs=5), resume=more.run_dir, progress=False)
    assert (resumed.step, resumed.epoch) == (4, 1)  # in this process, right after train()
    resumed.close()

    n.close()
    latest, steps = plain_latest(directory)
    assert latest == 12
    saved = read_plain(directory, 12)
    assert (saved["meta"]["step"], saved["meta"]["epoch"]) == (12, 3)


def test_back_to_back_short_calls_leave_a_consistent_checkpoint_set():
    n = nitro.Nitro(ToyWithMetrics(max_epochs=50), progress=False)
    for _ in range(8):
        n.train(epochs=1)
    assert n.epoch == 8
    n.close()
    directory = Path(n.run_dir) / "checkpoints"
    latest, steps = plain_latest(directory)
    assert latest == n.step  # the newest call's save
    assert sorted(os.listdir(directory)) == sorted(map(str, steps))  # nothing left half-done
    assert len(steps) <= 3 + 1  # the best k=3 plus the newest
    for step in steps:
        saved = read_plain(directory, step)
        assert saved["meta"]["step"] == step and saved["meta"]["epoch"] == step // 4
        assert np.isfinite(saved["state"]["params"]["out"]["kernel"]).all()
    # a resume continues from it, and saves on
    resumed = nitro.Nitro(ToyWithMetrics(max_epochs=10), resume=n.run_dir, progress=False)
    assert resumed.step == n.step
    resumed.train()
    assert resumed.checkpoints()["step"].max() == resumed.step == 40


def test_each_save_of_back_to_back_calls_holds_the_weights_of_its_own_step():
    # a small model's calls never donate its variables, so a save copies them to the host
    # when it is written, after later calls have run: each must still hold its own step
    n = nitro.Nitro(
        ToyWithMetrics(max_epochs=50),
        checkpointer=nitro.Checkpointer(budget=None, k=10),
        progress=False,
    )
    weights = {}
    for _ in range(5):
        n.train(epochs=1)
        weights[n.step] = [np.asarray(a).copy() for a in n.state.variables.params]
    n.close()
    directory = Path(n.run_dir) / "checkpoints"
    for step, params in weights.items():
        saved = flat(read_plain(directory, step)["state"]["params"])
        assert sorted(np.asarray(a).tobytes() for a in params) == sorted(
            a.tobytes() for a in saved.values()
        )


EXIT_AFTER_TRAIN = """
import sys
import nitro
from toys import ToyWithMetrics
n = nitro.Nitro(ToyWithMetrics(max_epochs=3), run_dir=sys.argv[1], progress=False).train()
print(n.step)
"""  # the process ends right after train(), its handle still open


def test_a_process_that_exits_right_after_train_leaves_the_final_step_readable(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", EXIT_AFTER_TRAIN, str(tmp_path / "run")],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "could not be saved" not in done.stderr
    step = int(done.stdout.split()[-1])
    latest, _ = plain_latest(tmp_path / "run" / "checkpoints")
    assert latest == step == 12
    saved = read_plain(tmp_path / "run" / "checkpoints", step)
    assert saved["meta"]["epoch"] == 3
