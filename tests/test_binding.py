"""Binding by name: batch routing, run keywords, schedules, metrics and the binding report."""

import inspect
import pydoc
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from toys import Toy, X, Y

import nitro
from nitro.core.metrics import MetricAccumulator, split_modes
from nitro.engine.run_keywords import KEYWORD_ONLY, RUN_KEYWORDS


def unshuffled(samples=64, batch_size=16, **extra):
    arrays = {"x": X[:samples], "y": Y[:samples], **{k: v[:samples] for k, v in extra.items()}}
    return nitro.data.ArrayLoader(arrays, batch_size, shuffle=False)


def params_of(n):
    return [np.asarray(a) for a in n.state.variables.params]


# --------------------------------------------------------------------------------- routing


def test_only_routed_fields_reach_the_device_and_bookkeeping_stays_on_the_host():
    ids = np.array([f"sample-{i}" for i in range(64)])

    @nitro.experiment
    class WithIds(Toy):
        def build_data(self):
            return {
                "train": unshuffled(ids=ids),
                "val": nitro.data.ArrayLoader(
                    {"x": X[:20], "y": Y[:20], "ids": ids[:20]},
                    16,
                    shuffle=False,
                    drop_last=False,
                ),
            }

        def metrics(self, logits, *, y, ids):
            return {"named": (np.float32(sum(i.startswith("sample-") for i in ids)), "sum")}

    n = nitro.Nitro(WithIds(max_epochs=1), progress=False)
    n.train()
    assert n.history()["val_named"].iloc[0] == 20
    report = str(n.binding_report())
    assert "fields x, y, ids; to device: x, y" in report


def test_optional_and_catch_all_parameters():
    @nitro.experiment
    class Flexible(Toy):
        def build_data(self):
            return {"train": unshuffled(w=np.ones(64, np.float32))}

        def forward(self, model, *, x, mask=None):
            assert mask is None  # not in the batch: the default applies
            return model(x)

        def loss(self, logits, **fields):
            weights = fields["w"]
            per = optax.softmax_cross_entropy_with_integer_labels(logits, fields["y"])
            return (per * weights).mean()

    n = nitro.Nitro(Flexible(max_epochs=1), progress=False)
    n.train()
    assert n.step == 4
    report = str(n.binding_report())
    assert "forward(x, mask?) <- train: x" in report
    assert "loss(**all) <- train: w, x, y" in report


# ---------------------------------------------------------------------------- run keywords


def test_run_keywords_resolve_keyword_then_method_then_field_then_default():
    @nitro.experiment
    class Configured(Toy):
        seed: int = 11  # a field of the same name
        max_epochs: int = 3

        def learning_rate(self):  # a method of the same name
            return 0.02

    n = nitro.Nitro(Configured(), max_epochs=1, progress=False)
    sources = {name: (r.value, r.source) for name, r in n.keywords.items()}
    assert sources["max_epochs"] == (1, "Nitro keyword")
    assert sources["learning_rate"] == (0.02, "method on experiment")
    assert sources["seed"] == (11, "field on experiment")
    assert sources["check_divergence"] == (True, "framework default")
    report = str(n.binding_report())
    assert "max_epochs = 1  [Nitro keyword]" in report
    assert "learning_rate = 0.02  [method on experiment]" in report
    assert "seed = 11  [field on experiment]" in report
    assert f"run_dir = {n.run_dir}  [framework default]" in report
    assert n.run_dir.endswith(f"runs/Configured/{n.run_id}")


def test_bad_run_keyword_values_name_the_keyword_and_source():
    with pytest.raises(
        ValueError, match=r"max_epochs must be an int >= 1, got 0 \[Nitro keyword\]"
    ):
        nitro.Nitro(Toy(), max_epochs=0)

    @nitro.experiment
    class BadField(Toy):
        check_divergence: str = "yes"

    with pytest.raises(
        ValueError, match=r"check_divergence must be True or False.*\[field on experiment\]"
    ):
        nitro.Nitro(BadField())


