"""The live panel's life in a real kernel: setup, Stop, the static record, counts, resources."""

from __future__ import annotations

import ast
import re

from notebook_kernel import kernel_fixture  # noqa: F401 - provides the `kernel` fixture

PANEL = "nitro_ipython.live_panel({})"


def _opened(cell, model: str) -> list[dict]:
    """The initial states of the widgets of `model` (e.g. "ButtonModel") the cell opened."""
    return [
        m["content"]["data"]["state"]
        for m in cell.messages
        if m["msg_type"] == "comm_open" and m["content"]["data"]["state"]["_model_name"] == model
    ]


def _records(kernel, cell_id: str, mime: str = "text/html") -> list[str]:
    """What replaced the panels of the cell `cell_id` (also after the cell ended), without
    the stand-ins they kept while their runs lived."""
    return [
        m["content"]["data"][mime]
        for m in kernel.log
        if m["msg_type"] == "update_display_data"
        and m["parent_header"].get("msg_id") == cell_id
        and mime in m["content"]["data"]
        and "nitro-standin" not in m["content"]["data"].get("text/html", "")
    ]


def _saved(kernel, cell_id: str) -> list[dict]:
    """The display outputs of the cell `cell_id` in a notebook saved now (checked against the
    notebook format's schema)."""
    import nbformat

    outputs = kernel.outputs(cell_id)
    cell = nbformat.v4.new_code_cell(outputs=outputs)
    nbformat.validate(nbformat.v4.new_notebook(cells=[cell]))
    return [o for o in outputs if o["output_type"] == "display_data"]


WIDGET = "application/vnd.jupyter.widget-view+json"


def _comms(kernel) -> int:
    return int(kernel.eval("len(__import__('comm').get_comm_manager().comms)"))


def test_a_first_run_shows_its_setup_then_leaves_a_record_and_closes_its_widgets(kernel):
    before = _comms(kernel)
    cell = kernel.run("rec = tiny_exp.Tiny(batches=5)\n%nitro train rec")

    updates = [
        m["content"]["data"]["state"].get("value", "")
        for m in cell.messages
        if m["msg_type"] == "comm_msg" and m["content"]["data"].get("method") == "update"
    ]
    assert "<b>setting up</b> &middot; the data, the model, the optimizer ..." in updates
    assert "<b>setting up</b> &middot; building model ..." in updates  # the setup's phases

    summary, curves = _saved(kernel, cell.msg_id)  # the record replaced panel and stand-in
    assert re.search(
        r"<b>done</b> &middot; epoch 1/1 &middot; step 5 &middot; loss [\d.]+",
        summary["data"]["text/html"],
    )
    assert summary["data"]["text/plain"].startswith("Tiny: done · epoch 1/1 · step 5")
    assert set(curves["data"]) == {"image/png", "text/plain"}  # the final curves
    assert curves["data"]["text/plain"] == "[training curves]"
    assert len(cell.updates("image/png")) == 1
    assert _comms(kernel) == before  # every widget of the panel closed


