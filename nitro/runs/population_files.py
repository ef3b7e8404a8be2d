"""A population's run directory: every member's state in one checkpoint, a directory per
member for its logs, what a resume reads, and a member's weights for a plain run.

```
runs/Digits/20261130-181500-a3f9/
    run.json          kind "population": run id, experiment, who ran it, start, members
    population.json   each member's settings, run id and directory; the axes
    run.lock          held by the population that writes here (one writer)
    checkpoints/      orbax, one step per save: every member's variables stacked on a
                      leading member axis (item `state`) and one JSON record (item `meta`)
    member-0/         a run directory per member: run.json (kind "population member", its
        run.json      settings and the population it belongs to) and its loggers' files
        metrics.jsonl
    member-1/ ...
```

One orbax step holds the whole population, so a save is one write, made atomic by orbax (a
step is renamed into place once it is whole): a crash loses that save only, and a resume finds
every member at the same step. The files are a run's (`PopulationFiles` is a `RunFiles`: the
same lock, writer and reader), and the record is a run's `CheckpointRecord` of kind
"population": the shared counters (step, epoch, position in the epoch) and a `MemberRecord` per
member (its settings, history, validations, healthy flag, why it stopped, the running sums of
the epoch under way and its loggers' state).

`weights=(run_dir, i)` or `weights=<run_dir>/member-<i>` on a plain `Nitro` reads member i's
slice of the population's newest checkpoint (`MemberWeights`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from nitro._version import __version__
from nitro.core.run_setup import CheckpointPolicy, CheckpointRef
from nitro.errors import SetupError
from nitro.experiments.fingerprint import code_digest
from nitro.runs.checkpoint_reads import SavedStep, read_checkpoint, resolve_checkpoint
from nitro.runs.checkpoint_record import CheckpointRecord
from nitro.runs.checkpoint_writer import CheckpointStore
from nitro.runs.identity import RunIdentity
from nitro.runs.resume import check_no_writer, warn_user
from nitro.runs.run_dirs import (
    KIND,
    MEMBER_KIND,
    POPULATION_JSON,
    checkpoint_dir,
    experiment_root,
    list_runs,
    member_dir,
    member_run_id,
    population_of,
    read_run_json,
    refuse_for_a_run,
    write_run_json,
)
from nitro.runs.run_files import RunFiles
from nitro.runs.run_lock import check_free
from nitro.runs.weights import MemberWeights, shown_setting

__all__ = [
    "KIND",
    "MEMBER_KIND",
    "POPULATION_JSON",
    "MemberWeights",
    "PopulationFiles",
    "member_dir",
    "member_run_id",
    "population_of",
    "refuse_for_a_run",
    "setting_token",
    "setting_differences",
]

# ---------------------------------------------------------------------------------------------
# settings as the records keep them


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def setting_token(value: Any, _depth: int = 0) -> Any:
    """A member's setting as JSON that is the same in every process for the same value:
    numbers, strings and containers as they are; a function as its qualified name, a
    digest of its code and the plain values it closes over (an optax schedule's init and end
    values, its steps); other objects by their repr, less memory addresses.

    >>> import optax
    >>> token = lambda end: setting_token(optax.linear_schedule(1e-3, end, 60))
    >>> token(1e-2) == token(1e-2), token(1e-2) == token(2e-2)
    (True, False)
    """
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [setting_token(v, _depth) for v in value]
    if isinstance(value, Mapping):
        return {str(k): setting_token(v, _depth) for k, v in value.items()}
    if callable(value) and hasattr(value, "__code__"):
        name = getattr(value, "__qualname__", type(value).__name__)
        token: dict[str, Any] = {"function": name, "code": code_digest(value)}
        if _depth < 4:  # the schedules an optax schedule joins; not a recursion of its own
            closure = [cell.cell_contents for cell in getattr(value, "__closure__", None) or ()]
            token["closure"] = [
                setting_token(c, _depth + 1)
                for c in closure
                if c is None or isinstance(c, (bool, int, float, str, np.generic)) or callable(c)
            ]
        return token
    return _ADDRESS.sub("", repr(value))


_shown = shown_setting


def setting_differences(saved: Sequence[Mapping[str, Any]], now: Sequence[Mapping[str, Any]]):
    """What differs between a checkpoint's members' settings and this population's, one
    line each (empty: the same members)."""
    lines = []
    saved_axes = sorted({k for s in saved for k in s})
    axes = sorted({k for s in now for k in s})
    if saved_axes != axes:
        lines.append(
            f"  axes: the checkpoint's {', '.join(saved_axes) or 'none'}; this population's "
            f"{', '.join(axes) or 'none'}"
        )
    if len(saved) != len(now):
        lines.append(f"  members: the checkpoint's {len(saved)}, this population's {len(now)}")
    for index, (before, after) in enumerate(zip(saved, now, strict=False)):
        for name in sorted(set(before) | set(after)):
            if before.get(name, "<unset>") != after.get(name, "<unset>"):
                lines.append(
                    f"  member {index} {name}: the checkpoint's "
                    f"{_shown(before.get(name, '<unset>'))}, this population's "
                    f"{_shown(after.get(name, '<unset>'))}"
                )
    return lines


# ---------------------------------------------------------------------------------------------
# the directory


@dataclasses.dataclass
class PopulationFiles(RunFiles):
    """Where a population lives and what it saves there: a run's files (`RunFiles`: its
    directory, lock, checkpoint writer) with a directory per member. `writes`: False with
    checkpointer=None, logger=None and no run_dir=: nothing on disk."""

    members: int = 1
    writes: bool = True
    WHO: ClassVar[str] = "this population"
    BUILD: ClassVar[str] = "Population"

    @classmethod
    def plan(  # pyright: ignore[reportIncompatibleMethodOverride]  # a population's keywords
        cls,
        experiment_cls: type,
        *,
        members: int,
        name: str | None,
        run_dir: str | None,
        resume: Any,
        checkpointer: CheckpointPolicy | None,
        settings: Sequence[Mapping[str, Any]],
        logs: bool,
        say: Callable[[str], None],
        busy: Callable[[], bool] = lambda: False,
    ) -> PopulationFiles:
        """Decide the population's directory and id; nothing is written yet. `resume`: the
        resolved keyword (False, "auto", a path or (path, "best" | "latest")); `settings`:
        the members' settings as `setting_token` makes them (resume="auto" prefers a
        population of the same members); `logs`: whether it has loggers."""
        identity = RunIdentity.of(experiment_cls, name)
        found = None
        if resume:
            found = _resume_source(experiment_cls, identity, run_dir, resume, settings, say)
        directory, run_id, branched_from = cls.located(
            experiment_cls.__name__, run_dir, found, kind=KIND
        )
        store = None
        if checkpointer is not None:
            store = CheckpointStore(checkpoint_dir(directory), checkpointer, deterministic=False)
        files = cls(
            run_id,
            directory,
            found,
            store,
            identity,
            branched_from=branched_from,
            busy=busy,
            members=members,
            writes=store is not None or logs or run_dir is not None or found is not None,
        )
        files.plan_claim(run_dir)
        return files

    def prepare(self) -> None:
        """Hold the run directory and create it and the members' directories, before the run
        starts (and its loggers write there): refused before any training when it cannot be
        created."""
        if not self.writes:
            return
        try:
            self.hold()
            for index in range(self.members):
                member_dir(self.run_dir, index).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SetupError(
                f"cannot create the population's run directory {str(self.run_dir)!r} "
                f"({type(error).__name__}: {error.strerror or error}); nothing was trained. "
                f"Put it where it can write with run_dir='/some/writable/dir', or "
                f"checkpointer=None, logger=None to write nothing"
            ) from None

    def open(self, record: Mapping[str, Any], say: Callable[[str], None]) -> None:
        """Write run.json, population.json and each member's run.json (those missing), once;
        the first line of the population's first run names its directory. `record`: the
        experiment (`experiment`), its GraphConst values (`graphconst`), the axes (`axes`),
        and per member its settings and seed (`members`)."""
        self.prepare()
        if self.opened or not self.writes:
            return
        info = read_run_json(self.run_dir)
        if info.get("run_id") not in (None, self.run_id):
            raise SetupError(
                f"run_dir {str(self.run_dir)!r} now holds run {info['run_id']}, written by "
                f"another handle since this population was built; one run directory holds one "
                f"run: build the population with another run_dir, or "
                f"resume={str(self.run_dir)!r} to continue that one"
            )
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        common = {
            "experiment": record["experiment"],
            **self.identity.as_json(),
            "started": started,
            "graphconst": record["graphconst"],
            "nitro": __version__,
        }
        if not info:
            write_run_json(
                self.run_dir,
                {
                    "run_id": self.run_id,
                    "kind": KIND,
                    **common,
                    "members": self.members,
                    "resumed_from": (
                        str(self.resume_from.path) if self.resume_from is not None else None
                    ),
                },
            )
        members = record["members"]
        if not (self.run_dir / POPULATION_JSON).is_file():
            write_run_json(
                self.run_dir,
                {
                    "run_id": self.run_id,
                    "experiment": record["experiment"],
                    "axes": record["axes"],
                    "members": [
                        {
                            "member": i,
                            "run_id": member_run_id(self.run_id, i),
                            "dir": member_dir(".", i).name,
                            "settings": m["settings"],
                            "seed": m["seed"],
                        }
                        for i, m in enumerate(members)
                    ],
                },
                POPULATION_JSON,
            )
        for i, m in enumerate(members):
            directory = member_dir(self.run_dir, i)
            if read_run_json(directory):
                continue
            write_run_json(
                directory,
                {
                    "run_id": member_run_id(self.run_id, i),
                    "kind": MEMBER_KIND,
                    "member": i,
                    "population": self.run_id,
                    **common,
                    "settings": m["settings"],
                    "seed": m["seed"],
                },
            )
        self.opened = True
        say(f"population {self.run_id} in {self.run_dir} ({self.members} members)")

    def read(self) -> tuple[Any, CheckpointRecord]:
        """(the state tree, the record) of the checkpoint this population resumes from;
        refused when it is not a population's."""
        assert self.resume_from is not None  # planned: a population that resumes
        directory, step = self.resume_from
        saved, record = read_checkpoint(directory, step)
        if record.kind != KIND:
            raise SetupError(
                f"{str(self.resume_from.path)!r} is a single run's checkpoint, not a "
                f"population's: Nitro(..., resume={str(directory.parent)!r}) continues it"
            )
        return saved, record

    def wait(self) -> None:
        if self.store is not None:
            self.store.wait()


