"""What the magics say about runs that ended, how they count epochs after a stop during
validation, and how `%nitro runs` shows its numbers (a real kernel)."""

from __future__ import annotations

import ast
import re
import time

from notebook_kernel import kernel_fixture  # noqa: F401 - provides the `kernel` fixture


def _wait_until(kernel, expression: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while kernel.eval(expression) != "True":
        assert time.monotonic() < deadline, f"{expression} stayed false"
        kernel.pump(0.05)


def test_stop_on_a_finished_run_says_it_is_not_running(kernel):
    kernel.run("fin = tiny_exp.Tiny(batches=3, max_epochs=2)\n%nitro train fin")
    said = kernel.run("%nitro stop fin_run").stdout
    assert (
        said == "nitro: fin_run is not running (finished at epoch 2/2, step 6); nothing to stop\n"
    )


def test_runs_shows_losses_and_rates_with_a_sensible_precision(kernel):
    kernel.run("tab = tiny_exp.Tiny(batches=3, max_epochs=2)\n%nitro train tab")
    table = kernel.run("%nitro runs").data()[-1]
    row = re.search(r"tab_run +Tiny +done +2/2 +6 +(\S+) +(\S+) +False", table)
    assert row, table
    loss, rate = row.groups()
    assert re.fullmatch(r"\d\.\d{1,4}|\d{2,}\.?\d*", loss), loss  # 4 significant digits
    assert re.fullmatch(r"[\d,]+", rate), rate  # whole steps per second
    html = kernel.run("%nitro runs").data("text/html")[-1]
    assert f"<td>{loss}</td>" in html and f"<td>{rate}</td>" in html


def test_one_more_epoch_after_a_stop_during_validation_trains_one_more_epoch(kernel):
    kernel.run(
        """
        @nitro.experiment
        class SlowVal(tiny_exp.Tiny):
            def build_data(self):
                data = super().build_data()
                data["val"] = tiny_exp.SlowBatches(40, 8, 0.05)
                return data

        sv = SlowVal(batches=3, max_epochs=3)
        """
    )
    kernel.run("%nitro train sv --background")
    _wait_until(kernel, "sv_run.phase == 'validating'")
    kernel.run("%nitro stop sv_run")
    assert ast.literal_eval(kernel.eval("(sv_run.epoch, sv_run.step)")) == (0, 3)
    kernel.run("%nitro train sv_run --epochs 1")  # the stopped epoch is validated, then one more
    assert ast.literal_eval(kernel.eval("(sv_run.epoch, sv_run.step)")) == (2, 6)
    assert kernel.eval("sv_run.history()['step'].tolist()") == "[3, 6]"


def test_train_a_class_with_a_preset_stores_its_run_and_runs_shows_the_preset(kernel):
    kernel.run(
        """
        @nitro.experiment
        class Sized(tiny_exp.Tiny):
            @classmethod
            def presets(cls):
                return {"small": {"width": 4, "batches": 3}}
        """
    )
    kernel.run("%nitro train Sized --preset small")
    shown = kernel.eval(
        "(sized_small_run.preset, sized_small_run.experiment.width, sized_small_run.step)"
    )
    assert shown == "('small', 4, 3)"
    table = kernel.run("%nitro runs").data()[-1]
    assert re.search(r"sized_small_run +Sized +small +done +1/1 +3 ", table), table
    on_disk = r"sized_small_run +Sized +[\d-]+ [\d:]+ +sized_small_run +small +1 "
    assert re.search(on_disk, table), table
    unknown = kernel.run("%nitro train Sized --preset big", check=False)
    assert unknown.reply["content"]["ename"] == "UsageError"
    assert unknown.error == (
        "UsageError: %nitro train Sized --preset big: Sized has no preset 'big'. Its presets: "
        "'small'."
    )
    kernel.run("sized = Sized()")
    instance = kernel.run("%nitro train sized --preset small", check=False)
    assert instance.error == (
        "UsageError: %nitro train sized --preset small: --preset builds the experiment from its "
        "class, and sized is a Sized; name the class: `%nitro train Sized --preset small`"
    )


def test_rewind_and_fork_go_back_in_a_run_and_branch_from_it(kernel):
    kernel.run("tt = tiny_exp.Tiny(batches=3, max_epochs=2)\n%nitro train tt")
    listed = kernel.run("%nitro rewind tt_run").data()[-1]  # the steps it can go back to
    assert re.search(r"\n0 +0 +0 +memory", listed), listed
    kernel.run("%nitro rewind tt_run 0")
    assert kernel.eval("(tt_run.step, len(tt_run.state.rewinds))") == "(0, 1)"
    said = kernel.run("%nitro fork tt_run").stdout.splitlines()
    assert re.fullmatch(r"nitro: forked from run \S+ at step 0 \(epoch 0\)", said[0]), said
    assert said[1] == "nitro: the fork is `tt_run_fork`; %nitro train tt_run_fork trains it"
    assert kernel.eval("_nitro is tt_run_fork and tt_run_fork.forked_from['step'] == 0") == "True"


def test_a_forks_panel_overlays_its_parents_curves_from_the_fork_step(kernel):
    kernel.run("ft = tiny_exp.Tiny(batches=3, max_epochs=2)\n%nitro train ft")
    kernel.run("ft_fork = ft_run.fork(step=3)\n%nitro train ft_fork")
    branches = kernel.eval(
        "[[r['epoch'] for r in b[2]] for b in ft_fork.reporter.curves.branches()]"
    )
    assert branches == "[[2]]"  # the parent's epoch after the fork step, drawn dimmed
    marks = kernel.eval("[label for _, label in ft_fork.reporter.curves.marks()]")
    assert f"forked from {kernel.eval('ft_run.run_id').strip(chr(39))}" in marks
