"""Restore choices as keywords and the handle's account of its checkpoints: `restore_best=`,
`n.best_checkpoint`, `n.elapsed`, and `nitro.runs.read(path)` without a handle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from toys import Toy

import nitro


def test_restore_best_ends_train_on_the_best_epochs_weights_and_keeps_the_counters(tmp_path):
    # a learning rate of 1.0 makes the toy's val_loss jump about: its best epoch is the 3rd of 5
    n = nitro.Nitro(
        Toy(max_epochs=5), run_dir=tmp_path, restore_best=True, learning_rate=1.0, progress=False
    )
    assert n.best_checkpoint is None  # nothing saved yet
    n.train()
    history = n.history()
    best_epoch = int(np.argmin(history["val_loss"].to_numpy())) + 1
    assert best_epoch != 5 and len(history) == 5 and n.step == 20
    # the weights evaluate to the best epoch's val_loss, bitwise: they are that epoch's
    assert n.evaluate("val")["val_loss"] == history["val_loss"].min()
    assert n.best_checkpoint == str(tmp_path / "checkpoints" / str(4 * best_epoch))
    assert n.elapsed == pytest.approx(float(history["epoch_seconds"].sum()))

    # without the keyword the run ends on its last step's weights
    last = nitro.Nitro(Toy(max_epochs=5), run_dir=tmp_path / "b", learning_rate=1.0, progress=False)
    assert last.train().evaluate("val")["val_loss"] == last.history()["val_loss"].iloc[-1]


def test_restore_best_needs_checkpoints_and_is_a_single_runs():
    with pytest.raises(nitro.SetupError, match="restore_best=True .* checkpointer=None"):
        nitro.Nitro(Toy(), checkpointer=None, restore_best=True, progress=False)
    assert nitro.Nitro(Toy(), checkpointer=None, progress=False).best_checkpoint is None
    with pytest.raises(nitro.PopulationError, match="restore_best=True is a single run's"):
        nitro.Population(Toy(), learning_rate=[1e-3, 1e-2], restore_best=True, progress=False)


def test_runs_read_gives_a_saved_steps_record_without_a_handle(tmp_path):
    n = nitro.Nitro(Toy(max_epochs=3), run_dir=tmp_path, learning_rate=1.0, progress=False)
    n.train()
    newest = nitro.runs.read(tmp_path)
    assert (newest.run_id, newest.step, newest.epoch) == (n.run_id, 12, 3)
    assert newest.stop_reason == "completed"
    assert newest.metrics["val_loss"] == n.history()["val_loss"].iloc[-1]
    assert [row["epoch"] for row in newest.member.history] == [1, 2, 3]
    best = nitro.runs.read(tmp_path, "best")
    assert best.metrics["val_loss"] == n.history()["val_loss"].min()
    one = nitro.runs.read(tmp_path / "checkpoints" / "4")
    assert (one.step, one.epoch, one.stop_reason) == (4, 1, None)
    assert np.isfinite(one.metrics["loss"])
    with pytest.raises(nitro.SetupError, match="no checkpoint at .*missing.*does not exist"):
        nitro.runs.read(Path(tmp_path) / "missing")
