"""Presets: named partial configurations an experiment declares (`presets()`), built by
`Exp.from_preset(name, **overrides)`, `nitro.Nitro(Exp, preset=...)` and
`nitro.Population(Exp, preset=...)`, every key checked against the fields; the preset's name
is recorded wherever a run describes itself."""

from __future__ import annotations

import json
from pathlib import Path

import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from toys import TinyMLP, Toy, loaders

import nitro
import nitro.bundle
from nitro import GraphConst
from nitro.examples.digits import Digits

SMALL = {"width": 32, "batch_size": 64, "max_epochs": 2}


def test_from_preset_builds_the_preset_with_the_overrides_winning_and_remembers_its_name():
    e = Digits.from_preset("small", width=64)
    assert e == Digits(width=64, batch_size=64, max_epochs=2)
    assert nitro.preset_of(e) == "small"
    assert nitro.preset_of(Digits(width=64, batch_size=64, max_epochs=2)) is None
    assert nitro.preset_of(Digits.from_preset(None, width=8)) is None  # no preset: the defaults
    assert Digits.from_preset(None, width=8) == Digits(width=8)


def test_nitro_presets_lists_the_presets_of_a_class_or_an_instance():
    assert nitro.presets(Digits) == {"small": SMALL, "large": {"width": 1024, "max_epochs": 60}}
    assert nitro.presets(Digits()) == nitro.presets(Digits)
    assert nitro.presets(Toy) == {}


def test_an_unknown_preset_is_refused_listing_the_known_ones():
    with pytest.raises(nitro.ExperimentError) as unknown:
        Digits.from_preset("smal")
    assert str(unknown.value) == (
        "Digits has no preset 'smal'. Did you mean 'small'? Its presets: 'small', 'large'."
    )
    with pytest.raises(nitro.ExperimentError) as none:
        Toy.from_preset("small")
    assert str(none.value) == (
        "Toy has no preset 'small'. It declares none (a classmethod presets(cls) returning "
        "{'small': {'width': 32}} declares them)."
    )


@nitro.experiment
class Misspelt(Toy):
    @classmethod
    def presets(cls):
        return {"good": {"width": 4}, "bad": {"widht": 4}}


@nitro.experiment
class SetsAKeyword(Toy):
    @classmethod
    def presets(cls):
        return {"seeded": {"seed": 3}}


def test_a_key_that_is_no_field_is_refused_saying_which_preset_and_what_it_meant():
    with pytest.raises(nitro.ExperimentError) as listing:
        nitro.presets(Misspelt)
    assert str(listing.value) == (
        "Misspelt.presets()['bad'] sets 'widht', which is not a field of Misspelt. Did you mean "
        "'width'? Its fields: width, offset, scale, batch_size, max_epochs, with_val."
    )
    assert Misspelt.from_preset("good").width == 4  # the one built is checked, not the others
    with pytest.raises(nitro.ExperimentError, match=r"presets\(\)\['bad'\] sets 'widht'"):
        Misspelt.from_preset("bad")
    with pytest.raises(nitro.ExperimentError) as override:
        Digits.from_preset("small", widht=8)
    assert str(override.value).startswith(
        "Digits.from_preset('small', ...) sets 'widht', which is not a field of Digits. "
        "Did you mean 'width'?"
    )
    with pytest.raises(nitro.ExperimentError) as keyword:
        SetsAKeyword.from_preset("seeded")
    assert "`seed` is a run keyword: a Host field named seed supplies it (declare one), or " in (
        str(keyword.value)
    )


@nitro.experiment
class Typed(Toy):
    @classmethod
    def presets(cls):
        return {"odd": {"width": "wide"}}


@nitro.experiment
class Plain(Toy):
    presets = {"small": {"width": 4}}  # a class attribute, not a field: no annotation


def test_a_preset_value_of_the_wrong_type_is_refused_naming_the_preset_and_the_field():
    with pytest.raises(nitro.ExperimentError) as wrong:
        Typed.from_preset("odd")
    assert str(wrong.value) == (
        "preset 'odd' of Typed: Typed.width is GraphConst[int] but got 'wide' (str); pass an "
        "int, e.g. Typed(width=8)"
    )


def test_a_presets_attribute_that_is_not_a_classmethod_is_refused_saying_how_to_declare_it():
    with pytest.raises(nitro.ExperimentError) as plain:
        Plain.from_preset("small")
    assert str(plain.value) == (
        "Plain.presets is a dict; declare the presets with a classmethod: @classmethod def "
        "presets(cls): return {'small': {'width': 32}}"
    )


def test_nitro_of_a_class_builds_the_preset_its_fields_among_the_keywords_and_runs_the_rest():
    n = nitro.Nitro(Digits, preset="small", width=16, seed=1, max_epochs=1, progress=False)
    assert n.experiment == Digits(width=16, batch_size=64, max_epochs=2)
    assert (n.preset, n.seed, n.max_epochs) == ("small", 1, 1)  # max_epochs: the run keyword
    assert n.keywords["max_epochs"].source == "Nitro keyword"
    assert n.given_keywords == {"seed": 1, "max_epochs": 1, "progress": False}
    assert nitro.Nitro(Digits.from_preset("small"), progress=False).preset == "small"


