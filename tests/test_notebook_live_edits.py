"""Edit while training, in a real kernel: a module file saved (or a class re-defined in a
cell) while `%nitro train --background` runs is compiled beside the run and swapped in at a
step boundary; a broken, non-finite or refused edit leaves the run training with a note."""

from __future__ import annotations

import ast
import time

from notebook_kernel import (
    TINY_MODULE,
    kernel_fixture,  # noqa: F401 - provides the `kernel` fixture
)

LOSS = ".mean()\n\n    def metrics"
WAIT = 120  # seconds: generous, a loaded machine only makes it slower


def _write(kernel, name: str, source: str) -> None:
    (kernel.cwd / f"{name}.py").write_text(source)


def _loss_times(factor: str) -> str:
    return TINY_MODULE.replace(LOSS, f".mean() * {factor}" + LOSS[7:])


def _until(kernel, expression: str, what: str, timeout: float = WAIT) -> None:
    """Poll `expression` (read without running a cell: no cell event fires) until true."""
    deadline = time.monotonic() + timeout
    while kernel.eval(expression) != "True":
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)


def _start(kernel, name: str, flags: str = ""):
    """A long background run of module `name`'s Tiny as `{name}_run`, a few steps in; the
    cell that started it."""
    _write(kernel, name, TINY_MODULE)
    cell = kernel.run(
        f"import {name}\n"
        f"{name}_run = nitro.Nitro({name}.Tiny(max_epochs=100_000, delay=0.002), "
        f"steps_per_dispatch=1)\n"
        f"%nitro train {name}_run --background {flags}"
    )
    _until(kernel, f"{name}_run.running and {name}_run.step > 30", "a few steps")
    return cell


def _stop(kernel, name: str) -> None:
    kernel.run(f"%nitro stop {name}_run")


def _swaps(kernel, name: str) -> list[dict]:
    return ast.literal_eval(
        kernel.eval(
            f"[{{k: r[k] for k in ('step', 'status', 'changed')}} for r in {name}_run.state.swaps]"
        )
    )


def test_a_loss_edit_saved_during_a_background_run_swaps_in_and_the_run_goes_on(kernel):
    _start(kernel, "live_a")
    misses = int(kernel.eval("nitro.cache_stats().misses"))
    compiles = int(kernel.eval("len(nitro.explain_compiles())"))

    # a constant added to the loss: the same gradients, and a curve that moves above 1000 at
    # the swap however far the run had trained (the loss it adds to reaches 0 in float32)
    _write(kernel, "live_a", TINY_MODULE.replace(LOSS, ".mean() + 1000.0" + LOSS[7:]))
    _until(kernel, "len(live_a_run.state.swaps) == 1", "the swap")
    (swap,) = _swaps(kernel, "live_a")
    assert swap["status"] == "swapped" and swap["changed"] == ["loss"]
    step = swap["step"]
    assert kernel.eval("live_a_run.running") == "True"  # the run never stopped
    _until(kernel, f"live_a_run.epoch > {step} // 20 + 2", "two epochs after the swap")

    # exactly the programs the edit reaches compiled, on the edit's own thread
    compiled = ast.literal_eval(
        kernel.eval(
            f"[(r.program, r.reason, r.thread) for r in nitro.explain_compiles()[{compiles}:]]"
        )
    )
    assert [(p, r) for p, r, _ in compiled] == [
        ("train step", "code changed: hook loss"),
        ("eval forward", "code changed: hook loss"),
    ]
    assert {t for _, _, t in compiled} == {"nitro-live-edit-Tiny"}
    assert int(kernel.eval("nitro.cache_stats().misses")) - misses == 2
    assert ast.literal_eval(kernel.eval("live_a_run.state.swaps[0]['compiled']")) == [
        "train step",
        "eval forward",
    ]

    # the loss curve changes at the swap: every epoch after it trains on loss + 1000, every
    # epoch before it on the cross-entropy alone (below 1000 from its first step)
    rows = ast.literal_eval(
        kernel.eval("live_a_run.history()[['step', 'loss']].to_dict('records')")
    )
    before = [r["loss"] for r in rows if r["step"] < step]
    after = [r["loss"] for r in rows if r["step"] - 20 >= step]
    assert before and after and max(before) < 1000.0 <= min(after), rows
    assert kernel.eval(f"list(live_a_run.swaps().index) == [{step}]") == "True"

    # the notebook says so, and the panel marks the step on the curves
    said = kernel.run("pass").stdout
    assert "nitro: reloaded live_a: changed Tiny.loss." in said
    assert (
        "live_a_run: compiling the edit of `loss` beside the run; it swaps in after compiling "
        "2 programs (train step, eval forward)."
    ) in said
    assert f"live_a_run: swapped in the edit of `loss` at step {step}." in said
    panel = "nitro_ipython.live_panel(live_a_run)"
    assert f"edit: loss at step {step}" in kernel.eval(f"{panel}.edits.value")
    assert f"swapped in the edit of `loss` at step {step}" in kernel.eval(f"{panel}.notes.value")

    status = kernel.run("%nitro status live_a_run").stdout
    assert f"  step {step}: edit of loss swapped" in status
    _stop(kernel, "live_a")
    assert kernel.eval("live_a_run.stale_changes()") == "{}"  # the handle has the new code

    # an idle handle: an edit waits for `%nitro train`, as before
    _write(kernel, "live_a", _loss_times("2.0"))
    _until(
        kernel,
        "any(m.startswith('live_a_run (Tiny): loss changed: train step and eval forward will "
        "recompile') for m in nitro_ipython.watcher().history)",
        "the report of the idle handle",
    )
    assert kernel.eval("(live_a_run.running, len(live_a_run.state.swaps))") == "(False, 1)"


