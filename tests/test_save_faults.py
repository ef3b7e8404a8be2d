"""Saves that fail and checkpoints that are damaged: a full disk, a read-only directory, a
truncated or corrupted file, an empty step directory, a stop in the middle of an epoch. Real
orbax, real files: the damage is done to the files themselves, the full disk is a small
tmpfs mounted by the test (as root; skipped otherwise)."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from system import fill, mounted
from toys import ToyWithMetrics

import nitro

EVERY_EPOCH = nitro.Checkpointer(budget=None)


def read_plain(directory: Path, step: int) -> dict:
    """One saved step, restored by orbax alone."""
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(Path(directory).absolute(), options=options) as manager:
        return manager.restore(step)


def plain_steps(directory: Path) -> list[int]:
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(Path(directory).absolute(), options=options) as manager:
        return list(manager.all_steps())


def caught_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught]


def two_runs() -> tuple[nitro.Nitro, nitro.Nitro]:
    """Two runs of ToyWithMetrics, two checkpoints each (steps 4 and 8), oldest first (their
    directories sort in that order, as run ids do)."""
    runs = [
        nitro.Nitro(
            ToyWithMetrics(max_epochs=2),
            run_dir=f"runs/ToyWithMetrics/{name}",
            checkpointer=EVERY_EPOCH,
            progress=False,
        )
        .train()
        .wait()  # train() returns while its saves are written
        for name in ("1-older", "2-newer")
    ]
    return runs[0], runs[1]


def truncate_metadata(step_dir: Path) -> Path:
    path = step_dir / "state" / "_METADATA"
    path.write_bytes(path.read_bytes()[:10])
    return path


def corrupt_data(step_dir: Path) -> None:
    """Flip bytes in the middle of each data file of the step's OCDBT database."""
    for path in (step_dir / "state" / "d").iterdir():
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
        path.write_bytes(bytes(data))


DAMAGE = {
    "truncated _METADATA": truncate_metadata,
    "corrupted data file": corrupt_data,
}


# ---------------------------------------------------------------------------------------------
# damaged checkpoints


def test_an_empty_step_directory_in_an_older_run_is_skipped_by_every_reader():
    older, newer = two_runs()
    empty = Path(older.run_dir) / "checkpoints" / "12"
    empty.mkdir()

    runs, said = caught_warnings(lambda: nitro.saved_runs("ToyWithMetrics"))
    assert runs["checkpoints"].tolist() == [2, 2]
    assert any(f"skipping the damaged checkpoint {str(empty)!r}" in m for m in said)

    resumed = nitro.Nitro(ToyWithMetrics(max_epochs=3), resume="auto", progress=False)
    assert (resumed.run_id, resumed.step) == (newer.run_id, 8)

    weights, said = caught_warnings(
        lambda: nitro.Nitro(ToyWithMetrics(), weights=older.run_dir, progress=False)
    )
    assert weights.weights_checkpoint["step"] == 8
    assert any(str(empty) in m for m in said)
    averaged = nitro.Nitro(
        ToyWithMetrics(), weights=nitro.average(older.run_dir, k=2), progress=False
    )
    assert sorted(averaged.weights_checkpoint["steps"]) == [4, 8]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_and_resume_takes_the_one_before(damage):
    older, newer = two_runs()
    step_dir = Path(newer.run_dir) / "checkpoints" / "8"
    DAMAGE[damage](step_dir)

    runs = nitro.saved_runs("ToyWithMetrics")  # listing reads no array: both runs listed
    assert runs.index.tolist() == [older.run_id, newer.run_id]

    resumed, said = caught_warnings(
        lambda: nitro.Nitro(ToyWithMetrics(max_epochs=3), resume="auto", progress=False)
    )
    mine = [m for m in said if "skipping the damaged checkpoint" in m]
    assert len(mine) == 1 and repr(str(step_dir)) in mine[0]
    assert (resumed.step, resumed.epoch) == (4, 1)
    # the damaged step stays as it was: the run goes on in a new directory
    assert resumed.run_dir != newer.run_dir
    resumed.train()
    assert (resumed.epoch, resumed.stop_reason) == (3, "completed")

    weights, said = caught_warnings(
        lambda: nitro.Nitro(ToyWithMetrics(), weights=newer.run_dir, progress=False)
    )
    assert weights.weights_checkpoint["step"] == 4
    with pytest.raises(nitro.WeightsError) as refused:
        nitro.Nitro(ToyWithMetrics(), weights=nitro.average(newer.run_dir, k=2), progress=False)
    assert str(step_dir) in str(refused.value) and "Lower k" in str(refused.value)
    with pytest.raises(nitro.SetupError) as refused:  # a step named explicitly is not replaced
        nitro.Nitro(ToyWithMetrics(), weights=str(step_dir), progress=False)
    assert f"the checkpoint {str(step_dir)!r} cannot be read" in str(refused.value)


def test_a_run_whose_every_checkpoint_is_damaged_is_refused_naming_its_directory():
    run = nitro.Nitro(ToyWithMetrics(max_epochs=2), checkpointer=EVERY_EPOCH, progress=False)
    run.train().wait()
    directory = Path(run.run_dir) / "checkpoints"
    truncate_metadata(directory / "4")
    corrupt_data(directory / "8")
    with pytest.raises(nitro.SetupError) as refused, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nitro.Nitro(ToyWithMetrics(max_epochs=3), resume=run.run_dir, progress=False)
    assert f"no readable checkpoint in {str(directory)!r}" in str(refused.value)
    assert "(4, 8)" in str(refused.value)


