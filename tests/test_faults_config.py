"""Faults in configuration: field values of the wrong type, hyperparameters out of their range,
functions as GraphConst values, and a compilation cache directory that cannot be used or holds
broken entries."""

import functools
import math
import os
import pathlib
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
from gan_toys import GAN
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
# hyperparameters out of their range: refused at setup, before anything compiles


@nitro.experiment
class TwoGroups(Toy):
    def param_group(self, path):
        return "body" if path.startswith("hidden") else "head"


@nitro.experiment
class InfiniteRateMethod(Toy):
    def learning_rate(self):
        return math.inf


@nitro.experiment
class NaNRateField(Toy):
    learning_rate: float = math.nan


@nitro.experiment
class BadGANOptimizer(GAN):
    def optimizer(self):
        return {"gen": optax.adam, "disc": functools.partial(optax.adam, b2=1.0)}


INF, NAN = math.inf, math.nan
OUT_OF_RANGE = [
    # (what is built, the error, what the message says)
    (
        lambda: nitro.Nitro(Toy(), sam=NAN),
        nitro.SetupError,
        "sam must be a finite number > 0, got nan; e.g. sam=0.05 [Nitro keyword]",
    ),
    (
        lambda: nitro.Nitro(Toy(), learning_rate=INF),
        nitro.SetupError,
        "learning_rate must be a finite number > 0, got inf (to start it at 0, schedule it: "
        "schedules={'learning_rate': ...}); e.g. learning_rate=0.001 [Nitro keyword]",
    ),
    (
        lambda: nitro.Nitro(InfiniteRateMethod()),
        nitro.SetupError,
        "learning_rate must be a finite number > 0, got inf",
    ),
    (
        lambda: nitro.Nitro(NaNRateField()),
        nitro.SetupError,
        "learning_rate must be a finite number > 0, got nan",
    ),
    (
        lambda: nitro.Nitro(Toy(), gradient_clip_norm=INF),
        nitro.SetupError,
        "gradient_clip_norm must be a finite number > 0, got inf (None turns clipping off); "
        "e.g. gradient_clip_norm=1.0 [Nitro keyword]",
    ),
    (
        lambda: nitro.Nitro(Toy(), weight_decay=NAN),
        nitro.SetupError,
        "weight_decay must be a finite number >= 0, got nan (None turns weight decay off); "
        "e.g. weight_decay=0.0001 [Nitro keyword]",
    ),
    (
        lambda: nitro.Nitro(TwoGroups(), group_lr={"body": INF}),
        nitro.SetupError,
        "group_lr['body'] must be a finite number >= 0, got inf (a ratio of the learning rate; "
        "0 freezes the group); e.g. group_lr={'body': 0.1} [Nitro keyword]",
    ),
    (
        lambda: nitro.Nitro(Toy(), optimizer=functools.partial(optax.adam, b1=1.5)),
        nitro.SetupError,
        "b1 of the optimizer optax.adam(b1=1.5)(learning_rate=0.001) must be a finite number in "
        "[0, 1), got 1.5; e.g. optimizer=functools.partial(optax.adam, b1=0.9)",
    ),
    (
        lambda: nitro.Nitro(Toy(), optimizer=functools.partial(optax.adam, eps=-1.0, b2=0.99)),
        nitro.SetupError,
        "eps of the optimizer optax.adam(eps=-1.0, b2=0.99)(learning_rate=0.001) must be a "
        "finite number >= 0, got -1.0; e.g. optimizer=functools.partial(optax.adam, eps=1e-08, "
        "b2=0.99)",
    ),
    (
        lambda: nitro.Nitro(Toy(), optimizer=functools.partial(optax.sgd, momentum=1.0)),
        nitro.SetupError,
        "momentum of the optimizer optax.sgd(momentum=1.0)(learning_rate=0.001) must be a finite "
        "number in [0, 1), got 1.0",
    ),
    (
        lambda: nitro.Nitro(
            TwoGroups(), optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=0.1, b2=NAN)
        ),
        nitro.SetupError,
        "b2 of the optimizer inject_hyperparams(b1, b2, eps, eps_root, learning_rate) must be a "
        "finite number in [0, 1), got nan; e.g. build the transformation with b2=0.999",
    ),
    (
        lambda: nitro.Nitro(BadGANOptimizer()),
        nitro.SetupError,
        "the optimizer of model 'disc': b2 of the optimizer optax.adam(b2=1.0)",
    ),
    (
        lambda: nitro.Nitro(Toy(), sam=nitro.ASAM(eta=-1)),
        nitro.SetupError,
        "ASAM's eta must be a finite number >= 0, got -1; e.g. sam=nitro.ASAM(eta=0.01)",
    ),
    (
        lambda: nitro.Nitro(Toy(), sam=nitro.SAM(rho=INF)),
        nitro.SetupError,
        "SAM's rho must be a finite number > 0, got inf; e.g. sam=nitro.SAM(rho=0.05)",
    ),
    (
        lambda: nitro.Nitro(Toy(), ema=nitro.EMA(decay=NAN)),
        nitro.SetupError,
        "ema decay must be a finite number in (0, 1), got nan; e.g. ema=0.999",
    ),
    (
        lambda: nitro.Nitro(Toy(), early_stop=nitro.EarlyStopping(min_delta=NAN)),
        nitro.SetupError,
        "EarlyStopping's min_delta must be a finite number >= 0, got nan; e.g. "
        "nitro.EarlyStopping(min_delta=1e-4)",
    ),
    (
        lambda: nitro.Nitro(Toy(), schedules={"b1": 1.5}),
        nitro.ScheduleError,
        "schedule 'b1' gives 1.5 at step 0; b1 must be a finite number in [0, 1), e.g. 0.9",
    ),
    (
        lambda: nitro.Nitro(TwoGroups(), schedules={"head/eps": lambda step: -1e-8}),
        nitro.ScheduleError,
        "schedule 'head/eps' gives -1e-08 at step 0; eps must be a finite number >= 0",
    ),
    (
        # 8 optimizer steps: fine at step 0, inf at the horizon's last
        lambda: nitro.Nitro(
            Toy(), schedules={"learning_rate": lambda step: 1e-3 if step < 7 else INF}
        ),
        nitro.ScheduleError,
        "schedule 'learning_rate' gives inf at step 7; learning_rate must be a finite number >= 0",
    ),
]