def test_broken_edits_leave_the_run_training_and_the_next_good_edit_applies(kernel):
    started = _start(kernel, "live_b")

    # a syntax error: the module keeps its code, the run goes on
    _write(kernel, "live_b", TINY_MODULE.replace("def scale(x):", "def scale(x)"))
    _until(
        kernel,
        "any('expected' in m for m in nitro_ipython.watcher().history)",
        "the syntax error's report",
    )
    said = kernel.run("pass").stdout
    assert "live_b.py line " in said and "Kept the last good code of live_b" in said
    assert "The run goes on with the code it had." in said
    assert kernel.eval("live_b_run.running and not live_b_run.state.swaps") == "True"

    # an error at trace time (a shape error): the edit fails, the note names the file and line
    _write(
        kernel,
        "live_b",
        TINY_MODULE.replace(LOSS, ".mean() + logits.reshape(3, 5).sum()" + LOSS[7:]),
    )
    _until(kernel, "live_b_run.live_edit is not None and live_b_run.live_edit.done", "the failure")
    assert kernel.eval("live_b_run.live_edit.status") == "'failed'"
    said = kernel.run("pass").stdout
    assert "live_b_run: the edit of `loss` failed to compile (live_b.py line " in said, said
    assert kernel.eval("live_b_run.running and not live_b_run.state.swaps") == "True"

    # a NaN loss on the first steps: rolled back to the code and weights from before the swap
    _write(kernel, "live_b", _loss_times("float('nan')"))
    _until(kernel, "len(live_b_run.state.swaps) == 2", "the roll-back")
    swapped, rolled = _swaps(kernel, "live_b")
    assert (swapped["status"], rolled["status"]) == ("swapped", "rolled back")
    assert rolled["step"] == swapped["step"]
    assert kernel.eval("live_b_run.running") == "True"
    said = kernel.run("pass").stdout
    assert "gave a non-finite loss (nan)" in said and "rolled back to the code" in said, said
    notes = kernel.eval("nitro_ipython.live_panel(live_b_run).notes.value")
    assert "gave a non-finite loss" in notes
    edits = kernel.eval("nitro_ipython.live_panel(live_b_run).edits.value")
    assert f"edit: loss (rolled back) at step {rolled['step']}" in edits

    # the next good edit applies
    _write(kernel, "live_b", _loss_times("2.0"))
    _until(kernel, "len(live_b_run.state.swaps) == 3", "the good edit's swap")
    assert _swaps(kernel, "live_b")[2]["status"] == "swapped"
    _until(kernel, f"live_b_run.step > {_swaps(kernel, 'live_b')[2]['step']} + 8", "probation")
    assert kernel.eval("(live_b_run.running, len(live_b_run.state.swaps))") == "(True, 3)"
    status = kernel.run("%nitro status live_b_run").stdout
    assert "edit of loss rolled back (non-finite loss nan at step" in status
    _stop(kernel, "live_b")

    # the run's record keeps the key to the curves' marks: every edit, at its step
    record = kernel.wait_for(
        lambda m: (
            m["parent_header"].get("msg_id") == started.msg_id
            and m["msg_type"] == "update_display_data"
            and "nitro-record" in m["content"]["data"].get("text/html", "")
            and "nitro-standin" not in m["content"]["data"]["text/html"]
        ),
        timeout=WAIT,
        what="the run's record",
    )["content"]["data"]["text/html"]
    good = _swaps(kernel, "live_b")[2]["step"]
    assert f"edit: loss (rolled back) at step {rolled['step']}" in record
    assert f"edit: loss at step {good}" in record


