"""A hook that fails in a notebook run (a real kernel): the hook named with its file and line,
the user's frames shown and Nitro's folded, and where the exception is kept."""

from __future__ import annotations

import re

from notebook_kernel import kernel_fixture  # noqa: F401 - provides the `kernel` fixture

BROKEN = """
import nitro
import tiny_exp


@nitro.experiment
class Broken(tiny_exp.Tiny):
    def loss(self, logits, *, y):
        raise RuntimeError("the loss is broken")
"""

SUMMARY = (
    "failed in hook Broken.loss (broken_exp.py, line 9): RuntimeError: the loss is broken "
    "(the exception is kept in {}.error)"
)


def _check_folded(lines: list[str]) -> None:
    text = "\n".join(lines)
    assert re.search(r"… \d+ frames in nitro", text)
    assert 'broken_exp.py", line 9, in loss' in text
    assert 'raise RuntimeError("the loss is broken")' in text
    assert "RuntimeError: the loss is broken" in text
    assert "/nitro/" not in text and "/nitro_ipython/" not in text  # no frame of Nitro's shown


def _import_broken(kernel) -> None:
    (kernel.cwd / "broken_exp.py").write_text(BROKEN)
    kernel.run("import broken_exp")


def test_a_hook_failing_in_the_background_names_itself_and_shows_its_frames(kernel):
    _import_broken(kernel)
    started = kernel.run("back = broken_exp.Broken()\n%nitro train back --background")
    kernel.wait_for(
        lambda m: (
            m["parent_header"].get("msg_id") == started.msg_id
            and m["msg_type"] == "stream"
            and "RuntimeError: the loss is broken" in m["content"]["text"]
        ),
        what="the background run's traceback",
    )
    kernel.run("%nitro wait back_run", check=False)
    outputs = kernel.outputs(started.msg_id)
    printed = "".join(o["text"] for o in outputs if o["output_type"] == "stream")
    _check_folded(printed.splitlines())
    records = [o["data"].get("text/html", "") for o in outputs if o["output_type"] != "stream"]
    assert any(SUMMARY.format("back_run") in r for r in records), (records, printed)
    assert kernel.eval("type(back_run.error).__name__") == "'RuntimeError'"


def test_a_hook_failing_in_the_foreground_shows_the_same_folded_traceback(kernel):
    _import_broken(kernel)
    cell = kernel.run("front = broken_exp.Broken()\n%nitro train front", check=False)
    assert cell.error == "RuntimeError: the loss is broken"
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in cell.reply["content"]["traceback"]]
    _check_folded(lines)
    assert lines[-1] == "nitro: " + SUMMARY.format("front_run")
    assert kernel.eval("type(front_run.error).__name__") == "'RuntimeError'"


def test_a_failure_without_a_panel_prints_the_summary_and_the_traceback(kernel):
    """The reporter of a kernel without widgets: lines on stdout."""
    _import_broken(kernel)
    cell = kernel.run(
        "from nitro_ipython.reporters import LineTracker\n"
        "lines = nitro.Nitro(broken_exp.Broken(), progress=LineTracker())\n"
        "lines.train(background=True)\nlines.wait()",
        check=False,
    )
    assert "nitro: " + SUMMARY.format("lines") in cell.stdout + cell.stderr
    _check_folded(cell.reply["content"]["traceback"])


def test_a_population_whose_hook_fails_names_the_hook_as_a_run_does(kernel):
    _import_broken(kernel)
    started = kernel.run(
        "popf = nitro.Population(broken_exp.Broken(), learning_rate=[1e-3, 1e-2])\n"
        "%nitro train popf --background"
    )
    kernel.wait_for(
        lambda m: (
            m["parent_header"].get("msg_id") == started.msg_id
            and m["msg_type"] == "stream"
            and "RuntimeError: the loss is broken" in m["content"]["text"]
        ),
        what="the background population's traceback",
    )
    waited = kernel.run("%nitro wait popf", check=False)
    assert "RuntimeError" in waited.error  # its wait() raises it
    outputs = kernel.outputs(started.msg_id)
    printed = "".join(o["text"] for o in outputs if o["output_type"] == "stream")
    _check_folded(printed.splitlines())
    records = [o["data"].get("text/html", "") for o in outputs if o["output_type"] != "stream"]
    summary = SUMMARY.format("popf")  # a population keeps its error as a run does
    assert any(summary in r and "<b>failed</b>" in r for r in records), (records, printed)
