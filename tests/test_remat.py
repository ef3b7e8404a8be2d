"""`remat=`: the modules named recompute their activations in the train step's backward pass;
the numbers are the ones without it, the program is keyed by it, and a bad value is refused."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from flax import nnx
from toys import Toy

import nitro
from nitro.errors import SetupError
from nitro.programs.compile_cache import cache_stats


def quiet(**keywords):
    return {"progress": False, "logger": None, "checkpointer": None, **keywords}


class Layers(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.stem = nnx.Linear(5, width, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(3)])
        self.head = nnx.Linear(width, 2, rngs=rngs)

    def __call__(self, x, *, gain: float = 1.0):
        h = nnx.relu(self.stem(x))
        for block in self.blocks:
            h = h + gain * jax.numpy.tanh(block(h))
        return self.head(h)


@nitro.experiment
class Deep(Toy):
    def build_model(self, rngs: nnx.Rngs):
        return Layers(self.width, rngs=rngs)


def leaves(n) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(n.state.variables.params)]


@pytest.mark.parametrize("remat", ["full", "dots", ["blocks.1", "head"], {"blocks": "full"}])
def test_a_rematerialized_run_trains_to_the_same_weights_bit_for_bit(remat):
    plain = nitro.Nitro(Deep(width=6), **quiet())
    plain.train()
    recomputed = nitro.Nitro(Deep(width=6), remat=remat, **quiet())
    recomputed.train()
    # the backward pass recomputes the forward's operations on the same inputs, in the same
    # order, so every value is the one it kept before
    for a, b in zip(leaves(plain), leaves(recomputed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [r["loss"] for r in plain.state.history] == [r["loss"] for r in recomputed.state.history]


def test_remat_keys_the_train_step_and_names_itself_in_the_explanation():
    nitro.Nitro(Deep(width=7), **quiet()).train()
    before = len(cache_stats().compiles)
    n = nitro.Nitro(Deep(width=7), remat="full", **quiet())
    n.train()
    new = cache_stats().compiles[before:]
    assert [record.program for record in new] == ["train step"]  # evaluation: unchanged
    assert "remat" in new[0].reason and "blocks.0: full" in new[0].reason
    report = str(n.binding_report())
    assert "remat = Remat('full' on the model)  [Nitro keyword]" in report
    assert (
        "remat  [Nitro keyword]\n  'full' on blocks.0, blocks.1, blocks.2, head, stem\n" in report
    )
    assert "train step scratch" in report and "without remat" in report


def test_a_policy_callable_applies_to_the_layers_keyed_by_its_values():
    policies = jax.checkpoint_policies
    n = nitro.Nitro(Deep(width=5), remat=policies.save_only_these_names("a"), **quiet())
    n.train()
    assert "SaveOnlyTheseNames on blocks.0, blocks.1, blocks.2, head, stem" in n.binding_report()
    before = len(cache_stats().compiles)
    nitro.Nitro(Deep(width=5), remat=policies.save_only_these_names("a"), **quiet()).train()
    assert len(cache_stats().compiles) == before  # an equal policy: the same program
    nitro.Nitro(Deep(width=5), remat=policies.save_only_these_names("b"), **quiet()).train()
    assert [r.program for r in cache_stats().compiles[before:]] == ["train step"]


def test_an_unknown_module_path_is_refused_listing_the_models_paths():
    with pytest.raises(SetupError) as error:
        nitro.Nitro(Deep(), remat=["blocks.7"], **quiet())
    message = str(error.value)
    assert "remat= names the module path 'blocks.7', which Layers does not have" in message
    assert "its module paths: blocks, blocks.0, blocks.1, blocks.2, head, stem" in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"blocks": "half"}, "remat={'blocks': ...} must be a policy: one of ['dots', 'full']"),
        (3, "remat= takes 'none', a policy ('full', 'dots' or a jax.checkpoint policy)"),
        ([""], "remat= module paths must be non-empty strings"),
    ],
)
def test_a_bad_policy_is_refused_naming_it(value, expected):
    with pytest.raises(ValueError, match="remat") as error:
        nitro.Nitro(Deep(), remat=value, **quiet())
    assert expected in str(error.value)


def test_none_is_no_rematerialization():
    assert nitro.Nitro(Toy(), remat="none", **quiet()).keywords["remat"].value is None


def test_a_population_shares_one_remat_and_refuses_one_per_member():
    pop = nitro.Population(Deep(width=6), seed=[0, 1], remat="full", **quiet())
    pop.train()
    assert sorted(set(pop.history().index.get_level_values("member"))) == [0, 1]
    with pytest.raises(nitro.PopulationError, match="remat cannot vary across a population"):
        nitro.Population(Deep(width=6), seed=[0, 1], remat=["full", "none"], **quiet())


def test_a_population_logs_its_train_steps_scratch_with_and_without_remat(tmp_path):
    pop = nitro.Population(
        Deep(width=6),
        seed=[0, 1],
        remat="full",
        progress=False,
        checkpointer=None,
        run_dir=str(tmp_path / "pop"),
    )
    pop.train(epochs=1)
    pop.train(epochs=1)  # its start logs the report again, with the train step compiled
    for member in (0, 1):
        lines = (tmp_path / "pop" / f"member-{member}" / "metrics.jsonl").read_text().splitlines()
        reports = [
            record["value"]
            for record in map(json.loads, lines)
            if record["type"] == "other" and record["key"] == "binding_report"
        ]
        assert len(reports) == 2
        assert (
            "remat  [Nitro keyword]\n  'full' on blocks.0, blocks.1, blocks.2, head, stem\n"
            in reports[0]
        )
        assert "its memory shows once the train step is compiled" in reports[0]
        assert re.search(
            r"\n  population train step scratch [\d.]+ \w+, without remat [\d.]+ \w+ "
            r"\([+-]\d+%\)\n",
            reports[1],
        )