def test_a_model_structure_edit_is_refused_live_and_the_run_goes_on(kernel):
    _start(kernel, "live_c")
    _write(
        kernel,
        "live_c",
        TINY_MODULE.replace("nnx.Linear(4, width,", "nnx.Linear(4, 2 * width,").replace(
            "nnx.Linear(width, 2,", "nnx.Linear(2 * width, 2,"
        ),
    )
    _until(
        kernel,
        "any('was refused' in m for m in nitro_ipython.watcher().history)",
        "the refusal",
    )
    said = kernel.run("pass").stdout
    assert "live_c_run: the edit of model (method Net.__init__) was refused: the model's " in said
    assert "structure changed" in said and "Stop the run and train again" in said
    step = int(kernel.eval("live_c_run.step"))
    _until(kernel, f"live_c_run.step > {step} + 20", "more steps")
    assert kernel.eval("(live_c_run.running, live_c_run.state.swaps)") == "(True, [])"
    assert "structure changed" in kernel.eval("nitro_ipython.live_panel(live_c_run).notes.value")
    _stop(kernel, "live_c")


def test_no_live_edits_keeps_the_deferral_until_the_run_stops(kernel):
    _start(kernel, "live_d", "--no-live-edits")
    assert kernel.eval("live_d_run.live_edits") == "False"
    _write(kernel, "live_d", TINY_MODULE.replace("return x * 1.0", "return x * 3.0"))
    _until(
        kernel,
        "any('it reloads once live_d_run stops' in m for m in nitro_ipython.watcher().history)",
        "the deferral",
    )
    assert kernel.eval("live_d.scale(1.0)") == "1.0"  # not reloaded while it trains
    assert kernel.eval("(live_d_run.running, live_d_run.state.swaps)") == "(True, [])"
    _stop(kernel, "live_d")
    said = kernel.run("pass").stdout
    assert "reloaded live_d: changed scale." in said
    assert "`%nitro train live_d_run` continues the run with the edit" in said
    assert kernel.eval("live_d.scale(1.0)") == "3.0"
    # the stopped run goes on, on the same handle, with the edit
    cell = kernel.run("old_d = live_d_run\n%nitro train live_d_run --epochs 1")
    assert "continues its run" in cell.stdout, cell.stdout
    assert kernel.eval("(live_d_run is old_d, live_d_run.live_edits)") == "(True, False)"


def test_a_class_redefined_in_a_cell_during_a_run_is_swapped_in(kernel):
    define = (
        "import optax\n\n"
        "@nitro.experiment\n"
        "class LiveCell(tiny_exp.Tiny):\n"
        "    def loss(self, logits, *, y):\n"
        "        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(){}\n"
    )
    kernel.run(
        define.format("")
        + "\nlive_e_run = nitro.Nitro(LiveCell(max_epochs=100_000, delay=0.002))\n"
        "%nitro train live_e_run --background"
    )
    _until(kernel, "live_e_run.running and live_e_run.step > 30", "a few steps")
    said = kernel.run(define.format(" * 3.0")).stdout
    assert "live_e_run: compiling the edit of `loss` beside the run" in said
    _until(kernel, "len(live_e_run.state.swaps) == 1", "the swap")
    assert kernel.eval("(live_e_run.running, live_e_run.cls is LiveCell)") == "(True, True)"
    _stop(kernel, "live_e")


