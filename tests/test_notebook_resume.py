"""After a kernel restart, `%nitro train exp --resume` continues the run the killed kernel left
on disk, and `%nitro runs` lists the experiment's run directories (a real kernel)."""

from __future__ import annotations

import ast
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

    kernel.manager.restart_kernel(now=True)  # kills the kernel process: everything in it is gone
    kernel.client.wait_for_ready(timeout=120)
    kernel.run(SETUP.format(cwd=str(tmp_path)))
    assert kernel.eval("'exp_run' in globals()") == "False"

    kernel.run("exp = tiny_exp.Tiny(batches=6, max_epochs=4)")
    listed = kernel.run("%nitro runs").data()[-1]  # the notebook's experiments' runs on disk
    assert "no runs in this kernel" in listed
    assert re.search(rf"{run_id} +Tiny +\S+ \S+ +\d +2 +val_loss \d\.\d+", listed), listed

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
    assert kernel.eval("[r['epoch'] for r in exp_run.reporter.curves.rows]") == "[1, 2, 3, 4]"
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
    assert "--resume continues the newest run on disk, --fresh starts over" in cell.error