@pytest.mark.parametrize(
    "build, error, message",
    OUT_OF_RANGE,
    ids=[
        "sam-nan",
        "learning-rate-inf",
        "learning-rate-method",
        "learning-rate-field",
        "clip-inf",
        "weight-decay-nan",
        "group-lr-inf",
        "adam-b1",
        "adam-eps",
        "sgd-momentum",
        "injected-b2",
        "manual-optimizer",
        "asam-eta",
        "sam-rho",
        "ema-decay",
        "early-stop-min-delta",
        "schedule-b1",
        "group-schedule-eps",
        "schedule-inf-at-horizon",
    ],
)
def test_a_hyperparameter_out_of_its_range_is_refused_at_setup_naming_it(
    build, error, message, tmp_path, fresh_cache
):
    with pytest.raises(error) as raised:
        build()
    assert message in str(raised.value)
    # refused before anything compiled, trained or was written
    assert (nitro.cache_stats().misses, nitro.cache_stats().entries) == (0, 0)
    assert not (tmp_path / "runs").exists()


def test_hyperparameters_at_the_edges_of_their_ranges_are_accepted():
    n = nitro.Nitro(
        TwoGroups(max_epochs=1),
        optimizer=functools.partial(optax.sgd, momentum=0.0),
        group_lr={"body": 0.0},
        weight_decay=0.0,
        sam=nitro.ASAM(eta=0.0),
        early_stop=nitro.EarlyStopping(metric="loss", min_delta=0.0),
        schedules={"learning_rate": lambda step: 1e-2 * step / 8},  # a warmup from 0
        progress=False,
    )
    n.train()
    assert n.step == 4 and n.stop_reason == "completed"
    # a constant that a schedule replaces is never fed: the schedule's values are checked
    scheduled = nitro.Nitro(
        Toy(max_epochs=1),
        optimizer=functools.partial(optax.adam, b1=1.5),
        schedules={"b1": 0.8},
        progress=False,
    )
    assert scheduled.train().hyperparameters["b1"] == pytest.approx(0.8)


# ---------------------------------------------------------------------------------------------
# resuming a checkpoint saved with another optimizer


