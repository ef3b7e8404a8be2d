"""Which experiment a run belongs to, and which run `resume="auto"` continues.

Every run records its identity in `run.json`: the experiment class's module and qualified
name, the notebook or script that started it (see `current_notebook`) and the run's name
(the `name=` keyword; `%nitro train exp` names its runs `exp_run`). Runs live under
`runs/<ClassName>/`, so two notebooks whose classes share a name share that folder; the
identity tells their runs apart.

`choose_run` picks the run to continue among the runs of a folder: only runs of the same
experiment (module, qualified name, notebook) are candidates, then those with the same
GraphConst values; the run a name last trained (`handles.json`, beside the runs) comes
first, then runs of the same name, then the furthest trained. Runs written before Nitro
recorded identities are candidates by class name, when no identified run is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from nitro.errors import SetupError
from nitro.runs.checkpoint_names import step_path
from nitro.runs.run_dirs import RunInfo, list_runs, read_run_json

__all__ = [
    "HANDLES_JSON",
    "Choice",
    "RunIdentity",
    "choose_run",
    "current_notebook",
    "record_name",
    "recorded_run",
]

HANDLES_JSON = "handles.json"


def current_notebook() -> str | None:
    """The notebook or script this process runs: in a Jupyter kernel the notebook's path
    (`JPY_SESSION_NAME`, which jupyter_server sets, or VS Code's `__vsc_ipynb_file__`); in a
    script its file (`__main__.__file__`, else `sys.argv[0]`); None when it cannot be known
    (an IPython session without a notebook, `python -c`)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        session = os.environ.get("JPY_SESSION_NAME")
        if session:
            return session
        vscode = getattr(shell, "user_ns", {}).get("__vsc_ipynb_file__")
        return str(vscode) if vscode else None
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv else "")
    if not script or script in ("-c", "-m", "-"):
        return None
    return os.path.abspath(script)


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """What a run belongs to: the experiment class (module, qualified name), the notebook or
    script that ran it, and its name (None: unnamed)."""

    module: str
    qualname: str
    notebook: str | None
    name: str | None = None

    @classmethod
    def of(cls, experiment_cls: type, name: str | None = None) -> RunIdentity:
        return cls(experiment_cls.__module__, experiment_cls.__qualname__, current_notebook(), name)

    @property
    def owner(self) -> str:
        return f"{self.module}.{self.qualname}"

    def as_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "qualname": self.qualname,
            "notebook": self.notebook,
            "name": self.name,
        }

    def same_experiment(self, info: Mapping[str, Any]) -> bool:
        """Whether the run.json `info` is a run of this experiment in this notebook."""
        return (info.get("module"), info.get("qualname"), info.get("notebook")) == (
            self.module,
            self.qualname,
            self.notebook,
        )

    def where(self) -> str:
        if self.notebook is None:
            return self.owner
        return f"{self.owner} in {self.notebook}"


def recorded(info: Mapping[str, Any]) -> bool:
    """Whether run.json `info` records its identity (older Nitro did not)."""
    return "qualname" in info


# ---------------------------------------------------------------------------------------------
# handles.json: which run each name last trained


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _key(identity: RunIdentity) -> str:
    return json.dumps([identity.module, identity.qualname, identity.notebook, identity.name])


