"""Compile control: the program cache, its key, explanations and stale handles."""

import importlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from toys import Toy, X

import nitro
from nitro.programs.compile_cache import compilation_cache_dir


def misses() -> int:
    return nitro.cache_stats().misses


def test_training_only_compiles_one_program_and_hits_grow_with_steps(fresh_cache):
    n = nitro.Nitro(Toy(max_epochs=2, with_val=False), progress=False)
    n.train()
    stats = nitro.cache_stats()
    assert (stats.misses, stats.entries, stats.hits) == (1, 1, 7)  # 8 steps, the first compiled
    assert stats.programs[0]["program"] == "train step"
    assert stats.programs[0]["calls"] == 8
    n.train(epochs=1)
    stats = nitro.cache_stats()
    assert (stats.misses, stats.entries, stats.hits) == (1, 1, 11)


def test_training_with_validation_compiles_train_step_and_eval_forward(fresh_cache):
    n = nitro.Nitro(Toy(max_epochs=2), progress=False)
    n.train()
    stats = nitro.cache_stats()
    assert (stats.misses, stats.entries) == (2, 2)
    assert sorted(p["program"] for p in stats.programs) == ["eval forward", "train step"]
    assert stats.hits == 8 + 2 * 2 - 2  # 8 steps + 2 padded val batches per epoch
    n.validate()
    n.evaluate(split="test")
    assert nitro.cache_stats().misses == 2  # the padded final batches reuse the same program


def test_what_never_recompiles(fresh_cache):
    nitro.Nitro(Toy(), progress=False).train()
    base = misses()
    nitro.Nitro(Toy(), progress=False).train()  # an equal experiment
    nitro.Nitro(Toy(scale=3.0), progress=False).train()  # a Device field
    nitro.Nitro(Toy(scale=2), progress=False).train()  # an int into Device[float]: coerced
    nitro.Nitro(Toy(with_val=True, max_epochs=3), progress=False).train()  # Host fields
    nitro.Nitro(Toy(), seed=7, progress=False).train()  # the seed
    nitro.Nitro(Toy(), max_epochs=1, run_dir="elsewhere", progress=False).train()
    nitro.Nitro(Toy(), learning_rate=0.05, progress=False).train()  # a new constant rate
    nitro.Nitro(
        Toy(), schedules={"learning_rate": lambda step: 1e-3 / (1 + step)}, progress=False
    ).train()  # a schedule
    nitro.Nitro(Toy(), schedules={"scale": lambda step: 1.0 + step}, progress=False).train()
    # the feed: host batches into the call one run, batches staged by workers the next
    nitro.Nitro(Toy(), prefetch="inline", progress=False).train()
    nitro.Nitro(Toy(), prefetch="threads", progress=False).train()
    assert misses() == base


def test_set_device_then_predict_recompiles_nothing(fresh_cache):
    n = nitro.Nitro(Toy(), progress=False)
    first = n.predict({"x": X[:4]})
    base = misses()
    n.set_device(scale=0.5)
    second = n.predict({"x": X[:4]})
    assert misses() == base
    assert not np.allclose(first, second)


def test_a_graphconst_change_recompiles_only_the_programs_that_read_it(fresh_cache):
    @nitro.experiment
    class Smoothed(Toy):
        smoothing: nitro.GraphConst[float] = 0.0

        def loss(self, logits, *, y):
            import jax
            import optax

            labels = optax.smooth_labels(jax.nn.one_hot(y, 2), self.smoothing)
            return optax.softmax_cross_entropy(logits, labels).mean()

    a = nitro.Nitro(Smoothed(max_epochs=1), progress=False)
    a.train()
    a.predict({"x": X[:4]})
    assert misses() == 3
    programs = {p["program"]: p["graphconst_read"] for p in nitro.cache_stats().programs}
    assert programs == {
        "train step": ["offset", "smoothing"],
        "eval forward": ["offset", "smoothing"],
        "predict": ["offset"],
    }
    b = nitro.Nitro(Smoothed(max_epochs=1, smoothing=0.1), progress=False)
    b.train()
    b.predict({"x": X[:4]})
    assert misses() == 5  # train step and eval forward; predict never read `smoothing`
    reasons = [r.reason for r in nitro.explain_compiles()[-2:]]
    assert reasons == ["GraphConst smoothing: 0.0 -> 0.1"] * 2


def test_a_graphconst_read_by_build_model_recompiles_through_the_shapes(fresh_cache):
    nitro.Nitro(Toy(max_epochs=1), progress=False).train()
    nitro.Nitro(Toy(max_epochs=1, width=16), progress=False).train()
    assert misses() == 4
    reason = nitro.explain_compiles()[2].reason
    assert reason.startswith(
        "GraphConst width: 8 -> 16 (read by build_model); model structure changed"
    )
    assert "argument parameter hidden.kernel: f32[5,8] -> f32[5,16]" in reason


