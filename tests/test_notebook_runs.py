"""%nitro in a real kernel: loading, help, interrupting, background runs, the live panel."""

from __future__ import annotations

import ast
import json
import re

from notebook_kernel import kernel_fixture  # noqa: F401 - provides the `kernel` fixture


def _progress_updates(k, comm_id: str) -> list[tuple[float, dict]]:
    """(arrival index, state) of every frontend update of the widget `comm_id`."""
    return [
        (i, m["content"]["data"]["state"])
        for i, m in enumerate(k.log)
        if m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] == comm_id
        and m["content"]["data"].get("method") == "update"
    ]


def test_load_ext_registers_the_magic_with_help(kernel):
    cell = kernel.run("%nitro?")
    help_text = "".join(p["data"]["text/plain"] for p in cell.reply["content"]["payload"])
    assert "%nitro train EXP [--epochs N] [--background] [--no-live-edits] [--fresh]" in help_text
    assert "--no-live-edits" in help_text and "live_edits=False" in help_text
    assert "--split" in help_text and "--batch" in help_text

    wrong = kernel.run("%nitro trian exp", check=False)
    assert wrong.status == "error" and "invalid choice: 'trian'" in wrong.error

    missing = kernel.run("%nitro train nothing_here", check=False)
    assert "no variable named 'nothing_here'" in missing.error

    export = kernel.run("%nitro export", check=False)
    assert "%nitro export needs a directory" in export.error


def test_interrupt_stops_a_foreground_run_and_train_resumes_it(kernel):
    # an epoch of 10 s at least: the interrupt lands in its middle even on a busy machine
    msg_id = kernel.start("exp = tiny_exp.Tiny(batches=1000, delay=0.01)\n%nitro train exp")

    def mid_epoch(message):
        state = message["content"].get("data", {}).get("state", {})
        value = state.get("value")
        return message["msg_type"] == "comm_msg" and isinstance(value, float) and value > 0.02

    kernel.wait_for(mid_epoch, timeout=120, what="a progress update in the middle of the epoch")
    kernel.manager.interrupt_kernel()
    cell = kernel.finish(msg_id)

    assert cell.status == "ok"  # the interrupt became a stop request, not an error
    assert cell.stderr == ""  # a stop is progress, not an error: nothing painted red
    (record,) = cell.updates()  # the panel's final record, with the interrupt's note
    assert "interrupted; stopping training after the current step" in record
    assert "<b>stopped</b>" in record
    step, epoch, reason = ast.literal_eval(
        kernel.eval("(exp_run.step, exp_run.epoch, exp_run.stop_reason)")
    )
    assert reason == "requested" and epoch == 0 and 0 < step < 1000
    assert f"step {step}" in cell.data()[-1]  # the cell returned the handle

    kernel.run("first = exp_run\n%nitro train exp")  # the kernel is alive; resume
    resumed = ast.literal_eval(
        kernel.eval("(exp_run is first, exp_run.step, exp_run.stop_reason, len(exp_run.history()))")
    )
    assert resumed == (True, 1000, "completed", 1)  # continued mid-epoch, not from step 0


def test_background_run_reports_status_and_stops(kernel):
    started = kernel.run(
        """
        @nitro.experiment
        class Chatty(tiny_exp.Tiny):
            def metrics(self, logits, *, y):
                print("metrics from the training thread")
                return {"acc": (logits.argmax(-1) == y).mean()}

        bg = Chatty(batches=20, delay=0.01, max_epochs=1000)
        %nitro train bg --background
        """
    )
    assert kernel.eval("bg_run.running") == "True"  # the cell returned while it trains
    kernel.wait_until("bg_run.epoch >= 1")  # compiled and validating every epoch

    # Another cell runs while the background run validates (and prints): it waits for two more
    # epochs (minutes at most), so at least one validation printed while it ran.
    before = len(kernel.log)
    other = kernel.run(
        """
        import time
        seen, deadline = bg_run.epoch, time.monotonic() + 120
        while bg_run.epoch < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        print('other cell', bg_run.epoch >= seen + 2)
        """
    )
    assert other.stdout == "other cell True\n"

    def chatty(message: dict) -> bool:
        return (
            message["msg_type"] == "stream"
            and "metrics from the training thread" in (message["content"]["text"])
        )

    kernel.wait_for(  # a print from that stretch, however late the kernel sends it
        lambda m: chatty(m) and kernel.log.index(m) > before, what="a print meanwhile"
    )
    printed = [m for m in kernel.log if chatty(m)]
    assert {m["parent_header"]["msg_id"] for m in printed} == {started.msg_id}

    status = kernel.run("%nitro status").stdout
    busy = r"(training|validating|checkpointing|compiling [a-z -]+)"
    assert re.match(rf"bg_run \(Chatty\): {busy}, epoch \d+/1000, step \d+", status)
    assert re.search(r"loss \d\.\d+, [\d.]+ steps/s", status)

    table = kernel.run("%nitro runs").data()[-1]
    assert re.search(rf"bg_run +Chatty +{busy}", table)

    stop = kernel.run("%nitro stop").stdout
    assert stop.startswith("nitro: stopped bg_run at epoch ")
    running, reason, phase = ast.literal_eval(
        kernel.eval("(bg_run.running, bg_run.stop_reason, bg_run.phase)")
    )
    assert (running, reason, phase) == (False, "requested", "stopped")


