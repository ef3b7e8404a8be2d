"""`nitro train module:Class` and the other experiment commands, in real processes (`python -m
nitro.cli`) and through `nitro.cli.main` in this one: the options are the experiment's fields
and the run keywords, configuration files go in and the resolved configuration comes out, a
rerun continues its run, and the command trains bit for bit what `nitro.Nitro(...).train()`
trains."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nitro
from nitro.cli import main
from nitro.engine.run_keywords import RUN_KEYWORDS
from nitro.examples.digits import Digits
from nitro.runner import PREEMPTED_EXIT_CODE

pytest.importorskip("jsonargparse")

REPO = Path(__file__).resolve().parents[1]
DIGITS = "nitro.examples.digits:Digits"
OPTIONS = ["--width", "16", "--max-epochs", "2", "--seed", "3", "--learning-rate", "0.01"]
TIMING = {"epoch_seconds", "host_ms", "device_ms", "data_wait_frac"}


def nitro_command(cwd: Path, *arguments: str) -> subprocess.CompletedProcess:
    """`python -m nitro.cli ARGUMENTS` in `cwd`, as a job runs it (output to files, not a
    terminal); fails the test with its output when it fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "nitro.cli", *arguments],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def only_run(cwd: Path) -> Path:
    (run_dir,) = (cwd / "runs" / "Digits").iterdir()
    return run_dir


def logged(run_dir: Path) -> list[tuple]:
    """Every metric a run logged (each step's loss, each epoch's results), timings left out."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        (
            r["context"],
            r["epoch"],
            r["step"],
            {k: v for k, v in r["metrics"].items() if k not in TIMING},
        )
        for r in rows
        if r["type"] == "metrics"
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The same run trained in Python and by `nitro train` with the equivalent options."""
    here = tmp_path_factory.mktemp("python")
    os.chdir(here)
    handle = nitro.Nitro(  # max_epochs: the run keyword, as the command takes it
        Digits(width=16), max_epochs=2, seed=3, learning_rate=0.01, progress=False
    ).train()
    command = tmp_path_factory.mktemp("command")
    done = nitro_command(command, "train", DIGITS, *OPTIONS)
    yield handle, only_run(command), done
    handle.close()


def test_the_command_trains_bitwise_what_python_trains_and_its_saved_config_trains_it_again(
    trained, tmp_path
):
    handle, run_dir, done = trained
    assert (run_dir / "config.yaml").read_text() == (
        "experiment: nitro.examples.digits:Digits\n"
        "preset: null\n"
        "width: 16\n"
        "scale: 1.0\n"
        "batch_size: 128\n"
        "max_epochs: 2\n"
        "seed: 3\n"
        "learning_rate: 0.01\n"
    )
    again = tmp_path / "again"
    nitro_command(again, "train", "--config", str(run_dir / "config.yaml"))

    assert logged(run_dir) == logged(Path(handle.run_dir)) == logged(only_run(again))
    history = handle.history().drop(columns=list(TIMING))
    epochs = [r[3] for r in logged(run_dir) if r[0] == "validate"]
    assert [row["val_loss"] for row in epochs] == history["val_loss"].tolist()
    # a log file gets one line per epoch, and the command prints the history at the end
    lines = [line for line in done.stderr.splitlines() if line.startswith("epoch ")]
    assert [line.split("  ")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]
    assert done.stdout.splitlines()[-1] == f"run {run_dir.name}: {run_dir}"


def test_rerunning_the_command_continues_its_run_bitwise(trained, tmp_path):
    _, run_dir, _ = trained
    half = [*OPTIONS[:2], "--max-epochs", "1", *OPTIONS[4:]]
    first = nitro_command(tmp_path, "train", DIGITS, *half)
    assert "nitro: no run to continue under runs/Digits: a new run" in first.stderr
    assert "RuntimeWarning" not in first.stderr
    second = nitro_command(tmp_path, "train", DIGITS, *OPTIONS)

    assert "resumed run" in second.stderr
    assert logged(only_run(tmp_path)) == logged(run_dir)


