"""Population runs: N members of one experiment trained by one vmapped program.

Real JAX, Flax and Optax throughout: every member is checked against the same settings
trained alone with `nitro.Nitro`.
"""

import numpy as np
import optax
import pytest

import nitro
from nitro.examples.digits import Digits

SMALL = dict(width=64, batch_size=32)  # the tiny MLP: 64-64-10, batch 32


def _alone(settings, epochs, **shared):
    """The member's settings trained alone: its Device fields on the experiment, its run
    keywords on `Nitro`."""
    fields = {k: v for k, v in settings.items() if k == "scale"}
    keywords = {k: v for k, v in settings.items() if k != "scale"}
    n = nitro.Nitro(
        Digits(max_epochs=epochs, **SMALL, **fields),
        progress=False,
        checkpointer=None,
        logger=None,
        **keywords,
        **shared,
    )
    return n.train()


def test_an_unrolled_member_trains_bit_for_bit_as_it_would_alone():
    # "auto" on one CPU device: each member's step one after another in the program, each
    # computing as a run's step does
    pop = nitro.Population(Digits(max_epochs=2, **SMALL), learning_rate=[1e-3, 3e-3])
    assert not pop.vectorized
    pop.train()
    for i, rate in enumerate((1e-3, 3e-3)):
        alone = _alone({"learning_rate": rate}, 2)
        assert pop.history().loc[i]["val_loss"].tolist() == alone.history()["val_loss"].tolist()
        member = pop.member(i)
        for a, b in zip(member.state.variables.params, alone.state.variables.params, strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_vectorize_auto_unrolls_small_populations_on_one_cpu_device_and_bad_values_are_refused():
    many = nitro.Population(Digits(**SMALL), learning_rate=list(np.geomspace(1e-4, 1e-1, 17)))
    assert many.vectorized  # past 16 members the unrolled program would compile too long
    with pytest.raises(nitro.PopulationError, match=r"vectorize='yes': pass True"):
        nitro.Population(Digits(**SMALL), learning_rate=[1e-3, 1e-2], vectorize="yes")


@pytest.mark.parametrize("vectorize", [True, False])
def test_each_member_equals_its_settings_trained_alone(vectorize):
    schedules = [
        {"learning_rate": optax.cosine_decay_schedule(3e-3, 120)},
        {"learning_rate": optax.linear_schedule(1e-3, 1e-2, 60)},
    ]
    pop = nitro.Population(
        Digits(max_epochs=3, **SMALL),
        schedules=schedules,
        scale=[1.0, 0.5],
        progress=False,
        vectorize=vectorize,
    )
    assert pop.vectorized is vectorize
    assert len(pop) == 4
    pop.train()
    history = pop.history()
    assert list(history.index.names) == ["member", "epoch"]
    assert {"schedules", "scale", "loss", "val_loss", "val_acc"} <= set(history.columns)
    for i, settings in enumerate(pop.members):
        alone = _alone(settings, 3)
        solo, mine = alone.history(), history.loc[i]
        assert list(mine.index) == [1, 2, 3]
        for column in ("loss", "val_loss", "val_acc"):
            np.testing.assert_allclose(mine[column], solo[column], rtol=0, atol=1e-6)
        assert mine["step"].tolist() == solo["step"].tolist()
        # the weights agree to rounding: a batched matmul sums in another order than one
        # member's (1 ulp at the first step), which Adam's normalized steps carry on
        member = pop.member(i)
        for a, b in zip(member.state.variables.params, alone.state.variables.params, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
        assert member.validate()["val_loss"] == pytest.approx(mine["val_loss"].iloc[-1], abs=1e-6)


def test_eight_members_compile_one_train_step(fresh_cache):
    pop = nitro.Population(
        Digits(max_epochs=1, **SMALL),
        learning_rate=[1e-3, 3e-3, 1e-2, 3e-2],
        scale=[1.0, 0.5],
        progress=False,
    )
    assert len(pop) == 8
    assert nitro.cache_stats().misses == 0  # building a population compiles nothing
    pop.train()
    pop.train(epochs=1)  # more epochs: the same programs
    stats = nitro.cache_stats()
    kinds = [p["kind"] for p in stats.programs]
    assert kinds.count("population train step") == 1
    assert "train step" not in kinds and "multi-step train" not in kinds
    log = [r.program for r in nitro.explain_compiles()]
    assert log.count("population train step") == 1
    assert log.count("population eval forward") == 1
    assert stats.misses == 2
    assert pop.epoch == 2 and pop.history().index.get_level_values("member").nunique() == 8


@pytest.mark.parametrize(
    ("axes", "names"),
    [
        ({"width": [64, 128]}, ["width", "GraphConst"]),
        ({"batch_size": [32, 64]}, ["batch_size", "Host field"]),
        ({"accum": [1, 2]}, ["accum", "program"]),
        ({"optimizer": [optax.adam, optax.sgd]}, ["optimizer", "structure"]),
        ({"max_epochs": [1, 2]}, ["max_epochs"]),
        ({"dropout": [0.1, 0.2]}, ["dropout", "neither a run keyword nor a field"]),
        ({"weight_decay": [None, 1e-4]}, ["weight_decay=None", "differs"]),
    ],
)
def test_an_axis_that_changes_the_program_is_refused_by_name(axes, names):
    with pytest.raises(nitro.PopulationError) as refused:
        nitro.Population(Digits(max_epochs=1, **SMALL), progress=False, **axes)
    for name in names:
        assert name in str(refused.value)


def test_best_is_a_handle_that_trains_validates_and_exports(tmp_path):
    pop = nitro.Population(
        Digits(max_epochs=2, **SMALL), learning_rate=[1e-4, 3e-3], seed=[0], progress=False
    )
    pop.train()
    history = pop.history()
    best_member = int(history.xs(2, level="epoch")["val_loss"].idxmin())
    assert best_member == 1  # 3e-3 beats 1e-4 over two epochs
    best = pop.best("val_loss")
    assert isinstance(best, nitro.Nitro)
    assert best.given_keywords["learning_rate"] == 3e-3
    val = best.validate()
    assert val["val_loss"] == pytest.approx(history.loc[(1, 2), "val_loss"], abs=1e-6)
    best.train(epochs=1)
    assert best.step > 0 and best.validate()["val_loss"] < val["val_loss"]
    manifest = best.export(str(tmp_path / "bundle"))
    assert manifest
    from nitro import bundle

    samples = nitro.datasets.digits_arrays()["test"]["x"][:4]
    served = bundle.load(str(tmp_path / "bundle"))
    np.testing.assert_allclose(
        np.asarray(served(x=samples)["output"]), best.predict({"x": samples}), atol=1e-5
    )


def test_a_diverging_member_stops_and_the_others_train_on():
    pop = nitro.Population(Digits(max_epochs=1, **SMALL), scale=[1.0, float("nan")], progress=False)
    pop.train()
    assert pop.stopped == {1: "diverged at step 1"}
    alone = _alone({"scale": 1.0}, 1)
    np.testing.assert_allclose(
        pop.history().loc[0]["val_loss"], alone.history()["val_loss"], rtol=0, atol=1e-6
    )
    assert pop.best().given_keywords == {"progress": False}  # the member that trained on


def test_members_list_and_shared_keywords():
    pop = nitro.Population(
        Digits(max_epochs=1, **SMALL),
        members=[{"learning_rate": 1e-3, "seed": 1}, {"learning_rate": 1e-2, "scale": 0.5}],
        steps_per_dispatch=1,
        progress=False,
    )
    assert pop.members == [
        {"learning_rate": 1e-3, "seed": 1},
        {"learning_rate": 1e-2, "scale": 0.5},
    ]
    assert pop.steps_per_call == 1
    with pytest.raises(nitro.PopulationError, match="members= or list-valued axes"):
        nitro.Population(Digits(), members=[{}], seed=[0, 1])


def test_a_populations_binding_report_names_its_member_axis_and_the_members_settings():
    pop = nitro.Population(Digits(**SMALL), learning_rate=[1e-3, 1e-2], scale=[1.0, 0.5])
    report = pop.binding_report(3)
    population = dict(report.sections)["population"]
    assert population[0] == "members = 4  (this report: member 3, learning_rate=0.01 scale=0.5)"
    assert "member axis = unrolled, one member's step after another  [vectorize]" in population
    assert "learning_rate = 0.01  [member 3's setting]" in dict(report.sections)["run keywords"]
    assert "scale = 0.5  [given]" in report
    with pytest.raises(nitro.PopulationError, match="has 4 members, numbered 0 to 3"):
        pop.binding_report(4)
