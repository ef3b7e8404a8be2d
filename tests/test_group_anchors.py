"""Per-group decay anchors: `decay_to={"backbone": "init", "head": "zero"}` pulls each
parameter group's decayed leaves toward its own anchor."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from toys import Toy

import nitro


class Grouped(Toy):
    def param_group(self, path: str) -> str:
        return "hidden" if path.startswith("hidden") else "out"


KEYWORDS = {
    "progress": False,
    "logger": None,
    "checkpointer": None,
    "weight_decay": 0.5,
    "learning_rate": 0.05,
}


def weights(handle) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(handle.model))]


def test_each_group_decays_toward_its_own_anchor_as_the_tree_of_those_anchors_would():
    by_group = nitro.Nitro(Grouped(max_epochs=3), decay_to={"hidden": "init"}, **KEYWORDS)
    start = nnx.state(by_group.model, nnx.Param)
    anchors = {"hidden": start["hidden"], "out": jax.tree.map(np.zeros_like, start["out"])}
    by_tree = nitro.Nitro(Grouped(max_epochs=3), decay_to=anchors, **KEYWORDS)
    to_zero = nitro.Nitro(Grouped(max_epochs=3), decay_to="zero", **KEYWORDS)
    for handle in (by_group, by_tree, to_zero):
        handle.train()
    assert by_group.history()["loss"].tolist() == by_tree.history()["loss"].tolist()
    for a, b in zip(weights(by_group), weights(by_tree), strict=True):
        np.testing.assert_array_equal(a, b)
    assert by_group.history()["loss"].tolist() != to_zero.history()["loss"].tolist()


@pytest.mark.parametrize(
    ("experiment", "decay_to", "expected"),
    [
        (
            Grouped(),
            {"hid": "init"},
            "decay_to['hid']: no such parameter group; the groups are hidden, out",
        ),
        (Grouped(), {"hidden": "w0"}, "a group's anchor is 'zero' or 'init'"),
        (Toy(), {"hidden": "init"}, "names parameter groups, and this run has none"),
    ],
)
def test_a_group_anchor_that_cannot_apply_is_refused_naming_it(experiment, decay_to, expected):
    with pytest.raises(nitro.OptimizerError) as caught:
        nitro.Nitro(experiment, decay_to=decay_to, **KEYWORDS)
    assert expected in str(caught.value)