def test_every_miss_is_explained(fresh_cache):
    nitro.Nitro(Toy(max_epochs=1), progress=False).train()
    nitro.Nitro(Toy(max_epochs=1, offset=1.0), progress=False).train()
    nitro.Nitro(Toy(max_epochs=1, batch_size=32), progress=False).train()
    log = nitro.explain_compiles()
    assert [r.program for r in log] == ["train step", "eval forward"] * 3
    assert [r.reason for r in log[:2]] == ["new program", "new program"]
    assert log[2].reason == "GraphConst offset: 0.0 -> 1.0"
    assert "argument x: f32[16,5] -> f32[32,5]" in log[4].reason
    assert all(r.seconds > 0 for r in log)
    assert "GraphConst offset: 0.0 -> 1.0" in str(nitro.cache_stats())


def test_a_compile_announces_itself(fresh_cache, capsys):
    nitro.Nitro(Toy(max_epochs=1, with_val=False), progress="lines").train()
    err = capsys.readouterr().err
    assert "nitro: compiling train step of Toy ..." in err
    assert "nitro: compiled train step in" in err and "(new program)" in err


CELL = """
import numpy as np, optax
from flax import nnx
import nitro
from toys import TinyMLP, loaders

SCALE = {scale}

def helper(x):
    return x * {helper}

@nitro.experiment
class Edited:
    width: nitro.GraphConst[int] = 8
    max_epochs: int = 1

    def build_data(self):
        {build_data}
        return loaders()

    def build_model(self, rngs):
        return TinyMLP(5, self.width, 2, rngs=rngs)

    def forward(self, model, *, x):
        return model(helper(x) * SCALE{forward})

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def metrics(self, logits, *, y):
        return {{"acc": (logits.argmax(-1) == y).mean(){metrics}}}

    def finalize_metrics(self, acc, split):
        {finalize}
        return acc
"""
BASE = dict(scale=1.0, helper=1.0, build_data="pass", forward="", metrics="", finalize="pass")


class Notebook:
    """Re-runs a cell that defines the experiment in one namespace, like a notebook does."""

    def __init__(self):
        self.namespace = {"__name__": "__main__"}

    def run(self, **edits):
        exec(compile(CELL.format(**{**BASE, **edits}), "<cell>", "exec"), self.namespace)
        return self.namespace["Edited"]


@pytest.mark.parametrize(
    "edit, recompiled",
    [
        ({}, 0),  # redefining the class with identical code
        ({"build_data": "x = 1"}, 0),
        ({"metrics": " * 1.0"}, 0),  # host metrics
        ({"finalize": "acc = dict(acc)"}, 0),
        ({"forward": " + 0.0"}, 2),
        ({"helper": 2.0}, 2),  # a helper forward calls
        ({"scale": 3.0}, 2),  # a module constant forward reads
    ],
)
def test_code_edits_recompile_exactly_what_they_reach(fresh_cache, edit, recompiled):
    cell = Notebook()
    first = nitro.Nitro(cell.run()(), progress=False)
    first.train()
    before = misses()
    edited = nitro.Nitro(cell.run(**edit)(), weights=first, progress=False)
    edited.train()
    assert misses() - before == recompiled
    if recompiled:
        programs = [r.program for r in nitro.explain_compiles()[-2:]]
        assert programs == ["train step", "eval forward"]


def test_explanations_name_the_edited_code(fresh_cache):
    cell = Notebook()
    nitro.Nitro(cell.run()(), progress=False).train()
    nitro.Nitro(cell.run(helper=2.0)(), progress=False).train()
    assert nitro.explain_compiles()[-1].reason == "code changed: helper helper"
    nitro.Nitro(cell.run(forward=" + 1.0")(), progress=False).train()
    assert nitro.explain_compiles()[-1].reason == "code changed: hook forward"
    nitro.Nitro(cell.run(scale=5.0)(), progress=False).train()
    assert nitro.explain_compiles()[-1].reason == "code changed: constant SCALE"


def test_a_stale_handle_reports_the_edit_and_keeps_its_programs(fresh_cache, capsys):
    cell = Notebook()
    old = nitro.Nitro(cell.run()(), progress=False)
    old.train()
    assert old.stale_report() is None
    cell.run(forward=" * 2.0")
    report = old.stale_report()
    assert report.startswith("Edited changed since this handle was built: forward.")
    assert "programs held: eval forward, train step" in report
    before = misses()
    result = old.validate()  # keeps using what it froze
    assert misses() == before and "val_loss" in result
    assert "Edited changed since this handle was built: forward" in capsys.readouterr().err
    old.validate()
    assert "changed since" not in capsys.readouterr().err  # reported once per change
    fresh = nitro.Nitro(cell.run(forward=" * 2.0")(), weights=old, progress=False)
    fresh.validate()
    assert misses() == before + 1  # the new handle picks up the edit


