"""Search inside one population: members drawn from a space (`nitro.search.Random`, `Sobol`),
reproducible from a seed, and a space the population cannot vary refused naming the key and
the fix. Real JAX, Flax and Optax on the digits MLP."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pandas as pd
import pytest
from system import child_env

import nitro
from nitro import search
from nitro.examples.digits import Digits

SMALL = dict(width=16, batch_size=128)  # 9 steps an epoch
QUIET: dict[str, Any] = dict(progress=False, checkpointer=None, logger=None)
SPACE = {
    "learning_rate": search.log_uniform(1e-4, 1e-1),
    "scale": search.uniform(0.5, 2.0),  # a Device field
    "weight_decay": search.choice([1e-5, 1e-4]),
}


def test_random_members_are_drawn_from_the_space_and_reproducible_from_the_seed():
    drawn = search.Random(SPACE, n=6, seed=3)
    assert drawn.members == search.Random(SPACE, n=6, seed=3).members
    assert drawn.members != search.Random(SPACE, n=6, seed=4).members
    assert len(drawn) == 6 and all(sorted(m) == sorted(SPACE) for m in drawn)
    for member in drawn:
        assert 1e-4 <= member["learning_rate"] <= 1e-1
        assert 0.5 <= member["scale"] <= 2.0
        assert member["weight_decay"] in (1e-5, 1e-4)
    seeds = search.Random({"seed": search.int_range(0, 2)}, n=40, seed=0)
    assert {m["seed"] for m in seeds} == {0, 1, 2}  # both ends included

    pop = nitro.Population(Digits(max_epochs=1, **SMALL), search=drawn, **QUIET)
    assert pop.members == drawn.members  # search= fills the members
    same = nitro.Population(Digits(max_epochs=1, **SMALL), members=drawn, **QUIET)
    assert same.members == pop.members
    history = pop.train().history()
    assert history.index.get_level_values("member").tolist() == list(range(6))
    assert history["learning_rate"].tolist() == [m["learning_rate"] for m in drawn]


def test_sobol_members_cover_the_space_one_in_each_stratum():
    drawn = search.Sobol({"scale": search.uniform(0.0, 1.0)}, n=8, seed=1)
    strata = sorted(int(m["scale"] * 8) for m in drawn)
    assert strata == list(range(8))
    assert drawn.members == search.Sobol({"scale": search.uniform(0.0, 1.0)}, n=8, seed=1).members


def test_a_space_the_population_cannot_vary_is_refused_naming_the_key_and_the_fix():
    with pytest.raises(nitro.PopulationError) as graph:
        nitro.Population(Digits(), search=search.Random({"width": search.choice([16, 32])}, n=2))
    assert str(graph.value).startswith("Random space key 'width': width cannot vary")
    assert "Build one population per value of width" in str(graph.value)

    with pytest.raises(nitro.PopulationError) as plain:
        search.Random({"learning_rate": 0.1}, n=2)
    assert "space['learning_rate'] = 0.1 is not a distribution" in str(plain.value)
    assert "a keyword of Population (learning_rate=0.1)" in str(plain.value)

    with pytest.raises(nitro.PopulationError, match="members= or search=Random"):
        nitro.Population(Digits(), members=[{}], search=search.Random(SPACE, n=2))
    with pytest.raises(ValueError, match=r"give 0 < low < high"):
        search.log_uniform(0.0, 1.0)
    with pytest.raises(nitro.PopulationError, match="positive int"):
        search.Random(SPACE, n=0)
    assert np.isfinite(search.log_uniform(1e-3, 1e-2).at(0.5))


# ---------------------------------------------------------------------------------------------
# population-based training

RATES = dict(learning_rate=[1e-4, 1e-3, 3e-3, 1e-2])


def without_timing(history):
    timing = ["epoch_seconds", "data_wait_frac", "host_ms", "device_ms"]
    return history.drop(columns=[c for c in timing if c in history])


def params(pop: nitro.Population) -> list[list[np.ndarray]]:
    return [[np.asarray(x) for x in pop.member(i).state.variables.params] for i in range(len(pop))]


def test_pbt_that_never_exploits_equals_the_plain_population_bitwise():
    plain = nitro.Population(Digits(max_epochs=3, **SMALL), **RATES, **QUIET).train()
    never = nitro.Population(
        Digits(max_epochs=3, **SMALL), search=nitro.PBT(every=float("inf")), **RATES, **QUIET
    ).train()
    pd.testing.assert_frame_equal(without_timing(never.history()), without_timing(plain.history()))
    for got, want in zip(params(never), params(plain), strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    assert never.lineage().empty


def test_an_exploit_copies_the_donors_state_bitwise_and_perturbs_its_values():
    # factor 1: the worst member becomes the best one, its weights, optimizer state and
    # learning rate; on the same batches the two then train alike, bit for bit
    pbt = nitro.PBT(every=2, factors=(1.0,), seed=0)
    pop = nitro.Population(Digits(max_epochs=4, **SMALL), search=pbt, **RATES, **QUIET).train()
    lineage = pop.lineage()
    assert lineage[["step", "epoch", "member", "copied_from"]].values.tolist() == [[18, 2, 0, 3]]
    assert lineage["metric"].tolist() == ["val_loss"]
    assert (lineage["old_learning_rate"][0], lineage["new_learning_rate"][0]) == (1e-4, 1e-2)
    history = without_timing(pop.history()).drop(columns="learning_rate")
    for epoch in (3, 4):  # after the copy, the member trains as its donor does
        pd.testing.assert_series_equal(
            history.loc[(0, epoch)], history.loc[(3, epoch)], check_names=False
        )
    for a, b in zip(params(pop)[0], params(pop)[3], strict=True):
        np.testing.assert_array_equal(a, b)
    assert pop.schedule(0) == {"learning_rate": [(0, 1e-2)]}  # its weights' own history
    assert pop.best().given_keywords["learning_rate"] == 1e-2


def test_pbt_is_reproducible_from_its_seed_and_replays_its_schedule_as_a_plain_run():
    def run(seed: int) -> nitro.Population:
        pbt = nitro.PBT(every=1, quantile=0.5, seed=seed, perturb=["learning_rate", "scale"])
        population = nitro.Population(
            Digits(max_epochs=4, **SMALL), search=pbt, scale=[1.0], **RATES, **QUIET
        )
        return population.train()

    first, again, other = run(0), run(0), run(1)
    pd.testing.assert_frame_equal(first.lineage(), again.lineage())
    pd.testing.assert_frame_equal(without_timing(first.history()), without_timing(again.history()))
    assert len(first.lineage()) == 6  # 2 of 4 members at each of 3 boundaries
    assert (
        first.lineage()["new_learning_rate"].tolist()
        != other.lineage()["new_learning_rate"].tolist()
    )

    lineage = first.lineage()
    member = int(lineage["member"].iloc[-1])  # its state and values came from another
    schedule = first.schedule(member)
    assert set(schedule) == {"learning_rate", "scale"}
    assert schedule["learning_rate"][-1] == (
        int(lineage["step"].iloc[-1]),
        lineage["new_learning_rate"].iloc[-1],
    )
    handle = first.member(member)
    assert handle.given_keywords["learning_rate"] == schedule["learning_rate"][-1][1]
    assert handle.experiment.scale == schedule["scale"][-1][1]
    assert "; trained with learning_rate " in handle.weights_origin
    replay = first.replay(member, progress=False, checkpointer=None, logger=None)
    for step, value in schedule["learning_rate"]:
        assert replay.runtime.feed.hyperparams_at(step)["learning_rate"] == pytest.approx(value)
    assert replay.train().epoch == 4


def test_pbt_over_a_scheduled_or_unknown_value_is_refused_naming_it():
    with pytest.raises(nitro.PopulationError, match="'momentum', which is not fed"):
        nitro.Population(Digits(**SMALL), search=nitro.PBT(perturb=["momentum"]), **RATES, **QUIET)
    with pytest.raises(nitro.PopulationError, match="which a schedule sets"):
        nitro.Population(
            Digits(**SMALL),
            search=nitro.PBT(),
            schedules={"learning_rate": lambda step: 1e-3},
            seed=[0, 1],
            **QUIET,
        )
    with pytest.raises(nitro.PopulationError, match="quantile"):
        nitro.PBT(quantile=0.9)


# ---------------------------------------------------------------------------------------------
# an exact resume after a kill

SEARCHES = {
    "pbt": nitro.PBT(every=2, quantile=0.5, seed=0),
    "pbt steps": nitro.PBT(every=5, unit="steps", seed=0),
    "halving": nitro.Halving(rungs=[1, 3]),
}


def searched(kind: str, **keywords: Any) -> nitro.Population:
    """The population a search `kind` trains here and in the child that is killed."""
    defaults = dict(checkpointer=nitro.Checkpointer(budget=None), logger=None)
    return nitro.Population(
        Digits(max_epochs=5, **SMALL),
        search=SEARCHES[kind],
        steps_per_dispatch=3,  # the same calls in every run
        **RATES,
        **{**defaults, **keywords},
    )


CHILD = """
import os, signal, sys
from test_search import searched

