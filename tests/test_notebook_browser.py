"""The notebooks in a real browser: JupyterLab in headless Chromium, driven like a person would.

What a kernel-level test cannot see: that the panel renders as widgets, that its numbers move
on screen, that the Stop button and the toolbar's interrupt stop runs, and that a saved and
reopened notebook shows each run's static record. Screenshots go to tests/artifacts/ (or
$NITRO_TEST_ARTIFACTS); docs/*.png are taken from them.
"""

from __future__ import annotations

import re
import time

import browser
import pytest
from browser import Lab, copy_notebooks, require_browser

# tutorial.ipynb and interrupt_and_edit.ipynb: the cells the tests run, by index
LOAD, FIELDS, TRAIN, HISTORY, PLOT, MORE, CACHE, BACKGROUND, RUNS = 2, 4, 6, 8, 9, 11, 12, 19, 22
EDIT_SETUP, EDIT_MODULE, EDIT_IMPORT, EDIT_TRAIN, EDIT_REPORT, EDIT_SAVE, EDIT_RETRAIN = (
    1,
    3,
    4,
    7,
    8,
    10,
    12,
)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    require_browser()
    root = tmp_path_factory.mktemp("lab")
    copy_notebooks(root)
    lab = Lab(root)
    try:
        yield lab
    finally:
        lab.close()


_LIVE_CURVES = (
    "[...window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]].node"
    ".querySelectorAll('.jp-OutputArea img')].some(i => i.naturalWidth > 0)"
)


def _stop(lab: Lab, cell: int) -> None:
    """Click Stop in `cell`'s panel and wait (generously: a loaded machine only makes it
    slower) until the page shows the run stopped."""
    lab.click_stop(cell)
    lab.wait_for(
        "(window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]].node"
        ".querySelector('.nitro-record')?.innerText || '').includes('stopped')",
        120,
        cell,
        what="the stopped run's record",
    )


def _redraws(lab: Lab, cell: int, wanted: int, timeout: float = 120.0) -> int:
    """How many times the curves image of `cell` changed, watching until it has changed
    `wanted` times (or `timeout` passed: a busy machine only makes it take longer)."""
    images = "return [...nb.content.widgets[args[0]].node.querySelectorAll('img')].map(i => i.src)"
    seen, changes = lab.js(images, cell), 0
    deadline = time.monotonic() + timeout
    while changes < wanted and time.monotonic() < deadline:
        time.sleep(0.05)
        now = lab.js(images, cell)
        changes, seen = changes + (now != seen), now
    return changes


def _advancing(lab: Lab, cell: int, timeout: float = 120.0) -> tuple[dict, dict]:
    """Two reads of a training panel: the first, and the first later one whose step and bar
    moved on (or the last one once `timeout` passed: a busy machine only makes it take
    longer)."""
    first = lab.panel(cell)
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(0.2)
        second = lab.panel(cell)
        moved = second["step"] > first["step"] and second["bar"] > first["bar"]
        if moved or time.monotonic() > deadline:
            return first, second


