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
    every_epoch = nitro.Checkpointer(budget=None)  # saves each epoch however busy the machine
    n = nitro.Nitro(
        Toy(max_epochs=3),
        run_dir=tmp_path,
        learning_rate=1.0,
        checkpointer=every_epoch,
        progress=False,
    )
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


def leaves(handle) -> list[np.ndarray]:
    return [np.asarray(x) for x in handle.state.variables.opt_state]


def test_restore_optimizer_false_resumes_the_model_with_a_fresh_optimizer_even_another(tmp_path):
    import optax

    first = nitro.Nitro(Toy(max_epochs=1), run_dir=tmp_path, progress=False, logger=None)
    first.train()
    first.close()
    resumed = nitro.Nitro(
        Toy(max_epochs=2),
        resume=str(tmp_path),
        restore_optimizer=False,
        optimizer=optax.sgd,
        progress=False,
        logger=None,
    )
    fresh = nitro.Nitro(Toy(), optimizer=optax.sgd, checkpointer=None, progress=False, logger=None)
    assert (resumed.epoch, resumed.step) == (1, 4)  # the counters, history and weights go on
    for a, b in zip(leaves(resumed), leaves(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    assert resumed.train().step == 8


def test_restore_optimizer_true_takes_the_optimizer_state_with_the_weights(tmp_path):
    import optax

    source = nitro.Nitro(Toy(max_epochs=1), run_dir=tmp_path, progress=False, logger=None)
    source.train()
    source.wait()
    quiet = {"progress": False, "logger": None, "checkpointer": None}
    from_dir = nitro.Nitro(Toy(), weights=str(tmp_path), restore_optimizer=True, **quiet)
    from_handle = nitro.Nitro(Toy(), weights=source, restore_optimizer=True, **quiet)
    plain = nitro.Nitro(Toy(), weights=source, **quiet)
    for a, b, c in zip(leaves(from_dir), leaves(from_handle), leaves(source), strict=True):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)
    assert int(leaves(plain)[0].ravel()[0]) == 0 and int(leaves(from_dir)[0].ravel()[0]) == 4
    with pytest.raises(nitro.SetupError, match=r"does not fit this run's optimizer \(optax.sgd"):
        nitro.Nitro(
            Toy(), weights=str(tmp_path), restore_optimizer=True, optimizer=optax.sgd, **quiet
        )
    with pytest.raises(nitro.SetupError, match="an average, a population member"):
        nitro.Nitro(Toy(), weights=nitro.average(tmp_path, k=1), restore_optimizer=True, **quiet)
