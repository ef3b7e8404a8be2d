"""Live edits through the public API: an experiment module's file edited while a handle trains
in the background, reloaded, and applied with `n.apply_edits()`: the new code compiles on a
thread of its own and swaps in between two calls; broken, refused and non-finite edits leave
the run on its old code. Real files, real reloads, real compiles; no timing assertions (waits
have generous deadlines)."""

from __future__ import annotations

import importlib
import json
import math
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

import nitro
from nitro.core.progress import SilentReporter

MODULE = """
import jax.numpy as jnp
import optax
from flax import nnx

import nitro
from nitro.data import ArrayLoader
from nitro.datasets import digits_arrays

ARRAYS = digits_arrays()
SCALE = 1.0


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.out = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


@nitro.experiment
class Live:
    def build_data(self):
        return {
            "train": ArrayLoader(ARRAYS["train"], 32),
            "val": ArrayLoader(ARRAYS["val"], 64, shuffle=False),
        }

    def build_model(self, rngs):
        return MLP(rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, outputs, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(outputs, y).mean() * SCALE
"""

DEADLINE = 300.0  # seconds a wait may take on a busy machine before the test gives up


class Recorder(SilentReporter):
    """Every step's loss, note and swap row, as the run reports them."""

    def __init__(self):
        self.losses: dict[int, float] = {}
        self.notes: list[str] = []
        self.swaps: list[dict] = []

    def step(self, step, loss):
        self.losses[step] = loss

    def note(self, message, done=False):
        self.notes.append(message)

    def swapped(self, row):
        self.swaps.append(dict(row))


class Module:
    """An experiment module written to a file, imported, edited and reloaded for real."""

    def __init__(self, directory: Path, text: str = MODULE):
        self.name = f"live_{uuid.uuid4().hex[:8]}"
        self.path = directory / f"{self.name}.py"
        self.text = text
        self.path.write_text(text)
        sys.path.insert(0, str(directory))
        self.module = importlib.import_module(self.name)

    def edit(self, old: str, new: str) -> None:
        assert old in self.text, old
        self.text = self.text.replace(old, new)
        self.path.write_text(self.text)
        importlib.invalidate_caches()
        importlib.reload(self.module)

    def handle(self, **keywords) -> nitro.Nitro:
        keywords.setdefault("checkpointer", None)
        keywords.setdefault("logger", None)
        keywords.setdefault("steps_per_dispatch", 1)
        return nitro.Nitro(self.module.Live(), **keywords)


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


def start(module: Module, predict: bool = False, **keywords) -> tuple[nitro.Nitro, Recorder]:
    recorder = Recorder()
    n = module.handle(max_epochs=10_000, progress=recorder, **keywords)
    if predict:  # a program of `forward` alone, which a `loss` edit does not reach
        n.predict({"x": module.module.ARRAYS["val"]["x"][:8]})
    n.train(background=True)
    wait_until(lambda: n.step >= 20, "the run's first steps")
    return n, recorder


def apply(n: nitro.Nitro, module: Module, old: str, new: str, then: int = 20):
    """Edit, apply, wait for the edit to settle and for `then` more steps."""
    module.edit(old, new)
    edit = n.apply_edits().wait(DEADLINE)
    assert edit.done, edit
    if edit.status == "swapped":
        wait_until(lambda: n.step >= edit.record["step"] + then, "steps on the new code")
    else:
        step = n.step
        wait_until(lambda: n.step >= step + then, "steps after the edit")
    return edit