def test_each_bad_value_gets_the_python_apis_message_naming_its_option(capsys):
    cases = {
        ("--max-epochs", "0"): "max_epochs must be an int >= 1, got 0",
        ("--prefetch", "fast"): (
            "prefetch must be one of 'auto', 'threads', 'processes', 'inline', got 'fast'"
        ),
        ("--width", "abc"): (
            "Digits.width is GraphConst[int] but got 'abc' (str); pass an int, e.g. "
            "Digits(width=256)"
        ),
    }
    for (option, value), message in cases.items():
        assert main(["train", DIGITS, option, value]) == 2
        assert capsys.readouterr().err == f"nitro train: error: {option} {value}: {message}\n"
    with pytest.raises(nitro.SetupError, match="max_epochs must be an int >= 1, got 0"):
        nitro.Nitro(Digits(), max_epochs=0)
    with pytest.raises(nitro.ExperimentError) as refused:
        Digits(width="abc")  # pyright: ignore[reportArgumentType]
    assert str(refused.value) == cases["--width", "abc"]

    assert main(["train", DIGITS, "--max-epoch", "3"]) == 2
    assert capsys.readouterr().err.startswith(
        "nitro train: error: unrecognized arguments: --max-epoch 3; --max-epoch (did you mean "
        "--max-epochs"
    )
    assert main(["train", "nitro.examples.digits:Digit"]) == 2
    assert capsys.readouterr().err == (
        "nitro train: error: nitro.examples.digits:Digit: module 'nitro.examples.digits' has "
        "no 'Digit' (did you mean Digits?)\n"
    )


def test_config_files_in_yaml_or_toml_are_overridden_by_the_options_after_them(tmp_path, capsys):
    (tmp_path / "base.toml").write_text(
        'experiment = "nitro.examples.digits:Digits"\nwidth = 8\nlearning_rate = 1e-2\n'
        'eval_splits = ["val", "test"]\n'
    )
    (tmp_path / "more.yaml").write_text("max_epochs: 3\nlearning_rate: 3e-3\n")
    arguments = ["--config", "base.toml", "--width", "12", "--config", "more.yaml"]

    assert main(["train", *arguments, "--print-config"]) == 0
    assert capsys.readouterr().out == (
        "experiment: nitro.examples.digits:Digits\n"
        "preset: null\n"
        "width: 12\n"
        "scale: 1.0\n"
        "batch_size: 128\n"
        "max_epochs: 3\n"
        "eval_splits:\n"
        "- val\n"
        "- test\n"
        "learning_rate: 0.003\n"
    )


