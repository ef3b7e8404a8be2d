"""@nitro.experiment: field kinds, the fields table, construction checks, the trace view."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from toys import Toy

import nitro
from nitro import Device, GraphConst
from nitro.experiments import FieldKind, field_specs
from nitro.experiments.trace_view import HostFieldError, TraceView


def test_experiment_is_a_keyword_dataclass_with_defaults():
    e = Toy(width=16)
    assert dataclasses.is_dataclass(e)
    assert (e.width, e.scale, e.max_epochs) == (16, 1.0, 2)
    with pytest.raises(TypeError):
        Toy(16)  # keyword-only constructor


def test_field_kinds_are_recorded():
    kinds = {s.name: s.kind for s in field_specs(Toy)}
    assert kinds["width"] is FieldKind.GRAPHCONST
    assert kinds["scale"] is FieldKind.DEVICE
    assert kinds["batch_size"] is FieldKind.HOST


def test_fields_table_lists_name_type_default_kind_and_doc():
    @nitro.experiment
    class Documented:
        width: GraphConst[int] = 128
        "hidden width"
        scale: Device[float] = 1.0
        epochs: int = 5

    table = nitro.fields(Documented)
    assert list(table.columns) == ["type", "default", "kind", "doc"]
    assert table.loc["width"].tolist() == ["int", 128, "graphconst", "hidden width"]
    assert table.loc["scale", "kind"] == "device"
    assert table.loc["epochs", "kind"] == "host"
    assert table.loc["epochs", "default"] == 5
    assert nitro.fields(Documented(width=7)).loc["width", "value"] == 7


def test_the_fields_table_shows_its_docs_left_aligned_with_their_code_as_code():
    @nitro.experiment
    class Documented:
        width: GraphConst[int] = 128
        "hidden width of `nnx.Linear` <in> layers"
        epochs: int = 5

    html = nitro.fields(Documented)._repr_html_()  # what a notebook shows
    cell = (
        "<div style='text-align:left'>hidden width of <code>nnx.Linear</code> &lt;in&gt; "
        "layers</div>"
    )
    assert cell in html and "`" not in html
    assert "<th style='text-align:left'>doc</th>" in html
    assert nitro.fields(Documented)[["doc"]]._repr_html_().count("<code>") == 0  # a plain frame


def test_graphconst_value_must_hash_by_content():
    @nitro.experiment
    class WithList:
        layers: GraphConst[tuple] = (8, 8)

    assert WithList(layers=(4, 4)).layers == (4, 4)
    with pytest.raises(
        nitro.ExperimentError, match=r"WithList\.layers is GraphConst .* not hashable.*tuple"
    ):
        WithList(layers=[4, 4])

    class Opaque:  # hashes by identity
        pass

    with pytest.raises(nitro.ExperimentError, match="hashes by identity, not content"):
        WithList(layers=Opaque())


def test_graphconst_with_a_driver_only_name_is_refused():
    with pytest.raises(
        nitro.ExperimentError, match=r"seed is marked GraphConst.*Leave it unmarked"
    ):

        @nitro.experiment
        class Bad:
            seed: GraphConst[int] = 0

    with pytest.raises(nitro.ExperimentError, match="max_epochs"):

        @nitro.experiment
        class Bad2:
            max_epochs: GraphConst[int] = 3


def test_user_post_init_still_runs_and_is_inherited():
    calls = []

    @nitro.experiment
    class Base:
        width: GraphConst[int] = 4

        def __post_init__(self):
            calls.append(self.width)

    @nitro.experiment
    class Child(Base):
        depth: GraphConst[int] = 2

    Base(width=3)
    Child(width=5)
    assert calls == [3, 5]
    with pytest.raises(nitro.ExperimentError):
        Child(depth=[1])


def test_trace_view_exposes_graphconst_and_device_and_refuses_host():
    reads = set()
    view = TraceView(Toy, {"width": 8, "offset": 0.0}, {"scale": jnp.float32(2.0)}, reads)
    assert view.width == 8
    assert float(view.scale) == 2.0
    assert reads == {"width"}
    with pytest.raises(
        HostFieldError, match=r"`self\.batch_size` is a Host field of Toy.*GraphConst.*Device"
    ):
        _ = view.batch_size
    with pytest.raises(AttributeError, match="read-only"):
        view.width = 3


def test_trace_view_binds_methods_and_properties():
    @nitro.experiment
    class Helpers:
        width: GraphConst[int] = 3
        data: object = None

        @property
        def double(self):
            return self.width * 2

        def scaled(self, x):
            return x * self.width

        @staticmethod
        def plus_one(x):
            return x + 1

    view = TraceView(Helpers, {"width": 3}, {})
    assert view.double == 6
    assert view.scaled(2) == 6
    assert view.plus_one(1) == 2


def test_a_host_field_read_inside_a_traced_hook_names_the_field():
    @nitro.experiment
    class ReadsHost(Toy):
        def forward(self, model, *, x):
            return model(x * self.batch_size)

    n = nitro.Nitro(ReadsHost(), progress=False)
    with pytest.raises(HostFieldError, match="batch_size"):
        n.train()
    assert n.phase == "failed"


def test_a_big_host_array_never_reaches_the_tracer():
    big = jax.numpy.zeros(3)  # any value: the view never exposes Host fields

    @nitro.experiment
    class Holder(Toy):
        table: object = None

    view = TraceView(Holder, {"width": 8, "offset": 0.0}, {})
    assert "table" not in view._nitro_graphconst and "table" not in view._nitro_device
    with pytest.raises(HostFieldError):
        _ = view.table
    assert Holder(table=big).table is big


def test_missing_required_hooks_are_named():
    @nitro.experiment
    class NoLoss:
        def build_data(self):
            return {}

        def build_model(self, rngs):
            return None

        def forward(self, model, *, x):
            return x

    with pytest.raises(nitro.ExperimentError, match="missing required hook loss"):
        nitro.Nitro(NoLoss())


def test_nitro_builds_a_class_with_its_field_keywords_and_refuses_a_plain_object():
    n = nitro.Nitro(Toy, width=4, seed=3, progress=False)
    assert (n.experiment, n.seed, n.preset) == (Toy(width=4), 3, None)
    with pytest.raises(nitro.ExperimentError, match="@nitro.experiment"):
        nitro.Nitro(object())