def test_tutorial_panels_render_update_stop_and_survive_a_reopen(lab):
    lab.open("tutorial.ipynb")
    lab.run(LOAD)
    assert "hidden width; bakes into the program" in lab.run(FIELDS)  # docs of a cell's class

    lab.run(TRAIN)
    done = lab.panel(TRAIN)
    assert not done["widgets"] and done["images"] == 1  # the record replaced the live panel
    assert re.search(r"done · epoch 6/6 · step 114 · loss [\d.]+ · [\d,]+ steps/s", done["record"])
    assert "Nitro: Digits" in done["text"]  # then the handle as a table
    lab.screenshot("tutorial-train-record", lab.cell(TRAIN))
    lab.run(HISTORY)
    lab.run(PLOT)
    lab.run(MORE)
    assert "epoch 9/9" in lab.panel(MORE)["record"]  # trained 3 more: the target moved
    cache = lab.run(CACHE)
    assert "why each program compiled" in cache and "train step" in cache

    # A background run: live widgets, moving numbers, a working Stop button.
    lab.start(BACKGROUND)
    lab.wait_done(BACKGROUND)
    lab.wait_for(
        "window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]].node"
        ".querySelector('.progress-bar')",
        120,
        BACKGROUND,
        what="the live panel's progress bar",
    )
    lab.wait_for(_LIVE_CURVES, 120, BACKGROUND, what="the live curves")
    assert _redraws(lab, BACKGROUND, wanted=3) == 3  # the curves keep redrawing while it trains
    first, second = _advancing(lab, BACKGROUND)
    assert first["widgets"] and "live training panel" not in first["text"]
    assert first["overflow"] <= 0  # no horizontal scrollbar
    assert first["button"] == "Stop" and first["buttonEnabled"]
    assert second["bar"] > first["bar"] and second["step"] > first["step"]
    # the phase of the moment: a save (about 5% of the time) shows as checkpointing, and
    # "auto" moving to a fused program as compiling
    assert re.match(
        r"(training|validating|checkpointing|compiling [a-z -]+) · epoch \d+/30000",
        second["status"],
    )
    lab.screenshot("live-panel", lab.cell(BACKGROUND))
    _stop(lab, BACKGROUND)

    # The same run continued: a fresh panel whose Stop button works.
    lab.start(BACKGROUND)
    lab.wait_done(BACKGROUND)
    lab.wait_for(
        "window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]].node"
        ".querySelector('.progress-bar')",
        120,
        BACKGROUND,
        what="the continued run's panel",
    )
    first, second = _advancing(lab, BACKGROUND)
    assert first["button"] == "Stop" and first["buttonEnabled"]
    assert "progress-bar-info" in first["barClass"]
    assert second["step"] > first["step"] > 0
    _stop(lab, BACKGROUND)
    runs = lab.run(RUNS)
    assert re.search(r"exp_run\s+Digits\s+done\s+9/9", runs)
    assert re.search(r"long_exp_run\s+Digits\s+stopped\s+\d+/30000", runs)

    # Saved and reopened (a new kernel): the records are still there, no widget errors.
    lab.save_and_close()
    lab.open("tutorial.ipynb")
    for cell, phase in ((TRAIN, "done"), (BACKGROUND, "stopped")):
        shown = lab.panel(cell)
        assert phase in shown["record"] and shown["images"] == 1, shown
    page = lab.js("return nb.content.node.innerText;")
    assert "Error displaying widget" not in page and "model not found" not in page
    lab.screenshot("tutorial-reopened", lab.cell(TRAIN))
    lab.save_and_close()


def test_interrupt_button_stops_a_foreground_run_and_the_kernel_goes_on(lab):
    lab.open("interrupt_and_edit.ipynb")
    lab.run(EDIT_SETUP)
    lab.run(EDIT_MODULE)
    lab.run(EDIT_IMPORT)

    lab.start(EDIT_TRAIN)  # 2000 epochs: press the interrupt button while it trains
    lab.wait_for(
        "(window.jupyterapp.shell.currentWidget.content.widgets[arguments[0]].node"
        ".querySelector('.jp-OutputArea')?.innerText || '').match(/ step ([2-9]\\d{2}|[1-9]\\d{3,})/)",
        120,
        EDIT_TRAIN,
        what="a few hundred steps (auto has decided its steps per call)",
    )
    lab.wait_for(_LIVE_CURVES, 120, EDIT_TRAIN, what="the live curves")
    time.sleep(1.0)  # a few more epochs on the curves
    training = lab.panel(EDIT_TRAIN)
    assert training["widgets"] and training["button"] == "Interrupt ■ to stop"
    assert not training["buttonEnabled"]  # a click would wait for the cell
    lab.screenshot("interrupt-1-training", lab.cell(EDIT_TRAIN))

    lab.click_interrupt()
    lab.wait_done(EDIT_TRAIN, timeout=120)  # it stops after the current step
    stopped = lab.panel(EDIT_TRAIN)
    assert "stopped" in stopped["record"]
    assert "interrupted; stopping training after the current step" in stopped["record"]
    assert "Traceback" not in stopped["text"] and "KeyboardInterrupt" not in stopped["text"]
    step = int(re.search(r"step (\d+)", stopped["record"]).group(1))
    lab.screenshot("interrupt-2-stopped", lab.cell(EDIT_TRAIN))

    report = lab.run(EDIT_REPORT)  # the kernel is alive and the handle says where it stopped
    assert "stop reason: requested" in report and f"stopped at step {step}:" in report

    lab.run(EDIT_SAVE)
    retrained = lab.run(EDIT_RETRAIN)
    assert "reloaded digits_edit_demo: changed Digits.loss" in retrained
    # the edited loss reaches the train program and eval forward (and the single step too,
    # when the interrupted run stopped between fused calls not lined up with its epoch)
    assert re.search(r"programs compiled for the edit: [23]\b", retrained), retrained
    assert "done" in lab.panel(EDIT_RETRAIN)["record"]
    lab.screenshot("interrupt-3-retrained", lab.cell(EDIT_RETRAIN))
    lab.save_and_close()