def _read_records(path: Path) -> dict[str, Any]:
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def record_name(root: Path, identity: RunIdentity, run_id: str, run_dir: Path) -> None:
    """Record in `root/handles.json` that `identity`'s name now trains `run_dir` (written
    atomically, under a lock: several kernels may record at once)."""
    if identity.name is None:
        return
    path = root / HANDLES_JSON
    with _locked(path):
        records = _read_records(path)
        records[_key(identity)] = {
            **identity.as_json(),
            "run_id": run_id,
            "run_dir": str(run_dir),
            "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(records, indent=2))
        os.replace(temporary, path)


def recorded_run(root: Path, identity: RunIdentity) -> Path | None:
    """The run directory `identity`'s name last trained, per `root/handles.json`."""
    if identity.name is None:
        return None
    entry = _read_records(root / HANDLES_JSON).get(_key(identity))
    if not isinstance(entry, dict) or not entry.get("run_dir"):
        return None
    return Path(entry["run_dir"])


# ---------------------------------------------------------------------------------------------
# choosing the run to continue


@dataclasses.dataclass(frozen=True)
class Choice:
    """The run to continue and why it was chosen (a sentence for the person)."""

    run: RunInfo
    why: str

    @property
    def path(self) -> Path:
        return self.run.path


def _progress(run: RunInfo) -> tuple[int, int, int]:
    """How far a run got; of two as far, the one that saved last (run ids started in the same
    second sort by their random suffix, not by time)."""
    newest = step_path(run.path / "checkpoints", max(run.checkpoints, default=0))
    try:
        saved = newest.stat().st_mtime_ns
    except OSError:
        saved = 0
    return (run.latest_epoch or 0, max(run.checkpoints, default=0), saved)


def describe(run: RunInfo, info: Mapping[str, Any]) -> str:
    name = info.get("name")
    return (
        f"  {run.run_id}  started {run.started or '?'}  epoch {run.latest_epoch}  "
        f"step {max(run.checkpoints, default=0)}" + (f"  name {name}" if name else "")
    )


def choose_run(
    root: Path,
    identity: RunIdentity,
    config: Mapping[str, Any],
    *,
    strict: bool = False,
    pick_hint: str = "",
    kind: str = "run",
    prefer: Callable[[Path], bool] | None = None,
) -> Choice | None:
    """The run under `root` (an experiment's folder) that `identity` continues, or None when
    none of its runs has a checkpoint. `config`: the GraphConst values now (a run with other
    values cannot resume; when every candidate has other values, the newest is chosen, and
    resuming it refuses with the difference). `strict`: several candidates and no record of
    the name's run raise a SetupError listing them (`pick_hint` says how to pick one). `kind`:
    the runs considered ("run", or "population"); `prefer`: of those, the ones it holds first."""
    runs = [run for run in list_runs(root) if run.checkpoints]
    infos = {run.path: read_run_json(run.path) for run in runs}
    runs = [run for run in runs if infos[run.path].get("kind", "run") == kind]
    ours = [
        run
        for run in runs
        if recorded(infos[run.path]) and identity.same_experiment(infos[run.path])
    ]
    legacy = [run for run in runs if not recorded(infos[run.path])]
    others = len(runs) - len(ours) - len(legacy)
    aside = (
        f"; {others} run{'s' * (others > 1)} of other experiments named {root.name} (another "
        f"module or notebook) {'are' if others > 1 else 'is'} not a candidate"
        if others
        else ""
    )
    pool, older = (ours, False) if ours else (legacy, True)
    if not pool:
        return None
    fits = lambda run: infos[run.path].get("graphconst") == dict(config)  # noqa: E731
    fitting = [run for run in pool if fits(run)]
    origin = (
        f"run of {root.name} written by an older Nitro (it recorded no module or notebook: "
        f"chosen by class name)"
        if older
        else f"run of {identity.where()}"
    )
    if not fitting:
        newest = pool[-1]
        return Choice(newest, f"the newest {origin}; none has these GraphConst values{aside}")
    last = recorded_run(root, identity)
    if last is not None:
        for run in fitting:
            if run.path == last.absolute():
                why = f"the run {identity.name!r} last trained ({root / HANDLES_JSON})"
                return Choice(run, why + aside)
    named = [
        run for run in fitting if identity.name and infos[run.path].get("name") == identity.name
    ]
    chosen = named or fitting
    if strict and len(chosen) > 1:
        listed = "\n".join(describe(run, infos[run.path]) for run in chosen)
        raise SetupError(
            f"{len(chosen)} runs of {identity.where()} with these GraphConst values could be "
            f"continued, and none is recorded as the last run of "
            f"{identity.name or 'this handle'}:\n{listed}\n{pick_hint}"
        )
    chosen = [run for run in chosen if prefer is None or prefer(run.path)] or chosen
    best = max(chosen, key=_progress)
    runs_of = origin.replace("run of", "runs of", 1)
    if len(chosen) == 1 and named:
        why = f"the only run named {identity.name!r}, a {origin} with these GraphConst values"
    elif len(chosen) == 1:
        why = f"the only {origin} with these GraphConst values"
    else:
        why = (
            f"the furthest trained (epoch {best.latest_epoch}, step {max(best.checkpoints)}) "
            f"of {len(chosen)} {runs_of}{f' named {identity.name!r}' if named else ''} with "
            f"these GraphConst values"
        )
    return Choice(best, why + aside)


def candidates_elsewhere(root: Path, identity: RunIdentity) -> int:
    """How many runs with checkpoints under `root` belong to other experiments."""
    count = 0
    for run in list_runs(root):
        info = read_run_json(run.path)
        if run.checkpoints and recorded(info) and not identity.same_experiment(info):
            count += 1
    return count
