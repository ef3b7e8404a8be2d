"""Preemption: a script's `train()` that receives SIGTERM or SIGUSR1 saves the step it is on,
finishes its logs and exits with code 75, and `resume="auto"` continues it bitwise. The
scripts are real child processes (tests/preemption_toys.py) signalled at random moments, in
validation and in the middle of a save; the resumes run here."""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from preemption_toys import EPOCHS, handle
from system import child_env

import nitro
from nitro.runner import PREEMPTED_EXIT_CODE, preemption_signals

TRIES = 20
EXIT = re.compile(r"(?P<signal>SIG\w+): exiting with code 75 at step (?P<step>\d+); .+")
STOPPED_IN = {"validating": "trained, before its validation", "checkpointing": "the end of epoch"}
LAST_STEP = EPOCHS * 39  # 1,258 training samples in batches of 32
COLUMNS = ["loss", "val_loss", "val_acc"]


class Zygote:
    """A process that has imported everything and forks the preempted scripts."""

    def __init__(self, cwd: Path):
        self.log = open(cwd / "zygote.log", "w")  # noqa: SIM115 - closed in close()
        code = "import preemption_toys; preemption_toys.zygote()"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=cwd,
            env=child_env(),
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.line() == "ready"

    def _read(self) -> None:
        for line in self.stdout:
            self.lines.put(line.strip())

    def line(self, timeout: float = 180) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the zygote said nothing for {timeout} s") from None

    def start(self, run_dir: Path, kind: str, nth: int = 0) -> int:
        self.stdin.write(f"{run_dir} {kind} {nth}\n")
        self.stdin.flush()
        self.said: list[str] = []
        return int(self.line().removeprefix("child "))

    def until(self, prefix: str) -> str:
        """The child's first line starting with `prefix` (the lines before it are kept)."""
        while not (line := self.line()).startswith(prefix):
            self.said.append(line)
        return line

    def finish(self) -> tuple[int, list[str]]:
        """Let the zygote reap the child: its exit code and the lines it printed."""
        self.stdin.write("reap\n")
        self.stdin.flush()
        code = int(self.until("exit ").removeprefix("exit "))
        return code, self.said

    def close(self) -> None:
        self.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


def outcome(n: nitro.Nitro) -> tuple[dict, dict]:
    history = n.history()
    paths = n.setup.model.leaf_paths["parameter"]
    weights = {p: np.asarray(x) for p, x in zip(paths, n.state.variables.params, strict=True)}
    return {c: history[c].tolist() for c in COLUMNS}, weights


def plan(draw: random.Random) -> list[tuple[str, str, int, float]]:
    """Who signals each try, with what, when: (kind, signal, nth, delay after the first step)."""
    tries = [("outside", "SIGTERM", 0, draw.uniform(0.0, 0.6)) for _ in range(12)]
    tries += [("outside", "SIGUSR1", 0, draw.uniform(0.0, 0.6)) for _ in range(3)]
    tries += [("outside", "SIGTERM twice", 0, draw.uniform(0.0, 0.6))]
    tries += [("validating", "SIGTERM", nth, 0.0) for nth in (1, 3)]
    tries += [("checkpointing", "SIGTERM, SIGUSR1", nth, 0.0) for nth in (2, 4)]
    draw.shuffle(tries)
    assert len(tries) == TRIES
    return tries


