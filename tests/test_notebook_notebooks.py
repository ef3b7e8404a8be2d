"""The notebooks in notebooks/ run end to end on a real kernel and show what they promise."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from notebook_kernel import REPO, kernel_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


def _execute(name: str, cwd) -> list[str]:
    """Run notebooks/<name> in `cwd`; returns each code cell's output text (errors fail), and
    last the saved widget state (the live panels' values, notes included)."""
    notebook = nbformat.read(REPO / "notebooks" / name, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    client.execute(env=kernel_env())
    texts = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        parts = []
        for output in cell.outputs:
            if output.output_type == "stream":
                parts.append(output.text)
            elif "data" in output:
                parts.extend(f"[{mime}] {output.data[mime]}" for mime in sorted(output.data))
        texts.append("".join(parts))
    texts.append(json.dumps(notebook.metadata.get("widgets", {})))
    return texts


def _find(texts: list[str], pattern: str) -> re.Match:
    for text in texts:
        match = re.search(pattern, text)
        if match:
            return match
    raise AssertionError(f"no output matches {pattern!r}")


def test_tutorial_runs_from_experiment_to_prediction(tmp_path):
    texts = _execute("tutorial.ipynb", tmp_path)

    _find(texts, r"\[application/vnd.jupyter.widget-view\+json\]")  # the live panel
    _find(texts, r"Nitro\(Digits, done, epoch 6/6")
    _find(texts, r"\[image/png\]")  # %nitro plot
    _find(texts, r"programs compiled by the extra epochs: 0")
    _find(texts, r"runs/Digits/\d{8}-\d{6}-[0-9a-f]{4}\n")  # the run directory
    resumed = _find(texts, r"resumed run (\d{8}-\d{6}-[0-9a-f]{4}) at epoch 9, step (\d+)")
    assert f"/runs/Digits/{resumed.group(1)}" in "".join(texts)
    _find(texts, rf"Nitro\(Digits, done, epoch 11/11, step {int(resumed.group(2)) // 9 * 11}")
    _find(
        texts,
        r"long_exp_run \(Digits\): (training|validating|checkpointing|compiling [a-z -]+), "
        r"epoch \d+/30000",
    )
    _find(texts, r"nitro: stopped long_exp_run at epoch \d+, step \d+")
    _find(texts, r"programs compiled for scale=0.5: 0")
    _find(texts, r"'test_acc': 0\.\d+")
    accuracy = float(_find(texts, r"test accuracy: (\d\.\d+)").group(1))
    assert accuracy > 0.8
    chose = rf"resume='auto' continues run {resumed.group(1)}: the run 'exp_run' last trained"
    _find(texts, chose)  # which run it took, and why, in one line

    # a second Run All in the same folder resumes the run its own cell 6 trained, not the
    # longer background run the first one left there
    again = _execute("tutorial.ipynb", tmp_path)
    second = _find(again, r"resumed run (\d{8}-\d{6}-[0-9a-f]{4}) at epoch 9, step (\d+)")
    assert second.group(1) != resumed.group(1)
    _find(again, rf"resume='auto' continues run {second.group(1)}: the run 'exp_run' last")


def test_interrupt_and_edit_notebook_interrupts_edits_and_retrains(tmp_path):
    texts = _execute("interrupt_and_edit.ipynb", tmp_path)

    _find(texts, r"interrupted; stopping training after the current step")
    _find(texts, r"stop reason: requested")
    _find(texts, r"nitro: reloaded digits_edit_demo: changed Digits.loss\.")
    _find(  # the train programs the run held: one step per call, fused (auto's K), or both
        texts,  # (interrupted while auto timed one against the other, on a busy machine)
        r"exp_run \(Digits\): loss changed: ((train step|multi-step train), )*"
        r"(train step|multi-step train) and eval forward will recompile",
    )
    # the edited loss reaches the train program and eval forward; a run interrupted between
    # fused calls that do not line up with its epoch also runs its epoch's remainder one step
    # per call, so the single step recompiles too; one interrupted while auto still timed its
    # fused sizes (a busy machine) goes on timing them, each size its own program
    _find(texts, r"programs compiled for the edit: [2-5]\b")
    _find(texts, r"digits_edit_demo.py line \d+: expected ':'\. Kept the last good code")
    _find(texts, r"cell_exp_run \(CellDigits\): loss changed")
    assert (tmp_path / "digits_edit_demo.py").exists()  # written in the notebook's directory


def test_the_gan_notebook_trains_two_models_with_a_train_step_hook(tmp_path):
    texts = _execute("gan.ipynb", tmp_path)
    match = _find(texts, r"generated mean \[ *(-?\d\.\d*) +(-?\d\.\d*) *\] data mean")
    generated = np.array([float(match.group(1)), float(match.group(2))])
    assert np.linalg.norm(generated - np.array([2.0, -1.0])) < 1.0
    # a spread along both axes, as the data's (0.3 each): not points collapsed onto a line
    match = _find(texts, r"generated spread \[ *(\d\.\d*) +(\d\.\d*) *\] data spread")
    narrow, wide = float(match.group(1)), float(match.group(2))
    assert 0.08 < narrow <= wide < 0.9, (narrow, wide)  # collapsed: narrow 0.05
    _find(texts, r"gen/learning_rate = 0.003")
    _find(texts, r"\[image/png\]")
    _find(texts, r"d_loss")


def test_plain_train_in_a_notebook_prints_into_its_cell(tmp_path):
    """Without %load_ext nitro: the training thread's progress lines land in the cell that
    called train()."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r})\n"
            "import nitro\nfrom toys import Toy"
        ),
        nbformat.v4.new_code_cell("n = nitro.Nitro(Toy(max_epochs=2))\nn.train();"),
        nbformat.v4.new_code_cell("print(n.step, n.stop_reason)"),
    ]
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute(env=kernel_env())
    train_output = "".join(o.get("text", "") for o in notebook.cells[1].outputs)
    assert "nitro: compiling train step of Toy ..." in train_output
    assert "epoch 1/2  loss " in train_output and "epoch 2/2  loss " in train_output
    assert "".join(o.get("text", "") for o in notebook.cells[2].outputs) == "8 completed\n"


def test_a_saved_run_shows_its_record_in_nbconvert_html_without_widgets(tmp_path):
    """What a reopened notebook, nbconvert and GitHub render: the record, never a widget."""
    nbconvert = pytest.importorskip("nbconvert")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r})\n"
            "%load_ext nitro\nfrom toys import Toy"
        ),
        nbformat.v4.new_code_cell("exp = Toy(max_epochs=2)\n%nitro train exp"),
    ]
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute(env=kernel_env())
    outputs = notebook.cells[1].outputs
    mimes = [sorted(o.get("data", {})) for o in outputs]
    assert mimes[:2] == [["text/html", "text/plain"], ["image/png", "text/plain"]], mimes
    assert not any("application/vnd.jupyter.widget-view+json" in m for m in mimes)
    assert outputs[0].data["text/plain"].startswith("Toy: done · epoch 2/2 · step 8")

    html, _ = nbconvert.HTMLExporter().from_notebook_node(notebook)
    assert "<b>done</b> · epoch 2/2 · step 8" in html
    assert "data:image/png;base64," in html  # the final curves
    assert "LivePanel(" not in html and "live training panel" not in html


def test_the_pretrained_notebook_fine_tunes_exports_and_serves_from_a_weights_file(tmp_path):
    texts = _execute("fine_tune_pretrained.ipynb", tmp_path)

    checkpoint = tmp_path / "convnextv2_atto.safetensors"
    assert checkpoint.exists()  # the stand-in for a downloaded checkpoint
    # every leaf but the new classifier came from the file, and the handle says so
    _find(
        texts,
        rf"build_model: ConvNeXt pretrained from {re.escape(str(checkpoint))} \(138 leaves, "
        r"57 converted from PyTorch layout; head\.fc\.bias, head\.fc\.kernel at initial values\)",
    )
    _find(texts, r"val_acc")  # the history of the frozen and the unfrozen epoch
    manifest = json.loads((tmp_path / "exports/digits-convnext/manifest.json").read_text())
    assert str(checkpoint) in manifest["provenance"]["weights_origin"]
    assert manifest["inputs"] == [
        {"name": "pixels", "dtype": "uint8", "shape": [-1, 8, 8], "axes": ["batch", None, None]}
    ]
    _find(texts, r"bundle accuracy on 16 test digits: \d")
    _find(texts, r"served logits match the bundle's: \(16, 10\)")
