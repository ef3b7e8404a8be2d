"""Device buffer sets: a Device field holding a dict or tuple of arrays, fed as one traced
input (its parts), changed by `set_device` without a recompile, each part checked."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from toys import Toy, X

import nitro
from nitro import Device
from nitro.programs.compile_cache import cache_stats


def table(w: float, b: float = 0.0) -> dict[str, np.ndarray]:
    return {"w": np.full(5, w, np.float32), "b": np.full(5, b, np.float32)}


@nitro.experiment
class Tabled(Toy):
    table: Device[dict] = dataclasses.field(default_factory=lambda: table(1.0))
    pair: Device[tuple] = (np.ones(5, np.float32), np.float32(0.0))

    def forward(self, model, *, x):
        scaled = x * self.table["w"] + self.table["b"]
        return model(scaled * self.pair[0] + self.pair[1])


def quiet(**keywords):
    return {"progress": False, "logger": None, "checkpointer": None, **keywords}


def test_set_device_changes_a_set_without_a_recompile_and_equals_a_handle_built_with_it():
    n = nitro.Nitro(Tabled(), **quiet())
    before = n.predict({"x": X[:4]})
    compiled = len(cache_stats().compiles)
    n.set_device(table=table(2.0, 0.5), pair=(np.full(5, 3.0, np.float32), np.float32(1.0)))
    after = n.predict({"x": X[:4]})
    assert len(cache_stats().compiles) == compiled  # fed, not baked in
    assert not np.array_equal(before, after)
    built = nitro.Nitro(
        Tabled(table=table(2.0, 0.5), pair=(np.full(5, 3.0, np.float32), np.float32(1.0))),
        **quiet(),
    )
    np.testing.assert_array_equal(built.predict({"x": X[:4]}), after)
    value = n.device_value("table")
    assert sorted(value) == ["b", "w"] and value["w"].tolist() == [2.0] * 5
    assert n.train().step == 8  # and it trains


def test_each_part_is_checked_and_a_bad_set_changes_nothing():
    n = nitro.Nitro(Tabled(), **quiet())
    with pytest.raises(ValueError, match=r"buffer set of 2 parts \(table\['b'\], table\['w'\]\)"):
        n.set_device(table={"w": np.ones(5, np.float32)})
    with pytest.raises(
        ValueError, match=r"\"table\['w'\]\" has shape \(5,\); the new value has shape \(4,\)"
    ):
        n.set_device(table={"w": np.ones(4, np.float32), "b": np.zeros(5, np.float32)})
    assert n.device_value("table")["w"].tolist() == [1.0] * 5  # neither part was written
    with pytest.raises(nitro.ExperimentError, match="a dict of numbers or numeric arrays"):
        Tabled(table={"w": "heavy"})
    with pytest.raises(nitro.ScheduleError, match="'table', a buffer set"):
        nitro.Nitro(Tabled(), schedules={"table": lambda step: 1.0}, **quiet())


def test_a_population_varies_a_set_across_its_members():
    pop = nitro.Population(Tabled(max_epochs=1), table=[table(1.0), table(0.0, 1.0)], **quiet())
    losses = pop.train().history()["loss"].tolist()
    assert len(losses) == 2 and losses[0] != losses[1]
