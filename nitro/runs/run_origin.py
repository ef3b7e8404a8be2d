"""Where a run comes from, as its run.json and an export's manifest record it: the git state
of the code that defines the experiment (commit, branch, remote, tree, dirty flag, and the
uncommitted diff written as `working_tree.patch` beside the record), the versions of the
packages that matter, and the resolved configuration (every field's value and every run
keyword's, as plain JSON).

Git is asked where the experiment's class is defined (its source file's directory; the working
directory for a class defined in a notebook cell or the REPL). It never fails a run: without
git, outside a work tree, or when git errs or hangs, the record says `"git": null`. Two git
commands run side by side (where HEAD is; the diff), on a thread started when the handle is
built (`OriginProbe`), so they overlap its setup; the remote is read once per work tree and
process, the package versions once per process (`bench/run_origin.py` measures what this
adds to a run's start).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import os
import re
import select
import subprocess
import threading
import time
from typing import Any

from nitro._version import __version__
from nitro.core.run_setup import RunSetup
from nitro.runs.checkpoint_record import setting_token

__all__ = [
    "PACKAGES",
    "PATCH",
    "PATCH_LIMIT",
    "SESSION_KEYWORDS",
    "GitState",
    "OriginProbe",
    "code_directory",
    "git_state",
    "package_versions",
    "provenance",
    "run_config",
]

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
PATCH = "working_tree.patch"
SESSION_KEYWORDS = ("progress", "logger")  # the run keywords its configuration leaves out
PATCH_LIMIT = 1 << 20  # bytes of the uncommitted diff kept; a longer one is cut, and said so
GIT_SECONDS = 10.0  # the most the git commands may take together; then git counts as absent

# what a remote's URL may carry that a record must not: https://user:token@host/...
_CREDENTIALS = re.compile(r"^(https?://)[^/@]*@", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class GitState:
    """The git work tree holding the code: its top directory, the commit checked out (and
    its tree), the branch (None: a detached HEAD), the remote's URL (`origin`, else the first
    remote; None: no remote; credentials left out), and the uncommitted changes to tracked
    files (`diff`, at most `PATCH_LIMIT` bytes; `cut`: it was longer)."""

    root: str
    commit: str
    tree: str
    branch: str | None
    remote: str | None
    diff: bytes
    cut: bool

    @property
    def dirty(self) -> bool:
        return bool(self.diff)

    def as_json(self) -> dict[str, Any]:
        """The record's `git` entry; the diff is written as `working_tree.patch` beside it."""
        record: dict[str, Any] = {
            "commit": self.commit,
            "branch": self.branch,
            "remote": self.remote,
            "tree": self.tree,
            "dirty": self.dirty,
            "root": self.root,
        }
        if self.dirty:
            record["patch"] = PATCH
            record["patch_bytes"] = len(self.diff)
            if self.cut:
                record["patch_cut"] = (
                    f"the uncommitted diff is longer than {PATCH_LIMIT:,} bytes: {PATCH} holds "
                    f"its first {PATCH_LIMIT:,} (`git diff HEAD` in {self.root} shows it whole)"
                )
        return record


BRANCH = ("--symbolic-full-name", "HEAD")  # the ref checked out: refs/heads/<branch>, or HEAD


