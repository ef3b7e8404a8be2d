"""Metrics from a library made for JAX: a metrics hook may return `clu.metrics` objects,
merged over batches as the library defines and computed at the end, on either residency."""

from __future__ import annotations

import optax
import pytest
from clu import metrics as clu_metrics

import nitro
from nitro.examples.digits import Digits


class Library(Digits):
    def metrics(self, logits, *, y):
        per_sample = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return {
            "acc": clu_metrics.Accuracy.from_model_output(logits=logits, labels=y),
            "by_hand": (logits.argmax(-1) == y).mean(),
            "mean_loss": clu_metrics.Average.from_model_output(values=per_sample),
        }


class OnDevice(Library):
    metrics_residency = "device"


@pytest.mark.parametrize("experiment", [Library, OnDevice], ids=["host", "device"])
def test_a_library_metric_streams_over_batches_as_the_hand_written_one(experiment):
    n = nitro.Nitro(experiment(max_epochs=1), progress=False, logger=None, checkpointer=None)
    row = n.train().history().iloc[-1]
    assert row["val_acc"] == row["val_by_hand"]  # every sample counted once, padding left out
    assert row["val_mean_loss"] == pytest.approx(row["val_loss"], rel=1e-6)
    test = n.evaluate("test")  # a split whose last batch is short
    assert test["test_acc"] == test["test_by_hand"] and 0 < test["test_acc"] <= 1


class WithMode(Digits):
    def metrics(self, logits, *, y):
        return {"acc": (clu_metrics.Accuracy.from_model_output(logits=logits, labels=y), "sum")}


def test_a_library_metric_given_a_mode_is_refused_naming_it():
    n = nitro.Nitro(WithMode(max_epochs=1), progress=False, logger=None, checkpointer=None)
    with pytest.raises(
        nitro.MetricError,
        match=r"'acc' of `metrics` is a library metric \(Accuracy\), which merges",
    ):
        n.validate()