def test_a_loss_edit_swaps_in_while_the_run_trains_and_only_the_programs_it_reaches_compile(
    tmp_path,
):
    module = Module(tmp_path)
    n, recorder = start(module, predict=True)
    compiles_before = len(nitro.explain_compiles())

    edit = apply(n, module, "* SCALE", "* SCALE * 1000.0")

    assert edit.status == "swapped" and n.running  # the run never stopped
    swap = edit.record["step"]
    assert list(n.swaps().index) == [swap]
    assert edit.record["changed"] == ["loss"] and edit.record["status"] == "swapped"
    # exactly the programs the edit reaches (the train step, and eval forward once the run
    # has validated), compiled beside the loop; predict runs `forward` alone: reused
    new = nitro.explain_compiles()[compiles_before:]
    beside = [r for r in new if r.thread == "nitro-live-edit-Live"]
    assert "train step" in edit.record["compiled"] and edit.record["reused"] == ["predict"]
    assert set(edit.record["compiled"]) <= {"train step", "eval forward"}
    assert sorted(edit.record["compiled"]) == sorted(r.program for r in beside)
    n.stop().wait()
    assert n.stop_reason == "requested"
    losses = recorder.losses
    # the curve changes at the swap: its step is the first the edit scales
    before = np.mean([losses[s] for s in range(swap - 10, swap)])
    after = np.mean([losses[s] for s in range(swap + 1, swap + 11)])
    assert after > 100 * before
    assert losses[swap] > 100 * losses[swap - 1]
    assert recorder.swaps == [dict(n.state.swaps[0])]
    assert any(f"swapped in the edit of `loss` at step {swap}" in m for m in recorder.notes)

    # the steps before the swap are those of a run without the edit, bit for bit
    module.edit("* SCALE * 1000.0", "* SCALE")
    reference = Recorder()
    module.handle(progress=reference).train(steps=swap - 1)
    assert [losses[s] for s in range(1, swap)] == [reference.losses[s] for s in range(1, swap)]


def test_broken_edits_leave_the_run_on_its_code_with_a_note_and_the_next_good_edit_applies(
    tmp_path,
):
    module = Module(tmp_path)
    n, recorder = start(module)
    ok = "return optax.softmax_cross_entropy_with_integer_labels(outputs, y).mean() * SCALE"

    raised = apply(n, module, ok, "raise ValueError('no such loss')\n        " + ok)
    assert raised.status == "failed" and n.running
    line = module.text.splitlines().index("        raise ValueError('no such loss')") + 1
    assert "`loss`" in raised.note and f"{module.name}.py line {line}" in raised.note
    assert "ValueError: no such loss" in raised.note
    module.edit("raise ValueError('no such loss')\n        ", "")

    shape = apply(n, module, ".mean() * SCALE", " * SCALE")
    assert shape.status == "failed" and "must return a scalar" in shape.note and n.running
    module.edit(" * SCALE", ".mean() * SCALE")

    nan = apply(n, module, "* SCALE", "* SCALE * jnp.nan")
    assert nan.status == "rolled back" and n.running
    assert "non-finite loss" in nan.note and "rolled back" in nan.note
    rows = n.state.swaps
    assert [r["status"] for r in rows] == ["swapped", "rolled back"]
    assert rows[0]["step"] == rows[1]["step"]  # back to the weights of the step it began at
    rolled_back_at = rows[1]["step"]
    wait_until(lambda: n.step > rolled_back_at + 20, "steps after the roll-back")
    assert all(math.isfinite(recorder.losses[s]) for s in range(rolled_back_at + 1, n.step))
    assert any("rolled back" in m for m in recorder.notes)

    good = apply(n, module, "* SCALE * jnp.nan", "* SCALE * 2.0")
    assert good.status == "swapped" and n.running
    assert [r["status"] for r in n.state.swaps] == ["swapped", "rolled back", "swapped"]
    n.stop().wait()
    assert n.stop_reason == "requested" and n.error is None


def test_the_model_edits_a_live_run_can_take_and_the_one_it_refuses(tmp_path):
    module = Module(tmp_path)
    n, _ = start(module)
    weights_layout = [a.shape for a in n.state.variables.params]

    refused = apply(n, module, "nnx.Linear(64, 32", "nnx.Linear(64, 48")
    assert refused.status == "refused" and n.running
    assert "train again" in refused.note
    assert refused.note.startswith(
        "the model's structure changed (parameter hidden.bias: f32[32] -> f32[48]; "
        "parameter hidden.kernel: f32[64,32] -> f32[64,48]): a live run keeps its weights' "
        "layout."
    )
    module.edit("nnx.Linear(64, 48", "nnx.Linear(64, 32")

    code = apply(n, module, "nnx.relu(", "nnx.tanh(")
    assert code.status == "swapped" and n.running
    assert "model" in code.record["changed"] and "train step" in code.record["compiled"]
    assert [a.shape for a in n.state.variables.params] == weights_layout

    field = apply(n, module, "class Live:\n", "class Live:\n    width: int = 3\n")
    assert field.status == "refused" and "added width" in field.note
    n.stop().wait()


