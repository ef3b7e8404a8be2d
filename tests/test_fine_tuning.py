"""`n.fine_tune`: a frozen backbone, then discriminative learning rates, in one program; and
`freeze_batch_stats=True`, which keeps a frozen group's batch statistics."""

from __future__ import annotations

from collections import Counter

import numpy as np
import optax
import pytest
from flax import nnx

import nitro
from nitro.data import ArrayLoader

SAVE_EVERY_EPOCH = nitro.Checkpointer(k=5, budget=None)
X = np.random.default_rng(0).normal(size=(96, 5)).astype(np.float32)
Y = (X[:, 0] + X[:, 1] > 0).astype(np.int32)


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.backbone = nnx.Sequential(
            nnx.Linear(5, 16, rngs=rngs), nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
        )
        self.head = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.backbone(x)))


@nitro.experiment
class Ungrouped:
    batch_size: int = 16

    def build_data(self):
        return {
            "train": ArrayLoader({"x": X[:64], "y": Y[:64]}, self.batch_size, shuffle=True),
            "val": ArrayLoader({"x": X[64:], "y": Y[64:]}, 16, shuffle=False, drop_last=False),
        }

    def build_model(self, rngs):
        return Net(rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nitro.experiment
class Pretrained(Ungrouped):
    def param_group(self, path):
        return "backbone" if path.startswith("backbone") else "head"


def variables_at(n, epoch):
    """(parameters, model state) by path, as the checkpoint of `epoch` saved them."""
    saved = n.checkpoints()
    step = int(saved[saved["epoch"] == epoch]["step"].iloc[0])
    back = nitro.Nitro(Pretrained(), weights=f"{n.run_dir}/checkpoints/{step}", progress=False)
    return by_path(back)


def by_path(n):
    paths = n.setup.model.leaf_paths
    return (
        {
            p: np.asarray(x)
            for p, x in zip(paths["parameter"], n.state.variables.params, strict=True)
        },
        {
            p: np.asarray(x)
            for p, x in zip(paths["model state"], n.state.variables.model_state, strict=True)
        },
    )


def test_fine_tune_keeps_the_backbone_bitwise_while_frozen_and_compiles_one_program(
    fresh_cache,
):
    n = nitro.Nitro(Pretrained(), learning_rate=1e-2, checkpointer=SAVE_EVERY_EPOCH, progress=False)
    start, _ = by_path(n)
    n.fine_tune(2, freeze_epochs=1)
    assert n.epoch == 3
    frozen, _ = variables_at(n, 1)
    unfrozen, _ = variables_at(n, 2)
    for path in start:
        if path.startswith("backbone"):
            np.testing.assert_array_equal(frozen[path], start[path])  # frozen: bitwise
            assert not np.array_equal(unfrozen[path], frozen[path]), path  # then it trains
        else:
            assert not np.array_equal(frozen[path], start[path]), path  # the head trains
            assert not np.array_equal(unfrozen[path], frozen[path]), path
    # both phases ran one train program: the rates are fed, switching them compiles nothing
    compiled = Counter(r.program for r in nitro.explain_compiles())
    assert {k: v for k, v in compiled.items() if "train" in k} in (
        {"train step": 1},
        {"multi-step train": 1},
        {"multi-step train": 1, "train step": 1},
    ), compiled
    assert n.hyperparameters["backbone/learning_rate"] > 0


def test_fine_tune_schedules_zero_then_a_smaller_rate_for_the_backbone():
    n = nitro.Nitro(Pretrained(), learning_rate=1e-2, progress=False)
    n.fine_tune(0, freeze_epochs=1)
    assert n.hyperparameters["backbone/learning_rate"] == 0.0
    assert n.hyperparameters["head/learning_rate"] > 0.0
    n.fine_tune(1, freeze_epochs=0, unfrozen_ratio=0.5)
    # the last of the epoch's 4 steps on fastai's one-cycle schedule to base_lr / 2
    cycle = optax.cosine_onecycle_schedule(4, 5e-3, 0.3, div_factor=5.0, final_div_factor=1e5)
    head = n.hyperparameters["head/learning_rate"]
    np.testing.assert_allclose(head, cycle(3), rtol=1e-6)
    np.testing.assert_allclose(n.hyperparameters["backbone/learning_rate"], 0.5 * head, rtol=1e-6)


@pytest.mark.parametrize("freeze_batch_stats", [True, False])
def test_freeze_batch_stats_keeps_a_frozen_groups_batchnorm_statistics(freeze_batch_stats):
    n = nitro.Nitro(
        Pretrained(),
        freeze_batch_stats=freeze_batch_stats,
        learning_rate=1e-2,
        checkpointer=SAVE_EVERY_EPOCH,
        progress=False,
    )
    _, start = by_path(n)
    assert sorted(start) == ["backbone.layers.1.mean", "backbone.layers.1.var"]
    n.fine_tune(1, freeze_epochs=1)
    _, frozen = variables_at(n, 1)
    _, unfrozen = variables_at(n, 2)
    for path in start:
        assert np.array_equal(frozen[path], start[path]) == freeze_batch_stats, path
        assert not np.array_equal(unfrozen[path], frozen[path]), path


def test_fine_tune_refuses_what_it_cannot_do_naming_the_argument():
    with pytest.raises(nitro.SetupError, match="fine_tune trains parameter groups"):
        nitro.Nitro(Ungrouped(), progress=False).fine_tune(1)
    n = nitro.Nitro(Pretrained(), progress=False)
    with pytest.raises(nitro.SetupError, match=r"backbone=\('backbon',\).*Did you mean 'backbone'"):
        n.fine_tune(1, backbone="backbon")
    with pytest.raises(nitro.SetupError, match="leave at least one"):
        n.fine_tune(1, backbone=["backbone", "head"])
    with pytest.raises(nitro.SetupError, match="freeze_epochs must be an int >= 0, got -1"):
        n.fine_tune(1, freeze_epochs=-1)
    with pytest.raises(nitro.SetupError, match=r"pct_start must be a finite number in \(0, 1\)"):
        n.fine_tune(1, pct_start=1.5)
    ratios = nitro.Nitro(Pretrained(), group_lr={"backbone": 0.0}, progress=False)
    with pytest.raises(nitro.SetupError, match=r"group_lr=\{'backbone': 0.0\} sets some too"):
        ratios.fine_tune(1)
    assert n.step == 0 and ratios.step == 0