def _files(root) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.mark.parametrize(
    "keywords, now",
    [
        (dict(optimizer=optax.sgd), "optax.sgd(learning_rate=0.001)"),
        (
            dict(optimizer=functools.partial(optax.sgd, momentum=0.9)),
            "optax.sgd(momentum=0.9)(learning_rate=0.001)",
        ),
        (dict(gradient_clip_norm=1.0), "optax.adam(learning_rate=0.001), gradient_clip_norm=1.0"),
    ],
    ids=["sgd", "sgd-momentum", "adam-clipped"],
)
def test_resuming_with_another_optimizer_is_refused_naming_both_and_the_fixes(
    keywords, now, tmp_path, fresh_cache
):
    import orbax.checkpoint as ocp

    first = nitro.Nitro(Toy(max_epochs=1), progress=False)
    first.train().wait()  # its save is written in the background: plain orbax reads it after
    run_dir = pathlib.Path(first.run_dir)
    manager = ocp.CheckpointManager(run_dir / "checkpoints")
    step = manager.latest_step()
    assert step is not None
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    manager.close()
    assert meta["optimizer"] == "optax.adam(learning_rate=0.001)"  # the checkpoint records it
    before = _files(tmp_path / "runs")
    nitro.cache_reset()

    with pytest.raises(nitro.SetupError) as raised:
        nitro.Nitro(Toy(max_epochs=2), resume=str(run_dir), progress=False, **keywords)
    message = str(raised.value)
    assert message.startswith(
        "cannot resume: the checkpoint's optimizer state does not fit this run's optimizer, so "
        "the checkpoint was saved with another optimizer:\n"
        "  the checkpoint's: optax.adam(learning_rate=0.001)\n"
        f"  this run's:       {now}\n"
        "Resume with the checkpoint's optimizer"
    )
    saved = str(run_dir / "checkpoints" / str(step))
    assert (
        f"start a new run from its weights with this optimizer: Nitro(Toy(...), weights={saved!r})"
        in message
    )
    assert "GraphConst" not in message
    # nothing compiled, trained or written
    assert nitro.cache_stats().misses == 0
    assert _files(tmp_path / "runs") == before

    # both fixes work: the checkpoint's optimizer resumes; weights= starts anew with this one
    resumed = nitro.Nitro(Toy(max_epochs=2), resume=str(run_dir), progress=False)
    assert (resumed.step, resumed.train().step) == (4, 8)
    fresh = nitro.Nitro(Toy(max_epochs=1), weights=saved, progress=False, **keywords)
    assert (fresh.step, fresh.train().step) == (0, 4)
    assert fresh.run_dir != first.run_dir


def _keyword_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "run keywords that differ" in str(w.message)]


@nitro.experiment
class GroupedToy(Toy):
    def param_group(self, path):
        return "body" if path.startswith("hidden") else "head"


TRAINED = dict(
    accum=2,
    sam=nitro.ASAM(rho=0.5, eta=0.01),
    ema=0.9,
    gradient_clip_norm=1.0,
    weight_decay=1e-4,
    group_lr={"body": 0.5},
)


def test_resuming_with_the_same_training_keywords_says_nothing_and_records_them(tmp_path, recwarn):
    import orbax.checkpoint as ocp

    first = nitro.Nitro(GroupedToy(max_epochs=1), progress=False, **TRAINED)
    first.train().wait()
    manager = ocp.CheckpointManager(pathlib.Path(first.run_dir) / "checkpoints")
    step = manager.latest_step()
    assert step is not None
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    manager.close()
    assert meta["training"] == {
        "optimizer": "optax.adam(learning_rate=0.001)",
        "accum": 2,
        "sam": "nitro.ASAM(rho=0.5, eta=0.01)",
        "ema": "nitro.EMA(decay=0.9, warmup=True, evaluate=False)",
        "gradient_clip_norm": 1.0,
        "weight_decay": 1e-4,
        "decay_to": "zero",
        "param_groups": {"body": 0.5, "head": None},
        "precision": "float32",
    }
    resumed = nitro.Nitro(GroupedToy(max_epochs=2), resume=first.run_dir, progress=False, **TRAINED)
    assert _keyword_warnings(recwarn) == []
    assert (resumed.step, resumed.train().step) == (2, 4)  # 4 batches an epoch, 2 per step