# ---------------------------------------------------------------------------------------------
# a full disk


def test_a_full_disk_warns_once_training_goes_on_and_two_resumes_in_one_process_complete(
    tmp_path, capfd
):
    with mounted(tmp_path / "disk", "size=2m") as disk:
        run_dir = disk / "run"
        n = (
            nitro.Nitro(
                ToyWithMetrics(max_epochs=2),
                run_dir=str(run_dir),
                checkpointer=EVERY_EPOCH,
                progress=False,
            )
            .train()
            .wait()
        )
        ballast = disk / "ballast"
        fill(ballast)
        capfd.readouterr()
        _, said = caught_warnings(lambda: n.train(epochs=3).wait())
        assert (n.epoch, n.stop_reason) == (5, "completed")
        failed = [m for m in said if "a checkpoint could not be saved" in m]
        assert len(failed) == 1 and str(run_dir / "checkpoints") in failed[0]
        assert "Traceback" not in capfd.readouterr().err  # orbax's own reports are quieted
        assert plain_steps(run_dir / "checkpoints") == [4, 8]

        ballast.unlink()  # free space: the next runs in this process save again
        for target in (6, 8):
            outcome = {}

            def resume(target=target, outcome=outcome):
                r = nitro.Nitro(
                    ToyWithMetrics(max_epochs=target),
                    run_dir=str(run_dir),
                    resume="auto",
                    checkpointer=EVERY_EPOCH,
                    progress=False,
                )
                outcome["from"] = r.epoch
                outcome["run"] = r.train().wait()

            worker = threading.Thread(target=resume, daemon=True)
            worker.start()
            worker.join(timeout=300)
            assert not worker.is_alive(), "a resume after the full disk hangs"
            assert outcome["run"].stop_reason == "completed", outcome
            assert outcome["run"].epoch == target
        assert outcome["from"] == 6
        steps = plain_steps(run_dir / "checkpoints")
        assert steps[-1] == 32
        for step in steps:
            saved = read_plain(run_dir / "checkpoints", step)
            assert saved["meta"]["step"] == step
            assert np.isfinite(saved["state"]["params"]["out"]["kernel"]).all()


# ---------------------------------------------------------------------------------------------
# a stop in the middle of an epoch


class StopAtStep:
    """A progress reporter that asks its handle to stop once `at` steps are done, and keeps
    the notes."""

    def __init__(self, at: int):
        self.at, self.handle, self.notes = at, None, []

    def step(self, step, loss):
        if step == self.at and self.handle is not None:
            self.handle.stop()

    def note(self, message, done=False):
        self.notes.append(message)


def params_of(n) -> list[np.ndarray]:
    return [np.asarray(a) for a in n.state.variables.params]


def test_a_stop_mid_epoch_saves_that_step_says_so_and_a_resume_continues_it_exactly():
    keywords = {"steps_per_dispatch": 1}  # the same calls in both runs
    full = nitro.Nitro(ToyWithMetrics(max_epochs=4), progress=False, **keywords).train()

    reporter = StopAtStep(10)  # epoch 3, batch 2 (4 batches an epoch)
    n = nitro.Nitro(ToyWithMetrics(max_epochs=4), run_dir="stopped", progress=reporter, **keywords)
    reporter.handle = n
    n.train()  # the budget skips most saves of these tiny epochs
    assert n.stop_reason == "requested" and 8 < n.step < 12
    path = Path(n.run_dir) / "checkpoints" / str(n.step)
    batch = n.step - 8
    assert reporter.notes[-1] == (
        f"stopped at step {n.step} (epoch 3, batch {batch}); saved {path}: resume= continues "
        f"from there"
    )
    saved = read_plain(path.parent, n.step)["meta"]
    assert (saved["step"], saved["epoch"], saved["partial_epoch"]["position"]) == (
        n.step,
        2,
        batch,
    )

    resumed = nitro.Nitro(
        ToyWithMetrics(max_epochs=4), run_dir="stopped", resume="auto", progress=False, **keywords
    )
    assert (resumed.step, resumed.epoch) == (n.step, 2)
    resumed.train()
    assert (resumed.step, resumed.epoch) == (16, 4)
    for column in ("loss", "val_loss", "val_acc"):
        assert resumed.history()[column].tolist() == full.history()[column].tolist(), column
    for got, want in zip(params_of(resumed), params_of(full), strict=True):
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# a read-only working directory


def test_a_read_only_directory_is_refused_before_any_training_naming_it_and_run_dir(tmp_path):
    with mounted(tmp_path / "readonly", "ro,size=64k") as readonly:
        os.chdir(readonly)
        n = nitro.Nitro(ToyWithMetrics(max_epochs=2), progress=False)
        with (
            pytest.raises(nitro.SetupError) as refused,
            warnings.catch_warnings(record=True) as said,
        ):
            warnings.simplefilter("always")
            n.train()
        assert [str(w.message) for w in said] == []  # refused before its loggers wrote
        message = str(refused.value)
        assert f"cannot create the run directory {n.run_dir!r}" in message
        assert "Read-only file system" in message and "run_dir=" in message
        assert (n.step, n.epoch) == (0, 0)
        os.chdir(tmp_path)
        moved = nitro.Nitro(ToyWithMetrics(max_epochs=1), run_dir="writable", progress=False)
        assert moved.train().stop_reason == "completed"
