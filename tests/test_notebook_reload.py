"""Hot reload in a real kernel: edit a module file or redefine a class in a cell, retrain,
and only the programs whose code changed compile again."""

from __future__ import annotations

import ast
import time

from notebook_kernel import (
    TINY_MODULE,
    Kernel,
    kernel_fixture,  # noqa: F401 - provides the `kernel` fixture
)

BATCH = "{'x': __import__('numpy').ones((3, 4), 'float32')}"
LOSS = ".mean()\n\n    def metrics"


def _write(kernel, name: str, source: str) -> None:
    (kernel.cwd / f"{name}.py").write_text(source)


def _misses(kernel) -> int:
    return int(kernel.eval("nitro.cache_stats().misses"))


def test_edit_of_a_module_file_recompiles_only_the_programs_it_reaches(kernel):
    _write(kernel, "edit_a", TINY_MODULE)
    kernel.run(f"import edit_a\nea = edit_a.Tiny()\n%nitro train ea\n_ = ea_run.predict({BATCH})")
    assert "edit_a.py" in kernel.eval("list(nitro_ipython.watcher().sources)")
    before = _misses(kernel)

    _write(kernel, "edit_a", TINY_MODULE.replace(LOSS, ".mean() * 2.0" + LOSS[7:]))
    cell = kernel.run("%nitro train ea")

    assert "nitro: reloaded edit_a: changed Tiny.loss." in cell.stdout
    assert (
        "ea_run (Tiny): loss changed: train step and eval forward will recompile; predict is "
        "reused." in cell.stdout
    )
    assert "ea_run rebuilt from the current Tiny, starting from the weights" in cell.stdout
    assert _misses(kernel) - before == 2
    reasons = ast.literal_eval(
        kernel.eval(f"[(r.program, r.reason) for r in nitro.explain_compiles()[{before}:]]")
    )
    assert reasons == [
        ("train step", "code changed: hook loss"),
        ("eval forward", "code changed: hook loss"),
    ]
    assert kernel.eval("ea_run.weights_origin").startswith("'the weights of a Tiny run at epoch")

    kernel.run(f"_ = ea_run.predict({BATCH})")
    assert _misses(kernel) - before == 2  # predict's program did not change: reused


def test_a_broken_edit_keeps_the_last_good_code_and_shows_the_error(kernel):
    _write(kernel, "edit_b", TINY_MODULE)
    kernel.run("import edit_b\neb = edit_b.Tiny()\n%nitro train eb")
    before = _misses(kernel)

    _write(kernel, "edit_b", TINY_MODULE.replace("def scale(x):", "def scale(x)"))
    cell = kernel.run("%nitro train eb --epochs 1\nprint(edit_b.scale(2.0))")
    assert "edit_b.py line " in cell.stdout and "expected ':'" in cell.stdout
    assert "Kept the last good code of edit_b (not reloaded)" in cell.stdout
    assert cell.stdout.endswith("2.0\n")  # the old code runs
    assert kernel.eval("(eb_run.epoch, eb_run.stop_reason)") == "(2, 'completed')"
    assert _misses(kernel) == before  # same code, same programs

    _write(kernel, "edit_b", TINY_MODULE + "\nraise RuntimeError('half-written module')\n")
    cell = kernel.run("print(edit_b.Tiny.__name__, edit_b.scale(3.0))")
    assert "reloading edit_b raised RuntimeError: half-written module" in cell.stdout
    assert cell.stdout.endswith("Tiny 3.0\n")  # the module is as before the edit


def test_saving_reloads_while_the_kernel_is_idle(kernel):
    _write(kernel, "edit_c", TINY_MODULE)
    kernel.run("import edit_c\nec = edit_c.Tiny()\n%nitro train ec")
    reloads = int(kernel.eval("nitro_ipython.watcher().reloads"))

    _write(kernel, "edit_c", TINY_MODULE.replace("return x * 1.0", "return x * 3.0"))
    # Read state without running a cell, so no cell event can trigger the reload.
    deadline = time.monotonic() + 120
    while int(kernel.eval("nitro_ipython.watcher().reloads")) == reloads:
        assert time.monotonic() < deadline, "the save did not reload the module"
        time.sleep(0.2)
    assert kernel.eval("edit_c.scale(1.0)") == "3.0"

    cell = kernel.run("pass")  # the report waits for the next cell
    assert "reloaded edit_c: changed scale." in cell.stdout
    assert "ec_run (Tiny): forward (helper scale) changed: train step and eval forward" in (
        cell.stdout
    )


