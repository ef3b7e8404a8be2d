"""`nitro train` as one process of a run across hosts: two `python -m nitro.cli train`
processes on localhost, 2 fake CPU devices each, joined with `--coordinator`,
`--num-processes` and `--process-id`, train one run (one directory, written by process 0),
continue it when the command runs again, and match one process on one device, as the
multi-host checks of tests/test_multihost.py do. The command's refusals need no second
process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ports import free_port

from nitro.cli import main

pytest.importorskip("jsonargparse")

REPO = Path(__file__).resolve().parents[1]
DIGITS = "nitro.examples.digits:Digits"
# a batch of 60: each process feeds 30 train samples a step, and the 180 of 'val' in full batches
OPTIONS = ["--width", "16", "--batch-size", "60", "--seed", "3"]
TOLERANCE = 1e-5
TIMING = {"epoch_seconds", "host_ms", "device_ms", "data_wait_frac"}


def start(cwd: Path, devices: int, *arguments: str) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.Popen(
        [sys.executable, "-m", "nitro.cli", "train", DIGITS, *OPTIONS, *arguments],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(procs: list[subprocess.Popen]) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr), once all exit 0 (killed after 5 minutes)."""
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-4000:]
            outputs.append((out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def across_two(cwd: Path, *arguments: str) -> list[tuple[str, str]]:
    """The command in two processes of 2 devices each, joined at a free port on localhost."""
    joined = ["--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]
    return finish([start(cwd, 2, *arguments, *joined, "--process-id", str(i)) for i in (0, 1)])


def logged(run_dir: Path) -> list[tuple]:
    """(context, epoch, step, metrics) of every metrics record the run logged, timings out."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        (
            r["context"],
            r["epoch"],
            r["step"],
            {k: r["metrics"][k] for k in r["metrics"].keys() - TIMING},
        )
        for r in rows
        if r["type"] == "metrics"
    ]


def yaml_keys(path: Path) -> list[str]:
    import yaml

    return list(yaml.safe_load(path.read_text()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run across two processes, trained 1 epoch then continued to 2 by the same command
    again; and the same run in one process on one device."""
    across = tmp_path_factory.mktemp("across")
    first = across_two(across, "--max-epochs", "1")
    second = across_two(across, "--max-epochs", "2")
    single = tmp_path_factory.mktemp("single")
    (alone,) = finish([start(single, 1, "--max-epochs", "2")])
    return across, first, second, single, alone


def test_two_processes_write_one_run_directory_from_process_zero(runs):
    across, first, second, _, _ = runs
    (run_dir,) = (across / "runs" / "Digits").iterdir()
    files = {path.name for path in run_dir.iterdir()}
    assert {"run.json", "config.yaml", "metrics.jsonl", "checkpoints"} <= files
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == run_dir.name
    assert not {"coordinator", "process_id"} & set(yaml_keys(run_dir / "config.yaml"))
    for (out0, err0), (out1, err1) in (first, second):
        assert f"run {run_dir.name}: {run_dir}" in out0  # the history and the run, once
        assert "epoch" in err0 and "val_loss" in err0  # the progress lines, once
        assert "val_loss" not in out1 and run_dir.name not in out1 + err1


def test_the_command_again_continues_the_run_across_processes(runs):
    across, _, second, _, _ = runs
    (run_dir,) = (across / "runs" / "Digits").iterdir()
    assert f"continues run {run_dir.name}" in second[0][1]
    epochs = [r[1] for r in logged(run_dir) if r[0] == "validate"]
    assert epochs == [1, 2]
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [20, 40]  # 1258 train samples: 20 global batches of 60 an epoch


def test_the_run_across_processes_matches_one_process(runs):
    across, _, _, single, _ = runs
    (run_dir,) = (across / "runs" / "Digits").iterdir()
    (alone,) = (single / "runs" / "Digits").iterdir()
    ours, theirs = logged(run_dir), logged(alone)
    assert [r[:3] for r in ours] == [r[:3] for r in theirs]
    for mine, other in zip(ours, theirs, strict=True):
        assert mine[3].keys() == other[3].keys()
        for key, value in mine[3].items():
            np.testing.assert_allclose(value, other[3][key], rtol=0, atol=TOLERANCE, err_msg=key)


def test_bad_process_options_name_the_option(capsys):
    assert main(["train", DIGITS, "--coordinator", "somehost", "--num-processes", "2"]) == 2
    assert "--coordinator somehost: expected HOST:PORT" in capsys.readouterr().err
    assert main(["train", DIGITS, "--num-processes", "2", "--process-id", "2"]) == 2
    assert "--process-id 2: expected 0 to 1" in capsys.readouterr().err
    assert main(["train", DIGITS, "--num-processes", "two"]) == 2
    assert "--num-processes: invalid int value: 'two'" in capsys.readouterr().err


def test_export_refuses_to_run_as_one_of_several_processes(monkeypatch, capsys):
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2"}
    for name, value in {**slurm, "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(name, value)
    assert main(["export", DIGITS]) == 2
    assert (
        "nitro export runs in one process, and this one is one of several (started by "
        "SLURM's srun (2 tasks)): run it once, outside the launcher, or with --num-processes 1"
    ) in capsys.readouterr().err


def test_process_options_in_a_configuration_file_are_refused(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("coordinator: localhost:1234\nmax_epochs: 1\n")
    assert main(["train", DIGITS, "--config", str(config)]) == 2
    assert (
        "--coordinator in a configuration file: each process of a run has its own, on its "
        "command line"
    ) in capsys.readouterr().err
