"""Runs in a notebook: finding handles by name, tracking their live numbers, status lines.

Every reporter this package installs keeps a `RunStats` per handle (latest loss, throughput,
elapsed time), so `%nitro status` and `%nitro runs` can answer while a run trains in the
background. Handles built outside the magics are found in the user namespace, and the runs a
coding agent started (`%nitro mcp start`) in the agent tools' registry, under their run ids.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import nitro

from .agents import agent_runs

__all__ = [
    "RunStats",
    "handle_names",
    "live_handles",
    "runs_table",
    "stats_of",
    "status_line",
    "status_row",
]


class RunStats:
    """What a reporter saw of one handle: kept cheap, since `observe` runs once per step."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.step = 0
        self.loss = float("nan")
        self.steps_per_second = float("nan")
        self._mark: tuple[int, float] | None = None

    def start_run(self) -> None:
        self.started = time.monotonic()
        self._mark = None

    def start_epoch(self) -> None:
        self._mark = None  # throughput is measured within epochs, after the first step

    def observe(self, step: int, loss: float) -> None:
        self.step = step
        self.loss = loss
        if self._mark is None:
            self._mark = (step, time.perf_counter())

    def refresh_rate(self) -> float:
        """Steps per second since the last refresh (smoothed); called a few times a second."""
        mark = self._mark
        if mark is None:
            return self.steps_per_second
        now = time.perf_counter()
        steps, seconds = self.step - mark[0], now - mark[1]
        if steps > 0 and seconds > 0.05:
            rate = steps / seconds
            old = self.steps_per_second
            self.steps_per_second = rate if old != old else 0.5 * old + 0.5 * rate  # nan check
            self._mark = (self.step, now)
        return self.steps_per_second

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


_STATS: weakref.WeakKeyDictionary[Any, RunStats] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def stats_of(handle: Any, create: bool = False) -> RunStats | None:
    with _LOCK:
        stats = _STATS.get(handle)
        if stats is None and create:
            stats = _STATS[handle] = RunStats()
        return stats


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
    with _LOCK:
        tracked = list(_STATS.keys())
    for handle in [*agent_runs().values(), *tracked]:
        seen.setdefault(id(handle), handle)
    return list(seen.values())


def _fmt(value: Any, spec: str = ".4g") -> str:
    if isinstance(value, float) and value == value:
        return format(value, spec)
    return "-"


def _throughput(handle: Any, stats: RunStats | None) -> float:
    if stats is not None:
        rate = stats.refresh_rate() if handle.running else stats.steps_per_second
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
        "phase": handle.phase,
        "epoch": f"{handle.epoch}/{handle.max_epochs}",
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


def runs_table(user_ns: Mapping[str, Any], handles: Iterable[Any]):
    """A DataFrame with one row per handle: phase, epoch, step, latest loss, throughput."""
    import pandas as pd

    rows = [status_row(h, ", ".join(handle_names(user_ns, h)) or "(unnamed)") for h in handles]
    columns = [
        "run",
        "experiment",
        "phase",
        "epoch",
        "step",
        "loss",
        "steps/s",
        "running",
        "stop reason",
    ]
    return pd.DataFrame(rows, columns=columns).set_index("run")