def _environment() -> dict[str, str]:
    """git's: read-only (no index refresh written), no prompt for credentials."""
    return {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0"}


def _git(directory: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["git", "-C", directory, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_environment(),
    )


def _read_capped(process: subprocess.Popen[bytes], limit: int, deadline: float) -> bytes | None:
    """Up to `limit + 1` bytes of `process`'s output (None: it did not finish by `deadline`);
    a longer output is cut there and the process ended."""
    assert process.stdout is not None
    fd, chunks, size = process.stdout.fileno(), [], 0
    while size <= limit:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, min(1 << 16, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def git_state(directory: str | os.PathLike) -> GitState | None:
    """The git state of the work tree holding `directory`; None without git, outside a work
    tree (or one with no commit yet), or when git fails or takes longer than `GIT_SECONDS`."""
    where = os.fspath(directory)
    deadline = time.monotonic() + GIT_SECONDS
    processes: list[subprocess.Popen[bytes]] = []
    try:
        # the top directory, the commit, its tree, the ref checked out ("HEAD": detached)
        processes.append(
            _git(where, "rev-parse", "--show-toplevel", "HEAD", "HEAD^{tree}", *BRANCH)
        )
        processes.append(
            _git(where, "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff", "--no-textconv")
        )
        located, diffing = processes
        diff = _read_capped(diffing, PATCH_LIMIT, deadline)
        out, _ = located.communicate(timeout=max(deadline - time.monotonic(), 0.001))
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine, or it hangs
        return None
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()
    lines = out.decode(errors="replace").splitlines()
    if diff is None or located.returncode != 0 or diffing.returncode not in (0, -9):
        return None
    if len(lines) != 4:
        return None
    root, commit, tree, ref = lines
    return GitState(
        root=root,
        commit=commit,
        tree=tree,
        branch=ref.removeprefix("refs/heads/") if ref.startswith("refs/heads/") else None,
        remote=_remote(root),
        diff=diff[:PATCH_LIMIT],
        cut=len(diff) > PATCH_LIMIT,
    )


@functools.cache
def _remote(root: str) -> str | None:
    """The URL of the remote `origin` of the work tree at `root`, else of its first remote,
    without credentials; None without one. Read once per work tree and process: remotes
    rarely change while a process lives, the code's state does."""
    try:
        done = subprocess.run(
            ["git", "-C", root, "config", "--get-regexp", r"^remote\..*\.url$"],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=GIT_SECONDS,
            env=_environment(),
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    urls = {}
    for line in done.stdout.decode(errors="replace").splitlines():
        key, _, url = line.partition(" ")
        urls.setdefault(key.removeprefix("remote.").removesuffix(".url"), url.strip())
    if not urls:
        return None
    url = urls.get("origin") or urls[min(urls)]
    return _CREDENTIALS.sub(r"\1", url)


def code_directory(cls: type) -> str:
    """Where the code of experiment class `cls` lives: its source file's directory, or the
    working directory for a class defined in a notebook cell or the REPL."""
    try:
        return os.path.dirname(inspect.getsourcefile(cls) or "") or os.getcwd()
    except (TypeError, OSError):
        return os.getcwd()


@functools.cache
def package_versions() -> dict[str, str | None]:
    """The installed versions of the packages that matter (None: not installed), and Nitro's
    own (the running code's); read once per process."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["nitro"] = __version__
    return versions


def provenance(cls: type) -> tuple[dict[str, Any], bytes | None]:
    """(the `git` and `packages` entries of a record, such as run.json or a manifest; the
    uncommitted diff of the code of `cls`, to write as `working_tree.patch` beside the record,
    or None when there is none)."""
    state = git_state(code_directory(cls))
    if state is None:
        return {"git": None, "packages": package_versions()}, None
    patch = state.diff if state.dirty else None
    return {"git": state.as_json(), "packages": package_versions()}, patch


class OriginProbe:
    """`provenance(cls)` found on a thread started when a handle is built, so git runs beside
    the setup instead of before the first step; `result()` waits for it. The git state is the
    one of the code the handle froze."""

    def __init__(self, cls: type):
        self._found: tuple[dict[str, Any], bytes | None] | None = None
        self._thread = threading.Thread(
            target=self._probe, args=(cls,), name="nitro-origin", daemon=True
        )
        self._thread.start()

    def _probe(self, cls: type) -> None:
        self._found = provenance(cls)

    def result(self) -> tuple[dict[str, Any], bytes | None]:
        self._thread.join()  # ended: no thread of it outlives the run's start
        if self._found is None:  # the probe raised: nothing is known of where the run comes from
            return {"git": None, "packages": package_versions()}, None
        return self._found


def run_config(setup: RunSetup) -> dict[str, Any]:
    """The resolved configuration of a run as plain JSON: every field's value at setup
    (`fields`) and every run keyword's resolved value (`keywords`), but those of the session
    that change nothing the run computes or saves (`SESSION_KEYWORDS`: how it shows progress,
    the loggers, which name their run's own files)."""
    return {
        "fields": setting_token(setup.experiment.values),
        "keywords": {
            name: setting_token(r.value)
            for name, r in setup.keywords.items()
            if name not in SESSION_KEYWORDS
        },
    }
