"""`hooks=`: hook functions given as values override the experiment's methods for one
handle; sets combine with `|`, a set mixing traced and host hooks is refused, a traced hook
capturing a jax array is refused naming it, and editing a host set compiles nothing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from toys import Toy

import nitro
from nitro.errors import SetupError
from nitro.programs.compile_cache import cache_stats


def quiet(**keywords):
    return {"progress": False, "logger": None, "checkpointer": None, **keywords}


def doubled(self, logits, *, y):
    return 2 * optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def accuracy(self, logits, *, y):
    return {"acc": (logits.argmax(-1) == y).mean()}


def hit_rate(self, logits, *, y):
    return {"hits": (logits.argmax(-1) == y).sum()}


def test_a_hook_given_as_a_value_overrides_the_method_of_that_name():
    plain = nitro.Nitro(Toy(), **quiet())
    hooked = nitro.Nitro(Toy(), hooks={"loss": doubled}, **quiet())
    assert hooked.validate()["val_loss"] == pytest.approx(2 * plain.validate()["val_loss"])
    assert type(hooked.experiment).__qualname__ == "Toy"
    assert "hooks = hooks(loss=doubled)  [Nitro keyword]" in hooked.binding_report()


def test_sets_combine_with_a_bar_and_a_host_set_adds_a_metrics_hook():
    given = nitro.hooks(loss=doubled) | nitro.hooks(metrics=accuracy)
    assert sorted(given) == ["loss", "metrics"] and len(given.parts) == 2
    n = nitro.Nitro(Toy(), hooks=given, **quiet())
    n.train()
    assert 0.0 <= n.state.history[-1]["val_acc"] <= 1.0
    with pytest.raises(ValueError, match="hooks: loss given in two sets"):
        _ = given | {"loss": doubled}


def test_a_set_mixing_traced_and_host_hooks_is_refused_with_the_two_sets_to_give():
    with pytest.raises(SetupError) as error:
        nitro.Nitro(Toy(), hooks={"loss": doubled, "metrics": accuracy}, **quiet())
    assert str(error.value) == (
        "hooks: the set (loss, metrics) mixes traced hooks (loss: they run inside compiled "
        "programs) with host hooks (metrics: they run in Python on the host). Give them as "
        "two sets, nitro.hooks(loss=...) | nitro.hooks(metrics=...), so editing the host set "
        "never compiles"
    )


def test_a_traced_hook_capturing_a_jax_array_is_refused_naming_it():
    weight = jnp.ones(2)

    def weighted(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits * weight, y).mean()

    with pytest.raises(SetupError, match="hooks: loss captures 'weight', a jax array"):
        nitro.Nitro(Toy(), hooks={"loss": weighted}, **quiet())

    def counted(self, logits, *, y):  # a host hook may hold anything
        return {"acc": (logits.argmax(-1) == y).mean() * weight[0]}

    n = nitro.Nitro(Toy(), hooks=nitro.hooks(metrics=counted), **quiet())
    assert "val_acc" in n.validate()


def test_editing_a_host_set_compiles_nothing_and_a_traced_one_what_it_reaches():
    traced = nitro.hooks(loss=doubled)
    nitro.Nitro(Toy(width=13), hooks=traced | nitro.hooks(metrics=accuracy), **quiet()).train()
    before = len(cache_stats().compiles)
    edited = nitro.Nitro(Toy(width=13), hooks=traced | nitro.hooks(metrics=hit_rate), **quiet())
    edited.train()
    assert len(cache_stats().compiles) == before
    assert "val_hits" in edited.state.history[-1]

    def tripled(self, logits, *, y):
        return 3 * optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    nitro.Nitro(Toy(width=13), hooks=nitro.hooks(loss=tripled), **quiet()).train()
    new = cache_stats().compiles[before:]
    assert sorted({record.program for record in new}) == ["eval forward", "train step"]
    assert all("code changed: hook loss" in record.reason for record in new)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"los": doubled}, "hooks: 'los' is not a hook (did you mean 'loss'?)"),
        ({"loss": lambda: 0.0}, "hooks: loss must take self first"),
        ([doubled], "hooks= takes a dict of hook name -> function or nitro.hooks(...)"),
    ],
)
def test_a_bad_set_is_refused_naming_the_hook(value, expected):
    with pytest.raises(ValueError) as error:
        nitro.Nitro(Toy(), hooks=value, **quiet())
    assert expected in str(error.value)


def test_a_live_edit_of_the_class_keeps_the_hooks_given(tmp_path):
    from test_live_edits import DEADLINE, Module

    module = Module(tmp_path)
    n = module.handle(hooks={"loss": doubled}, progress=False)
    plain = module.handle(progress=False).validate()["val_loss"]
    assert n.validate()["val_loss"] == pytest.approx(2 * plain)
    module.edit("return model(x)", "return 0.0 * model(x)")  # uniform outputs: loss log(10)
    edit = n.apply_edits().wait(DEADLINE)
    assert edit.record is not None and edit.record["changed"] == ["forward"], edit
    assert n.validate()["val_loss"] == pytest.approx(2 * np.log(10), rel=1e-6)


def test_a_population_runs_one_set_of_hooks():
    pop = nitro.Population(Toy(), seed=[0, 1], hooks={"loss": doubled}, **quiet())
    pop.train()
    assert sorted(set(pop.history().index.get_level_values("member"))) == [0, 1]
