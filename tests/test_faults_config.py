"""Faults in configuration: field values of the wrong type, functions as GraphConst values, and
a compilation cache directory that cannot be used or holds broken entries."""

import functools
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from toys import TinyMLP, Toy, X, loaders

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


# ---------------------------------------------------------------------------------------------
# functions as GraphConst values


@nitro.experiment
class Activated:
    act: GraphConst[Callable] = jnp.tanh
    max_epochs: int = 1

    def build_data(self):
        splits = loaders(16)
        del splits["test"]
        return splits

    def build_model(self, rngs):
        return TinyMLP(5, 8, 2, rngs=rngs)

    def forward(self, model, *, x):
        return self.act(model(x))

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _scaled_by(c):
    return lambda x: x * c


def test_equal_lambdas_compile_once(fresh_cache):
    for act in (lambda x: x * 2, lambda x: x * 2, lambda x: x * 2):
        nitro.Nitro(Activated(act=act), progress=False).train()
    stats = nitro.cache_stats()
    assert (stats.misses, stats.entries) == (2, 2)  # the train step and the eval forward
    assert sorted(p["program"] for p in stats.programs) == ["eval forward", "train step"]


def test_a_function_with_other_code_or_another_closure_value_recompiles_naming_the_field(
    fresh_cache,
):
    nitro.Nitro(Activated(act=_scaled_by(2.0)), progress=False).train()
    nitro.Nitro(Activated(act=_scaled_by(2.0)), progress=False).train()
    assert nitro.cache_stats().misses == 2
    nitro.Nitro(Activated(act=_scaled_by(3.0)), progress=False).train()
    nitro.Nitro(Activated(act=lambda x: x - 1.0), progress=False).train()
    assert nitro.cache_stats().misses == 6
    reasons = [(r.program, r.reason) for r in nitro.explain_compiles()[2:]]
    closure = "_scaled_by.<locals>.<lambda> changed (its closure, defaults or what it calls)"
    assert reasons[:2] == [("train step", f"GraphConst act: {closure}")] + [
        ("eval forward", f"GraphConst act: {closure}")
    ]
    assert reasons[2][1].startswith("GraphConst act: ")
    assert "<lambda>" in reasons[2][1]


def test_the_traced_hook_calls_the_function_given(fresh_cache):
    zeroed = nitro.Nitro(Activated(act=lambda x: x * 0.0), progress=False)
    np.testing.assert_array_equal(zeroed.predict({"x": X[:4]}), np.zeros((4, 2), np.float32))
    tanh = nitro.Nitro(Activated(), progress=False).predict({"x": X[:4]})
    identity = nitro.Nitro(Activated(act=lambda x: x), progress=False).predict({"x": X[:4]})
    np.testing.assert_allclose(tanh, np.tanh(identity), rtol=1e-5)


def test_library_functions_and_partials_are_accepted_and_keyed_by_content(fresh_cache):
    for act in (jax.nn.relu, jax.nn.relu, jnp.tanh):  # refused before: a copy hashed differently
        nitro.Nitro(Activated(act=act), progress=False).predict({"x": X[:4]})
    assert nitro.cache_stats().misses == 2
    for _ in range(2):
        clip = functools.partial(jnp.clip, min=0.0)
        nitro.Nitro(Activated(act=clip), progress=False).predict({"x": X[:4]})
    nitro.Nitro(Activated(act=functools.partial(jnp.clip, min=1.0)), progress=False).predict(
        {"x": X[:4]}
    )
    assert nitro.cache_stats().misses == 4
    assert nitro.explain_compiles()[-1].reason.startswith("GraphConst act: ")
    assert nitro.explain_compiles()[-1].reason.endswith(" -> partial(clip, min=1.0)")


# ---------------------------------------------------------------------------------------------
# the persistent compilation cache (configured once per process: each case runs in its own)

