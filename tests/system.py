"""What tests need of the operating system: a small tmpfs to fill, a full disk, the
environment of a child Python process that imports the tests' modules."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


@contextlib.contextmanager
def mounted(directory: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at `directory` for the test (`options`: mount's -o, e.g. "size=2m" or
    "ro,size=64k"), unmounted after it; the test skips, saying why, where it cannot mount."""
    if getattr(os, "geteuid", lambda: -1)() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    directory.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def fill(path: Path, leave: int = 0) -> None:
    """Write `path` until its disk is full, then free `leave` bytes of it."""
    with open(path, "wb", buffering=0) as file:
        try:
            while True:
                file.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC, error
        file.truncate(max(0, file.tell() - leave))


def child_env() -> dict[str, str]:
    """The environment of a child Python that imports the tests' modules and Nitro, on CPU."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(TESTS), str(REPO), env.get("PYTHONPATH")])
    )
    env["JAX_PLATFORMS"] = "cpu"
    return env