def test_fused_calls_swap_between_calls_and_an_idle_handle_takes_an_edit_at_once(tmp_path):
    module = Module(tmp_path)
    n, recorder = start(module, steps_per_dispatch=4)
    edit = apply(n, module, "* SCALE", "* SCALE * 1000.0")
    assert edit.status == "swapped"
    batches = len(n.splits["train"])  # calls of 4 from each epoch's start, single steps after
    position = (edit.record["step"] - 1) % batches
    assert position % 4 == 0 or position > batches - batches % 4  # between two calls
    assert "multi-step train" in edit.record["compiled"]
    n.stop().wait()

    idle = module.handle(steps_per_dispatch=1)
    before = idle.validate()["val_loss"]
    module.edit("* SCALE * 1000.0", "* SCALE * 2000.0")
    edit = idle.apply_edits().wait(DEADLINE)
    assert edit.status == "swapped" and edit.record["step"] == 1  # the first step on it
    assert idle.validate()["val_loss"] == pytest.approx(2 * before, rel=1e-5)
    assert idle.stale_changes() == {}  # the handle's code is the live code


def test_a_checkpoint_after_a_swap_records_it_and_resume_says_which_code_it_continues(tmp_path):
    module = Module(tmp_path)
    run_dir = tmp_path / "run"
    logger = nitro.loggers.JSONLinesLogger(str(tmp_path / "metrics.jsonl"))
    recorder = Recorder()
    n = module.handle(
        max_epochs=10_000,
        progress=recorder,
        run_dir=str(run_dir),
        checkpointer=nitro.Checkpointer(budget=None),
        logger=logger,
    )
    n.train(background=True)
    wait_until(lambda: n.step >= 20, "the run's first steps")
    edit = apply(n, module, "* SCALE", "* SCALE * 3.0")
    swap = edit.record["step"]
    epoch = n.epoch
    wait_until(lambda: n.epoch > epoch + 1, "an epoch saved after the swap")
    n.stop().wait()

    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options) as manager:
        meta = manager.restore(manager.latest_step())["meta"]
    assert [r["step"] for r in meta["swaps"]] == [swap]
    assert meta["code"]["loss"] == n.setup.experiment.code["loss"].digest
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    marks = [r for r in records if r["type"] == "other" and r["key"] == f"live_edit/step_{swap}"]
    assert marks and marks[0]["value"]["changed"] == ["loss"]

    notes = Recorder()
    resumed = module.handle(run_dir=str(run_dir), resume="auto", progress=notes)
    assert [r["step"] for r in resumed.state.swaps] == [swap]
    assert any(
        f"continuing with the code of the live edit swapped in at step {swap}" in m
        for m in notes.notes
    )


def test_live_edits_is_a_setting_of_the_handle_and_a_bad_value_names_it(tmp_path):
    n = Module(tmp_path).handle()
    assert n.live_edits is None  # on where the notebook extension watches, off in scripts
    n.live_edits = False
    assert n.live_edits is False
    with pytest.raises(TypeError, match="live_edits must be True, False or None"):
        n.live_edits = "yes"  # pyright: ignore[reportAttributeAccessIssue]
    assert n.live_edits is False
    assert n.apply_edits().note == "nothing that runs changed"


# ---------------------------------------------------------------------------------------------
# live values


HOST_MODULE = MODULE.replace(
    "class Live:\n",
    "class Live:\n    label: str = 'a'\n    rate: nitro.Device[float] = 1.0\n\n"
    "    def finalize_metrics(self, metrics, split):\n"
    "        return {**metrics, 'label_length': float(len(self.label))}\n\n",
)


