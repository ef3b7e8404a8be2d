"""After a kernel restart, `%nitro train exp --resume` continues the run the killed kernel left
on disk, and `%nitro runs` lists the experiment's run directories (a real kernel)."""

from __future__ import annotations

import ast
import os
import re

import pytest
from notebook_kernel import TINY_MODULE, Kernel

SETUP = """
import sys
sys.path.insert(0, {cwd!r})
%load_ext nitro
import nitro, tiny_exp
"""


@pytest.fixture
def kernel(tmp_path):
    (tmp_path / "tiny_exp.py").write_text(TINY_MODULE)
    k = Kernel(tmp_path)
    try:
        k.run(SETUP.format(cwd=str(tmp_path)))
        yield k
    finally:
        k.close()


def test_resume_after_a_kernel_restart_continues_the_killed_kernels_run(kernel, tmp_path):
    kernel.run("exp = tiny_exp.Tiny(batches=6, max_epochs=4)\n%nitro train exp --epochs 2")
    run_id, losses = ast.literal_eval(
        kernel.eval("(exp_run.run_id, exp_run.history()['loss'].tolist())")
    )

    # saves are written in the background: a kill loses the one in flight (a graceful
    # shutdown waits for it), so this waits for it before killing
    kernel.run("exp_run.wait()")
    kernel.manager.restart_kernel(now=True)  # kills the kernel process: everything in it is gone
    kernel.client.wait_for_ready(timeout=120)
    kernel.run(SETUP.format(cwd=str(tmp_path)))
    assert kernel.eval("'exp_run' in globals()") == "False"

    kernel.run("exp = tiny_exp.Tiny(batches=6, max_epochs=4)")
    listed = kernel.run("%nitro runs").data()[-1]  # the notebook's experiments' runs on disk
    assert "no runs in this kernel" in listed
    assert re.search(rf"{run_id} +Tiny +\S+ \S+ +exp_run +\d +2 +val_loss \d\.\d+", listed), listed

    cell = kernel.run("%nitro train exp --resume")
    assert f"exp_run continues run {run_id} from its checkpoint at epoch 2, step 12" in cell.stdout
    resumed = ast.literal_eval(
        kernel.eval(
            "(exp_run.run_id, exp_run.epoch, exp_run.step, exp_run.history()['step'].tolist(), "
            "exp_run.history()['loss'].tolist())"
        )
    )
    assert resumed[:4] == (run_id, 4, 24, [6, 12, 18, 24])
    assert resumed[4][:2] == losses  # the history continues the killed kernel's
    # the curves hold every epoch of the history, not only the resumed run's
    assert kernel.eval("[r['epoch'] for r in exp_run.reporter.curves.rows[0]]") == "[1, 2, 3, 4]"
    table = kernel.eval("exp_run._repr_html_()")
    assert f"checkpoint of run {run_id} at epoch 2, step 12" in table  # not build_model
    # the resume's note is in the run's record, above its end, not printed below it
    (record, *_) = [u for u in cell.updates("text/html") if "nitro-standin" not in u][-1:]
    assert f"resumed run {run_id} from its checkpoint at epoch 2, step 12" in record
    assert "resumed run" not in cell.stdout

    listed = kernel.run("%nitro runs").data()[-1]
    assert re.search(rf"{run_id} +exp_run +Tiny .* 4 +val_loss", listed), listed


def test_resume_and_fresh_together_are_refused(kernel):
    cell = kernel.run("exp = tiny_exp.Tiny()\n%nitro train exp --resume --fresh", check=False)
    assert "--resume continues a run on disk, --fresh starts over" in cell.error


DIGITS = """
import nitro, tiny_exp

@nitro.experiment
class Digits(tiny_exp.Tiny):  # a notebook's class: module __main__, like the shipped notebooks'
    pass
"""


def notebook_kernel(tmp_path, notebook: str) -> Kernel:
    """A kernel as jupyter_server starts one for `notebook` (it sets JPY_SESSION_NAME)."""
    k = Kernel(tmp_path, env={"JPY_SESSION_NAME": str(tmp_path / notebook)})
    k.run(SETUP.format(cwd=str(tmp_path)) + DIGITS)
    return k