def test_live_panel_updates_from_the_training_thread_and_its_stop_button_works(kernel):
    kernel.run("panel_exp = tiny_exp.Tiny(batches=20, delay=0.01, max_epochs=1000)")
    cell = kernel.run("%nitro train panel_exp --background")
    idle_at = len(kernel.log)  # everything after this arrived while no cell was running
    panel = "nitro_ipython.live_panel(panel_exp_run)"
    # the run claims the panel its cell displayed once its setup (on the training thread) ends
    kernel.wait_until(f"{panel} is not None", timeout=300)
    bar_id = ast.literal_eval(kernel.eval(f"{panel}.progress.model_id"))
    curves_id = ast.literal_eval(kernel.eval(f"{panel}.plots[0].model_id"))  # the loss plot
    panel_id = ast.literal_eval(kernel.eval(f"{panel}.model_id"))
    views = cell.data("application/vnd.jupyter.widget-view+json")
    assert [view["model_id"] for view in views] == [panel_id]  # shown in the starting cell

    first = kernel.wait_until(f"{panel}.progress.value", lambda value: float(value) > 0)
    later = float(first) + 5 / 1000  # five epochs on
    second = kernel.wait_until(f"{panel}.progress.value", lambda v: float(v) > later)
    assert 0 < float(first) < float(second) < 1

    # The frontend received the updates, sent by the training thread while the kernel idled.
    updates = [s["value"] for i, s in _progress_updates(kernel, bar_id) if i >= idle_at]
    assert len(updates) >= 3 and updates == sorted(updates)
    steps = int(kernel.eval("panel_exp_run.step"))
    assert len(updates) < steps  # throttled: not one message per step
    kernel.wait_until(f"len({panel}.plots[0].value)", lambda size: int(size) > 0)  # drawn
    assert any(i >= idle_at for i, _ in _progress_updates(kernel, curves_id))
    status_html = ast.literal_eval(kernel.eval(f"{panel}.status.value"))
    shown = re.sub(r"<[^>]+>", "", status_html)  # each part in a span kept on one line
    assert re.search(r"(training|validating) &middot; epoch \d+/1000", shown), status_html
    assert "steps/s" in status_html

    # Click Stop the way a browser does: a comm message to the button's model.
    button_id = ast.literal_eval(kernel.eval(f"{panel}.stop_button.model_id"))
    click = kernel.client.session.msg(
        "comm_msg",
        {"comm_id": button_id, "data": {"method": "custom", "content": {"event": "click"}}},
    )
    kernel.client.shell_channel.send(click)
    kernel.wait_until("panel_exp_run.running", lambda value: value == "False")
    assert kernel.eval("panel_exp_run.stop_reason") == "'requested'"
    assert kernel.eval(f"{panel}.progress.bar_style") == "'warning'"