def _resume_source(
    experiment_cls: type,
    identity: RunIdentity,
    run_dir: str | None,
    resume: Any,
    settings: Sequence[Mapping[str, Any]],
    say: Callable[[str], None],
) -> SavedStep | None:
    if resume != "auto":
        path, which = resume if isinstance(resume, tuple) else (resume, "latest")
        path = Path(path).absolute()
        check_no_writer(path)
        return resolve_checkpoint(CheckpointRef(os.fspath(path), which))
    root = Path(run_dir) if run_dir is not None else experiment_root(experiment_cls.__name__)
    if population_of(root) is not None and read_run_json(root).get("kind") != MEMBER_KIND:
        runs = list_runs(root)
        if runs and runs[0].checkpoints:
            check_free(root)
            return resolve_checkpoint(root)
        return None
    candidates = []
    for run in list_runs(root):
        info = read_run_json(run.path)
        if run.checkpoints and info.get("kind") == KIND and identity.same_experiment(info):
            same = _recorded_settings(run.path) == [dict(s) for s in settings]
            candidates.append((same, run.latest_epoch or 0, max(run.checkpoints), run))
    if not candidates:
        warn_user(
            f"resume='auto' found no population's checkpoint under {str(root.absolute())!r} "
            f"of {identity.where()}; starting a fresh population"
        )
        return None
    same, epoch, step, run = max(candidates, key=lambda c: c[:3])
    why = "with these members" if same else "(none has these members: resuming it is refused)"
    say(f"resume='auto' continues population {run.run_id} (epoch {epoch}, step {step}) {why}")
    check_free(run.path)
    return resolve_checkpoint(run.path)


def _recorded_settings(run_dir: Path) -> list[dict[str, Any]] | None:
    try:
        info = json.loads((run_dir / POPULATION_JSON).read_text())
        return [dict(m["settings"]) for m in info["members"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