def test_a_schedule_and_a_host_field_changed_while_the_run_trains_apply_without_a_compile(
    tmp_path,
):
    module = Module(tmp_path, HOST_MODULE)
    n, _ = start(module)
    wait_until(lambda: n.epoch >= 1, "the first validation (its program compiled)")
    compiles = len(nitro.explain_compiles())
    n.set_schedule(learning_rate=0.0)
    n.set_host(label="abcd")
    epoch = n.epoch
    wait_until(lambda: n.epoch > epoch + 1, "an epoch after the change")
    n.stop().wait()
    assert n.history()["val_label_length"].iloc[-1] == 4.0
    frozen = [np.asarray(a) for a in n.state.variables.params]
    n.train(steps=5)  # a learning rate of 0 leaves the weights exactly where they were
    assert all(
        np.array_equal(a, np.asarray(b))
        for a, b in zip(frozen, n.state.variables.params, strict=True)
    )
    assert len(nitro.explain_compiles()) == compiles  # fed values: nothing recompiled

    with pytest.raises(TypeError, match=r"set_host\(rate=...\) changes Host fields only"):
        n.set_host(rate=2.0)
    with pytest.raises(AttributeError, match="no field 'lable'; Host fields: label"):
        n.set_host(lable="x")
    with pytest.raises(nitro.ScheduleError, match="matches no optimizer hyperparameter"):
        n.set_schedule(learning_rat=0.1)
    n.set_schedule(rate=lambda step: 0.5)
    with pytest.raises(TypeError, match="is scheduled"):
        n.set_device(rate=2.0)


# ---------------------------------------------------------------------------------------------
# metrics, manual steps, large variables

METRICS_MODULE = MODULE.replace(
    "    def loss(self, outputs, *, y):",
    "    def metrics(self, outputs, *, y):\n"
    "        return {'acc': (outputs.argmax(-1) == y).mean() * 1.0}\n\n"
    "    def loss(self, outputs, *, y):",
)


def test_a_metrics_edit_applies_from_the_next_validation(tmp_path):
    module = Module(tmp_path, METRICS_MODULE)
    n, _ = start(module)
    wait_until(lambda: n.epoch >= 1, "the first validation")
    module.edit("* 1.0}", "* 0.0 - 1.0}")  # a metric no accuracy can give
    edit = n.apply_edits().wait(DEADLINE)
    assert edit.status == "swapped" and edit.record["changed"] == ["metrics"]
    epoch = n.epoch
    wait_until(lambda: n.epoch > epoch + 1, "two validations after the swap")
    n.stop().wait()
    accuracy = n.history().set_index("step")["val_acc"]
    assert (accuracy[accuracy.index >= edit.record["step"]] == -1.0).all()
    assert (accuracy[accuracy.index < edit.record["step"]] >= 0.0).all()


def test_a_host_metrics_edit_that_raises_rolls_back_on_its_first_call_and_the_run_goes_on(
    tmp_path,
):
    module = Module(tmp_path, METRICS_MODULE)
    n, recorder = start(module)
    wait_until(lambda: n.epoch >= 1, "the first validation")
    module.edit("(outputs.argmax(-1) == y).mean() * 1.0", "1 - acuracy")  # a typo
    edit = n.apply_edits().wait(DEADLINE)
    # it swapped at once, compiling nothing (the hook runs on the host); the validation that
    # rolls it back may already have run on a busy machine (the swaps record both, below)
    assert edit.status in ("swapped", "rolled back") and edit.programs == (), edit
    wait_until(lambda: edit.status == "rolled back", "the first validation on the edit")
    epoch = n.epoch
    wait_until(lambda: n.epoch > epoch + 1, "validations after the roll-back")
    assert n.running and n.error is None
    line = module.text.splitlines().index("        return {'acc': 1 - acuracy}") + 1
    assert edit.note.startswith("the edit of `metrics` raised on its first call")
    assert f"({module.name}.py line {line})" in edit.note
    assert "NameError: name 'acuracy' is not defined" in edit.note
    assert edit.note in recorder.notes
    swapped, rolled = n.state.swaps
    assert (swapped["status"], rolled["status"]) == ("swapped", "rolled back")
    assert rolled["reason"] == "`metrics` raised NameError: name 'acuracy' is not defined"

    module.edit("1 - acuracy", "(outputs.argmax(-1) == y).mean() * 0.0 - 1.0")  # fixed
    fixed = n.apply_edits().wait(DEADLINE)
    assert fixed.status == "swapped"
    epoch = n.epoch
    wait_until(lambda: n.epoch > epoch + 1, "validations on the fixed edit")
    n.stop().wait()
    assert n.stop_reason == "requested" and n.error is None
    accuracy = n.history().set_index("step")["val_acc"]
    assert (accuracy[accuracy.index < fixed.record["step"]] >= 0.0).all()  # the old code's
    assert (accuracy[accuracy.index >= fixed.record["step"]] == -1.0).all()
    assert fixed.status == "swapped"  # its first call passed: it stays


