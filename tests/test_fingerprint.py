"""The code fingerprint: what a program's code depends on. Only the names a hook's code loads as
globals are dependencies; an attribute of the same name (`self.scale`) is not."""

import nitro

CELL = """
import optax
import nitro
from toys import TinyMLP, loaders

@nitro.experiment
class Swept:
    scale: nitro.Device[float] = 1.0
    b: nitro.Device[float] = 0.0
    max_epochs: int = 1

    def build_data(self):
        return loaders()

    def build_model(self, rngs):
        return TinyMLP(5, 8, 2, rngs=rngs)

    def forward(self, model, *, x):
        return model(x * self.scale + self.b)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * self.scale

    def metrics(self, logits, *, y):
        return {"acc": [(logits.argmax(-1) == y).mean() * self.scale for _ in range(1)][0]}
"""


def test_a_notebook_variable_named_like_a_field_a_hook_reads_recompiles_nothing(fresh_cache):
    notebook = {"__name__": "__main__"}
    exec(compile(CELL, "<cell>", "exec"), notebook)
    notebook["scale"], notebook["b"] = 1.0, 0.0  # the loop variables of a sweep
    first = nitro.Nitro(notebook["Swept"](scale=1.0), progress=False)
    first.train()
    compiled = nitro.cache_stats().misses
    assert compiled == 2  # the train step and the eval forward

    for scale in (2.0, 3.0):
        notebook["scale"], notebook["b"] = scale, scale / 10
        assert first.stale_changes() == {}
        assert first.stale_report() is None
        n = nitro.Nitro(notebook["Swept"](scale=scale, b=scale / 10), progress=False)
        n.train()
        assert n.stale_changes() == {}
    assert nitro.cache_stats().misses == compiled


def test_a_module_constant_a_hook_loads_is_still_a_dependency(fresh_cache):
    notebook = {"__name__": "__main__", "SHIFT": 0.0}
    cell = CELL.replace("x * self.scale + self.b", "x * self.scale + self.b + SHIFT")
    exec(compile(cell, "<cell>", "exec"), notebook)
    first = nitro.Nitro(notebook["Swept"](), progress=False)
    first.train()
    notebook["SHIFT"] = 1.0
    assert first.stale_changes() == {"forward": ["constant SHIFT"]}
    before = nitro.cache_stats().misses
    nitro.Nitro(notebook["Swept"](), weights=first, progress=False).train()
    assert nitro.cache_stats().misses == before + 2
    assert nitro.explain_compiles()[-1].reason == "code changed: constant SHIFT"
