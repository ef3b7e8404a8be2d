"""`nitro.ReduceOnPlateau`: a fed value that drops when a monitored metric stops improving,
decided from the committed history (so a resumed run reduces where the first run did), fed
to the step (so nothing recompiles)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from toys import Toy

import nitro
from nitro.programs.compile_cache import cache_stats


def quiet(**keywords):
    return {"progress": False, "logger": None, "checkpointer": None, **keywords}


def keras_rule(losses, start, factor, patience, cooldown=0, min_lr=0.0, min_delta=1e-4):
    """Keras's ReduceLROnPlateau.on_epoch_end, written out: the rate after each epoch."""
    lr, best, wait, cooling, rates = start, np.inf, 0, 0, []
    for loss in losses:
        if cooling > 0:
            cooling, wait = cooling - 1, 0
        if loss < best - min_delta:
            best, wait = loss, 0
        elif cooling == 0:
            wait += 1
            if wait >= patience and lr > min_lr:
                lr, cooling, wait = max(lr * factor, min_lr), cooldown, 0
        rates.append(lr)
    return rates


@pytest.mark.parametrize(("patience", "cooldown"), [(1, 0), (2, 1)])
def test_the_rate_follows_keras_rule_on_the_validation_loss_and_nothing_recompiles(
    patience, cooldown
):
    plateau = nitro.ReduceOnPlateau(factor=0.5, patience=patience, cooldown=cooldown)
    n = nitro.Nitro(
        Toy(max_epochs=7),
        learning_rate=1.0,
        schedules={"learning_rate": plateau},
        **quiet(),
    )
    used, compiles = [], None
    for _ in range(7):
        n.train(epochs=1)
        used.append(n.hyperparameters["learning_rate"])  # the rate the epoch's last step used
        compiles = compiles if compiles is not None else len(cache_stats().compiles)
    losses = n.history()["val_loss"].tolist()
    expected = keras_rule(losses, 1.0, 0.5, patience, cooldown)
    assert used == pytest.approx([1.0, *expected[:-1]])
    assert min(used) < 1.0  # the toy's val_loss jumps at this rate: it did reduce
    assert len(cache_stats().compiles) == compiles  # after the first epoch, nothing compiled
    assert plateau.scale == 1.0  # the run's plateau is its own copy


def test_a_resumed_run_reduces_where_the_uninterrupted_one_did_bitwise(tmp_path):
    keywords = {"learning_rate": 1.0, "progress": False, "logger": None}
    schedules = {"learning_rate": nitro.ReduceOnPlateau(factor=0.5, patience=1)}
    whole = nitro.Nitro(Toy(max_epochs=6), run_dir=tmp_path / "a", schedules=schedules, **keywords)
    whole.train()
    first = nitro.Nitro(Toy(max_epochs=3), run_dir=tmp_path / "b", schedules=schedules, **keywords)
    first.train()
    first.close()
    resumed = nitro.Nitro(
        Toy(max_epochs=6), resume=str(tmp_path / "b"), schedules=schedules, **keywords
    )
    resumed.train()
    columns = ["loss", "val_loss"]
    assert resumed.history()[columns].equals(whole.history()[columns])
    for a, b in zip(jax.tree.leaves(resumed.model), jax.tree.leaves(whole.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed.hyperparameters["learning_rate"] == whole.hyperparameters["learning_rate"] < 1


def test_a_device_field_and_a_train_metric_can_be_watched_and_bad_settings_are_refused():
    n = nitro.Nitro(
        Toy(max_epochs=6),
        learning_rate=1.0,
        schedules={"scale": nitro.ReduceOnPlateau("loss", factor=0.5, patience=1, start=2.0)},
        **quiet(),
    )
    n.train()
    expected = keras_rule(n.history()["loss"].tolist(), 2.0, 0.5, 1)
    assert n.device_value("scale") == expected[-1] < 2.0  # the Device field follows it
    with pytest.raises(nitro.SetupError, match="ReduceOnPlateau's factor must be"):
        nitro.ReduceOnPlateau(factor=1.5)
    with pytest.raises(nitro.SetupError, match=r"ReduceOnPlateau\(patience=0\)"):
        nitro.ReduceOnPlateau(patience=0)
    with pytest.raises(nitro.SetupError, match="'val_f1', which this run does not produce"):
        nitro.Nitro(Toy(), schedules={"learning_rate": nitro.ReduceOnPlateau("val_f1")}, **quiet())
    with pytest.raises(nitro.SetupError, match="'val' split is not evaluated"):
        nitro.Nitro(
            Toy(with_val=False),
            schedules={"learning_rate": nitro.ReduceOnPlateau("val_loss")},
            **quiet(),
        )