FINALIZE_MODULE = MODULE.replace(
    "    def loss(self, outputs, *, y):",
    "    def finalize_metrics(self, metrics, split):\n"
    "        return {**metrics, 'twice': 2.0 * metrics['loss']}\n\n"
    "    def loss(self, outputs, *, y):",
)


def test_an_idle_handle_rolls_back_a_finalize_metrics_edit_that_raises_and_validates(tmp_path):
    module = Module(tmp_path, FINALIZE_MODULE)
    n = module.handle(progress=False)
    good = n.validate()
    module.edit("2.0 * metrics['loss']", "2.0 * metrics['los']")
    edit = n.apply_edits().wait(DEADLINE)
    assert edit.status == "swapped"
    assert n.validate() == good  # the old code's result, after the roll-back
    assert edit.status == "rolled back"
    assert "the edit of `finalize_metrics` raised on its first call" in edit.note
    assert "KeyError: 'los'" in edit.note
    assert [r["status"] for r in n.state.swaps] == ["swapped", "rolled back"]
    assert n.validate() == good


GATED_MODULE = MODULE.replace(
    "SCALE = 1.0\n",
    "SCALE = 1.0\n"
    "import threading\n"
    "ENTERED = globals().setdefault('ENTERED', threading.Event())  # kept across reloads\n"
    "GATE = globals().setdefault('GATE', threading.Event())\n",
).replace(
    "    def loss(self, outputs, *, y):",
    "    def finalize_metrics(self, metrics, split):\n"
    "        ENTERED.set()\n"
    "        GATE.wait(300)\n"
    "        return metrics\n\n"
    "    def loss(self, outputs, *, y):",
)


def test_an_edit_ready_while_validate_holds_an_idle_handle_swaps_in_when_it_returns(tmp_path):
    module = Module(tmp_path, GATED_MODULE)
    entered, gate = module.module.ENTERED, module.module.GATE
    gate.set()
    n = module.handle(progress=False)
    before = n.validate()["val_loss"]
    gate.clear()
    entered.clear()
    validating = threading.Thread(target=n.validate)
    validating.start()
    wait_until(entered.is_set, "validate() to hold the handle")
    module.edit("* SCALE", "* SCALE * 2.0")
    edit = n.apply_edits()
    # compiled, offered, and refused by the busy handle: its compile thread has ended
    wait_until(
        lambda: (
            edit.status != "compiling"
            and not any(t.name == "nitro-live-edit-Live" for t in threading.enumerate())
        ),
        "the edit's compile",
    )
    assert edit.status == "ready"
    gate.set()
    validating.join()
    assert edit.status == "swapped" and edit.record["step"] == 1
    assert n.validate()["val_loss"] == pytest.approx(2 * before, rel=1e-5)


GAN_MODULE = (Path(__file__).parent / "gan_toys.py").read_text()


def test_a_train_step_hook_is_edited_live_like_any_hook(tmp_path):
    module = Module(tmp_path, GAN_MODULE)
    recorder = Recorder()
    n = nitro.Nitro(
        module.module.GAN(max_epochs=10_000),
        checkpointer=None,
        logger=None,
        progress=recorder,
        steps_per_dispatch=1,
    )
    n.train(background=True)
    wait_until(lambda: n.step >= 20, "the run's first steps")
    module.edit('return {"loss": d_loss + g_loss', 'return {"loss": 100.0 * (d_loss + g_loss)')
    edit = n.apply_edits().wait(DEADLINE)
    assert edit.status == "swapped" and edit.record["changed"] == ["train_step"], edit
    swap = edit.record["step"]
    wait_until(lambda: n.step >= swap + 10, "steps on the new train_step")
    n.stop().wait()
    losses = recorder.losses
    assert min(losses[s] for s in range(swap, swap + 8)) > 10 * max(
        losses[s] for s in range(swap - 9, swap)
    )


