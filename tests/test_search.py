"""Search inside one population: members drawn from a space (`nitro.search.Random`, `Sobol`),
reproducible from a seed, and a space the population cannot vary refused naming the key and
the fix. Real JAX, Flax and Optax on the digits MLP."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

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
