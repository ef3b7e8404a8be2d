"""`validation_split=`: Keras's hold-out of the last part of the training arrays as 'val'."""

from __future__ import annotations

import pytest
from toys import Toy, X, Y

import nitro
from nitro.data import ArrayLoader


class Explicit(Toy):
    """The same data, split by hand: the first 48 samples train, the last 16 validate."""

    def build_data(self):
        return {
            "train": ArrayLoader({"x": X[:48], "y": Y[:48]}, 16),
            "val": ArrayLoader({"x": X[48:], "y": Y[48:]}, 16, shuffle=False, drop_last=False),
        }


class Batches(Toy):
    def build_data(self):
        return {"train": [{"x": X[i : i + 16], "y": Y[i : i + 16]} for i in range(0, 64, 16)]}


def quiet(**keywords):
    return {"progress": False, "logger": None, "checkpointer": None, **keywords}


def test_the_last_fraction_validates_and_the_run_equals_one_given_that_split_by_hand():
    held = nitro.Nitro(Toy(with_val=False), validation_split=0.25, seed=3, **quiet()).train()
    by_hand = nitro.Nitro(Explicit(), seed=3, **quiet()).train()
    assert held.step == 2 * 3  # 48 samples left: 3 batches of 16 an epoch
    columns = ["loss", "val_loss"]
    assert held.history()[columns].equals(by_hand.history()[columns])
    assert held.keywords["validation_split"].value == 0.25


@pytest.mark.parametrize(
    ("experiment", "fraction", "expected"),
    [
        (Toy(), 0.25, "build_data returns a 'val' split already"),
        (Batches(), 0.25, "the 'train' split is list: give 'train' as a nitro.data.ArrayLoader"),
        (Toy(with_val=False), 0.9, "leaving 6 to train on in batches of 16"),
        (Toy(with_val=False), 1.0, "validation_split must be"),
    ],
)
def test_a_split_that_cannot_hold_out_is_refused_naming_the_keyword(experiment, fraction, expected):
    with pytest.raises((nitro.SetupError, ValueError), match="validation_split") as caught:
        nitro.Nitro(experiment, validation_split=fraction, **quiet())
    assert expected in str(caught.value)