def test_evaluate_validate_predict_and_export_use_the_trained_run(trained, tmp_path, capsys):
    handle, run_dir, _ = trained
    run = ["--config", str(run_dir / "config.yaml"), "--resume", str(run_dir)]

    assert main(["evaluate", *run, "--split", "test"]) == 0
    assert json.loads(capsys.readouterr().out) == handle.evaluate("test")
    assert main(["validate", *run]) == 0
    assert json.loads(capsys.readouterr().out) == handle.validate()

    x = nitro.datasets.digits_arrays()["test"]["x"][:4]
    np.savez(tmp_path / "batch.npz", x=x)
    predicted = tmp_path / "predicted.npy"
    assert main(["predict", *run, "--input", "batch.npz", "--output", str(predicted)]) == 0
    np.testing.assert_array_equal(np.load(predicted), handle.predict({"x": x}))

    assert main(["export", *run, "--directory", "bundle"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "exported digits to bundle"
    assert (tmp_path / "bundle" / "manifest.json").is_file()

    assert main(["evaluate", DIGITS, "--width", "24"]) == 2
    assert capsys.readouterr().err == (
        "nitro evaluate: error: no trained run of Digits with these GraphConst values under "
        "runs/Digits to evaluate: train one with nitro train, or name one with --resume DIR or "
        "--weights DIR\n"
    )


def test_runs_lists_the_runs_on_disk_and_diff_shows_what_differs(trained, capsys):
    handle, run_dir, _ = trained

    assert main(["runs", str(run_dir.parent.parent)]) == 0
    listing = capsys.readouterr().out
    assert run_dir.name in listing
    assert "width=16 scale=1 batch_size=128 max_epochs=2 seed=3 learning_rate=0.01" in listing

    assert main(["runs", "diff", handle.run_dir, str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    differing = {line.split()[0] + " " + line.split()[1] for line in lines[3:-1]}
    assert differing == {"run.json notebook"}  # the same settings, code and versions


def test_a_graphconst_change_starts_a_new_run_and_going_back_continues_the_first(tmp_path):
    tiny = [DIGITS, "--max-epochs", "1", "--progress", "false"]
    assert main(["train", *tiny, "--width", "16"]) == 0
    assert main(["train", *tiny, "--width", "8"]) == 0  # resume="auto" would refuse the first
    assert main(["train", *tiny, "--width", "16", "--max-epochs", "2"]) == 0

    runs = nitro.saved_runs("Digits")
    widths = [
        json.loads((Path(p) / "run.json").read_text())["graphconst"]["width"] for p in runs["path"]
    ]
    epochs = runs["latest epoch"].tolist()
    assert sorted(zip(widths, epochs, strict=True)) == [(8, 1), (16, 2)]


def test_help_lists_every_field_and_run_keyword_with_its_doc_type_and_default(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", DIGITS, "--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # the columns' wrapping undone
    assert (
        "--width WIDTH GraphConst: hidden width; bakes into the program (changing it "
        "recompiles) [int; default: 256]"
    ) in shown
    assert (
        "--max-epochs MAX_EPOCHS, --max_epochs MAX_EPOCHS epochs train() runs to [int; "
        "default: 30 (Digits.max_epochs)]"
    ) in shown
    assert "--prefetch PREFETCH" in shown and "[auto | threads | processes | inline;" in shown
    for name, keyword in RUN_KEYWORDS.items():
        assert keyword.type is not Any, f"{name} declares no type for the command line"
        assert f"--{name.replace('_', '-')} " in shown


def test_a_signalled_command_rerun_as_it_was_ends_bitwise_as_one_never_signalled(tmp_path):
    # a job's life: the command is signalled at a random moment of its run, exits (75: saved,
    # run me again; or killed, when the signal came before training or after it ended), and
    # the job's rerun of the same command continues it: the run ends as one never signalled
    options = ["--max-epochs", "6", "--batch-size", "32", "--seed", "5"]
    baseline = tmp_path / "baseline"
    nitro_command(baseline, "train", DIGITS, *options)
    expected = logged(only_run(baseline))
    rng = np.random.default_rng(0)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    codes = []
    for trial, signal_name in enumerate(["SIGTERM", "SIGTERM", "SIGUSR1"]):
        number = getattr(signal, signal_name)
        cwd = tmp_path / f"trial-{trial}"
        cwd.mkdir()
        job = subprocess.Popen(
            [sys.executable, "-m", "nitro.cli", "train", DIGITS, *options],
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []
        reader = threading.Thread(target=lines.extend, args=(job.stderr,), daemon=True)
        reader.start()
        deadline = time.monotonic() + 300
        while job.poll() is None and time.monotonic() < deadline:
            if any(line.startswith("epoch 1/") for line in list(lines)):  # it trains
                break
            time.sleep(0.005)
        time.sleep(float(rng.uniform(0.0, 0.1)))  # a random moment of the run, not a bound
        job.send_signal(number)
        job.wait(timeout=300)
        reader.join(timeout=300)
        err = "".join(lines)
        codes.append(job.returncode)
        assert job.returncode in (0, PREEMPTED_EXIT_CODE, -number), err[-3000:]
        if job.returncode == PREEMPTED_EXIT_CODE:
            assert f"{signal_name}: exiting with code {PREEMPTED_EXIT_CODE} at step" in err
        # the job's rerun: it continues the run (or, killed before its first save, starts
        # one beside it) and names the run it trained last
        rerun = nitro_command(cwd, "train", DIGITS, *options)
        run_dir = Path(rerun.stdout.splitlines()[-1].split(": ", 1)[1])
        assert logged(run_dir) == expected, (trial, codes)
    assert PREEMPTED_EXIT_CODE in codes, codes  # at least one was cut short in its run
