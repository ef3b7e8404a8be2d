"""Faults in configuration: field values of the wrong type."""

from typing import Literal

import jax.numpy as jnp
import numpy as np
import pytest
from toys import Toy, X

import nitro
from nitro import Device, GraphConst

# ---------------------------------------------------------------------------------------------
# field values against their declared types


def test_a_graphconst_value_of_the_wrong_type_is_refused_naming_field_type_and_value():
    with pytest.raises(nitro.ExperimentError) as error:
        Toy(width="abc")
    assert str(error.value) == (
        "Toy.width is GraphConst[int] but got 'abc' (str); pass an int, e.g. Toy(width=8)"
    )
    with pytest.raises(nitro.ExperimentError, match=r"got True \(bool\); pass an int"):
        Toy(width=True)
    with pytest.raises(nitro.ExperimentError, match=r"Toy\.offset is GraphConst\[float\] but got"):
        Toy(offset="big")
    # the numeric tower: an int is a float, a numpy integer an int
    assert (Toy(offset=1).offset, Toy(width=np.int64(4)).width) == (1, 4)


def test_a_device_value_that_is_not_a_number_is_refused_naming_field_type_and_value():
    with pytest.raises(nitro.ExperimentError) as error:
        Toy(scale="big")
    assert str(error.value) == (
        "Toy.scale is Device[float] but got 'big' (str); pass a float, e.g. Toy(scale=1.0)"
    )
    with pytest.raises(nitro.ExperimentError, match=r"got None \(NoneType\); pass a float"):
        Toy(scale=None)
    with pytest.raises(nitro.ExperimentError, match=r"got 2j \(complex\)"):
        Toy(scale=2j)
    accepted = [2, np.float32(0.5), jnp.asarray(0.5, jnp.bfloat16), np.ones(3)]
    assert [Toy(scale=v).scale is v for v in accepted] == [True] * 4


def test_optional_literal_and_generic_annotations_are_checked_by_what_they_allow():
    @nitro.experiment
    class Annotated:
        act: GraphConst[Literal["relu", "gelu"]] = "relu"
        layers: GraphConst[tuple[int, ...]] = (8, 8)
        dropout: GraphConst[float | None] = None
        steps: Device[int] = 3

    Annotated(act="gelu", layers=(4,), dropout=0.1)
    Annotated(dropout=None, steps=np.int32(5))
    with pytest.raises(nitro.ExperimentError, match=r"pass one of 'relu', 'gelu', e\.g\."):
        Annotated(act="tanh")
    with pytest.raises(
        nitro.ExperimentError, match=r"but got frozenset\(\{4\}\) \(frozenset\); pass a tuple"
    ):
        Annotated(layers=frozenset({4}))
    with pytest.raises(nitro.ExperimentError, match=r"float \| None\] .*pass a float or None"):
        Annotated(dropout="0.1")
    with pytest.raises(nitro.ExperimentError, match=r"Device\[int\] but got 0\.5 .*pass an int"):
        Annotated(steps=0.5)


def test_an_annotation_that_does_not_resolve_is_not_checked_and_the_others_still_are():
    @nitro.experiment
    class Forward:
        width: "GraphConst[int]" = 8  # noqa: F821 - resolved in this module
        shape: "GraphConst[NotDefinedAnywhere]" = 1  # noqa: F821 - never resolves

    assert Forward(shape="anything").shape == "anything"
    with pytest.raises(nitro.ExperimentError, match=r"Forward\.width is GraphConst\[int\]"):
        Forward(width="abc")


def test_set_device_refuses_a_value_of_the_wrong_type_and_keeps_the_old_one():
    n = nitro.Nitro(Toy(), progress=False)
    before = n.predict({"x": X[:4]})
    with pytest.raises(nitro.ExperimentError) as error:
        n.set_device(scale="big")
    assert str(error.value) == (
        "Toy.scale is Device[float] but got 'big' (str); pass a float, e.g. set_device(scale=1.0)"
    )
    with pytest.raises(nitro.ExperimentError, match=r"got None \(NoneType\)"):
        n.set_device(scale=None)
    assert n.device_value("scale") == 1.0 and n.experiment.scale == 1.0
    np.testing.assert_array_equal(n.predict({"x": X[:4]}), before)


def test_the_shipped_experiments_still_construct():
    from nitro.examples.digits import Digits

    for cls in (Toy, Digits):
        experiment = cls()
        assert type(experiment) is cls
