"""The run state: the running guard, weights taken at a step boundary, the compile cache under
threads, and the event path's isolation of reporters."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import threading
import time
import warnings
from collections.abc import Mapping, MutableMapping

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from toys import TinyMLP, Toy, ToyWithMetrics, X, loaders

import nitro
from nitro.runner import RunControl, RunGuard, at_step_boundary

ENGINE = pathlib.Path(nitro.__file__).parent
WAIT = 300  # seconds: a bound for conditions, reached only if the code is wrong


def background_run(**fields) -> nitro.Nitro:
    n = nitro.Nitro(Toy(max_epochs=100_000, with_val=False, **fields), progress=False)
    n.train(background=True)
    deadline = time.monotonic() + WAIT
    while n.step < 5:  # past the compile: the loop is stepping
        assert time.monotonic() < deadline, "the background run did not start"
        time.sleep(0.01)
    return n


# ---------------------------------------------------------------------------------------------
# the running guard


@pytest.mark.parametrize(
    "call",
    [
        lambda n: n.train(),
        lambda n: n.train(epochs=1, background=True),
        lambda n: n.validate(),
        lambda n: n.evaluate(split="test"),
        lambda n: n.predict({"x": X[:3]}),
    ],
    ids=["train", "train-background", "validate", "evaluate", "predict"],
)
def test_every_entry_point_answers_at_once_while_the_handle_trains(call):
    n = background_run()
    try:
        with pytest.raises(nitro.RunningError) as raised:
            call(n)  # refused while the run goes on: it never waits for the run to end
        message = str(raised.value)
        assert "is training in the background" in message
        assert "n.stop()" in message and "n.wait()" in message and "%nitro stop" in message
        assert n.running  # the refused call left the run alone
    finally:
        n.stop().wait()
    assert n.stop_reason == "requested"
    assert set(n.evaluate(split="test")) == {"test_loss"}  # once stopped, it answers again


def test_a_refused_call_says_what_it_cannot_start_and_what_the_handle_is_doing():
    n = background_run()
    try:
        with pytest.raises(nitro.RunningError) as training:
            n.train()
        with pytest.raises(nitro.RunningError) as validating:
            n.validate()
    finally:
        n.stop().wait()
    running = (
        "this Toy handle is training in the background. n.stop() stops it after the current "
        "step and n.wait() waits for it to end (in a notebook: %nitro stop or %nitro wait)"
    )
    assert str(training.value) == f"cannot start training: {running}"
    assert str(validating.value) == f"cannot start evaluating val: {running}"


def test_weights_from_a_training_handle_are_taken_at_the_next_step_boundary():
    n = background_run()
    try:
        forked = nitro.Nitro(Toy(), weights=n, progress=False)
        step = int(forked.weights_origin.rpartition(", step ")[2])
        assert 5 <= step <= n.step
        model = n.model  # a copy of the current model, also taken between two steps
        assert isinstance(model, nnx.Module)
        assert n.running
    finally:
        n.stop().wait()
    assert n.stop_reason == "requested" and n.step > step
    outputs = forked.predict({"x": X[:4]})
    assert outputs.shape == (4, 2) and np.isfinite(outputs).all()
    # the copy is its own: training the fork leaves the source's weights alone
    before = [np.asarray(a) for a in n.state.variables.params]
    forked.train(epochs=1)
    assert all(np.array_equal(a, b) for a, b in zip(before, n.state.variables.params, strict=True))


def test_weights_taken_from_fused_calls_in_training_are_those_of_the_step_they_name():
    # fused calls of a small model keep nothing until the loop reads them back: the copy
    # waits for the call in flight, so it holds the weights of the step its origin names
    n = nitro.Nitro(Toy(max_epochs=100_000, with_val=False), steps_per_dispatch=4, progress=False)
    n.train(background=True)
    try:
        deadline = time.monotonic() + WAIT
        while n.step < 8:
            assert time.monotonic() < deadline, "the background run did not start"
            time.sleep(0.01)
        forked = nitro.Nitro(Toy(), weights=n, progress=False)
    finally:
        n.stop().wait()
    step = int(forked.weights_origin.rpartition(", step ")[2])
    assert step % 4 == 0 and 8 <= step <= n.step
    again = nitro.Nitro(Toy(max_epochs=100_000, with_val=False), progress=False)
    again.train(steps=step)
    for a, b in zip(params(forked), params(again), strict=True):
        np.testing.assert_array_equal(a, b)


def params(n: nitro.Nitro) -> list[np.ndarray]:
    return [np.asarray(a) for a in n.state.variables.params]


def test_weights_and_model_of_an_idle_handle_are_copies():
    n = nitro.Nitro(Toy(max_epochs=1), progress=False)
    n.train()
    forked = nitro.Nitro(Toy(), weights=n, progress=False)
    assert forked.weights_origin == "the weights of a Toy run at epoch 1, step 4"
    mine = [np.asarray(a) for a in n.state.variables.params]
    theirs = [np.asarray(a) for a in forked.state.variables.params]
    assert all(np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True))
    before = np.asarray(n.model.out.bias[...])
    model = n.model
    model.out.bias[...] = model.out.bias[...] + 1.0
    assert np.array_equal(np.asarray(n.model.out.bias[...]), before)


def _request_at_step_boundary(guard, control) -> tuple[threading.Thread, dict]:
    """`at_step_boundary` on a thread of its own, once the request is registered."""
    answer: dict = {}

    def request():
        answer["value"] = at_step_boundary(
            guard, control, lambda: threading.current_thread().name, "copying its weights"
        )

    thread = threading.Thread(target=request, name="requester", daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not control.copies_pending:
        assert time.monotonic() < deadline, "the request was never registered"
        time.sleep(0.001)
    return thread, answer


def test_a_request_during_training_runs_on_the_training_thread_at_its_step_boundary():
    guard, control = RunGuard(), RunControl()
    guard.claim("training", background=True)
    thread, answer = _request_at_step_boundary(guard, control)
    # what the loop does at a step boundary, on its thread
    training = threading.Thread(target=control.serve_copies, name="training")
    training.start()
    training.join(WAIT)
    thread.join(WAIT)
    assert not thread.is_alive() and answer == {"value": "training"}
    assert guard.activity == "training"  # served without taking the handle


def test_a_request_the_run_ended_without_serving_runs_once_the_handle_is_free():
    guard, control = RunGuard(), RunControl()
    guard.claim("training", background=True)
    thread, answer = _request_at_step_boundary(guard, control)
    guard.release()  # the run ends after its last step boundary
    thread.join(WAIT)
    assert not thread.is_alive() and answer == {"value": "requester"}
    assert guard.activity is None


# ---------------------------------------------------------------------------------------------
# the compile cache under threads

TRACING = threading.Event()  # set when a trace of SlowToTrace's forward starts
TRACE_MAY_END = threading.Event()  # cleared by a test that holds the trace until it is done
TRACE_MAY_END.set()
TRACE_SECONDS = 2.0


@nitro.experiment
class SlowToTrace:
    """A forward that takes seconds to trace: a compile that takes seconds."""

    width: nitro.GraphConst[int] = 8
    max_epochs: int = 1

    def build_data(self):
        splits = loaders()
        del splits["val"]
        return splits

    def build_model(self, rngs):
        return TinyMLP(5, self.width, 2, rngs=rngs)

    def forward(self, model, *, x):
        TRACING.set()
        time.sleep(TRACE_SECONDS)  # runs at trace time only
        TRACE_MAY_END.wait(WAIT)
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_cache_stats_answer_at_once_while_another_thread_compiles(fresh_cache):
    TRACING.clear()
    TRACE_MAY_END.clear()  # the compile lasts until the questions are answered
    n = nitro.Nitro(SlowToTrace(width=9), progress=False)
    try:
        n.train(background=True)
        assert TRACING.wait(WAIT), "the compile did not start"
        for _ in range(5):
            stats = nitro.cache_stats()
            nitro.explain_compiles()
        # answered while the compile went on (it had not waited for the compile's lock)
        assert n.running and stats.misses == 0
    finally:
        TRACE_MAY_END.set()
    n.wait()
    assert nitro.cache_stats().misses == 1


def test_two_handles_that_need_the_same_new_program_compile_it_once(fresh_cache):
    handles = [nitro.Nitro(SlowToTrace(width=11), progress=False) for _ in range(2)]
    for n in handles:
        n.train(background=True)
    for n in handles:
        n.wait()
    stats = nitro.cache_stats()
    assert [n.stop_reason for n in handles] == ["completed", "completed"]
    assert stats.misses == 1 and stats.entries == 1
    assert [p["calls"] for p in stats.programs] == [8]  # 4 steps each, one program
    assert stats.hits == 7  # every call but the one the program was compiled for


def test_hit_counts_are_exact_when_threads_call_programs_at_once(fresh_cache):
    handles = [nitro.Nitro(Toy(), progress=False) for _ in range(4)]
    handles[0].predict({"x": X[:16]})  # compile once
    calls_each = 200

    def predict_many(n):
        for _ in range(calls_each):
            n.predict({"x": X[:16]})

    threads = [threading.Thread(target=predict_many, args=(n,)) for n in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = nitro.cache_stats()
    assert stats.misses == 1
    assert stats.programs[0]["calls"] == 1 + 4 * calls_each
    assert stats.hits == 4 * calls_each


# ---------------------------------------------------------------------------------------------
# the event path


class Raises:
    def __init__(self, where: str):
        self.where = where
        self.calls: list[str] = []

    def __getattr__(self, name):
        if name not in nitro.events.EVENT_NAMES:
            raise AttributeError(name)

        def method(*args):
            self.calls.append(name)
            if name == self.where:
                raise ValueError(f"broken {name}")

        return method


@pytest.mark.parametrize(
    "where", ["start_run", "start_epoch", "step", "phase", "end_epoch", "end_run"]
)
def test_a_reporter_that_raises_is_switched_off_with_one_warning_and_training_goes_on(where):
    reporter = Raises(where)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = nitro.Nitro(ToyWithMetrics(max_epochs=2), progress=reporter)  # phases from setup on
        n.train()
    mine = [str(w.message) for w in caught if "progress reporter Raises" in str(w.message)]
    warning = (
        f"progress reporter Raises raised ValueError in {where}(): broken {where}; it is "
        f"switched off for the rest of this run, which goes on"
    )
    # phase: once while the handle sets up, and once in the run, which switches it back on
    assert mine == [warning] * (2 if where == "phase" else 1), [str(w.message) for w in caught]
    assert (n.epoch, n.step, n.stop_reason, n.phase) == (2, 8, "completed", "done")
    assert reporter.calls[-1] == where  # nothing reached it after it raised
    assert len(n.history()) == 2


def test_a_reporter_needs_only_the_methods_it_uses():
    rows = []

    class Rows:
        def end_epoch(self, row):
            rows.append(dict(row))

    n = nitro.Nitro(ToyWithMetrics(max_epochs=2), progress=Rows())
    n.train()
    assert [r["epoch"] for r in rows] == [1, 2]
    assert {"loss", "val_loss", "val_acc"} <= set(rows[-1])


def test_a_progress_setting_that_is_no_reporter_is_refused():
    with pytest.raises(ValueError, match="progress=42 is not a progress setting"):
        nitro.Nitro(Toy(), progress=42)


def test_phases_reach_reporters_in_order():
    phases = []

    class Phases:
        def phase(self, phase):
            phases.append(phase)

    n = nitro.Nitro(ToyWithMetrics(max_epochs=1), progress=Phases())
    n.train()
    n.evaluate(split="test")
    assert phases == [
        "building data",
        "building model",
        "routing",
        "ready",
        "training",
        "validating",
        "checkpointing",
        "done",
        "evaluating test",
        "done",
    ]


# ---------------------------------------------------------------------------------------------
# the state and the setup


def test_the_train_state_holds_counters_history_and_arrays_and_the_setup_is_frozen():
    n = nitro.Nitro(ToyWithMetrics(max_epochs=2), seed=3, progress=False)
    n.train()
    state, setup = n.state, n.setup
    assert (state.step, state.epoch, state.position, state.seed) == (8, 2, 0, 3)
    assert [row["epoch"] for row in state.history] == [1, 2]
    assert len(state.variables.params) == len(setup.model.leaf_paths["parameter"]) == 4
    assert setup.splits["train"].batches == 4 and setup.splits["val"].width == 16
    assert setup.splits["train"].hook_fields == {"forward": ("x",), "loss": ("y",)}
    params = jax.tree.unflatten(setup.model.params_def, state.variables.params)
    assert params["out"]["kernel"][...].shape == (8, 2)
    with pytest.raises(AttributeError):
        setup.max_epochs = 5


HELD_AS_GIVEN = {("SplitSetup", "source")}  # the user's data source (a list of batches, say)


def records(value) -> bool:
    """Nitro's own records are looked into; other objects (a flax GraphDef, an optax
    transformation, a function) are held as they are."""
    return (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and type(value).__module__.startswith("nitro.")
    )


def mutable_parts(value, path: str = "setup", seen: set | None = None) -> list[str]:
    """Every list, dict or set and every mutable record reachable from `value` through
    Nitro's records, mappings and tuples."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, (list, dict, set, bytearray)) or isinstance(value, MutableMapping):
        return [f"{path}: {type(value).__name__}"]
    found = []
    if records(value):
        if not type(value).__dataclass_params__.frozen:
            found.append(f"{path}: a mutable {type(value).__name__}")
        for field in dataclasses.fields(value):
            if (type(value).__name__, field.name) not in HELD_AS_GIVEN:
                found += mutable_parts(getattr(value, field.name), f"{path}.{field.name}", seen)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            found += mutable_parts(item, f"{path}[{key!r}]", seen)
    elif isinstance(value, (tuple, frozenset)):
        for i, item in enumerate(value):
            found += mutable_parts(item, f"{path}[{i}]", seen)
    return found