def test_a_notebook_saved_while_a_run_lives_holds_its_latest_state_not_only_a_widget(kernel):
    kernel.run("alive = tiny_exp.Tiny(batches=5, delay=0.01, max_epochs=1000)")
    started = kernel.run("%nitro train alive --background")
    kernel.wait_until("alive_run.epoch >= 3")

    def standin_epoch():
        kernel.pump(0.2)
        shown = _saved(kernel, started.msg_id)[1]["data"].get("text/html", "")
        found = re.search(r"epoch (\d+)/1000", shown)
        return int(found.group(1)) if found and "nitro-standin" in shown else -1

    kernel.wait_until("True", lambda _: standin_epoch() >= 3)  # refreshed as epochs end
    panel, standin = _saved(kernel, started.msg_id)
    assert WIDGET in panel["data"]  # the live widget, with a fallback for viewers without it
    assert panel["data"]["text/plain"].startswith("nitro: live training panel")
    html, text = standin["data"]["text/html"], standin["data"]["text/plain"]
    # what the run did when the stand-in was last updated, not in bold as if it did it now
    phase = r"(training|validating|checkpointing|compiling [a-z -]+)"
    assert re.search(rf"last seen {phase} &middot; epoch \d+/1000", html)
    assert not re.search(rf"<b>{phase}</b>", html)
    assert "<style>" in html and ".widget-vbox" in html  # hidden while the widget lives
    assert re.match(rf"Tiny: last seen {phase} · epoch \d+/1000", text)
    # the magic's word on the background run: in the live panel only, not under the stand-in
    assert "in the background" not in started.stdout
    said = kernel.eval(f"{PANEL.format('alive_run')}.hint.value")
    assert "alive_run is training in the background; `%nitro status` shows how far" in said

    kernel.run("%nitro stop alive_run")
    kernel.wait_for(
        lambda m: (
            m["parent_header"].get("msg_id") == started.msg_id
            and m["msg_type"] == "update_display_data"
            and "image/png" in m["content"]["data"]
        ),
        what="the stopped run's curves",
    )
    summary, curves = _saved(kernel, started.msg_id)
    assert WIDGET not in summary["data"] and "<b>stopped</b>" in summary["data"]["text/html"]
    assert "image/png" in curves["data"] and "text/html" not in curves["data"]
    saved = kernel.outputs(started.msg_id)
    assert not any("in the background" in str(output) for output in saved)


def test_the_stop_button_of_a_foreground_run_points_to_the_interrupt_button(kernel):
    cell = kernel.run("fg = tiny_exp.Tiny(batches=30, delay=0.01)\n%nitro train fg")
    (button,) = _opened(cell, "ButtonModel")
    assert button["description"] == "Interrupt ■ to stop" and button["disabled"]
    assert "interrupt button" in button["tooltip"]
    enabled = [
        m
        for m in cell.messages
        if m["msg_type"] == "comm_msg"
        and m["content"]["data"].get("state", {}).get("disabled") is False
    ]
    assert not enabled  # never offered a click that would wait for the cell


def test_a_continued_background_run_gets_a_panel_whose_stop_button_works(kernel):
    kernel.run("cont = tiny_exp.Tiny(batches=20, delay=0.01, max_epochs=1000)")
    first = kernel.run("%nitro train cont --background")
    kernel.wait_until("cont_run.step > 25")
    kernel.click(ast.literal_eval(kernel.eval(f"{PANEL.format('cont_run')}.stop_button.model_id")))
    kernel.wait_until("cont_run.running", lambda value: value == "False")
    kernel.pump(0.5)
    assert any("<b>stopped</b>" in r for r in _records(kernel, first.msg_id))

    again = kernel.run("%nitro train cont --background")  # continues the same handle
    panel = PANEL.format("cont_run")
    state = ast.literal_eval(
        kernel.eval(
            f"({panel}.stop_button.disabled, {panel}.stop_button.description, "
            f"{panel}.progress.bar_style, cont_run.running)"
        )
    )
    assert state == (False, "Stop", "info", True)
    step = int(kernel.eval("cont_run.step"))
    kernel.wait_until(f"cont_run.step > {step + 10}")
    kernel.click(ast.literal_eval(kernel.eval(f"{panel}.stop_button.model_id")))
    kernel.wait_until("cont_run.running", lambda value: value == "False")
    assert kernel.eval("cont_run.stop_reason") == "'requested'"
    kernel.pump(0.5)
    (record,) = _records(kernel, again.msg_id)
    assert "<b>stopped</b> &middot; epoch " in record and "/1000" in record


