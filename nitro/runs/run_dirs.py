"""Run directories: where a run's files live, and the runs of an experiment on disk.

Every run gets a directory, by default `runs/<Experiment>/<run id>` under the working
directory; the run id is a sortable timestamp plus a short random suffix
(`20261130-181500-a3f9`), so listing a folder lists its runs in the order they started.

```
runs/Digits/20261130-181500-a3f9/
    run.json          the run id, the experiment, when it started, its preset and resolved
                      configuration, the git state of its code and the packages' versions
    working_tree.patch  the code's uncommitted diff, when it had one (`nitro.runs.run_origin`)
    checkpoints/      orbax: one directory per saved step
    metrics.jsonl     the default logger's lines
```

A population's directory is one run directory (run.json of kind "population") with a
directory per member (`member-<i>/`, run.json of kind "population member"): a single run
refuses to write there, and `weights=` reads a member's slice (`population_of`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from nitro.errors import SetupError

__all__ = [
    "KIND",
    "MEMBER_KIND",
    "POPULATION_JSON",
    "RUNS_ROOT",
    "RunInfo",
    "checkpoint_dir",
    "default_run_dir",
    "list_runs",
    "member_dir",
    "member_run_id",
    "new_run_id",
    "population_of",
    "read_run_json",
    "refuse_for_a_run",
    "saved_runs",
    "write_run_json",
]

RUNS_ROOT = "runs"
RUN_JSON = "run.json"


_ISSUED: set[str] = set()  # the run ids this process gave out
_ISSUING = threading.Lock()


def new_run_id() -> str:
    """A sortable timestamp plus a short random suffix: `20261130-181500-a3f9`, never one
    this process gave out before (handles made in a loop share their second)."""
    with _ISSUING:
        while True:
            run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
            if run_id not in _ISSUED:
                _ISSUED.add(run_id)
                return run_id


def experiment_root(experiment_name: str, root: str | os.PathLike = RUNS_ROOT) -> Path:
    return Path(root) / experiment_name


def default_run_dir(experiment_name: str, run_id: str) -> Path:
    return (experiment_root(experiment_name) / run_id).absolute()


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def write_run_json(run_dir: str | os.PathLike, info: dict[str, Any], name: str = RUN_JSON) -> None:
    """Write `run.json` (or another JSON file of the run, `name`) atomically (a temporary
    file, then a rename)."""
    path = Path(run_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(info, indent=2, default=repr))
    os.replace(temporary, path)


def read_run_json(run_dir: str | os.PathLike, name: str = RUN_JSON) -> dict[str, Any]:
    """`run.json` (or another JSON file of the run, `name`); empty when it cannot be read."""
    try:
        return json.loads((Path(run_dir) / name).read_text())
    except (OSError, ValueError):
        return {}


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """One run directory on disk."""

    run_id: str
    path: Path
    experiment: str
    started: str
    checkpoints: tuple[int, ...]  # saved optimizer steps
    latest_epoch: int | None
    best_metric: str | None
    best_value: float | None
    name: str | None = None  # the run's name (`name=`; `%nitro train exp` names it exp_run)
    preset: str | None = None  # the preset its experiment was built from

    def as_row(self) -> dict[str, Any]:
        return {
            "run id": self.run_id,
            "started": self.started,
            "name": self.name or "",
            "preset": self.preset or "",
            "checkpoints": len(self.checkpoints),
            "latest epoch": self.latest_epoch,
            "best": (
                f"{self.best_metric} {self.best_value:.4g}" if self.best_value is not None else "-"
            ),
            "path": str(self.path),
        }


def _is_run_dir(path: Path) -> bool:
    return (path / RUN_JSON).is_file() or (path / "checkpoints").is_dir()


def list_runs(root: str | os.PathLike) -> list[RunInfo]:
    """The runs under `root` (an experiment's folder such as `runs/Digits`, or one run
    directory), oldest first, with their checkpoints and best metric."""
    from nitro.runs.checkpoint_reads import describe_checkpoints

    root = Path(root)
    if not root.is_dir():
        return []
    candidates = [root] if _is_run_dir(root) else sorted(p for p in root.iterdir() if p.is_dir())
    runs = []
    for path in candidates:
        if not _is_run_dir(path):
            continue
        info = read_run_json(path)
        steps, latest_epoch, metric, best = describe_checkpoints(checkpoint_dir(path))
        runs.append(
            RunInfo(
                run_id=info.get("run_id", path.name),
                path=path.absolute(),
                experiment=info.get("experiment", ""),
                started=info.get("started", ""),
                checkpoints=tuple(steps),
                latest_epoch=latest_epoch,
                best_metric=metric,
                best_value=best,
                name=info.get("name"),
                preset=info.get("preset"),
            )
        )
    return runs


def saved_runs(where: Any = None):
    """The runs on disk of an experiment (a class, an instance or its name, under `runs/`),
    or under a directory: a DataFrame with one row per run (id, start, name, preset,
    checkpoints, latest epoch, best metric, path), oldest first.

    >>> import nitro
    >>> from nitro.examples.digits import Digits
    >>> n = nitro.Nitro(Digits(max_epochs=1), progress=False).train()
    >>> runs = nitro.saved_runs("Digits")
    >>> runs.columns.tolist(), runs.index.tolist() == [n.run_id]
    (['started', 'name', 'preset', 'checkpoints', 'latest epoch', 'best', 'path'], True)
    """
    import pandas as pd

    if where is None:
        root = Path(RUNS_ROOT)
    elif isinstance(where, (str, os.PathLike)) and (Path(where).is_dir() or os.sep in str(where)):
        root = Path(where)
    else:
        name = where if isinstance(where, str) else getattr(where, "__name__", None)
        name = name or type(where).__name__
        root = experiment_root(name)
    rows = [run.as_row() for run in list_runs(root)]
    columns = [
        "run id",
        "started",
        "name",
        "preset",
        "checkpoints",
        "latest epoch",
        "best",
        "path",
    ]
    frame = pd.DataFrame(rows, columns=columns)  # pyright: ignore[reportArgumentType]  # pandas' SequenceNotStr rejects list[str]
    return frame.set_index("run id")


# ---------------------------------------------------------------------------------------------
# a population's directories

KIND = "population"
MEMBER_KIND = "population member"
POPULATION_JSON = "population.json"


def member_dir(run_dir: str | os.PathLike, index: int) -> Path:
    """Member `index`'s directory in a population's run directory: `member-<index>`."""
    return Path(run_dir) / f"member-{index}"


def member_run_id(run_id: str, index: int) -> str:
    """Member `index`'s run id: the population's, then `-m<index>`."""
    return f"{run_id}-m{index}"


def population_of(path: str | os.PathLike) -> tuple[Path, int | None] | None:
    """(the population's run directory, the member) when `path` is a population's run
    directory (member None) or one of its members' directories; None otherwise."""
    path = Path(path).absolute()
    info = read_run_json(path)
    if info.get("kind") == KIND or (path / POPULATION_JSON).is_file():
        return path, None
    if info.get("kind") == MEMBER_KIND:
        member = info.get("member")
        return path.parent, int(member) if isinstance(member, int) else None
    return None


def refuse_for_a_run(path: str | os.PathLike, keyword: str) -> None:
    """Refuse a single run's `run_dir=` naming a population's directory or a member's: a
    population writes there (and its checkpoints hold every member at once)."""
    found = population_of(path)
    if found is None:
        return
    population, member = found
    what = (
        f"the directory of member {member} of the population in {str(population)!r}"
        if member is not None
        else f"the run directory of a population ({str(population)!r})"
    )
    raise SetupError(
        f"{keyword}={os.fspath(path)!r} is {what}; a single run cannot write there. "
        f"Population(..., resume={str(population)!r}) continues the population, and "
        f"Nitro(..., weights=({str(population)!r}, {member or 0})) starts a run of its own "
        f"from a member's weights"
    )