def test_sigterm_at_random_moments_saves_exits_75_and_resume_auto_continues_bitwise(tmp_path):
    expected = outcome(handle(str(tmp_path / "whole")).train())
    zygote = Zygote(tmp_path)
    seen = []
    try:
        for attempt, (kind, sent, nth, delay) in enumerate(plan(random.Random(40))):
            run_dir = tmp_path / f"try{attempt}"
            pid = zygote.start(run_dir, kind, nth)
            if kind == "outside":
                assert zygote.until("training ") == f"training {pid}"
                time.sleep(delay)
                for name in sent.split()[:1] * (2 if "twice" in sent else 1):
                    os.kill(pid, getattr(signal, name))
                    time.sleep(0.005)
            code, said = zygote.finish()
            seen.append((kind, sent, code))
            where = f"try {attempt} ({kind}, {sent}): exit {code}\n" + "\n".join(said)
            # the logs are finished before the exit: the run's last record says how it ended
            records = (run_dir / "metrics.jsonl").read_text().splitlines()
            status = json.loads(records[-1])["status"]
            resumed = handle(str(run_dir), resume="auto")
            if code == PREEMPTED_EXIT_CODE:
                exit = EXIT.fullmatch(said[-1])
                assert exit is not None and exit["signal"] in sent, where
                step = int(exit["step"])
                assert resumed.step == step, where  # the step it was on is saved
                assert status == "requested" or (status, step) == ("completed", LAST_STEP), where
                if kind != "outside":  # stopped where the signal came
                    assert exit["signal"] == "SIGTERM", where
                    stop = next(line for line in said if line.startswith("stopped at step"))
                    assert STOPPED_IN[kind] in stop, where
            else:  # the run had ended: the signal came after train() returned, or never
                # (a process a signal ends then loses the saves still being written, and
                # resumes from an earlier one)
                assert kind == "outside" and code in (0, -getattr(signal, sent.split()[0])), where
                assert status == "completed", where
            resumed.train()
            assert resumed.epoch == EPOCHS
            history, weights = outcome(resumed)
            assert history == expected[0], where  # == on floats: bitwise
            assert all(np.array_equal(weights[k], v) for k, v in expected[1].items()), where
    finally:
        zygote.close()
    preempted = [s for s in seen if s[2] == PREEMPTED_EXIT_CODE]
    # every signal sent from inside the run preempted it; most from outside landed in it too
    assert all(s[2] == PREEMPTED_EXIT_CODE for s in seen if s[0] != "outside"), seen
    assert len(preempted) >= TRIES // 2, seen