PRELUDE = f"""
import sys, warnings
sys.path.insert(0, {os.path.dirname(__file__)!r})
import nitro
from nitro.programs.compile_cache import compilation_cache_dir
from toys import Toy
warnings.simplefilter("default")
"""
BUILD_TWICE = (
    PRELUDE
    + """
for _ in range(2):
    nitro.Nitro(Toy(max_epochs=1, with_val=False), progress=False)
print("cache:", compilation_cache_dir())
"""
)
TRAIN = (
    PRELUDE
    + """
nitro.Nitro(
    Toy(max_epochs=1, with_val=False), progress=False, logger=None, checkpointer=None
).train()
print("cache:", compilation_cache_dir())
"""
)


def _run(script: str, cache: str, limit_bytes: int | None = None) -> subprocess.CompletedProcess:
    if limit_bytes is not None:  # files this process writes stop at that size (EFBIG)
        script = (
            "import resource, signal\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, {limit_bytes}))\n"
        ) + script
    env = {**os.environ, "NITRO_COMPILATION_CACHE": cache, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tempfile.mkdtemp(),  # the run's directory goes there, not into the cache
    )
    assert out.returncode == 0, out.stderr
    return out


def _assert_warned_once_and_ran_without_cache(out, directory: str) -> None:
    assert out.stdout.strip().endswith("cache: None")
    assert out.stderr.count("RuntimeWarning") == 1, out.stderr
    assert f"the compilation cache directory {directory} (set by NITRO_COMPILATION_CACHE)" in (
        out.stderr
    )
    assert "NITRO_COMPILATION_CACHE=/some/dir" in out.stderr
    assert "NITRO_COMPILATION_CACHE=off" in out.stderr


def test_a_file_where_the_cache_directory_should_be_warns_once_and_runs_without_cache(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    directory = str(tmp_path / "afile" / "cache")
    out = _run(
        BUILD_TWICE
        + textwrap.dedent(
            f"""
            try:
                nitro.set_compilation_cache({directory!r})
            except nitro.CompilationCacheError as error:
                print("refused:", error)
            print("cache:", compilation_cache_dir())
            """
        ),
        directory,
    )
    _assert_warned_once_and_ran_without_cache(out, directory)
    assert "NotADirectoryError" in out.stderr
    # asked for explicitly, the same directory is an error, and the cache stays off
    assert f"refused: the compilation cache directory {directory} (given to " in out.stdout
    assert out.stdout.strip().endswith("cache: None")


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="needs Linux's /sys")
def test_a_directory_that_cannot_be_written_warns_once_and_runs_without_cache():
    # chmod does not stop root (these tests may run as root), but no one may create a file in
    # sysfs: /sys is an existing directory that really refuses writes, for root too.
    out = _run(BUILD_TWICE, "/sys")
    _assert_warned_once_and_ran_without_cache(out, "/sys")
    assert "PermissionError" in out.stderr


def _entries(directory) -> list:
    return [p for p in directory.iterdir() if p.name.endswith("-cache")]


def test_empty_entries_left_by_a_full_disk_are_removed_and_written_again(tmp_path):
    _run(TRAIN, str(tmp_path))
    entries = _entries(tmp_path)
    assert entries
    for entry in entries:  # what a full disk leaves: the file, with nothing in it
        entry.write_bytes(b"")

    out = _run(TRAIN, str(tmp_path))
    assert "Error reading persistent compilation cache" not in out.stderr
    assert out.stdout.strip().endswith(f"cache: {tmp_path}")
    assert sorted(e.name for e in _entries(tmp_path)) == sorted(e.name for e in entries)
    assert all(e.stat().st_size > 0 for e in _entries(tmp_path))


def test_a_failed_write_leaves_no_entry_behind(tmp_path):
    # A file-size limit makes every write past 3000 bytes fail, as a full disk does; written in
    # place, the train step's entry (about 28 KB) would be left truncated at 3000 bytes.
    out = _run(TRAIN, str(tmp_path), limit_bytes=3000)
    assert "Error writing persistent compilation cache entry" in out.stderr
    assert all(0 < e.stat().st_size < 3000 for e in _entries(tmp_path))
    assert not [p.name for p in tmp_path.iterdir() if not p.name.endswith("-cache")]

    out = _run(TRAIN, str(tmp_path))  # a later process reads and completes the cache
    assert "Error reading persistent compilation cache" not in out.stderr
    assert max(e.stat().st_size for e in _entries(tmp_path)) > 3000