class KillAt:
    def member_steps(self, first, losses):
        if first + losses.shape[1] > int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)   # no save, no goodbye

searched(sys.argv[2], run_dir=sys.argv[1], progress=KillAt()).train()
"""


def saved_state(run_dir) -> dict[str, np.ndarray]:
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(Path(run_dir, "checkpoints").absolute(), options=options) as m:
        saved = m.restore(m.latest_step())
    flat: dict[str, np.ndarray] = {}

    def walk(tree, prefix):
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[prefix + key] = np.asarray(value)

    walk(saved["state"], "")
    return flat


@pytest.mark.parametrize("kind", ["pbt", "halving"])
def test_a_search_killed_mid_epoch_resumes_bitwise_equal_to_the_uninterrupted_run(tmp_path, kind):
    run_dir = tmp_path / "killed"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(run_dir), kind, "40"],  # in epoch 5 of 5
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    resumed = searched(kind, run_dir=str(run_dir), resume=str(run_dir), progress=False)
    assert 0 < resumed.step < 40  # its newest checkpoint written whole
    resumed.train().wait()
    whole = searched(kind, run_dir=str(tmp_path / "whole"), progress=False).train().wait()
    pd.testing.assert_frame_equal(
        without_timing(resumed.history()), without_timing(whole.history())
    )
    pd.testing.assert_frame_equal(resumed.lineage(), whole.lineage())
    assert resumed.stopped == whole.stopped
    for got, want in zip(params(resumed), params(whole), strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    expected = saved_state(tmp_path / "whole")  # every member's, the optimizer state too
    for name, value in saved_state(run_dir).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_a_steps_search_stopped_between_boundaries_resumes_exactly():
    whole = searched("pbt steps", checkpointer=None, progress=False).train()
    stopped = searched("pbt steps", run_dir="mid", progress=False)
    stopped.train(steps=13)  # 3 steps after the boundary at 10: their losses are saved
    stopped.close()
    resumed = searched("pbt steps", run_dir="mid", resume="mid", progress=False).train()
    assert whole.lineage()["step"].tolist() == [5, 10, 15, 20, 25, 30, 35, 40]
    pd.testing.assert_frame_equal(resumed.lineage(), whole.lineage())
    pd.testing.assert_frame_equal(
        without_timing(resumed.history()), without_timing(whole.history())
    )


# ---------------------------------------------------------------------------------------------
# successive halving


class Steps:
    """A reporter keeping every call's `member_steps` losses."""

    def __init__(self):
        self.losses: list[np.ndarray] = []

    def member_steps(self, first, losses):
        self.losses.append(np.asarray(losses))


