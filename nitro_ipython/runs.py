"""Runs in a notebook: finding handles by name, tracking their live numbers, status lines.

Every reporter this package installs keeps a `RunStats` per handle (latest loss, throughput,
elapsed time), so `%nitro status` and `%nitro runs` can answer while a run trains in the
background. A `nitro.Population` is stopped, waited for and listed as a run is; its status
line says how many members still train and which is best, and a line per stopped member
follows it, as the live edits swapped in follow a run's. Handles built outside the magics are found in the user namespace, and the runs a
coding agent started (`%nitro mcp start`) in the agent tools' registry, under their run ids.
`%nitro runs` also lists the run directories of the notebook's experiments on disk
(`nitro.saved_runs`), so a restarted kernel sees what it can resume.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import nitro
from nitro.progress import settings_label
from nitro.staleness import is_experiment

from .member_table import best_member, members_text

__all__ = [
    "RunStats",
    "RunTables",
    "agent_runs",
    "ended",
    "handle_names",
    "live_handles",
    "live_runs",
    "named_populations",
    "populations_table",
    "runs_on_disk",
    "runs_table",
    "stats_of",
    "status_line",
    "status_lines",
    "status_row",
    "stop",
]


class RunStats:
    """What a reporter saw of one handle's latest run: step, loss, throughput, elapsed time.

    Throughput is measured on a training clock that runs only while the run trains: it stops
    while the run compiles a program, validates or saves a checkpoint (each phase other than
    "training") and between runs, and runs again when training goes on. The rate is the steps
    over that clock in a sliding window of its last few seconds, across epoch boundaries: a
    step's cost, without the compiles (their notes say how long each took). `observe` runs
    once per step on the training thread: it stores two numbers and, every few milliseconds,
    one sample.
    """

    WINDOW = 3.0  # seconds of training clock the rate is measured over
    SAMPLE_EVERY = 0.02

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.ended: float | None = None
        self.step = 0
        self.loss = float("nan")
        self._samples: deque[tuple[int, float]] = deque(maxlen=512)  # (step, training clock)
        self._latest: tuple[int, float] | None = None
        self._clock_base = 0.0  # training seconds before the current stretch
        self._stretch: float | None = None  # perf_counter at the start of the current stretch

    def start_run(self, step: int = 0) -> None:
        """A run starts at `step`."""
        self.started, self.ended = time.monotonic(), None
        self._samples.clear()
        self._latest, self._clock_base, self._stretch = None, 0.0, None
        self.step = step

    def resume(self) -> None:
        """Training starts or goes on: the training clock runs. The run's first sample is
        taken here, before its first step, so the window of a run shorter than it counts the
        wait for the first batch."""
        if self._stretch is None:
            self._stretch = time.perf_counter()
        if not self._samples:
            self._samples.append((self.step, self._clock()))

    def follow(self, phase: str) -> None:
        """The run's phase changed: the training clock runs while it is "training" and stops
        in any other (a compile, validation, a checkpoint, the run's end)."""
        if phase == "training":
            self.resume()
        else:
            self.pause()

    def pause(self) -> None:
        """Training pauses (a compile, validation, the end of the run): the training clock
        stops."""
        if self._stretch is not None:
            self._clock_base += time.perf_counter() - self._stretch
            self._stretch = None

    def end_run(self) -> None:
        self.pause()
        self.ended = time.monotonic()

    def _clock(self) -> float:
        stretch = self._stretch
        return self._clock_base + (time.perf_counter() - stretch if stretch is not None else 0.0)

    def observe(self, step: int, loss: float) -> None:
        self.step, self.loss = step, loss
        clock = self._clock()
        self._latest = (step, clock)
        if not self._samples or clock - self._samples[-1][1] >= self.SAMPLE_EVERY:
            self._samples.append((step, clock))

    @property
    def steps_per_second(self) -> float:
        """Steps per training second over the last `WINDOW` seconds (nan before two samples)."""
        latest, samples = self._latest, list(self._samples)
        if latest is None or not samples:
            return float("nan")
        oldest = samples[0]
        for sample in samples:  # the newest sample at or before the window's start
            if sample[1] > latest[1] - self.WINDOW:
                break
            oldest = sample
        steps, seconds = latest[0] - oldest[0], latest[1] - oldest[1]
        return steps / seconds if steps > 0 and seconds > 0 else float("nan")

    @property
    def elapsed(self) -> float:
        """Seconds since the run started; frozen when it ended."""
        return (self.ended if self.ended is not None else time.monotonic()) - self.started


_STATS: weakref.WeakKeyDictionary[Any, RunStats] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def stats_of(handle: Any, create: bool = False) -> RunStats | None:
    with _LOCK:
        stats = _STATS.get(handle)
        if stats is None and create:
            stats = _STATS[handle] = RunStats()
        return stats


def agent_runs() -> dict[str, Any]:
    """Run id -> handle of the runs agent tools started in this process (empty when the
    agent extra is not installed)."""
    try:
        from nitro.mcp import RUNS
    except ImportError:  # pragma: no cover - the registry needs only the engine
        return {}
    return RUNS.handles()


def handle_names(user_ns: Mapping[str, Any], handle: Any) -> list[str]:
    """The names the notebook uses for `handle` (public names first), else the run ids agent
    tools gave it."""
    names = [k for k, v in user_ns.items() if v is handle and not k.startswith("_")]
    names = names or [k for k, v in user_ns.items() if v is handle and k == "_nitro"]
    return names or [run_id for run_id, h in agent_runs().items() if h is handle]


def live_handles(user_ns: Mapping[str, Any]) -> list[Any]:
    """Handles bound to names in the notebook, then handles of agents' runs, then handles
    known only to a reporter."""
    seen: dict[int, Any] = {}
    for value in list(user_ns.values()):
        if isinstance(value, nitro.Nitro):
            seen.setdefault(id(value), value)
    with _LOCK:  # a population's numbers too: its status lines are its own
        tracked = [h for h in _STATS.keys() if isinstance(h, nitro.Nitro)]
    for handle in [*agent_runs().values(), *tracked]:
        seen.setdefault(id(handle), handle)
    return list(seen.values())


def live_runs(user_ns: Mapping[str, Any]) -> list[Any]:
    """`live_handles`, and the populations the notebook names that are training: what an
    edit of the code reaches while it trains."""
    running = [p for _, p in named_populations(user_ns) if p.running]
    return [*live_handles(user_ns), *running]


def named_populations(user_ns: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The populations the notebook names (public names), one entry each."""
    seen: dict[int, tuple[str, Any]] = {}
    for key, value in list(user_ns.items()):
        if isinstance(value, nitro.Population) and not key.startswith("_"):
            seen.setdefault(id(value), (key, value))
    return list(seen.values())


def ended(target: Any) -> str:
    """How a run or population that is not running ended: "finished at epoch 4/4, step 24"."""
    at = f"at epoch {target.epoch}/{target.target_epoch or target.max_epochs}, step {target.step}"
    said = {"done": "finished", "stopped": "stopped", "failed": "failed"}
    return f"{said[target.phase]} {at}" if target.phase in said else f"{target.phase}, {at}"


def stop(target: Any, name: str) -> None:
    """`%nitro stop RUN`: stop a run or a population after its current step (a population's
    current call) and wait until it stopped; say where, or that it was not running."""
    if not target.running:
        print(f"nitro: {name} is not running ({ended(target)}); nothing to stop")
        return
    began = time.monotonic()
    target.stop()
    try:
        target.wait()
    finally:
        if target.stop_reason != "requested":  # it ended before the stop took effect
            print(f"nitro: {name} is not running ({ended(target)}); nothing to stop")
    if target.stop_reason == "requested":
        print(
            f"nitro: stopped {name} at epoch {target.epoch}, step {target.step} (in "
            f"{time.monotonic() - began:.1f} s); `%nitro train {name}` resumes it"
        )


def status_lines(target: Any, name: str = "") -> list[str]:
    """`%nitro status`: a run's line and, under it, the live edits swapped in (or rolled
    back) while it trained; a population's line and, under it, each stopped member and the
    step it stopped at."""
    if not isinstance(target, nitro.Population):
        return [status_line(target, name), *(f"  {line}" for line in _swap_lines(target))]
    stopped, members = target.stopped, target.members
    text = (
        f"{name} ({target.cls.__name__} population of {len(members)}): {target.phase}, epoch "
        f"{target.epoch}/{target.target_epoch or target.max_epochs}, step {target.step}, "
        + members_text(len(members) - len(stopped), len(members), target.running)
    )
    best = best_member(target)
    if best is not None:
        text += f", best {best}"
    if not target.running and target.stop_reason:
        text += f" (stop reason: {target.stop_reason})"
    at = target.stopped_at  # where each stopped member's record ends, not the run's step
    return [text] + [
        f"  member {index} ({settings_label(members[index])}): {why}"
        + (f" (at step {at[index]})" if index in at else "")
        for index, why in stopped.items()
    ]


def populations_table(user_ns: Mapping[str, Any]):
    """`%nitro runs`' populations: one row per population the notebook names (its run
    directory among them), or None."""
    import pandas as pd

    rows = []
    for name, pop in named_populations(user_ns):
        members = len(pop.members)
        rows.append(
            {
                "population": name,
                "experiment": pop.cls.__name__,
                "preset": pop.preset or "",
                "phase": pop.phase,
                "epoch": f"{pop.epoch}/{pop.target_epoch or pop.max_epochs}",
                "step": pop.step,
                "members": members_text(members - len(pop.stopped), members, pop.running),
                "best": best_member(pop) or "-",
                "running": pop.running,
            }
        )
    return pd.DataFrame(rows).set_index("population") if rows else None


def _fmt(value: Any, spec: str = ".4g") -> str:
    if isinstance(value, float) and value == value:
        return format(value, spec)
    return "-"


def _throughput(handle: Any, stats: RunStats | None) -> float:
    if stats is not None:
        rate = stats.steps_per_second
        if rate == rate:  # not nan
            return rate
    rows = handle.history()
    if rows.empty or "epoch_seconds" not in rows or "step" not in rows:
        return float("nan")
    last = rows.iloc[-1]
    before = rows.iloc[-2]["step"] if len(rows) > 1 else 0
    seconds = float(last["epoch_seconds"])
    return float(last["step"] - before) / seconds if seconds > 0 else float("nan")


def status_row(handle: Any, name: str = "") -> dict[str, Any]:
    stats = stats_of(handle)
    loss = stats.loss if stats is not None and stats.step == handle.step else float("nan")
    if loss != loss:
        loss = float(handle.last_metrics.get("loss", float("nan")))
    return {
        "run": name,
        "experiment": handle.cls.__name__,
        "preset": handle.preset or "",
        "phase": handle.phase,
        "epoch": f"{handle.epoch}/{handle.target_epoch}",
        "step": handle.step,
        "loss": loss,
        "steps/s": _throughput(handle, stats),
        "running": handle.running,
        "stop reason": handle.stop_reason or "-",
    }


def status_line(handle: Any, name: str = "") -> str:
    row = status_row(handle, name)
    label = f"{name} ({row['experiment']})" if name else row["experiment"]
    text = (
        f"{label}: {row['phase']}, epoch {row['epoch']}, step {row['step']}, "
        f"loss {_fmt(row['loss'])}, {_fmt(row['steps/s'], '.1f')} steps/s"
    )
    if not handle.running and handle.stop_reason:
        text += f" (stop reason: {handle.stop_reason})"
    return text


def _swap_lines(handle: Any) -> list[str]:
    """One line per live edit swapped in (or rolled back) while `handle` trained: step, what
    changed, status."""
    lines = []
    for row in handle.state.swaps:
        changed = ", ".join(row.get("changed") or []) or "the code"
        text = f"step {row['step']}: edit of {changed} {row['status']}"
        if row["status"] == "rolled back" and row.get("reason"):
            text += f" ({row['reason']})"
        lines.append(text)
    return lines


def runs_table(user_ns: Mapping[str, Any], handles: Iterable[Any]):
    """A DataFrame with one row per handle: experiment, preset, phase, epoch, step, latest
    loss, throughput."""
    import pandas as pd

    rows = [status_row(h, ", ".join(handle_names(user_ns, h)) or "(unnamed)") for h in handles]
    columns = [
        "run",
        "experiment",
        "preset",
        "phase",
        "epoch",
        "step",
        "loss",
        "steps/s",
        "running",
        "stop reason",
    ]
    return pd.DataFrame(rows, columns=columns).set_index("run")


DISK_RUNS_SHOWN = 10  # newest run directories shown per experiment


def _experiment_names(user_ns: Mapping[str, Any], handles: Iterable[Any]) -> list[str]:
    """Class names of the experiments the notebook holds (instances, classes, handles)."""
    names: dict[str, None] = {}
    for key, value in list(user_ns.items()):
        if key.startswith("_") or not is_experiment(value):
            continue
        names[(value if isinstance(value, type) else type(value)).__name__] = None
    for handle in handles:
        names[handle.cls.__name__] = None
    return list(names)


def runs_on_disk(user_ns: Mapping[str, Any], handles: Iterable[Any]):
    """One row per run directory of the notebook's experiments under `runs/` (the newest
    `DISK_RUNS_SHOWN` of each) and of its handles and populations elsewhere (`run_dir=`):
    experiment, started, the run's recorded name and preset, checkpoints, latest epoch, best metric,
    path, and the notebook's name for it when a handle or population here is that run."""
    import pandas as pd

    handles = list(handles)
    names_by_id = {h.run_id: ", ".join(handle_names(user_ns, h)) for h in handles}
    populations = named_populations(user_ns)
    names_by_id.update((pop.run_id, name) for name, pop in populations)
    held = [*handles, *(pop for _, pop in populations)]
    frames = []
    for name in _experiment_names(user_ns, held):
        frame = nitro.saved_runs(name).tail(DISK_RUNS_SHOWN)
        frames.append(frame.assign(experiment=name))
    shown = {path for frame in frames for path in frame["path"]}
    for handle in held:
        if handle.run_dir not in shown and os.path.isdir(handle.run_dir):
            frame = nitro.saved_runs(handle.run_dir)
            frames.append(frame.assign(experiment=handle.cls.__name__))
    columns = [
        "experiment",
        "started",
        "name",
        "preset",
        "checkpoints",
        "latest epoch",
        "best",
        "path",
    ]
    frames = [f for f in frames if not f.empty]
    if not frames:
        return pd.DataFrame(columns=["in this kernel", *columns])
    table = pd.concat(frames)[columns]
    table.insert(0, "in this kernel", [names_by_id.get(i, "") for i in table.index])
    return table


class RunTables:
    """`%nitro runs`: the notebook's live runs, its populations, then the run directories on
    disk."""

    def __init__(self, live, on_disk, populations=None):
        self.live, self.on_disk, self.populations = live, on_disk, populations

    # the live table's numbers, as the status line shows them
    FORMATTERS = {"loss": lambda v: _fmt(v), "steps/s": lambda v: _fmt(v, ",.0f")}

    def __repr__(self) -> str:
        parts = [
            self.live.to_string(formatters=self.FORMATTERS)
            if self.live is not None
            else "no runs in this kernel"
        ]
        if self.populations is not None:
            parts.append("populations:\n" + self.populations.to_string())
        if not self.on_disk.empty:
            parts.append("on disk:\n" + self.on_disk.to_string())
        return "\n\n".join(parts)

    def _repr_html_(self) -> str:
        parts = [
            self.live.to_html(formatters=self.FORMATTERS)
            if self.live is not None
            else "<p>no runs in this kernel</p>"
        ]
        if self.populations is not None:
            parts.append("<p><b>populations</b></p>" + self.populations.to_html())
        if not self.on_disk.empty:
            parts.append("<p><b>on disk</b></p>" + self.on_disk.to_html())
        return "\n".join(parts)
