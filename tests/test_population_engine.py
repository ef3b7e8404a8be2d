"""A population trains through the run's loop: what a run takes, a population takes
(evaluation within epochs, max_steps, measured steps per call, each member's data order in
fused calls), and its code uses no private helper of the run.

Real JAX, Flax and Optax; members are checked against the same settings trained alone.
"""

import ast
import math
from pathlib import Path

import numpy as np

import nitro
from nitro.examples.digits import Digits

SMALL = dict(width=64, batch_size=32)  # the tiny MLP: 64-64-10, batch 32 (39 steps an epoch)
ROOT = Path(nitro.__file__).parent


def _alone(epochs, **keywords):
    n = nitro.Nitro(
        Digits(max_epochs=epochs, **SMALL),
        progress=False,
        checkpointer=None,
        logger=None,
        **keywords,
    )
    return n.train()


def test_a_population_validates_within_epochs_as_each_member_alone():
    pop = nitro.Population(
        Digits(max_epochs=1, **SMALL),
        learning_rate=[1e-3, 1e-2],
        val_every_steps=10,
        progress=False,
    ).train()
    for index, lr in enumerate((1e-3, 1e-2)):
        solo = _alone(1, learning_rate=lr, val_every_steps=10).validations()
        mine = pop.validations().loc[index]
        assert mine.index.tolist() == solo.index.tolist() == [10, 20, 30]
        np.testing.assert_allclose(mine["val_loss"], solo["val_loss"], rtol=0, atol=1e-6)
        assert mine["learning_rate"].tolist() == [lr] * 3


def test_max_steps_stops_every_member_at_that_step_mid_epoch():
    pop = nitro.Population(
        Digits(max_epochs=3, **SMALL), learning_rate=[1e-3, 1e-2], max_steps=50, progress=False
    ).train()
    assert (pop.step, pop.epoch, pop.stop_reason) == (50, 1, "max_steps")
    assert pop.history().index.tolist() == [(0, 1), (1, 1)]  # epoch 2 is under way
    assert pop.train().step == 50  # trained to max_steps already: nothing more
    assert pop.train(steps=3).step == 53  # steps=N trains N more, as a run's
    solo = _alone(3, learning_rate=1e-2, max_steps=50)
    assert (solo.step, solo.epoch) == (50, 1)
    np.testing.assert_allclose(
        pop.history().loc[1]["val_loss"], solo.history()["val_loss"], rtol=0, atol=1e-6
    )


def test_auto_measures_the_population_s_steps_per_call_and_trains_as_one_step_a_call(
    monkeypatch,
):
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)  # however short the run
    monkeypatch.setattr(nitro.dispatch, "TARGET_SECONDS", 0.0)
    auto = nitro.Population(
        Digits(max_epochs=2, **SMALL), learning_rate=[1e-3, 1e-2], progress=False
    )
    assert auto.steps_per_call is None  # "auto" decides by measuring, while it trains
    auto.train()
    single = nitro.Population(
        Digits(max_epochs=2, **SMALL),
        learning_rate=[1e-3, 1e-2],
        steps_per_dispatch=1,
        progress=False,
    ).train()
    assert auto.dispatch.setting == "auto" and auto.steps_per_call == auto.dispatch.steps
    assert isinstance(auto.steps_per_call, int) and not auto.dispatch.probing
    # a fused size is kept only where it computes what single steps do, bit for bit
    columns = ["loss", "val_loss", "val_acc"]
    assert auto.history()[columns].equals(single.history()[columns])


def test_each_member_s_own_data_order_in_fused_accumulated_calls_equals_its_seed_alone():
    pop = nitro.Population(
        Digits(max_epochs=1, **SMALL),
        seed=[0, 1],
        accum=2,
        steps_per_dispatch=4,
        progress=False,
    ).train()
    assert pop.batches == "own"
    for index, seed in enumerate((0, 1)):
        solo = _alone(1, seed=seed, accum=2, steps_per_dispatch=4)
        np.testing.assert_allclose(
            pop.history().loc[index]["val_loss"], solo.history()["val_loss"], rtol=0, atol=1e-6
        )


def _private_imports(path: Path) -> list[str]:
    """`from nitro.x import _name` in `path`: a private name of another module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nitro"):
            found += [
                f"{node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.endswith("__")  # `__version__` is public
            ]
    return found


def test_population_code_imports_no_private_helper_of_the_run():
    modules = [
        "engine/member_axis.py",
        "engine/member_spikes.py",
        "handle/population.py",
        "handle/population_loggers.py",
        "handle/population_members.py",
        "handle/lr_find.py",
        "programs/population.py",
    ]
    found = {name: _private_imports(ROOT / name) for name in modules}
    assert found == {name: [] for name in modules}
    # no loop of its own: it trains, evaluates and predicts as a run does, through the
    # methods a run's handle and it share
    from nitro.handle.run_handle import RunHandle

    for name in ("train", "_train_run", "validate", "evaluate", "predict"):
        assert getattr(nitro.Population, name) is getattr(RunHandle, name)
        assert getattr(nitro.Nitro, name) is getattr(RunHandle, name)