def test_without_a_copy_of_large_variables_a_roll_back_keeps_the_guards_weights(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(nitro.engine.swaps, "PROBATION_COPY_BYTES", 0)
    module = Module(tmp_path)
    n, recorder = start(module)
    edit = apply(n, module, "* SCALE", "* SCALE * jnp.nan")
    assert edit.status == "rolled back" and n.running
    swapped, rolled = n.state.swaps
    assert rolled["status"] == "rolled back" and rolled["step"] == swapped["step"]  # the guard
    # skipped the first new step: the weights are those of the step the swap began at
    wait_until(lambda: n.step > rolled["step"] + 20, "steps after the roll-back")
    n.stop().wait()
    assert all(math.isfinite(recorder.losses[s]) for s in range(rolled["step"] + 1, n.step))
    assert all(np.isfinite(np.asarray(a)).all() for a in n.state.variables.params)


def test_the_history_plot_marks_each_swap_at_its_step(tmp_path):
    module = Module(tmp_path)
    n, _ = start(module)
    wait_until(lambda: n.epoch >= 1, "a first epoch")
    edit = apply(n, module, "* SCALE", "* SCALE * 2.0")
    epoch = n.epoch
    wait_until(lambda: n.epoch > epoch + 1, "epochs after the swap")
    n.stop().wait()
    figure = n.plot()
    marks = [line for line in figure.axes[0].lines if line.get_gid() == "live-edit"]
    assert len(marks) == 1
    steps = n.history()["step"]
    where = marks[0].get_xdata()[0]
    batches = len(n.splits["train"])
    assert where == pytest.approx(edit.record["step"] / batches)  # epochs of equal length
    assert any(t.get_text() == "edit: loss" for t in figure.axes[0].texts)
    assert steps.iloc[0] == batches


class MemberRecorder(Recorder):
    """Each member's loss at every step of a population's calls."""

    def __init__(self):
        super().__init__()
        self.member_losses: dict[int, list[float]] = {}

    def member_steps(self, first, losses):
        for offset, column in enumerate(np.asarray(losses).T):
            self.member_losses[first + offset] = column.tolist()


def test_a_population_takes_a_live_edit_into_every_member_at_one_step(tmp_path):
    module = Module(tmp_path)
    recorder = MemberRecorder()
    rates = [1e-3, 3e-3]
    pop = nitro.Population(
        module.module.Live(),
        learning_rate=rates,
        max_epochs=10_000,
        progress=recorder,
        checkpointer=None,
        run_dir=str(tmp_path / "pop"),
        steps_per_dispatch=1,
    )
    assert pop.live_edits is None and pop.live_edit is None
    pop.train(background=True)
    wait_until(lambda: pop.step >= 20, "the population's first steps")

    module.edit("* SCALE", "* SCALE * 1000.0")
    edit = pop.apply_edits().wait(DEADLINE)
    assert edit.status == "swapped", edit
    swap = edit.record["step"]
    wait_until(lambda: pop.step >= swap + 10, "steps on the new code")
    assert pop.running and pop.live_edit is edit
    pop.stop().wait()
    assert list(pop.swaps().index) == [swap] and edit.record["changed"] == ["loss"]
    compiled = edit.record["compiled"]  # one program for every member (eval's, once validated)
    assert "population train step" in compiled, compiled
    assert set(compiled) <= {"population train step", "population eval forward"}, compiled
    losses = recorder.member_losses
    for member in range(len(rates)):  # every member's loss is scaled from the same step
        assert losses[swap][member] > 100 * losses[swap - 1][member]
    assert any(f"swapped in the edit of `loss` at step {swap}" in m for m in recorder.notes)
    for member in range(len(rates)):  # each member's logger run records the swap, as a run's
        lines = (tmp_path / "pop" / f"member-{member}" / "metrics.jsonl").read_text().splitlines()
        marks = [r for r in map(json.loads, lines) if r.get("key") == f"live_edit/step_{swap}"]
        assert marks and marks[0]["value"]["changed"] == ["loss"]

    # before the swap, each member's steps are those of its run alone on the old code (to
    # float32 rounding: a vmapped step sums in another order)
    module.edit("* SCALE * 1000.0", "* SCALE")
    for member, rate in enumerate(rates):
        alone = Recorder()
        module.handle(progress=alone, learning_rate=rate).train(steps=swap - 1)
        mine = [losses[s][member] for s in range(1, swap)]
        np.testing.assert_allclose(mine, [alone.losses[s] for s in range(1, swap)], atol=1e-5)
    # an idle population takes an edit at once, and its members train on the new code
    module.edit("* SCALE", "* SCALE * 1000.0")
    assert pop.apply_edits().wait(DEADLINE).status == "swapped"
    assert type(pop.member(1).experiment) is module.module.Live