def test_nitro_reload_applies_a_save_at_once_within_the_cell_that_made_it(kernel):
    _start(kernel, "live_f")
    # the save and the check in one cell: the watcher's own check waits for the kernel to be
    # idle, so what reloads here is %nitro reload's doing
    said = kernel.run(
        f"import pathlib\npathlib.Path('live_f.py').write_text({_loss_times('7.0')!r})\n"
        "%nitro reload"
    ).stdout
    assert "reloaded live_f: changed Tiny.loss" in said
    assert "live_f_run: compiling the edit of `loss` beside the run" in said
    _until(kernel, "len(live_f_run.state.swaps) == 1", "the swap")
    again = kernel.run("%nitro reload").stdout
    assert "no watched file changed since it was last loaded" in again
    _stop(kernel, "live_f")


def test_a_live_reload_never_leaves_a_global_missing_for_code_running_meanwhile(tmp_path):
    """A run's data thread and host-side hooks run the module's code while it reloads."""
    import importlib
    import sys
    import threading

    from nitro_ipython.reload import reload_module

    path = tmp_path / "live_globals.py"
    path.write_text("VALUE = 1\nREMOVED = 0\n\ndef read():\n    return VALUE\n")
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("live_globals")
        good = dict(vars(module))
        read = module.read  # the old code, as a running thread holds it
        # the new code binds VALUE only after a pause: a cleared namespace would lack it
        path.write_text(
            "import time\ntime.sleep(0.5)\nVALUE = 2\n\ndef read():\n    return VALUE\n"
        )
        errors: list[BaseException] = []
        done = threading.Event()

        def keep_reading() -> None:
            while not done.is_set():
                try:
                    read()
                except NameError as error:
                    errors.append(error)
                    return

        reader = threading.Thread(target=keep_reading)
        reader.start()
        try:
            assert reload_module(module, good, {}, live=True) is None
        finally:
            done.set()
            reader.join()
        assert errors == []
        assert (module.VALUE, read(), hasattr(module, "REMOVED")) == (2, 2, False)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("live_globals", None)


def test_a_loss_edit_saved_while_a_population_trains_reaches_every_member(kernel):
    _write(kernel, "live_p", TINY_MODULE)
    kernel.run(
        "import live_p\n"
        "live_pop = nitro.Population(live_p.Tiny(max_epochs=100_000, delay=0.002), "
        "learning_rate=[1e-3, 1e-2], steps_per_dispatch=1)\n"
        "%nitro train live_pop --background"
    )
    _until(kernel, "live_pop.running and live_pop.step > 30", "a few steps")
    _write(kernel, "live_p", TINY_MODULE.replace(LOSS, ".mean() + 1000.0" + LOSS[7:]))
    _until(kernel, "len(live_pop.swaps()) == 1", "the swap")
    swap = ast.literal_eval(kernel.eval("live_pop.swaps().reset_index().iloc[0].to_dict()"))
    assert swap["status"] == "swapped" and swap["changed"] == ["loss"], swap
    assert kernel.eval("live_pop.running") == "True"  # it never stopped
    step = swap["step"]
    _until(kernel, f"live_pop.epoch > {step} // 20 + 2", "two epochs after the swap")
    rows = ast.literal_eval(
        kernel.eval(
            "live_pop.history().reset_index()[['member', 'step', 'loss']].to_dict('records')"
        )
    )
    for member in (0, 1):  # every member's curve moves above 1000 from the swap on
        mine = [r for r in rows if r["member"] == member]
        before = [r["loss"] for r in mine if r["step"] < step]
        after = [r["loss"] for r in mine if r["step"] - 20 >= step]
        assert before and after and max(before) < 1000.0 <= min(after), mine
    said = kernel.run("pass").stdout
    assert "live_pop: compiling the edit of `loss` beside the run" in said, said
    kernel.run("%nitro stop live_pop")
    assert kernel.eval("live_pop.stale_changes()") == "{}"  # it holds the new code