def test_a_notebook_saved_while_a_run_trains_reopens_with_its_latest_state(lab):
    """JupyterLab autosaves every two minutes: a run live at the save, whose kernel then dies,
    leaves its stand-in (the panel's latest state), not "model not found"."""
    import nbformat

    tutorial = nbformat.read(lab.root / "tutorial.ipynb", as_version=4)
    cells = [tutorial.cells[LOAD].source, tutorial.cells[FIELDS].source]
    cells.append("live = Digits(max_epochs=30_000)\n%nitro train live --background")
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(c) for c in cells], metadata=tutorial.metadata
    )
    nbformat.write(notebook, lab.root / "saved_live.ipynb")
    standin = (
        "const s = nb.content.widgets[args[0]].node.querySelector('.nitro-standin');"
        "return s ? [getComputedStyle(s.closest('.jp-OutputArea-child')).display, s.innerText]"
        " : null;"
    )
    lab.open("saved_live.ipynb")
    lab.run(0)
    lab.run(1)
    lab.start(2)
    lab.wait_done(2)
    lab.wait_for(
        "(window.jupyterapp.shell.currentWidget.content.widgets[2].node.querySelector("
        "'.nitro-standin')?.textContent || '').match(/epoch [1-9]\\d*\\/30000/)",
        120,
        what="the stand-in of a few epochs",
    )
    assert lab.js(standin, 2)[0] == "none"  # hidden while the widget lives
    assert lab.panel(2)["widgets"]

    # the kernel restarts with the notebook open: the frozen panel (its Stop button does
    # nothing now) gives way to the stand-in
    lab.js("await nb.sessionContext.session.kernel.restart();")
    lab.wait_for_kernel("idle", timeout=120)
    lab.wait_for(
        "getComputedStyle(window.jupyterapp.shell.currentWidget.content.widgets[2].node"
        ".querySelector('.nitro-standin').closest('.jp-OutputArea-child')).display !== 'none'",
        120,
        what="the stand-in after the restart",
    )
    assert not lab.js(
        "return [...nb.content.widgets[2].node.querySelectorAll('button')]"
        ".some(b => b.offsetParent !== null);"
    )  # no Stop button to click
    lab.screenshot("saved-live-restarted", lab.cell(2))

    lab.save_and_close()  # the save, then the kernel dies
    lab.open("saved_live.ipynb")
    lab.wait_for(
        "window.jupyterapp.shell.currentWidget.content.widgets[2].node.querySelector("
        "'.jp-OutputArea-output.jupyter-widgets')",
        120,
        what="the dead widget's output",
    )
    shown, text = lab.js(standin, 2)
    assert shown != "none" and re.search(
        r"Digits\s+last seen (training|validating|checkpointing|compiling [a-z -]+)", text
    )
    assert re.search(r"epoch [1-9]\d*/30000", text), text
    page = lab.js("return nb.content.node.innerText;")
    assert "Error displaying widget" not in page and "model not found" not in page
    lab.screenshot("saved-live-reopened", lab.cell(2))
    lab.save_and_close()