@pytest.mark.parametrize(
    "changed, line, fix",
    [
        (
            dict(accum=1),
            "  accum: the checkpoint's 2, this run's 1",
            "accum=2",
        ),
        (
            dict(sam=None),
            "  sam: the checkpoint's nitro.ASAM(rho=0.5, eta=0.01), this run's None",
            "sam=nitro.ASAM(rho=0.5, eta=0.01)",
        ),
        (
            dict(sam=0.05),
            "  sam: the checkpoint's nitro.ASAM(rho=0.5, eta=0.01), this run's nitro.SAM(rho=0.05)",
            "sam=nitro.ASAM(rho=0.5, eta=0.01)",
        ),
        (
            dict(ema=nitro.EMA(0.99)),
            "  ema: the checkpoint's nitro.EMA(decay=0.9, warmup=True, evaluate=False), this "
            "run's nitro.EMA(decay=0.99, warmup=True, evaluate=False)",
            "ema=nitro.EMA(decay=0.9, warmup=True, evaluate=False)",
        ),
        (
            dict(learning_rate=1e-2),
            "  optimizer: the checkpoint's optax.adam(learning_rate=0.001), this run's "
            "optax.adam(learning_rate=0.01)",
            "the same optimizer=, learning_rate=, group_lr= and param_group method",
        ),
        (
            dict(gradient_clip_norm=2.0),
            "  gradient_clip_norm: the checkpoint's 1.0, this run's 2.0",
            "gradient_clip_norm=1.0",
        ),
        (
            dict(weight_decay=1e-3),
            "  weight_decay: the checkpoint's 0.0001, this run's 0.001",
            "weight_decay=0.0001",
        ),
        (
            dict(group_lr={"body": 0.1}),
            "  param_groups: the checkpoint's {'body': 0.5, 'head': None}, this run's "
            "{'body': 0.1, 'head': None}",
            "the same optimizer=, learning_rate=, group_lr= and param_group method",
        ),
    ],
    ids=["accum", "sam-off", "sam-kind", "ema", "learning-rate", "clip", "decay", "group-lr"],
)
def test_resuming_with_other_training_keywords_continues_with_a_warning_naming_each(
    changed, line, fix, tmp_path
):
    first = nitro.Nitro(GroupedToy(max_epochs=1), progress=False, **TRAINED)
    first.train().wait()
    keywords = {**TRAINED, **changed}
    with pytest.warns(RuntimeWarning, match="run keywords that differ") as record:
        resumed = nitro.Nitro(
            GroupedToy(max_epochs=2), resume=first.run_dir, progress=False, **keywords
        )
    (message,) = _keyword_warnings(record)
    assert message == (
        "resuming with run keywords that differ from the checkpoint's; the run continues with "
        f"this run's:\n{line}\nTo continue as the checkpoint was trained, resume with its "
        f"keywords: {fix}"
    )
    assert record[0].filename == __file__  # it points at the line that resumed
    # the run goes on with this run's keywords, from the checkpoint's step
    assert resumed.step == 2 and resumed.run_id == first.run_id
    per_epoch = 4 // keywords["accum"]
    assert resumed.train().step == 2 + per_epoch


def test_resuming_with_several_other_keywords_names_each_difference(tmp_path):
    first = nitro.Nitro(GroupedToy(max_epochs=1), progress=False, **TRAINED)
    first.train().wait()
    with pytest.warns(RuntimeWarning) as record:
        nitro.Nitro(
            GroupedToy(max_epochs=2),
            resume="auto",
            progress=False,
            **{**TRAINED, "accum": 1, "sam": None, "ema": None},
        )
    (message,) = _keyword_warnings(record)
    assert "  accum: the checkpoint's 2, this run's 1\n" in message
    assert "  sam: the checkpoint's nitro.ASAM(rho=0.5, eta=0.01), this run's None\n" in message
    assert "  ema: the checkpoint's nitro.EMA(decay=0.9, warmup=True, evaluate=False), " in message
    assert message.endswith(
        "resume with its keywords: accum=2, sam=nitro.ASAM(rho=0.5, eta=0.01), "
        "ema=nitro.EMA(decay=0.9, warmup=True, evaluate=False)"
    )


def test_resuming_mid_epoch_with_another_accum_groups_the_rest_of_the_epoch_by_it(tmp_path):
    class Stopper:
        handle: nitro.Nitro | None = None

        def step(self, step, loss):  # the reporter's step event, on the run's thread
            if step == 5 and self.handle is not None:
                self.handle.stop()

    stopper = Stopper()
    small = dict(batch_size=4, max_epochs=2, with_val=False)  # 16 batches an epoch
    first = nitro.Nitro(Toy(**small), steps_per_dispatch=1, progress=stopper)
    stopper.handle = first
    first.train().wait()
    position = first.step  # stopped in the first epoch, a few steps after the fifth
    assert first.stop_reason == "requested" and 0 < position < 16
    accum = next(k for k in (2, 4, 8, 16) if position % k)  # not whole steps of the stop
    with pytest.warns(RuntimeWarning, match=f"accum: the checkpoint's 1, this run's {accum}"):
        resumed = nitro.Nitro(Toy(**small), resume=first.run_dir, accum=accum, progress=False)
    resumed.train()
    # the epoch goes on at its next batch, in steps of `accum` (the last takes what is left)
    rest = -(-(16 - position) // accum)
    assert resumed.history()["step"].tolist() == [position + rest, position + rest + 16 // accum]


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
    assert "Error writing persistent compilation cache entry" in out.stderr, out.stderr
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert all(0 < size < 3000 for name, size in sizes.items() if name.endswith("-cache")), (
        sizes,
        out.stderr,
    )
    assert all(name.endswith("-cache") for name in sizes), (sizes, out.stderr)

    out = _run(TRAIN, str(tmp_path))  # a later process reads and completes the cache
    assert "Error reading persistent compilation cache" not in out.stderr
    assert max(e.stat().st_size for e in _entries(tmp_path)) > 3000
