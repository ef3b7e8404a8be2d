"""Which directories are a population's: the population's run directory and its members'.

The lowest piece of a population's files, read by single runs too (a single run refuses to
write into a population's directory, `weights=` reads a member's slice): it knows the names
on disk, nothing of checkpoints or lifecycles (`nitro.runs.population_files`).
"""

from __future__ import annotations

import os
from pathlib import Path

from nitro.errors import SetupError
from nitro.runs.run_dirs import read_run_json

__all__ = [
    "KIND",
    "MEMBER_KIND",
    "POPULATION_JSON",
    "member_dir",
    "member_run_id",
    "population_of",
    "refuse_for_a_run",
]

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
