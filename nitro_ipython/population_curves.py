"""A population's curves: every member's loss per step and validation loss per epoch, one plot.

`PopulationCurves` collects what the population reports (`member_steps`: the loss of every
member at each step, NaN once a member stopped; `member_rows`: each member's history row per
epoch); `PopulationFigure` draws them on one axis over steps, one colour per member (the
colours of the members' table), a legend naming each member's settings. It has the interface
`curves.CurveRenderer` draws with (`png(data)`, `css_width`), so the renderer thread and the
figure's object API (no pyplot) are the single run's.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "CSS_WIDTH",
    "PopulationCurves",
    "PopulationFigure",
    "member_colours",
    "readable_limits",
]

CSS_WIDTH = 620  # displayed pixels: the plot and, to its right, the legend
CSS_HEIGHT = 260
PIXEL_RATIO = 2
LEGEND_MEMBERS = 12  # members named in the legend; more are "... and N more"


def member_colours(count: int) -> list[str]:
    """One colour per member (hex), the same in the curves and the members' table."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    if count <= 10:
        return [to_hex(colormaps["tab10"](i)) for i in range(count)]
    if count <= 20:
        return [to_hex(colormaps["tab20"](i)) for i in range(count)]
    return [to_hex(colormaps["viridis"](i / max(1, count - 1))) for i in range(count)]


