"""`compile_options=`: XLA's options reach every program a handle compiles, key the cache,
show in the explanations and the binding report, and an unknown one is refused before setup."""

from __future__ import annotations

import pytest
from toys import Toy

import nitro
from nitro.programs.compile_cache import cache_stats


def quiet(**keywords):
    return {"progress": False, "logger": None, "checkpointer": None, **keywords}


class Counted(Toy):
    built = 0

    def build_data(self):
        type(self).built += 1
        return super().build_data()


def compiled_modules(directory) -> set[str]:
    """The jitted modules XLA dumped into `directory` (its `xla_dump_to`), by name."""
    names = {path.name.split(".")[1] for path in directory.glob("module_*.txt")}
    return {name.removeprefix("jit_") for name in names}


def test_the_options_reach_xla_for_each_kind_they_name_and_key_the_compile_cache(tmp_path):
    train_dump, eval_dump = tmp_path / "train", tmp_path / "eval"
    options = {"train": {"xla_dump_to": str(train_dump)}, "eval": {"xla_dump_to": str(eval_dump)}}
    n = nitro.Nitro(Toy(width=11), compile_options=options, **quiet())
    n.train()
    # the train step went to one directory, the evaluation's forward to the other
    assert any(train_dump.glob("module_*.txt")) and any(eval_dump.glob("module_*.txt"))
    trained, evaluated = compiled_modules(train_dump), compiled_modules(eval_dump)
    assert "step" in trained and "step" not in evaluated
    assert "evaluate" in evaluated and "evaluate" not in trained
    assert n.keywords["compile_options"].value.for_kind("train") == options["train"]
    assert "compile_options = {'train': {'xla_dump_to':" in str(n.binding_report())

    # the same options: every program from the cache; other options: the kinds they change
    before = len(cache_stats().compiles)
    nitro.Nitro(Toy(width=11), compile_options=options, **quiet()).train()
    assert len(cache_stats().compiles) == before
    other = {"train": {"xla_cpu_enable_fast_math": False}, "eval": options["eval"]}
    nitro.Nitro(Toy(width=11), compile_options=other, **quiet()).train()
    new = cache_stats().compiles[before:]
    assert [record.program for record in new] == ["train step"]
    assert "compile options" in new[0].reason and "xla_cpu_enable_fast_math=False" in new[0].reason


def test_options_for_every_program_at_once_and_none_are_the_defaults(tmp_path):
    everything = tmp_path / "all"
    n = nitro.Nitro(Toy(width=12), compile_options={"xla_dump_to": str(everything)}, **quiet())
    n.train()
    assert {"step", "evaluate"} <= compiled_modules(everything)
    modules = {path.name.split(".")[0] for path in everything.glob("module_*.txt")}
    n.predict({"x": Toy().build_data()["val"].arrays["x"][:3]})  # predict's program too
    assert len({path.name.split(".")[0] for path in everything.glob("module_*.txt")}) > len(modules)
    assert nitro.Nitro(Toy(), **quiet()).keywords["compile_options"].value is None


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {"xla_cpu_enable_fast_mat": True},
            "compile_options: XLA has no compile option 'xla_cpu_enable_fast_mat'",
        ),
        ({"xla_cpu_enable_fast_math": "yes"}, "compile_options['xla_cpu_enable_fast_math']: XLA"),
        ({"trian": {"xla_cpu_enable_fast_math": True}}, "compile_options['trian']: not a program"),
        ({"xla_cpu_enable_fast_math": [1]}, "take a bool, int, float or string"),
        (
            {"train": {"xla_cpu_enable_fast_math": True}, "xla_dump_to": "x"},
            "mixes program kinds",
        ),
        ("fast", "compile_options takes a dict of XLA option -> value"),
    ],
)
def test_a_bad_option_is_refused_before_setup_naming_it_and_the_fix(options, expected):
    Counted.built = 0
    with pytest.raises(ValueError, match="compile_options") as caught:
        nitro.Nitro(Counted(), compile_options=options, **quiet())
    assert expected in str(caught.value)
    assert Counted.built == 0  # refused before build_data ran
    if "no compile option" in expected:
        assert "did you mean xla_cpu_enable_fast_math" in str(caught.value)


def test_a_population_compiles_with_the_shared_options_and_refuses_them_as_an_axis(tmp_path):
    dump = tmp_path / "pop"
    pop = nitro.Population(
        Toy(width=13),
        learning_rate=[1e-3, 1e-2],
        compile_options={"train": {"xla_dump_to": str(dump)}},
        **quiet(),
    )
    pop.train()
    assert any(dump.glob("module_*.txt"))
    with pytest.raises(nitro.PopulationError, match="compile_options cannot vary"):
        nitro.Population(Toy(), compile_options=[{}, {"xla_dump_to": str(dump)}], **quiet())