def contents(value, seen: set | None = None) -> list:
    """What `mutable_parts` walks, as (type, identity) pairs: equal lists, same record."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    out = [(type(value).__name__, id(value))]
    if records(value):
        for field in dataclasses.fields(value):
            out += contents(getattr(value, field.name), seen)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            out += [key, *contents(item, seen)]
    elif isinstance(value, (tuple, frozenset)):
        for item in value:
            out += contents(item, seen)
    return out


def test_the_setup_and_everything_in_it_is_immutable_after_a_run():
    schedules = {"learning_rate": lambda step: 1e-2}
    loggers = [nitro.loggers.JSONLinesLogger()]
    n = nitro.Nitro(
        ToyWithMetrics(max_epochs=2), schedules=schedules, logger=loggers, progress=False
    )
    n.train()
    n.validate()
    assert mutable_parts(n.setup) == []
    assert n.given_keywords["schedules"] == schedules  # read-only, and equal to what was given
    schedules["learning_rate"] = 5.0
    assert n.given_keywords["schedules"]["learning_rate"] is not schedules["learning_rate"]
    with pytest.raises(TypeError):
        n.setup.splits["val"] = n.setup.splits["train"]
    with pytest.raises(TypeError):
        n.setup.keywords["seed"] = n.setup.keywords["max_epochs"]


def test_set_device_and_auto_dispatch_take_effect_and_leave_the_setup_unchanged(monkeypatch):
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", float("inf"))  # "auto" decides in this run
    n = nitro.Nitro(Toy(max_epochs=3, with_val=False), progress=False)
    setup, before = n.setup, contents(n.setup)
    n.set_device(scale=0.5)
    n.train()
    assert n.setup is setup and contents(n.setup) == before
    assert n.device_value("scale") == 0.5 and n.experiment.scale == 0.5
    assert "scale: float = 0.5" in str(n.binding_report())
    assert not n.dispatch.probing and n.dispatch.reason.startswith("auto: a step took")
    assert f"steps per dispatch: {n.dispatch.describe()}" in str(n.binding_report())
    # a handle built from these weights continues the measured choice, frozen as it was
    forked = nitro.Nitro(Toy(max_epochs=3, with_val=False), weights=n, progress=False)
    assert forked.dispatch == n.dispatch
    again = nitro.Nitro(Toy(), steps_per_dispatch=n.dispatch, progress=False)
    assert again.dispatch == n.dispatch
    fixed = nitro.Nitro(Toy(), weights=n, steps_per_dispatch=2, progress=False)
    assert (fixed.dispatch.steps, fixed.dispatch.reason) == (2, "set by steps_per_dispatch")


def test_restoring_the_best_weights_swaps_in_a_new_state_and_leaves_the_old_one_untouched():
    n = nitro.Nitro(ToyWithMetrics(max_epochs=3), progress=False)
    n.train()
    old = n.state
    params, history = list(old.variables.params), list(old.history)
    n.restore_best()
    assert n.state is not old and n.state.variables is not old.variables
    assert old.variables.params == params and old.history == history  # as it was
    assert (n.state.step, n.state.epoch, n.state.history) == (old.step, old.epoch, history)
    assert n.weights_checkpoint["step"] in {row["step"] for row in history}
    assert n.state.variables.opt_state is old.variables.opt_state  # kept, not restored


def test_no_engine_module_imports_the_handle_or_the_notebook_layer():
    for path in ENGINE.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == ENGINE:
            continue  # the %load_ext shim
        if "_public_path.stand_for(" in path.read_text():
            continue  # a public import path: the facade's, standing for its module
        tree = ast.parse(path.read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                imported.add((node.module or "") + "." + ".".join(a.name for a in node.names))
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
        # mcp serves handles
        if "handle" not in path.relative_to(ENGINE).parts and "mcp" not in path.parts:
            assert not any("handle" in name.split(".") for name in imported), path
        assert not any(
            name.split(".")[0] in ("IPython", "ipywidgets", "nitro_ipython") for name in imported
        ), path