def test_epoch_counts_agree_everywhere_and_the_stop_advice_resumes(kernel):
    kernel.run("cnt = tiny_exp.Tiny(batches=5, delay=0.002, max_epochs=2)\n%nitro train cnt")
    kernel.run("%nitro train cnt --epochs 1000 --background")
    kernel.wait_until("cnt_run.epoch > 3")
    stop = kernel.run("%nitro stop cnt_run").stdout
    assert "`%nitro train cnt_run` resumes it" in stop
    epoch = int(kernel.eval("cnt_run.epoch"))
    counted = f"{epoch}/1002"
    assert f"epoch {counted}," in kernel.run("%nitro status cnt_run").stdout
    assert re.search(rf"cnt_run +Tiny +stopped +{counted}", kernel.run("%nitro runs").data()[-1])
    assert f"epoch {counted}," in kernel.eval("repr(cnt_run)")
    shown = re.sub(r"<[^>]+>", "", kernel.eval(f"{PANEL.format('cnt_run')}.status.value"))
    assert f"&middot; epoch {counted} &middot;" in shown

    kernel.run("%nitro train cnt_run --background")  # the advice works: it resumes
    assert ast.literal_eval(kernel.eval("(cnt_run.running, cnt_run.target_epoch)")) == (True, 1002)
    kernel.run("%nitro stop cnt_run")


def test_steps_per_second_count_each_runs_steps_over_their_own_time_without_the_compile(kernel):
    """Each batch takes `delay` seconds to build, so no honest rate passes 1 / delay by more
    than the few batches the pipeline builds ahead (while a program compiles, say); a clock
    left stopped after the compile counted the first epoch's steps in no time (thousands of
    steps/s). The history's rate, steps over `epoch_seconds` (which count the compile), is
    a floor within the two clocks' edges."""
    for name, delay, epochs in (("once", 0.01, 1), ("twice", 0.006, 2)):
        kernel.run(
            f"{name} = tiny_exp.Tiny(batches=40, delay={delay}, max_epochs={epochs})\n"
            f"%nitro train {name}"
        )
        status = kernel.run(f"%nitro status {name}_run").stdout
        rate = float(re.search(r"([\d.]+) steps/s", status).group(1))
        history = ast.literal_eval(
            kernel.eval(f"{name}_run.history()[['step', 'epoch_seconds']].values.tolist()")
        )
        with_compile = history[-1][0] / sum(seconds for _, seconds in history)
        built_ahead = 8  # at most, of each epoch's 40 batches
        assert with_compile / 2 <= rate <= 40 / ((40 - built_ahead) * delay), (name, rate)


def test_a_narrow_panel_wraps_between_its_parts_and_keeps_each_plot_its_size(kernel):
    """A notebook beside an editor (~450 px): the header, the status line, the metrics and the
    plots wrap between whole parts, and each plot keeps its 380 px instead of all of them
    shrinking into one thumbnail-sized image."""
    from io import BytesIO

    from PIL import Image

    cell = kernel.run(
        "slim = tiny_exp.Tiny(batches=20, delay=0.03, max_epochs=2)\n%nitro train slim"
    )
    wrapping = [s for s in _opened(cell, "LayoutModel") if s.get("flex_flow") == "row wrap"]
    assert len(wrapping) == 2  # what the frontend lays out: the header and the curves
    panel = PANEL.format("slim_run")
    plots = ast.literal_eval(
        kernel.eval(
            f"[(p.layout.display, p.layout.width, p.layout.max_width, len(p.value)) "
            f"for p in {panel}.plots]"
        )
    )
    shown = [plot for plot in plots if plot[0] != "none"]
    assert [plot[:3] for plot in shown] == [("", "380px", "100%")] * 2  # loss, acc
    assert all(size > 0 for *_, size in shown)
    loss = Image.open(BytesIO(ast.literal_eval(kernel.eval(f"bytes({panel}.plots[0].value)"))))
    assert loss.size == (760, 460)  # one plot, at twice its displayed size
    status = ast.literal_eval(kernel.eval(f"{panel}.status.value"))
    parts = status.count(" &middot; ") + 1
    assert status.count("<span style='white-space:nowrap'>") == parts >= 5
    metrics = ast.literal_eval(kernel.eval(f"{panel}.metrics.value"))
    assert "flex-wrap:wrap" in metrics and "<table>" not in metrics