def test_auto_takes_the_signals_a_script_left_at_their_defaults_on_its_main_thread_only():
    """(In a notebook's kernel "auto" takes none: docs/preemption.md shows it in one.)"""
    before = {s: signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        assert preemption_signals("auto") == (signal.SIGTERM, signal.SIGUSR1)
        assert preemption_signals(False) == ()
        # a handler of the program's own stays; True takes the signal anyway
        signal.signal(signal.SIGUSR1, lambda signum, frame: None)
        assert preemption_signals("auto") == (signal.SIGTERM,)
        assert preemption_signals(True) == (signal.SIGTERM, signal.SIGUSR1)
        off_main = []
        thread = threading.Thread(target=lambda: off_main.append(preemption_signals(True)))
        thread.start()
        thread.join()
        assert off_main == [()]
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_a_bad_preemption_setting_is_refused_naming_the_choices():
    with pytest.raises(nitro.SetupError, match=r"preemption must be 'auto', True or False, got 1"):
        handle("unused", preemption=1)


GROUP = """
import os, sys
import nitro
from pipeline_toys import Pipe
from process_toys import Augmented

class Started:
    def step(self, step, loss):
        if step == 1:
            print("training", flush=True)

n = nitro.Nitro(
    Pipe(max_epochs=20),
    data={"train": Augmented(sleep=0.05)},
    run_dir=sys.argv[1],
    resume="auto",
    prefetch="processes",
    prefetch_workers=1,
    progress=Started(),
)
n.train()
"""


def test_a_run_whose_worker_processes_are_signalled_with_it_saves_and_exits_75(tmp_path):
    """As SLURM signals every process of a job step: the run's worker process, which builds
    the batch its next step waits for (50 ms a batch), is sent SIGTERM with it."""
    from pipeline_toys import Pipe
    from process_toys import Augmented
    from worker_processes import gone, workers_of

    def run(**keywords) -> nitro.Nitro:
        data = {"train": Augmented()}
        return nitro.Nitro(Pipe(max_epochs=20), data=data, progress=False, **keywords)

    script = subprocess.Popen(
        [sys.executable, "-c", GROUP, str(tmp_path / "run")],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a job step's
    )
    try:
        assert script.stdout is not None
        line = script.stdout.readline()
        if line != "training\n":  # it ended before its first step: say how
            out, err = script.communicate(timeout=180)
            raise AssertionError(f"no first step (exit {script.returncode}): {line}{out}\n{err}")
        workers = workers_of(script.pid)
        os.killpg(script.pid, signal.SIGTERM)
        _, err = script.communicate(timeout=180)
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
    assert script.returncode == PREEMPTED_EXIT_CODE, err
    assert gone(workers) == []
    resumed = run(run_dir=str(tmp_path / "run"), resume="auto")
    assert resumed.step > 0  # the step it stopped on
    expected = run(steps_per_dispatch=1).train()
    resumed.train()
    assert resumed.history()["loss"].tolist() == expected.history()["loss"].tolist()


POPULATION = """
import os, signal, sys
import nitro
from nitro.examples.digits import Digits

class SignalAtThirdValidation:
    seen = 0
    def note(self, message, done=False):
        print(message, file=sys.stderr)
    def phase(self, phase):
        if phase == "validating":
            self.seen += 1
            if self.seen == 3:
                os.kill(os.getpid(), signal.SIGTERM)

nitro.Population(
    Digits(max_epochs=4, batch_size=32),
    learning_rate=[1e-3, 3e-3],
    run_dir=sys.argv[1],
    progress=SignalAtThirdValidation(),
).train()
"""


def test_a_population_preempted_in_a_script_exits_75_and_resumes_bitwise(tmp_path):
    from nitro.examples.digits import Digits

    def population(**keywords) -> nitro.Population:
        return nitro.Population(
            Digits(max_epochs=4, batch_size=32),
            learning_rate=[1e-3, 3e-3],
            progress=False,
            **keywords,
        )

    done = subprocess.run(
        [sys.executable, "-c", POPULATION, str(tmp_path / "pop")],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == PREEMPTED_EXIT_CODE, done.stderr
    exit = EXIT.search(done.stderr)
    assert exit is not None and exit["signal"] == "SIGTERM", done.stderr
    resumed = population(run_dir=str(tmp_path / "pop"), resume="auto")
    assert resumed.step == int(exit["step"]) > 0
    expected = population(run_dir=str(tmp_path / "whole")).train()
    resumed.train()
    assert resumed.history()["loss"].tolist() == expected.history()["loss"].tolist()
    assert resumed.history()["val_loss"].tolist() == expected.history()["val_loss"].tolist()


# ---------------------------------------------------------------------------------------------
# the recipes of docs/preemption.md

PAGE = Path(__file__).resolve().parents[1] / "docs" / "preemption.md"

# Stand-ins for SLURM's commands: `srun` runs the step (its pid in $STEP_PID, where SLURM's
# --signal would reach it), `scontrol` records what it is asked
SRUN = '#!/bin/sh\necho $$ > "$STEP_PID"\nexec "$@"\n'
SCONTROL = '#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n'
# Imported by the job's Python at its start: with $PAUSE_AT_VALIDATION=N, the process stops
# itself (SIGSTOP) when its N-th validation begins, so the signal arrives mid-run
PAUSE = """
import os, signal
if os.environ.get("PAUSE_AT_VALIDATION"):
    import nitro
    seen = []
    def pause(change):
        if change.phase == "validating":
            seen.append(change.step)
            if len(seen) == int(os.environ["PAUSE_AT_VALIDATION"]):
                os.kill(os.getpid(), signal.SIGSTOP)
    nitro.on_phase(pause)
"""


def fence(language: str, heading: str | None = None) -> str:
    """The first ```language block of docs/preemption.md (under `heading`, if given)."""
    markdown_it = pytest.importorskip("markdown_it")
    tokens = markdown_it.MarkdownIt("commonmark").parse(PAGE.read_text(encoding="utf-8"))
    under = None
    for before, token in zip([None, *tokens], tokens, strict=False):
        if before is not None and before.type == "heading_open":
            under = token.content
        if token.type == "fence" and token.info.split()[:1] == [language]:
            if heading is None or under == heading:
                return token.content
    raise AssertionError(f"no {language} block under {heading!r} in {PAGE.name}")


def test_the_slurm_recipe_requeues_a_preempted_job_and_the_requeued_job_finishes_it_bitwise(
    tmp_path,
):
    import psutil
    from worker_processes import wait_for

    (tmp_path / "train.py").write_text(fence("python"))
    (tmp_path / "job.sh").write_text(fence("sh", "SLURM"))
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(PAUSE)
    for name, text in [
        ("srun", SRUN),
        ("scontrol", SCONTROL),
        ("python", f'#!/bin/sh\nexec {sys.executable} "$@"\n'),
    ]:
        (stand_ins / name).write_text(text)
        (stand_ins / name).chmod(0o755)
    env = child_env()
    env.update(
        PATH=f"{stand_ins}{os.pathsep}{env['PATH']}",
        PYTHONPATH=f"{hooks}{os.pathsep}{env['PYTHONPATH']}",
        SLURM_JOB_ID="4242",
        STEP_PID=str(tmp_path / "step.pid"),
        SCONTROL_LOG=str(tmp_path / "scontrol.log"),
    )

    def job(**more: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["bash", "job.sh"],
            cwd=tmp_path,
            env={**env, **more},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    first = job(PAUSE_AT_VALIDATION="3")
    try:
        step = tmp_path / "step.pid"

        def paused() -> bool:
            assert first.poll() is None, first.communicate()[0]
            if not step.is_file() or not step.read_text().strip():
                return False
            return psutil.Process(int(step.read_text())).status() == psutil.STATUS_STOPPED

        assert wait_for(paused, 180), "the job never reached its third validation"
        pid = int(step.read_text())
        os.kill(pid, signal.SIGUSR1)  # as --signal=USR1@90 sends it
        os.kill(pid, signal.SIGCONT)
        said, _ = first.communicate(timeout=180)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == PREEMPTED_EXIT_CODE, said
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    exit = EXIT.search(said)
    assert exit is not None and exit["signal"] == "SIGUSR1", said

    again = job()  # the requeued job
    said_again, _ = again.communicate(timeout=300)
    assert again.returncode == 0, said_again
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # not requeued again
    (run,) = (tmp_path / "runs" / "Digits").iterdir()
    resumed = f"nitro: resumed run {run.name} from its checkpoint at epoch \\d+, step (\\d+) "
    found = re.search(resumed, said_again)
    assert found is not None and found[1] == exit["step"], said_again

    from nitro.examples.digits import Digits

    finished = nitro.Nitro(Digits(), run_dir=str(run), resume="auto", progress=False)
    expected = nitro.Nitro(Digits(), run_dir=str(tmp_path / "whole"), progress=False).train()
    assert finished.epoch == expected.epoch == 30
    assert outcome(finished)[0] == outcome(expected)[0]  # bitwise
    for name, value in outcome(expected)[1].items():
        assert np.array_equal(outcome(finished)[1][name], value), name


def test_the_kubernetes_recipe_replaces_a_pod_that_exits_75_and_gives_it_time_to_save():
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load(fence("yaml", "Kubernetes"))
    assert job["kind"] == "Job"
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "train.py"]
    assert pod["restartPolicy"] == "Never"  # what podFailurePolicy requires
    assert pod["terminationGracePeriodSeconds"] >= 60
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "Ignore",
        "onExitCodes": {
            "containerName": container["name"],
            "operator": "In",
            "values": [PREEMPTED_EXIT_CODE],
        },
    }
    mount = container["volumeMounts"][0]["mountPath"]
    assert mount == f"{container['workingDir']}/runs"  # runs/ outlives the pod