def restart(k: Kernel, tmp_path) -> None:
    """Kill the kernel once its handles' saves are written (a kill loses the one in flight),
    then start it again."""
    k.run("import gc\n_ = [h.wait() for h in gc.get_objects() if isinstance(h, nitro.Nitro)]")
    k.manager.restart_kernel(now=True)
    k.client.wait_for_ready(timeout=120)
    k.run(SETUP.format(cwd=str(tmp_path)) + DIGITS)


def test_two_notebooks_same_named_classes_do_not_resume_each_others_runs(tmp_path):
    (tmp_path / "tiny_exp.py").write_text(TINY_MODULE)
    first = notebook_kernel(tmp_path, "a.ipynb")
    try:
        first.run("exp = Digits(batches=4, max_epochs=2)\n%nitro train exp")
        theirs = ast.literal_eval(first.eval("(exp_run.run_id, exp_run.run_dir)"))
    finally:
        first.close()  # the kernel's end waits for the save written in the background
    saved = sorted(os.listdir(os.path.join(theirs[1], "checkpoints")))
    second = notebook_kernel(tmp_path, "b.ipynb")
    try:
        cell = second.run("exp = Digits(batches=4, max_epochs=3)\n%nitro train exp --resume")
        assert "no checkpoint of exp_run (Digits from this notebook)" in cell.stdout
        assert "starting a fresh run" in cell.stdout
        ours = ast.literal_eval(second.eval("(exp_run.run_id, exp_run.step, exp_run.epoch)"))
        assert ours[0] != theirs[0] and ours[1:] == (12, 3)  # its own run, from step 0
        # the other notebook's run is as it left it
        assert sorted(os.listdir(os.path.join(theirs[1], "checkpoints"))) == saved
    finally:
        second.close()


def test_resume_continues_the_handles_own_run_not_a_later_shorter_one(tmp_path):
    (tmp_path / "tiny_exp.py").write_text(TINY_MODULE)
    k = notebook_kernel(tmp_path, "digits.ipynb")
    try:
        k.run("exp = Digits(batches=4, max_epochs=5)\n%nitro train exp")
        long_id = k.eval("exp_run.run_id")
        k.run("quick = Digits(batches=4, max_epochs=1)\n%nitro train quick")  # later, shorter

        restart(k, tmp_path)
        cell = k.run("exp = Digits(batches=4, max_epochs=6)\n%nitro train exp --resume")
        assert (
            f"exp_run continues run {ast.literal_eval(long_id)} from its checkpoint at epoch 5, "
            f"step 20 (the run 'exp_run' last trained" in cell.stdout
        ), cell.stdout
        assert k.eval("(exp_run.epoch, exp_run.step)") == "(6, 24)"
    finally:
        k.close()


def test_several_runs_that_could_be_resumed_are_listed_and_one_is_picked_by_id(tmp_path):
    (tmp_path / "tiny_exp.py").write_text(TINY_MODULE)
    k = notebook_kernel(tmp_path, "digits.ipynb")
    try:
        k.run(
            "a = nitro.Nitro(Digits(batches=4, max_epochs=1), progress=False).train()\n"
            "b = nitro.Nitro(Digits(batches=4, max_epochs=2), progress=False).train()"
        )
        a_id, b_id = ast.literal_eval(k.eval("(a.run_id, b.run_id)"))
        cell = k.run(
            "exp = Digits(batches=4, max_epochs=3)\n%nitro train exp --resume", check=False
        )
        assert "UsageError: %nitro train --resume: 2 runs of __main__.Digits in " in cell.error
        assert "digits.ipynb with these GraphConst values could be continued" in cell.error
        assert re.search(rf"{a_id}  started \S+ \S+  epoch 1  step 4", cell.error), cell.error
        assert re.search(rf"{b_id}  started \S+ \S+  epoch 2  step 8", cell.error), cell.error
        assert "Pick one: `%nitro train exp --resume RUN_ID`" in cell.error

        cell = k.run(f"%nitro train exp --resume {a_id}")
        assert f"exp_run continues run {a_id} from its checkpoint at epoch 1, step 4" in cell.stdout
        assert k.eval("(exp_run.run_id == a.run_id, exp_run.epoch)") == "(True, 3)"
    finally:
        k.close()
