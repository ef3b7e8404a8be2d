"""`nitro runs [DIR]`: the runs on disk (what `%nitro runs` lists under "on disk", from
`nitro.saved_runs`), with their preset and settings; `nitro runs diff A B`: how two runs
differ in their settings, code digests, versions and the rest of their `run.json`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["run_record", "runs_command", "runs_on_disk"]

USAGE = """usage: nitro runs [DIR]        the runs under DIR (default: runs/): an experiment's folder,
                             a folder of experiments' folders, or one run directory
       nitro runs diff A B   how runs A and B differ (run directories)"""


def runs_command(argv: Sequence[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return 0
    if argv[:1] == ["diff"]:
        if len(argv) != 3:
            print(f"nitro runs diff: error: give two run directories\n{USAGE}", file=sys.stderr)
            return 2
        missing = [path for path in argv[1:] if not Path(path).is_dir()]
        if missing:
            print(f"nitro runs diff: error: no run directory {missing[0]!r}", file=sys.stderr)
            return 2
        print(diff_text(argv[1], argv[2]))
        return 0
    if len(argv) > 1:
        print(f"nitro runs: error: one directory at most\n{USAGE}", file=sys.stderr)
        return 2
    table = runs_on_disk(argv[0] if argv else "runs")
    if table.empty:
        print(f"no runs under {argv[0] if argv else 'runs'}")
    else:
        print(table.to_string(index=False))
    return 0


def runs_on_disk(directory: str = "runs"):
    """One row per run under `directory` (one run directory, or a folder of run directories
    and of folders of them, such as `runs/`): experiment, started, name, preset, checkpoints, latest
    epoch, best metric, settings (the fields and run keywords its config.yaml gives, else its
    GraphConst values), path; oldest first within each experiment."""
    import pandas as pd

    from nitro.progress import settings_label
    from nitro.runs.run_dirs import list_runs, read_run_json, saved_runs

    root = Path(directory)
    listed = {run.path for run in list_runs(root)}  # root itself, or the run directories in it
    folders = [root] + [
        child
        for child in sorted(root.glob("*"))
        if child.is_dir() and child.absolute() not in listed
    ]
    frames = []
    for folder in folders:
        frame = saved_runs(str(folder))
        if frame.empty:
            continue
        infos = [read_run_json(path) for path in frame["path"]]
        configs = [_config(path) for path in frame["path"]]
        pairs = list(zip(infos, configs, strict=True))
        frames.append(
            frame.assign(
                experiment=[_experiment_name(info, folder) for info in infos],
                preset=[info.get("preset") or config.get("preset") or "" for info, config in pairs],
                settings=[settings_label(_settings(info, config)) for info, config in pairs],
            )
        )
    if not frames:
        return pd.DataFrame()
    columns = ["experiment", "started", "name", "preset", "checkpoints", "latest epoch", "best"]
    table = pd.concat(frames)[[*columns, "settings", "path"]].reset_index()
    table["path"] = [_relative(path) for path in table["path"]]
    return table


def _relative(path: str) -> str:
    """`path` from the working directory when it lies under it."""
    import os

    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _experiment_name(info: Mapping[str, Any], folder: Path) -> str:
    return str(info.get("qualname") or folder.name)


def _config(run_dir: str | Path) -> dict[str, Any]:
    from nitro.cli.options import CONFIG_FILE, load_config_text

    try:
        config = load_config_text((Path(run_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _settings(info: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    if config:
        return {k: v for k, v in config.items() if k not in ("experiment", "preset")}
    return dict(info.get("graphconst") or {})


def _flat(section: str, value: Any, into: dict[str, Any], path: str = "") -> None:
    """`value`'s leaves into `into`, keyed `<section> <path.to.leaf>`."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            _flat(section, item, into, f"{path}.{key}" if path else str(key))
    elif path:
        into[f"{section} {path}"] = value


def run_record(run_dir: str | Path) -> dict[str, Any]:
    """What a run records about itself, flat: `setting <name>` (the fields and run keywords
    it resolved, as its logger's params say; else its config.yaml), `code <unit>` (the digests
    of its hooks' code in its newest checkpoint), `version <package>`, and `run.json <key>`
    for the rest of its run.json."""
    from nitro.runs.checkpoint_reads import newest_record
    from nitro.runs.run_dirs import read_run_json

    record: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            if '"type": "params"' in line:
                try:
                    settings.update(json.loads(line).get("params") or {})
                except ValueError:
                    continue
    _flat("setting", settings or _config(run_dir), record)
    saved = newest_record(run_dir)
    if saved is not None:
        _flat("code", dict(saved.code), record)
        record["version nitro"], record["version jax"] = saved.nitro, saved.jax
    info = read_run_json(run_dir)
    for key in ("nitro", "jax"):
        if key in info:
            record[f"version {key}"] = info[key]  # the versions that started the run
    for key in ("versions", "packages"):
        _flat("version", info.get(key) or {}, record)
    rest = {k: v for k, v in info.items() if k not in ("nitro", "jax", "versions", "packages")}
    _flat("run.json", rest, record)
    return record


_SAME_IN_EVERY_RUN = ("run.json run_id", "run.json started")


def diff_text(a: str | Path, b: str | Path) -> str:
    """How runs `a` and `b` differ, a line per difference: what, A's value, B's value."""
    import pandas as pd

    first, second = run_record(a), run_record(b)
    keys = [k for k in {**first, **second} if k not in _SAME_IN_EVERY_RUN]
    missing = "(none)"
    rows = {
        key: [_shown(first.get(key, missing)), _shown(second.get(key, missing))]
        for key in keys
        if first.get(key, missing) != second.get(key, missing)
    }
    names = [f"A {first.get('run.json run_id', a)}", f"B {second.get('run.json run_id', b)}"]
    head = f"A: {Path(a)}\nB: {Path(b)}"
    if not rows:
        return f"{head}\nno differences in their settings, code, versions or run.json"
    table = pd.DataFrame.from_dict(rows, orient="index", columns=pd.Index(names))
    same = len(keys) - len(rows)
    return f"{head}\n{table.to_string()}\n({same} recorded values are the same in both)"


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."