def test_an_edit_saved_during_a_background_run_is_marked_on_its_curves(lab):
    """Edit while training: the module file saved from the notebook while a run trains is
    compiled beside it and swapped in; the panel marks the swap on the loss curve, and the
    swaps' table names its step."""
    import nbformat
    from notebook_kernel import TINY_MODULE

    loss = ".mean()\n\n    def metrics"
    cells = [
        f"from pathlib import Path\nPath('live_demo.py').write_text({TINY_MODULE!r})\n"
        "%load_ext nitro\nimport nitro, live_demo",
        "demo_run = nitro.Nitro(live_demo.Tiny(max_epochs=100_000, delay=0.002), "
        "steps_per_dispatch=1)\n%nitro train demo_run --background",
        # the edit, saved from the notebook: the loss times 1000
        f"source = Path('live_demo.py').read_text()\n"
        f"Path('live_demo.py').write_text(source.replace({loss!r}, "
        f"{'.mean() * 1000.0' + loss[7:]!r}))",
        "demo_run.swaps()[['epoch', 'status', 'changed']]",
        "%nitro status demo_run",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(notebook, lab.root / "live_edit.ipynb")
    lab.open("live_edit.ipynb")
    lab.run(0)
    lab.start(1)
    lab.wait_done(1)
    lab.wait_for(_LIVE_CURVES, 120, 1, what="the live curves")
    lab.wait_for(
        "(window.jupyterapp.shell.currentWidget.content.widgets[1].node.querySelector("
        "'.jp-OutputArea')?.innerText || '').match(/ step ([1-9]\\d{2,})/)",
        120,
        what="a hundred steps",
    )
    lab.run(2)
    lab.wait_for(
        "(window.jupyterapp.shell.currentWidget.content.widgets[1].node.querySelector("
        "'.jp-OutputArea')?.innerText || '').includes('edit: loss at step')",
        120,
        what="the key to the swap's marker on the curves",
    )
    step = int(re.search(r"edit: loss at step (\d+)", lab.panel(1)["text"]).group(1))
    # the status line is its own widget and may redraw after the curves
    lab.wait_for(
        "(window.jupyterapp.shell.currentWidget.content.widgets[1].node.querySelector("
        "'.jp-OutputArea')?.innerText || '').includes(arguments[0])",
        120,
        f"swapped in the edit of `loss` at step {step}",
        what="the swap's line in the status",
    )
    shown = lab.panel(1)
    assert shown["widgets"] and shown["button"] == "Stop"  # still training
    assert f"swapped in the edit of `loss` at step {step}" in shown["text"]
    time.sleep(1.0)  # the curves redraw with the marker and the steps after it
    lab.screenshot("live-edit-marker", lab.cell(1))

    swaps = lab.run(3)
    assert re.search(rf"{step}\s+\d+\s+swapped\s+\[loss\]", swaps), swaps
    status = lab.run(4)
    # still running: between epochs it reads "validating"
    assert re.search(r"demo_run \(Tiny\): (training|validating)", status), status
    assert f"step {step}: edit of loss swapped" in status
    _stop(lab, 1)
    lab.save_and_close()


def test_a_population_s_panel_is_the_run_s_with_its_members_table_and_buttons(lab):
    """A population in the browser: the run's panel (bar, status, the loss and metric plots
    side by side) with every member's curves, a plot naming the members, and the members'
    table; a member's Stop button prunes it, the run's Stop button stops the run, and the
    record keeps the table."""
    import nbformat
    from notebook_kernel import TINY_MODULE

    cells = [
        f"from pathlib import Path\nPath('pop_demo.py').write_text({TINY_MODULE!r})\n"
        "%load_ext nitro\nimport nitro, pop_demo",
        "pop = nitro.Population(pop_demo.Tiny(max_epochs=100_000, delay=0.002), "
        "learning_rate=[1e-3, 1e-2], seed=[0, 1], steps_per_dispatch=1)\n"
        "%nitro train pop --background",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(notebook, lab.root / "population.ipynb")
    lab.open("population.ipynb")
    lab.run(0)
    lab.start(1)
    lab.wait_done(1)
    shown_images = (
        "[...window.jupyterapp.shell.currentWidget.content.widgets[1].node"
        ".querySelectorAll('.jp-OutputArea img')].filter(i => i.offsetParent !== null"
        " && i.naturalWidth > 0).length"
    )
    lab.wait_for(f"{shown_images} === 3", 120, what="the loss, acc and members plots")
    lab.wait_for(
        "(window.jupyterapp.shell.currentWidget.content.widgets[1].node.querySelector("
        "'.jp-OutputArea')?.innerText || '').match(/epoch [2-9]\\d*\\/100000/)",
        120,
        what="a few epochs",
    )
    buttons = "return [...nb.content.widgets[1].node.querySelectorAll('button')].map(b => [b.textContent.trim(), b.disabled]);"
    assert lab.js(buttons) == [["Stop", False]] * 5  # the run's, then one per member
    live = lab.panel(1)
    assert live["widgets"] and "4 of 4 members training" in live["status"]

    from selenium.webdriver.common.by import By

    lab.output(1).find_elements(By.CSS_SELECTOR, "button")[3].click()  # member 2's
    lab.wait_for(
        "(window.jupyterapp.shell.currentWidget.content.widgets[1].node.querySelector("
        "'.jp-OutputArea')?.innerText || '').includes('3 of 4 members training')",
        120,
        what="member 2 pruned",
    )
    assert lab.js(buttons)[3] == ["Stopped", True]
    time.sleep(1.0)  # the curves redraw with member 2's ended
    lab.screenshot("population-panel", lab.cell(1))
    _stop(lab, 1)
    record = lab.panel(1)["record"]
    assert "stopped by its Stop button in the panel" in record and "rank" in record
    lab.save_and_close()


def test_without_chromium_the_browser_tests_skip_and_say_how_to_install_it(monkeypatch):
    monkeypatch.setattr(browser, "CHROMIUM", "/nonexistent/chromium")
    with pytest.raises(pytest.skip.Exception, match=r"make browser.*apt-get install chromium"):
        require_browser()


def test_the_gallery_shows_refreshes_and_survives_a_save_and_reopen_as_an_image(lab):
    import nbformat

    cells = [
        "%load_ext nitro\nimport nitro_ipython.sample_gallery as sample_gallery\n"
        "sample_gallery.SHARE = 0.5  # redraw soon after each drawing, to see it refresh\n"
        "from nitro.examples.digits import Digits",
        "gal = Digits(max_epochs=30_000)\n%nitro train gal --background",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(notebook, lab.root / "gallery.ipynb")
    gallery = (
        "[...window.jupyterapp.shell.currentWidget.content.widgets[1].node"
        ".querySelectorAll('img.nitro-gallery-live')].filter(i => i.naturalWidth > 0)"
        ".map(i => i.src)[0]"
    )
    lab.open("gallery.ipynb")
    lab.run(0)
    lab.start(1)
    lab.wait_done(1)
    first = lab.wait_for(gallery, 120, what="the live gallery")
    lab.wait_for(f"({gallery}) !== arguments[0]", 120, first, what="a refreshed gallery")
    lab.screenshot("live-gallery", lab.cell(1))
    _stop(lab, 1)
    record = (
        "const img = nb.content.widgets[1].node.querySelector('.nitro-record .nitro-gallery img');"
        "return img ? [img.naturalWidth, img.src.slice(0, 22)] : null;"
    )
    lab.wait_for(
        "window.jupyterapp.shell.currentWidget.content.widgets[1].node"
        ".querySelector('.nitro-record .nitro-gallery img')?.naturalWidth > 0",
        120,
        what="the gallery in the record",
    )
    lab.save_and_close()
    lab.open("gallery.ipynb")
    lab.wait_for(
        "window.jupyterapp.shell.currentWidget.content.widgets[1].node"
        ".querySelector('.nitro-record .nitro-gallery img')?.naturalWidth > 0",
        120,
        what="the gallery in the reopened record",
    )
    width, source = lab.js(record)
    assert width > 400 and source == "data:image/png;base64,"
    page = lab.js("return nb.content.node.innerText;")
    assert "Error displaying widget" not in page and "model not found" not in page
    lab.screenshot("gallery-reopened", lab.cell(1))
    lab.save_and_close()
