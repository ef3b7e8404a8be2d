"""Terminal IPython (no widgets): the same magics, with a tqdm bar instead of the panel."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from notebook_kernel import TINY_MODULE, kernel_env

pytest.importorskip("IPython")
termios = pytest.importorskip("termios")  # a pseudo-terminal needs POSIX
import fcntl  # noqa: E402
import pty  # noqa: E402

CODE = """
import sys
sys.path.insert(0, {cwd!r})
%load_ext nitro
import tiny_exp
exp = tiny_exp.Tiny(batches=30, delay=0.005)
%nitro train exp
%nitro status
"""


def test_terminal_ipython_trains_with_a_tqdm_bar_and_reports_status(tmp_path):
    (tmp_path / "tiny_exp.py").write_text(TINY_MODULE)
    ipython = Path(sys.executable).with_name("ipython")
    command = [
        str(ipython),
        "--no-banner",
        "--colors=NoColor",
        "-c",
        CODE.format(cwd=str(tmp_path)),
    ]
    primary, secondary = pty.openpty()  # stdout and stderr are a terminal, as in a shell
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
        cwd=tmp_path,
        env=kernel_env(),
    )
    os.close(secondary)
    chunks, deadline = [], time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            data = os.read(primary, 65536)
        except OSError:  # the terminal closed: the process ended
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    assert process.wait(timeout=60) == 0
    output = b"".join(chunks).decode(errors="replace")

    assert "epoch 1/1" in output and "step/s" in output  # tqdm's bar: description and rate
    assert "epoch 1/1  loss " in output  # the epoch summary line above the bar
    assert "exp_run (Tiny): done, epoch 1/1, step 30, loss " in output
    status = output[output.index("exp_run (Tiny): done") :].splitlines()[0]
    assert "- steps/s" not in status  # the terminal reporter measured the throughput