@pytest.mark.parametrize(
    ("name", "default"),
    [
        ("learning_rate", "0.001"),
        ("precision", "'float32'"),
        ("seed", "0"),
        ("max_epochs", "1"),
        ("accum", "1"),
        ("schedules", "{}"),
        ("resume", "False"),
    ],
)
def test_none_for_a_keyword_that_has_no_none_setting_is_refused_naming_its_default(name, default):
    doc = " ".join(RUN_KEYWORDS[name].doc.split())
    with pytest.raises(nitro.SetupError) as refused:
        nitro.Nitro(Toy(), progress=False, **{name: None})
    assert str(refused.value) == (
        f"{name}=None is not a setting ({name}: {doc}). Leave it out for the default (the "
        f"framework's: {name}={default}) [Nitro keyword]"
    )
    with pytest.raises(nitro.PopulationError) as axis:  # a population's axis says its member
        nitro.Population(Toy(), learning_rate=[1e-3, None], progress=False)
    assert str(axis.value).startswith(
        "member 1 (learning_rate=None): learning_rate=None is not a setting (learning_rate: "
    )


def test_none_where_a_keyword_says_what_none_does_is_that_setting():
    n = nitro.Nitro(Toy(), weight_decay=None, max_steps=None, early_stop=None, progress=False)
    assert n.keywords["weight_decay"].value is None and n.keywords["max_steps"].value is None
    assert n.train().step == 8  # 2 epochs of 4 batches