EIGHT = dict(learning_rate=[1e-4, 3e-4, 1e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2e-2])


def test_halving_shrinks_the_population_at_each_rung_compiling_once_per_size(fresh_cache):
    steps = Steps()
    keywords: dict[str, Any] = dict(steps_per_dispatch=3, checkpointer=None, logger=None)
    pop = nitro.Population(
        Digits(max_epochs=3, **SMALL),
        search=nitro.Halving(rungs=[1, 2]),
        progress=steps,
        **EIGHT,
        **keywords,
    ).train()
    reasons = [str(r.reason) for r in nitro.explain_compiles() if r.program.endswith("train step")]
    assert len(reasons) == 3 and reasons[0] == "new program"
    assert reasons[1].startswith("setting members: 8 -> 4;")
    assert reasons[2].startswith("setting members: 4 -> 2;")

    lineage = pop.lineage()
    assert lineage.groupby("rung")["kept"].agg(["size", "sum"]).values.tolist() == [[8, 4], [4, 2]]
    kept = lineage[(lineage["rung"] == 2) & lineage["kept"]]["member"].tolist()
    assert sorted(pop.stopped) == sorted(set(range(8)) - set(kept))
    assert all(why.startswith("halved at rung") for why in pop.stopped.values())
    # every call reports a row per member, NaN for those left out
    assert {losses.shape[0] for losses in steps.losses} == {8}
    assert np.isnan(steps.losses[-1][sorted(pop.stopped)]).all()
    assert np.isfinite(steps.losses[-1][kept]).all()

    plain = nitro.Population(Digits(max_epochs=3, **SMALL), progress=False, **EIGHT, **keywords)
    plain.train(epochs=1)
    first = int(lineage.query("rung == 1 and not kept")["member"].tolist()[0])
    for a, b in zip(
        pop.member(first).state.variables.params,
        plain.member(first).state.variables.params,
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # its weights at its rung
    plain.train()
    for member in kept:  # trained on in smaller programs: as in the whole population, to 1e-5
        np.testing.assert_allclose(
            pop.history().loc[member]["val_loss"],
            plain.history().loc[member]["val_loss"],
            rtol=0,
            atol=1e-5,
        )
    assert (
        pop.best().given_keywords["learning_rate"] == EIGHT["learning_rate"][pop.ranking()[1][0][0]]
    )