def readable_limits(
    losses: np.ndarray, validation: Sequence[Sequence[tuple[int, float]]] = ()
) -> tuple[tuple[float, float] | None, list[int]]:
    """The y limits that keep every member's curve readable when some diverge, and the
    members left above them. `losses`: [steps, members]. A member diverged when the median
    of the later half of its finite losses is more above the members' median start than the
    start is from zero (twice the start, for a positive loss); the limits span the others'
    losses and validation losses, padded 5%. None when no member diverged (the axis scales
    itself) or every one did."""
    if losses.size == 0:
        return None, []
    firsts, laters = [], []
    for member in range(losses.shape[1]):
        values = losses[:, member]
        values = values[np.isfinite(values)]
        firsts.append(values[0] if len(values) else np.nan)
        laters.append(np.median(values[len(values) // 2 :]) if len(values) else np.nan)
    starts = np.asarray(firsts)[np.isfinite(firsts)]
    if not len(starts):
        return None, []
    start = float(np.median(starts))
    above = [m for m, later in enumerate(laters) if later > start + abs(start)]
    kept = [m for m in range(losses.shape[1]) if m not in above]
    if not above or not kept:
        return None, above if kept else []
    values = [losses[:, kept].ravel()]
    values += [np.asarray([v for _, v in validation[m]]) for m in kept if m < len(validation)]
    shown = np.concatenate(values)
    shown = shown[np.isfinite(shown)]
    low, high = float(shown.min()), float(shown.max())
    pad = 0.05 * (high - low) or 0.05 * abs(high) or 0.05
    return (low - pad, high + pad), above


class PopulationCurves:
    """Every member's loss per step (thinned to a bounded size, NaN once a member stopped) and
    its validation loss per epoch (at the epoch's last step); `version` counts changes."""

    MAX_POINTS = 2000

    def __init__(self, members: int = 0) -> None:
        self.lock = threading.Lock()
        self.members = members
        self.steps: list[int] = []
        self.losses: list[np.ndarray] = []  # one [members] array per kept step
        self.validation: list[list[tuple[int, float]]] = [[] for _ in range(members)]
        self._ended: set[int] = set()  # members whose curves ended (stopped)
        self.version = 0
        self._stride = 1
        self._skipped = 0

    def add_steps(self, first: int, losses: Any) -> None:
        """The steps `first`, `first + 1`, ... of a call (counted from 1): `losses`
        [members, steps]."""
        block = np.asarray(losses, np.float64)
        with self.lock:
            for offset in range(block.shape[1]):
                self._skipped += 1
                if self._skipped < self._stride:
                    continue
                self._skipped = 0
                self.steps.append(first + offset)
                self.losses.append(block[:, offset].copy())
                if len(self.steps) > self.MAX_POINTS:
                    del self.steps[::2], self.losses[::2]
                    self._stride *= 2
            self.version += 1

    def add_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """An epoch's rows: each member's `val_loss` at the epoch's last step. A member that
        stopped gets the point of the epoch it stopped in (its final weights), then no more."""
        with self.lock:
            for row in rows:
                index = int(row.get("member", 0))
                if index >= self.members or index in self._ended:
                    continue
                if "stopped" in row:
                    self._ended.add(index)
                value, step = row.get("val_loss"), row.get("step")
                if isinstance(value, (int, float)) and isinstance(step, int):
                    self.validation[index].append((step, float(value)))
            self.version += 1

    def snapshot(self):
        with self.lock:
            losses = np.stack(self.losses) if self.losses else np.zeros((0, self.members))
            return list(self.steps), losses, [list(v) for v in self.validation], self.version


class PopulationFigure:
    """One plot over steps: each member's step loss (a thin line) and validation loss per epoch
    (dashed, with markers), in its colour; the legend names each member by its settings."""

    def __init__(self, labels: Sequence[str], pixel_ratio: int = PIXEL_RATIO):
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D

        self.labels = list(labels)
        colours = member_colours(len(self.labels))
        dpi = 100 * pixel_ratio
        self._figure = Figure(figsize=(CSS_WIDTH / 100, CSS_HEIGHT / 100), dpi=dpi)
        ax = self._figure.add_axes((0.09, 0.17, 0.55, 0.73))
        self._steps = [ax.plot([], [], lw=0.8, alpha=0.6, color=c)[0] for c in colours]
        self._validation = [
            ax.plot([], [], "o--", lw=1.0, markersize=3, color=c)[0] for c in colours
        ]
        ax.set_xlabel("step", fontsize=8)
        ax.set_title("loss of every member", fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        shown = min(len(self.labels), LEGEND_MEMBERS)
        handles: list[Any] = [
            Line2D([], [], color=colours[i], lw=2, label=f"{i}: {self.labels[i] or 'member'}")
            for i in range(shown)
        ]
        if len(self.labels) > shown:
            handles.append(Line2D([], [], lw=0, label=f"... and {len(self.labels) - shown} more"))
        handles.append(Line2D([], [], color="#555", lw=0.8, label="loss per step"))
        handles.append(
            Line2D([], [], color="#555", lw=1.0, ls="--", marker="o", ms=3, label="val_loss")
        )
        ax.legend(
            handles=handles, fontsize=6.5, loc="upper left", bbox_to_anchor=(1.02, 1.0),
            frameon=False, borderaxespad=0.0,
        )  # fmt: skip
        self._ax = ax
        self._above = ax.text(
            0.99, 0.98, "", transform=ax.transAxes, ha="right", va="top", fontsize=6.5,
            color="#c0392b",
        )  # fmt: skip

    @property
    def css_width(self) -> int:
        return CSS_WIDTH

    @property
    def figure(self):
        """The matplotlib `Figure` as the latest `png()` drew it."""
        return self._figure

    def png(self, data: PopulationCurves) -> bytes | None:
        steps, losses, validation, _ = data.snapshot()
        if not steps and not any(validation):
            return None
        for index, line in enumerate(self._steps):
            line.set_data(steps, losses[:, index] if len(steps) else [])
        for index, line in enumerate(self._validation):
            points = validation[index] if index < len(validation) else []
            line.set_data([p[0] for p in points], [p[1] for p in points])
            line.set_markersize(3 if len(points) <= 40 else 0)
        self._ax.relim()
        self._ax.autoscale_view()
        limits, above = readable_limits(losses, validation)
        if limits is not None:
            self._ax.set_ylim(*limits)
        self._above.set_text(
            f"member{'s' * (len(above) > 1)} {', '.join(map(str, above))} above the plot (diverged)"
            if above
            else ""
        )
        buffer = io.BytesIO()
        self._figure.savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
        return buffer.getvalue()