def test_notebook_commands_during_a_background_run_answer_in_one_line(kernel):
    kernel.run("busy = tiny_exp.Tiny(batches=20, delay=0.005, max_epochs=30)")
    kernel.run("%nitro train busy --background")
    refused = kernel.run("%nitro validate busy_run", check=False)
    assert refused.reply["content"]["ename"] == "UsageError"
    assert refused.reply["content"]["traceback"] == []  # no traceback, one line
    assert "`%nitro stop busy_run`" in refused.error and "`%nitro wait busy_run`" in refused.error
    waited = kernel.run("%nitro wait busy_run").stdout
    assert waited.startswith("busy_run (Tiny): done, epoch 30/30")
    assert "val_loss" in kernel.run("%nitro validate busy_run").data()[-1]
    predicted = kernel.run("%nitro predict busy_run")  # compiles: a note, not an error
    assert "nitro: compiling predict" in predicted.stdout and predicted.stderr == ""


def test_cache_shows_tables_and_a_cell_class_shows_its_field_docs(kernel):
    cache = kernel.run("%nitro cache").data("text/html")[-1]
    assert cache.count("<table>") == 2 and "why each program compiled" in cache
    assert re.search(r"<td[^>]*>train step</td>", cache)

    fields = kernel.run(
        """
        @nitro.experiment
        class Documented(tiny_exp.Tiny):
            rate: float = 0.1
            "how fast it learns"

            def loss(self, logits, *, y):
                return super().loss(logits, y=y)

        nitro.fields(Documented)["doc"].to_dict()
        """
    ).data()[-1]
    assert ast.literal_eval(fields)["rate"] == "how fast it learns"


def test_two_hundred_runs_leave_no_widgets_threads_or_memory_behind(kernel):
    """A kernel that trains many times keeps no panels, curve threads or figures behind."""
    # memory in use: the runs' checkpoint writes finish first (they go on in the background,
    # one handle's after another's, and hold their state until written), and the allocator's
    # free pages go back to the system, so that what is measured is what the runs keep, not
    # what is still being saved or how the heap is fragmented
    measure = (
        "(_saved(), len(__import__('comm').get_comm_manager().comms),"
        " __import__('threading').active_count(), _in_use())[1:]"
    )
    hundred = """
        for _ in range(50):
            many.train(epochs=1)                        # the same handle again
            nitro.Nitro(tiny_exp.Tiny(batches=2)).train()  # a new handle each time
        panels_in_cell = _panels()  # while the cell still runs
        """
    kernel.run(
        """
        import ctypes, gc, os, threading
        from nitro_ipython.panel import LivePanel

        def _saved():
            for thread in threading.enumerate():
                if thread.name.startswith("nitro-save"):
                    thread.join()

        def _in_use():
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGESIZE")

        def _panels():
            gc.collect()
            return sum(isinstance(o, LivePanel) for o in gc.get_objects())

        many = nitro.Nitro(tiny_exp.Tiny(batches=2))
        for _ in range(10):  # warm up: programs, fonts, caches
            many.train(epochs=1)
            nitro.Nitro(tiny_exp.Tiny(batches=2)).train()
        """
    )
    start = ast.literal_eval(kernel.eval(measure))
    kernel.run(hundred, timeout=600)
    middle = ast.literal_eval(kernel.eval(measure))
    kernel.run(hundred, timeout=600)
    end = ast.literal_eval(kernel.eval(measure))
    assert start[:2] == middle[:2] == end[:2]  # widgets (their comms) and threads
    # a cell that trains a hundred times does not hold every finished run's panel until it
    # ends (a few linger while their closing messages are sent: 13-19 of 100 measured)
    assert int(kernel.eval("panels_in_cell")) < 50
    grown = (end[2] - middle[2]) / 1e6  # the second hundred, once caches are warm
    assert grown < 30, f"{grown:.0f} MB more over 100 runs"  # 20.2 MB read once on a busy CI