def test_fresh_starts_from_new_weights_and_a_finished_run_says_how_to_continue(kernel):
    kernel.run("short = tiny_exp.Tiny(batches=5)\n%nitro train short\nfirst = short_run")

    again = kernel.run("%nitro train short")
    assert "short_run already trained its 1 epochs (max_epochs=1)" in again.stdout
    assert "`%nitro train short --epochs N` trains N more" in again.stdout

    kernel.run("%nitro train short --fresh")
    fresh = ast.literal_eval(kernel.eval("(short_run is first, short_run.weights_origin)"))
    assert fresh == (False, "build_model")

    refused = kernel.run("short.width = 16\n%nitro train short", check=False)
    assert "the weights of short_run do not fit the new Tiny model" in refused.error
    assert "Add --fresh" in refused.error


def test_export_writes_a_bundle_of_the_latest_run_that_matches_predict(kernel, tmp_path):
    target = tmp_path / "tiny"
    kernel.run("bundled = tiny_exp.Tiny(batches=4)\n%nitro train bundled")
    cell = kernel.run(f"%nitro export {target} --name tiny-net")
    assert f"nitro: exported bundled_run (step 4) to {target} as bundle 'tiny-net'" in cell.stdout
    assert f"serve it with `nitro serve {target}`" in cell.stdout
    kernel.run(
        "import numpy as np, nitro.bundle\n"
        "probe = np.ones((3, 4), np.float32)\n"
        f"served = nitro.bundle.load({str(target)!r})(x=probe)['output']"
    )
    assert (
        kernel.eval("bool(np.abs(served - bundled_run.predict({'x': probe})).max() < 1e-6)")
        == "True"
    )
    assert sorted(p.name for p in target.iterdir()) == [
        "manifest.json",
        "program.jaxexport",
        "weights.safetensors",
    ]


def test_export_takes_echo_batch_sizes_and_axes_with_the_checks_of_n_export(kernel, tmp_path):
    target = tmp_path / "tagged"
    kernel.run(
        """
        import jax, jax.numpy as jnp

        @nitro.experiment
        class TaggedTiny(tiny_exp.Tiny):
            def export_inputs(self):
                return {"x": jax.ShapeDtypeStruct((4,), jnp.float32),
                        "id": jax.ShapeDtypeStruct((), jnp.int32)}

        tagged = TaggedTiny(batches=2)
        """
    )
    kernel.run("%nitro train tagged")
    cell = kernel.run(
        f"%nitro export {target} --echo id --batch-sizes 2 8 --axes x=batch,feature "
        f"--axes output=batch,"
    )
    assert f"nitro: exported tagged_run (step 2) to {target}" in cell.stdout
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["program"]["batch_sizes"] == [2, 8]
    assert [(e["name"], e["axes"]) for e in manifest["inputs"]] == [
        ("x", ["batch", "feature"]),
        ("id", ["batch"]),
    ]
    assert [(e["name"], e["axes"], e.get("echo")) for e in manifest["outputs"]] == [
        ("output", ["batch", None], None),
        ("id", ["batch"], "id"),
    ]
    wrong = tmp_path / "wrong"
    sizes = kernel.run(f"%nitro export {wrong} --batch-sizes 8 2", check=False)
    assert "ExportError" in sizes.error and "got (8, 2)" in sizes.error
    rank = kernel.run(f"%nitro export {wrong} --axes x=batch,height,width", check=False)
    assert (
        "axes['x'] names 3 axes ('batch', 'height', 'width'), but x: float32[batch, 4] has 2"
    ) in rank.error
    echo = kernel.run(f"%nitro export {wrong} --echo key", check=False)
    assert "echo names 'key', which is not an input of the bundle" in echo.error
    form = kernel.run(f"%nitro export {wrong} --axes x", check=False)
    assert "--axes takes NAME=AXIS,AXIS,... (e.g. --axes x=batch,height,width" in form.error
    assert not wrong.exists()


def test_an_experiment_defined_in_a_cell_exports_and_a_magic_takes_a_trailing_comment(
    kernel, tmp_path
):
    target = tmp_path / "cell"
    kernel.run(
        """
        @nitro.experiment
        class InACell(tiny_exp.Tiny):
            pass

        celled = InACell(batches=2)
        """
    )
    kernel.run("%nitro train celled   # a note: the line's rest is a comment")
    cell = kernel.run(f"%nitro export {target}  # the class has no source file")
    assert f"nitro: exported celled_run (step 2) to {target}" in cell.stdout
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["provenance"]["experiment"].endswith("InACell")