def test_help_and_the_signature_of_nitro_show_every_run_keyword_with_its_default_and_doc():
    signature = inspect.signature(nitro.Nitro)
    help_text = pydoc.render_doc(nitro.Nitro, renderer=pydoc.plaintext)
    names = [*RUN_KEYWORDS, *KEYWORD_ONLY]
    assert list(signature.parameters) == ["experiment", "preset", *names]
    assert list(nitro.Nitro(Toy(), progress=False).keywords) == list(RUN_KEYWORDS)
    for name in names:
        parameter = signature.parameters[name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert f" |    {name}={parameter.default!r}\n" in help_text
    lines = (line.removeprefix(" |") for line in help_text.splitlines())
    help_words = " ".join(" ".join(lines).split())  # the docs unwrapped
    for name, keyword in RUN_KEYWORDS.items():
        assert repr(signature.parameters[name].default) == keyword.default_text
        assert f"{name}={keyword.default_text} {' '.join(keyword.doc.split())}" in help_words
    for name, doc in KEYWORD_ONLY.items():
        assert f"{name}=None {' '.join(doc.split())}" in help_words
    assert "seed=0, run_dir=None, checkpointer=Checkpointer()," in str(signature)
    assert "n_devs=jax.device_count()" in str(signature)
    assert "steps_per_dispatch='auto'" in str(signature)
    assert str(signature).endswith("progress=True, weights=None, data=None)")
    assert (
        " |    seed=0\n |        seeds the model's nnx.Rngs, the data order and the hooks' rngs\n"
        in help_text
    )
    assert " |    weights=None\n |        start from these weights: a Nitro handle" in help_text


# ------------------------------------------------------------------------------- schedules


def test_a_learning_rate_schedule_reaches_the_optimizer():
    @nitro.experiment
    class Plain(Toy):
        samples: int = 64

        def build_data(self):
            return {"train": unshuffled(self.samples)}

    frozen = nitro.Nitro(Plain(max_epochs=1), schedules={"learning_rate": 0.0}, progress=False)
    start = params_of(frozen)
    frozen.train()
    assert all(np.array_equal(a, b) for a, b in zip(start, params_of(frozen), strict=True))

    # 1e-2 for two steps, then 0: the same weights as two steps at 1e-2
    stepped = nitro.Nitro(
        Plain(max_epochs=1),
        schedules={"learning_rate": lambda step: 1e-2 if step < 2 else 0.0},
        progress=False,
    )
    stepped.train()
    short = nitro.Nitro(Plain(samples=32, max_epochs=1), learning_rate=1e-2, progress=False)
    short.train()
    for a, b in zip(params_of(stepped), params_of(short), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert stepped.hyperparameters["learning_rate"] == 0.0
    assert short.hyperparameters["learning_rate"] == pytest.approx(1e-2)


def test_a_scheduled_device_field_takes_each_steps_value_and_its_dtype():
    @nitro.experiment
    class Traced(Toy):
        def build_data(self):
            return {"train": unshuffled()}

        def train_metrics(self, logits, *, y):
            return {"scale_used": (jnp.full(y.shape, self.scale), "concat")}

    n = nitro.Nitro(
        Traced(max_epochs=2),
        schedules={"scale": lambda step: step * 0.5},
        progress=False,
    )
    n.train()
    used = n.state.history[1]["scale_used"]
    np.testing.assert_array_equal(used, np.repeat([2.0, 2.5, 3.0, 3.5], 16))
    assert used.dtype == np.float32


def test_a_schedule_factory_is_called_once_with_the_total_steps():
    seen = []

    def factory(total):
        seen.append(total)
        return optax.linear_schedule(1e-2, 0.0, total)

    n = nitro.Nitro(Toy(max_epochs=3), schedules={"learning_rate": factory}, progress=False)
    assert seen == [12]
    assert "learning_rate -> opt.learning_rate (factory)" in str(n.binding_report())
    n.train()
    assert n.hyperparameters["learning_rate"] == pytest.approx(1e-2 * (1 - 11 / 12), rel=1e-5)


def test_switching_schedules_recompiles_nothing(fresh_cache):
    for schedules in [
        {},
        {"learning_rate": 3e-3},
        {"learning_rate": optax.cosine_decay_schedule(1e-3, 8)},
        {"opt": {"b1": 0.8}, "device": {"scale": lambda s: 1.0 / (1 + s)}},
    ]:
        nitro.Nitro(Toy(), schedules=schedules, progress=False).train()
    assert nitro.cache_stats().misses == 2


def test_schedule_keys_that_match_both_or_neither_are_errors():
    @nitro.experiment
    class Clash(Toy):
        b1: nitro.Device[float] = 0.5

    with pytest.raises(nitro.ScheduleError, match=r"matches both.*\{'opt': \{'b1': \.\.\.\}\}"):
        nitro.Nitro(Clash(), schedules={"b1": 0.9})
    n = nitro.Nitro(Clash(), schedules={"device": {"b1": 0.7}}, progress=False)
    assert "b1 -> device.b1 (constant)" in str(n.binding_report())
    with pytest.raises(
        nitro.ScheduleError, match=r"'learning_rat' matches no.*Did you mean 'learning_rate'"
    ):
        nitro.Nitro(Toy(), schedules={"learning_rat": 0.1})
    with pytest.raises(nitro.ScheduleError, match="names a graphconst field.*Mark it Device"):
        nitro.Nitro(Toy(), schedules={"width": 4})
    with pytest.raises(nitro.ScheduleError, match="names no Device field"):
        nitro.Nitro(Toy(), schedules={"device": {"learning_rate": 0.1}})


def test_set_device_refuses_a_scheduled_field():
    n = nitro.Nitro(Toy(), schedules={"scale": 2.0}, progress=False)
    with pytest.raises(TypeError, match="'scale' is scheduled"):
        n.set_device(scale=1.0)


# --------------------------------------------------------------------------------- metrics


def test_metric_modes_reduce_leaf_by_leaf():
    acc = MetricAccumulator("metrics")
    for values, n in [
        (
            {
                "acc": 1.0,
                "hits": (3.0, 4.0),
                "nested": ({"a": 1.0, "b": 5.0}, "max"),
                "scores": (np.array([0.1, 0.2]), "concat"),
                "total": (2, "sum"),
                "low": (4.0, "min"),
            },
            2,
        ),
        (
            {
                "acc": 0.0,
                "hits": (1.0, 4.0),
                "nested": ({"a": 3.0, "b": 2.0}, "max"),
                "scores": (np.array([0.3]), "concat"),
                "total": (5, "sum"),
                "low": (1.0, "min"),
            },
            1,
        ),
    ]:
        specs, leaves = split_modes(values, "metrics")
        acc.add(specs, leaves, n)
    result = acc.result()
    assert result["acc"] == pytest.approx(2 / 3)  # weighted by real samples
    assert result["hits"] == pytest.approx(0.5)  # (3 + 1) / (4 + 4)
    assert (result["nested/a"], result["nested/b"]) == (3.0, 5.0)
    np.testing.assert_array_equal(result["scores"], [0.1, 0.2, 0.3])
    assert result["total"] == 7 and result["low"] == 1.0


def test_metric_errors_name_the_metric():
    with pytest.raises(
        nitro.MetricError,
        match=r"metric 'acc' of `metrics` has unknown mode 'avg'; modes are sum, max, min, concat",
    ):
        split_modes({"acc": (1.0, "avg")}, "metrics")
    with pytest.raises(nitro.MetricError, match=r"metric 'acc' of `metrics` has no mode"):
        split_modes({"acc": (1.0, None)}, "metrics")
    with pytest.raises(nitro.MetricError, match="must return a dict"):
        split_modes([1.0], "metrics")
    with pytest.raises(nitro.MetricError, match="carries a mode twice"):
        split_modes({"a": ((1.0, "sum"), "max")}, "metrics")
    acc = MetricAccumulator("metrics")
    acc.add(*split_modes({"a": (1.0, "sum")}, "metrics"), 1)
    with pytest.raises(
        nitro.MetricError, match=r"'a' of `metrics` changed mode between batches: 'sum' -> 'max'"
    ):
        acc.add(*split_modes({"a": (1.0, "max")}, "metrics"), 1)
    with pytest.raises(nitro.MetricError, match="key set is fixed by the first batch"):
        acc.add(*split_modes({"b": (1.0, "sum")}, "metrics"), 1)
    with pytest.raises(nitro.MetricError, match=r"changed shape between batches: \(\) -> \(2,\)"):
        acc.add(*split_modes({"a": (np.ones(2), "sum")}, "metrics"), 1)


@pytest.mark.parametrize("residency", ["host", "device"])
def test_metrics_never_see_padding_in_either_residency(residency):
    @nitro.experiment
    class Modes(Toy):
        def metrics(self, logits, *, y):
            correct = (logits.argmax(-1) == y).astype(jnp.float32)
            return {
                "acc": correct.mean(),
                "counted": (correct.sum(), jnp.float32(y.shape[0])),
                "labels": (y, "concat"),
                "seen": (jnp.float32(y.shape[0]), "sum"),
                "worst": (-correct.min(), "max"),
            }

        def metrics_residency(self, hook):
            return residency

        def finalize_metrics(self, acc, split):
            acc["labels_mean"] = float(np.mean(acc.pop("labels")))
            return acc

    n = nitro.Nitro(Modes(), progress=False)
    result = n.validate()
    logits = n.predict({"x": X[:20]})
    correct = logits.argmax(-1) == Y[:20]
    assert result["val_seen"] == 20
    assert result["val_acc"] == pytest.approx(correct.mean())
    assert result["val_counted"] == pytest.approx(correct.mean())
    assert result["val_labels_mean"] == pytest.approx(Y[:20].mean())
    assert "val_labels" not in result


def test_editing_a_device_metric_recompiles_its_program_only(fresh_cache):
    def make(factor):
        @nitro.experiment
        class DeviceMetric(Toy):
            def metrics(self, logits, *, y):
                return {"acc": (logits.argmax(-1) == y).mean() * factor}

            def metrics_residency(self, hook):
                return "device"

        return DeviceMetric

    nitro.Nitro(make(1.0)(), progress=False).validate()
    before = nitro.cache_stats().misses
    nitro.Nitro(make(2.0)(), progress=False).validate()
    new = [r.program for r in nitro.explain_compiles()[before:]]
    assert new == ["device metrics", "device metrics"]  # full width and the final short batch


def test_a_bad_residency_is_a_setup_error():
    @nitro.experiment
    class Odd(Toy):
        def metrics_residency(self, hook):
            return "gpu"

    with pytest.raises(
        nitro.SetupError, match=r"metrics_residency\('train_metrics'\) returned 'gpu'"
    ):
        nitro.Nitro(Odd())


def test_without_a_metrics_hook_val_loss_comes_from_loss():
    n = nitro.Nitro(Toy(), progress=False)
    assert set(n.validate()) == {"val_loss"}
    assert "metrics: none; validation reports val_loss through loss" in str(n.binding_report())


# -------------------------------------------------------------------------- binding report


def test_binding_report_shows_splits_hooks_keywords_schedules_and_optimizer():
    n = nitro.Nitro(Toy(), seed=3, schedules={"learning_rate": 1e-2}, progress=False)
    report = str(n.binding_report())
    # "auto" builds batches inline when one builds in microseconds, else on workers: which,
    # depends on how busy the machine is; the report names the choice either way
    assert re.search(
        r"train: 4 batches x 16; 64 of 64 samples; prefetch "
        r"(inline: a batch builds in|fanout: 2 workers)",
        report,
    )
    assert (
        "val: 2 batches x 16; 20 of 20 samples; final batch of 4 padded to 16 then sliced" in report
    )
    assert "forward(x) <- train: x; val: x; test: x" in report
    assert "seed = 3  [Nitro keyword]" in report
    assert "learning_rate -> opt.learning_rate (constant)  [Nitro keyword]" in report
    assert "horizon: 8 optimizer steps" in report
    assert "optax.adam(learning_rate=0.001)  [framework default]" in report
    assert "learning_rate = 0.01 at step 0 (scheduled, fed per step)" in report
    assert "b1 = 0.9 (constant, fed per step)" in report
    assert "parameters: 66" in report
    assert "scale: float = 1" in report
    assert "<table>" in n.binding_report()._repr_html_()


def test_binding_report_counts_dropped_samples():
    @nitro.experiment
    class Uneven(Toy):
        def build_data(self):
            return {"train": nitro.data.ArrayLoader({"x": X[:60], "y": Y[:60]}, 16)}

    report = str(nitro.Nitro(Uneven(), progress=False).binding_report())
    assert "train: 3 batches x 16; 48 of 60 samples; 12 dropped by drop_last" in report


def test_finalize_metrics_gets_each_evaluated_split_and_the_epochs_train_metrics():
    seen = []

    @nitro.experiment
    class Finalized(Toy):
        def metrics(self, logits, *, y):
            return {"acc": (logits.argmax(-1) == y).mean()}

        def train_metrics(self, logits, *, y):
            return {"train_acc": (logits.argmax(-1) == y).mean()}

        def finalize_metrics(self, acc, split):
            seen.append((split, sorted(acc)))
            return {**acc, "finalized": 1.0}

    n = nitro.Nitro(Finalized(max_epochs=1), progress=False)
    n.train()
    n.evaluate(split="test")
    assert seen == [
        ("train", ["train_acc"]),
        ("val", ["acc", "loss"]),
        ("test", ["acc", "loss"]),
    ]
    row = n.history().iloc[-1]
    assert row["finalized"] == 1.0 and row["val_finalized"] == 1.0  # train's unprefixed