def test_reloading_an_edited_module_recompiles_what_changed(fresh_cache, tmp_path, monkeypatch):
    module = tmp_path / "edited_experiment.py"
    module.write_text(CELL.format(**BASE))
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = importlib.import_module("edited_experiment")
    old = nitro.Nitro(imported.Edited(), progress=False)
    old.train()
    before = misses()
    module.write_text(CELL.format(**{**BASE, "forward": " - 1.0"}))
    reloaded = importlib.reload(imported)
    assert "forward" in old.stale_report()
    nitro.Nitro(reloaded.Edited(), weights=old, progress=False).train()
    assert misses() - before == 2
    assert nitro.explain_compiles()[-1].reason == "code changed: hook forward"
    sys.modules.pop("edited_experiment", None)


def test_device_metrics_are_their_own_program(fresh_cache):
    @nitro.experiment
    class DeviceMetrics(Toy):
        def metrics(self, logits, *, y):
            return {"acc": (logits.argmax(-1) == y).mean()}

        def metrics_residency(self, hook):
            return "device"

    n = nitro.Nitro(DeviceMetrics(max_epochs=1), progress=False)
    n.train()
    programs = sorted(p["program"] for p in nitro.cache_stats().programs)
    # full-width batch and the sliced final batch each get a device-metrics program
    assert programs == ["device metrics", "device metrics", "eval forward", "train step"]
    assert 0.0 <= n.validate()["val_acc"] <= 1.0
    assert misses() == 4


def test_the_persistent_compilation_cache_is_on_by_default(fresh_cache):
    nitro.Nitro(Toy(max_epochs=1, with_val=False), progress=False).train()
    directory = compilation_cache_dir()
    assert directory and os.path.isdir(directory)
    assert any(os.scandir(directory))


def test_the_persistent_cache_can_be_moved_or_disabled(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
        import jax, nitro
        from nitro.programs.compile_cache import compilation_cache_dir
        from toys import Toy
        nitro.Nitro(Toy(max_epochs=1, with_val=False), progress=False).train()
        print(compilation_cache_dir(), jax.config.jax_compilation_cache_dir)
        """
    )
    moved = tmp_path / "xla"
    for setting, expected in [(str(moved), f"{moved} {moved}"), ("0", "None None")]:
        env = {**os.environ, "NITRO_COMPILATION_CACHE": setting}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == expected
    assert any(moved.iterdir())


MODEL_CELL = """
import optax
from flax import nnx
import nitro
from toys import loaders

class Net(nnx.Module):
    def __init__(self, *, rngs):
        self.hidden = nnx.Linear(5, 8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.{activation}(self.hidden(x)))

@nitro.experiment
class WithNet:
    max_epochs: int = 1

    def build_data(self):
        return loaders()

    def build_model(self, rngs):
        return Net(rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
"""


def test_editing_the_model_class_is_stale_and_recompiles_its_programs(fresh_cache):
    namespace = {"__name__": "__main__"}
    exec(MODEL_CELL.format(activation="relu"), namespace)
    old = nitro.Nitro(namespace["WithNet"](), progress=False)
    old.train()
    exec(MODEL_CELL.format(activation="relu"), namespace)  # identical: nothing is stale
    assert old.stale_changes() == {}
    exec(MODEL_CELL.format(activation="gelu"), namespace)
    assert old.stale_changes() == {"model": ["method Net.__call__"]}
    assert "It reaches the train step, eval forward, predict programs" in old.stale_report()
    before = misses()
    nitro.Nitro(namespace["WithNet"](), weights=old, progress=False).train()
    assert misses() - before == 2
    assert nitro.explain_compiles()[-1].reason == "code changed: method Net.__call__"


def test_a_handle_keeps_its_hooks_when_they_are_patched_in_place(fresh_cache):
    """IPython's autoreload swaps `__code__` on the existing function objects."""
    cell = Notebook()
    cls = cell.run()
    old = nitro.Nitro(cls(), progress=False)

    def zero(self, model, *, x):
        return model(x) * 0.0

    cls.forward.__code__ = zero.__code__
    assert old.stale_changes() == {
        "forward": ["constant SCALE (no longer used)", "helper helper (no longer used)"]
    }
    outputs = old.predict({"x": X[:4]})  # compiled now, from the hook it froze
    assert np.abs(outputs).sum() > 0
    assert np.abs(nitro.Nitro(cls(), progress=False).predict({"x": X[:4]})).sum() == 0


def test_record_compile_logs_work_outside_the_cache_without_counting_a_miss(fresh_cache):
    from nitro.programs.compile_cache import record_compile

    record = record_compile("export", "my.Experiment", 0.25, "outside the program cache")
    assert nitro.explain_compiles()[-1] == record
    assert str(record) == "export [my.Experiment] 0.25 s: outside the program cache"
    stats = nitro.cache_stats()
    assert (stats.hits, stats.misses, stats.entries) == (0, 0, 0)