def test_nitro_refuses_a_preset_for_an_instance_and_a_keyword_that_is_neither_field_nor_keyword():
    with pytest.raises(nitro.ExperimentError) as instance:
        nitro.Nitro(Digits(), preset="small")
    assert str(instance.value) == (
        "Nitro(preset='small') builds the experiment from its class: Nitro(Digits, "
        "preset='small', ...); this Digits instance has its field values already "
        "(Digits.from_preset('small', ...) builds one from the preset)"
    )
    with pytest.raises(TypeError) as unknown:
        nitro.Nitro(Digits, preset="small", widht=16)
    assert str(unknown.value).startswith(
        "Nitro(Digits, ...) got an unknown keyword 'widht', neither a field of Digits nor a run "
        "keyword. Did you mean 'width', 'weights'? Fields: width, scale, batch_size, max_epochs; "
        "run keywords: accum,"
    )
    with pytest.raises(nitro.ExperimentError, match="Digits has no preset 'tiny'"):
        nitro.Nitro(Digits, preset="tiny")


def test_a_population_of_a_class_builds_its_experiment_from_the_preset():
    pop = nitro.Population(
        Digits, preset="small", learning_rate=[1e-3, 1e-2], width=8, progress=False
    )
    assert pop.preset == "small"
    assert pop.experiment == Digits.from_preset("small")  # the shared fields as given:
    assert pop.given_keywords["width"] == 8
    assert nitro.preset_of(pop.experiment) == "small"
    again = nitro.Population(pop.experiment, **pop.given_keywords)  # builds it again
    assert again.preset == "small" and again.members == pop.members
    with pytest.raises(nitro.ExperimentError, match=r"Population\(preset='small'\) builds"):
        nitro.Population(Digits(), preset="small", learning_rate=[1e-3, 1e-2])


def _meta(run_dir: str) -> dict:
    """The newest checkpoint's record, read with plain orbax."""
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(Path(run_dir, "checkpoints").absolute(), options=options) as m:
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        return m.restore(m.latest_step(), args=args)["meta"]


def _logged(run_dir: str, kind: str) -> dict:
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return next(json.loads(line) for line in lines if json.loads(line)["type"] == kind)


def test_a_run_records_its_preset_everywhere_it_describes_itself(tmp_path):
    n = nitro.Nitro(Digits, preset="small", width=8, max_epochs=1, seed=0, progress=False)
    n.train().close()  # its saves written
    info = json.loads(Path(n.run_dir, "run.json").read_text())
    assert info["preset"] == "small"
    assert info["config"]["fields"] == {"width": 8, "scale": 1.0, "batch_size": 64, "max_epochs": 2}
    assert (info["config"]["keywords"]["seed"], info["config"]["keywords"]["max_epochs"]) == (0, 1)
    assert _meta(n.run_dir)["preset"] == "small"
    assert _logged(n.run_dir, "params")["params"]["preset"] == "small"
    assert _logged(n.run_dir, "tags")["tags"] == {
        "experiment": "nitro.examples.digits.Digits",
        "preset": "small",
    }
    report = str(n.binding_report())
    assert report.startswith("experiment nitro.examples.digits.Digits, preset 'small'\n")
    assert "  width = 8  [given]\n  scale = 1  [default]\n" in report
    assert "  batch_size = 64  [preset 'small']\n  max_epochs = 2  [preset 'small']\n" in report
    assert nitro.saved_runs(Digits).loc[n.run_id, "preset"] == "small"
    n.export(str(tmp_path / "bundle"))
    provenance = nitro.bundle.load(tmp_path / "bundle").manifest["provenance"]
    assert (provenance["preset"], provenance["config"]) == ("small", info["config"])


def test_a_resumed_run_keeps_its_preset_and_a_run_without_one_records_none(tmp_path):
    first = nitro.Nitro(Digits, preset="small", width=8, max_epochs=1, progress=False)
    first.train().close()
    resumed = nitro.Nitro(
        Digits.from_preset("small", width=8), resume=first.run_dir, max_epochs=2, progress=False
    )
    assert (resumed.preset, resumed.epoch) == ("small", 1)
    resumed.train().close()
    assert _meta(resumed.run_dir)["preset"] == "small"
    plain = nitro.Nitro(Digits(width=8, max_epochs=1), progress=False).train().close()
    assert json.loads(Path(plain.run_dir, "run.json").read_text())["preset"] is None
    assert _meta(plain.run_dir)["preset"] is None
    assert "preset" not in _logged(plain.run_dir, "params")["params"]
    assert str(plain.binding_report()).startswith("experiment nitro.examples.digits.Digits\n")


@nitro.experiment(frozen=True)
class Still:
    width: GraphConst[int] = 8

    @classmethod
    def presets(cls):
        return {"narrow": {"width": 2}}

    def build_data(self):
        return loaders()

    def build_model(self, rngs: nnx.Rngs):
        return TinyMLP(5, self.width, 2, rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_a_frozen_experiment_remembers_its_preset_and_the_handles_copy_keeps_it():
    e = Still.from_preset("narrow")
    assert (e.width, nitro.preset_of(e)) == (2, "narrow")
    n = nitro.Nitro(e, progress=False)
    assert (n.preset, n.experiment.width, nitro.preset_of(n.experiment)) == ("narrow", 2, "narrow")


def test_the_command_builds_a_preset_and_its_run_records_it():
    pytest.importorskip("jsonargparse")
    from nitro.cli import main

    tiny = ["--width", "8", "--max-epochs", "1", "--progress", "false"]
    assert main(["train", "nitro.examples.digits:Digits", "--preset", "small", *tiny]) == 0
    (run_dir,) = Path("runs", "Digits").iterdir()
    info = json.loads((run_dir / "run.json").read_text())
    assert info["preset"] == "small"
    assert info["config"]["fields"] == {"width": 8, "scale": 1.0, "batch_size": 64, "max_epochs": 2}
    assert "preset: small\n" in (run_dir / "config.yaml").read_text()
    assert main(["train", "nitro.examples.digits:Digits", "--preset", "smal", *tiny]) == 2