def test_rerunning_a_cell_that_redefines_an_experiment_reports_and_retrains(kernel):
    define = (
        "import optax\n\n"
        "@nitro.experiment\n"
        "class InCell(tiny_exp.Tiny):\n"
        "    def loss(self, logits, *, y):\n"
        "        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(){}\n"
    )
    kernel.run(define.format("") + "\nic = InCell()\n%nitro train ic")
    before = _misses(kernel)

    cell = kernel.run(define.format(" * 0.5"))
    assert "ic_run (InCell): loss changed: train step and eval forward will recompile" in (
        cell.stdout
    )
    kernel.run("%nitro train ic")
    assert _misses(kernel) - before == 2
    assert kernel.eval("ic_run.cls is InCell") == "True"


def test_with_autoreload_the_edit_is_reported_and_retrained_the_same_way(tmp_path):
    (tmp_path / "edit_d.py").write_text(TINY_MODULE)
    k = Kernel(tmp_path)
    try:
        k.run(
            f"""
            import sys
            sys.path.insert(0, {str(tmp_path)!r})
            %load_ext nitro
            %load_ext autoreload
            %autoreload 2
            import nitro
            from edit_d import Tiny
            ed = Tiny()
            %nitro train ed
            """
        )
        before = _misses(k)
        (tmp_path / "edit_d.py").write_text(
            TINY_MODULE.replace("nnx.relu(self.hidden(x))", "nnx.gelu(self.hidden(x))")
        )
        cell = k.run("%nitro train ed")
        assert "reloaded edit_d: changed Net.__call__." in cell.stdout
        assert (
            "ed_run (Tiny): model (method Net.__call__) changed: train step and eval forward "
            "will recompile" in cell.stdout
        )
        assert _misses(k) - before == 2
    finally:
        k.close()


def test_a_renamed_class_and_a_deleted_file_are_reported_and_the_handle_keeps_its_code(kernel):
    _write(kernel, "edit_e", TINY_MODULE)
    kernel.run("import edit_e\nee_run = nitro.Nitro(edit_e.Tiny(), progress=False)")
    expected = kernel.eval(f"ee_run.predict({BATCH}).tolist()")

    _write(kernel, "edit_e", TINY_MODULE.replace("class Tiny:", "class Small:"))
    cell = kernel.run("pass")
    assert "nitro: reloaded edit_e: changed Small.width, " in cell.stdout
    assert "Tiny.width (removed)" in cell.stdout
    assert (
        "nitro: edit_e.py: class Tiny is gone (renamed or deleted); ee_run keeps using the Tiny "
        "it was built with. Rename it back, or build a new handle from the new class.\n"
    ) in cell.stdout
    assert kernel.eval("(hasattr(edit_e, 'Tiny'), ee_run.cls.__name__)") == "(False, 'Tiny')"
    assert kernel.eval(f"ee_run.predict({BATCH}).tolist()") == expected
    assert "Tiny is gone" not in kernel.run("pass").stdout  # said once

    (kernel.cwd / "edit_e.py").unlink()
    cell = kernel.run("pass")
    assert "nitro: edit_e.py was deleted; edit_e and ee_run keep the code they have.\n" in (
        cell.stdout
    )
    assert kernel.eval("edit_e.Small.__name__") == "'Small'"
    assert kernel.eval(f"ee_run.predict({BATCH}).tolist()") == expected
    assert "deleted" not in kernel.run("pass").stdout  # said once


def test_the_prediction_counts_only_the_train_program_the_rebuilt_run_calls(kernel):
    """The cache holds the single train step (another handle's, or the steps "auto" timed)
    and the fused one; the rebuilt run continues its handle's steps per call: one of them."""
    _write(kernel, "edit_k", TINY_MODULE)
    kernel.run(
        "import edit_k\nek = edit_k.Tiny()\n"
        "_ = nitro.Nitro(ek, steps_per_dispatch=1).train()\n"  # the single train step
        "fused = nitro.Nitro(ek, steps_per_dispatch=4)\n%nitro train fused"
    )
    assert kernel.eval("fused.dispatch.steps") == "4"
    before = _misses(kernel)

    _write(kernel, "edit_k", TINY_MODULE.replace(LOSS, ".mean() * 2.0" + LOSS[7:]))
    cell = kernel.run("%nitro train fused")

    assert (
        "fused (Tiny): loss changed: multi-step train and eval forward will recompile"
        in cell.stdout
    ), cell.stdout
    assert _misses(kernel) - before == 2
