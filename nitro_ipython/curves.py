"""Training curves: what a run collects, a figure redrawn in place, and the thread that redraws it.

The curves are PNGs in `ipywidgets.Image`s, one per plot (side by side, wrapping under each
other in a narrow panel), drawn with matplotlib's object API (no pyplot, safe off the main
thread) at twice the size they are displayed at, so they stay sharp on
high-density screens and are never stretched. The figure is built once per run and its lines
are moved as data arrives; a redraw costs a few tens of milliseconds. A live edit swapped in
(or rolled back) while the run trains is a labelled vertical line on the loss plot at its
step (`CurveData.add_marker`); the branches a rewind left are drawn dimmed under the run's
curves, with a mark where it went back to (`CurveData.rewind`).
"""

from __future__ import annotations

import contextvars
import io
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from nitro.progress import TIMING_COLUMNS

__all__ = [
    "CSS_HEIGHT",
    "CSS_PANEL_WIDTH",
    "CurveData",
    "CurveFigure",
    "CurveRenderer",
    "acquire_figure",
    "member_colours",
    "readable_limits",
    "release_figure",
]

CSS_PANEL_WIDTH = 380  # displayed pixels per plot
CSS_HEIGHT = 230
PIXEL_RATIO = 2
LEGEND_MEMBERS = 12  # members a population's figure names; more are "... and N more"
_SKIP = {"epoch", "step", *TIMING_COLUMNS, "loss", "val_loss"}


class CurveData:
    """Each member's loss per step (thinned to a bounded size; NaN once a member stopped) and
    history rows, and the live edits' marks; a run has one member. `version` counts changes."""

    MAX_POINTS = 2000

    def __init__(self, members: int = 1) -> None:
        self.lock = threading.Lock()
        self.members = members
        self.steps: list[int] = []
        self.losses: list[list[float]] = [[] for _ in range(members)]
        self.rows: list[list[dict[str, Any]]] = [[] for _ in range(members)]
        self.markers: list[tuple[int, str]] = []  # (step, label): the live edits' swaps
        # the branches rewinds left (a run's): their steps and losses, and their rows
        self.abandoned: list[tuple[list[int], list[float], list[dict[str, Any]]]] = []
        self.parent_rows: list[dict[str, Any]] = []  # a fork's parent's, after the fork step
        self.version = 0
        self._ended: set[int] = set()  # members whose curves ended (stopped)
        self._stride = 1
        self._skipped = 0

    @property
    def empty(self) -> bool:
        """No row yet (a resumed run's curves start with its history)."""
        return not any(self.rows)

    def add_step(self, step: int, loss: float) -> None:
        """One step of a run (its only member)."""
        self._skipped += 1
        if self._skipped < self._stride:
            return
        self._skipped = 0
        with self.lock:
            self.steps.append(step)
            self.losses[0].append(loss)
            self._thin()
            self.version += 1

    def add_steps(self, first: int, losses: Any) -> None:
        """The steps `first`, `first + 1`, ... of a call (counted from 1): `losses`
        [members, steps]."""
        block = np.asarray(losses, np.float64).reshape(self.members, -1)
        with self.lock:
            for offset in range(block.shape[1]):
                self._skipped += 1
                if self._skipped < self._stride:
                    continue
                self._skipped = 0
                self.steps.append(first + offset)
                for member, column in enumerate(self.losses):
                    column.append(float(block[member, offset]))
                self._thin()
            self.version += 1

    def _thin(self) -> None:
        if len(self.steps) > self.MAX_POINTS:
            del self.steps[::2]
            for column in self.losses:
                del column[::2]
            self._stride *= 2

    def add_row(self, row: dict[str, Any], member: int = 0) -> None:
        """An epoch's history row of `member` (its numbers). A row that says `stopped` is
        the member's last (its final weights); its curves end there."""
        with self.lock:
            if member >= self.members or member in self._ended:
                return
            if "stopped" in row:
                self._ended.add(member)
            self.rows[member].append({k: v for k, v in row.items() if isinstance(v, (int, float))})
            self.version += 1

    def add_marker(self, row: dict[str, Any]) -> None:
        """A live edit's swap (`row`: a row of `n.state.swaps`) marks its step: "edit: loss",
        or "rolled back" (which replaces the mark of the swap it undid)."""
        changed = ", ".join(row.get("changed") or []) or "code"
        rolled_back = row.get("status") == "rolled back"
        label = f"edit: {changed}" + (" (rolled back)" if rolled_back else "")
        with self.lock:
            if rolled_back and self.markers and self.markers[-1][0] == row["step"]:
                self.markers[-1] = (row["step"], label)
            else:
                self.markers.append((row["step"], label))
            self.version += 1

    def rewind(self, row: dict[str, Any]) -> None:
        """A run went back to `row["step"]` (`n.rewind`, a spike's roll-back): its curves
        after that step become an abandoned branch, drawn dimmed, and a mark says where."""
        to = row["step"]
        with self.lock:
            kept = sum(1 for step in self.steps if step <= to)
            rows = self.rows[0]
            left = [r for r in rows if r.get("step", 0) > to]
            self.abandoned.append((self.steps[kept:], self.losses[0][kept:], left))
            del self.steps[kept:], self.losses[0][kept:]
            self.rows[0] = [r for r in rows if r.get("step", 0) <= to]
            self.markers.append((to, f"rewound from {row.get('from_step')}"))
            self.version += 1

    def overlay(self, rows: list[dict[str, Any]]) -> None:
        """A fork's parent's history rows after the fork step, drawn dimmed under the fork's
        curves (replacing the ones given before: the parent may train on)."""
        with self.lock:
            if rows != self.parent_rows:
                self.parent_rows = rows
                self.version += 1

    def branches(self) -> list[tuple[list[int], list[float], list[dict[str, Any]]]]:
        """The branches drawn dimmed: those rewinds abandoned, and a fork's parent's rows
        after the fork step: (steps, losses, rows) each."""
        with self.lock:
            branches = [(list(s), list(v), list(r)) for s, v, r in self.abandoned]
            return branches + ([([], [], list(self.parent_rows))] if self.parent_rows else [])

    def snapshot(self):
        """(steps, losses [steps, members], each member's rows, version)."""
        with self.lock:
            losses = np.asarray(self.losses, np.float64).reshape(self.members, -1).T
            return list(self.steps), losses, [list(r) for r in self.rows], self.version

    def add_mark(self, step: int, label: str) -> None:
        """A mark on the loss curve at `step` (a population's search: "PBT: 3<-1")."""
        with self.lock:
            self.markers.append((step, label))
            self.version += 1

    def marks(self) -> list[tuple[int, str]]:
        with self.lock:
            return list(self.markers)


def metric_groups(rows: list[list[dict[str, Any]]]) -> list[tuple[str, list[str]]]:
    """Up to two metrics with their split variants: [("acc", ["acc", "val_acc"]), ...]."""
    groups: dict[str, list[str]] = {}
    for member in rows:
        for row in member:
            for key in row:
                if key in _SKIP:
                    continue
                names = groups.setdefault(key.removeprefix("val_").removeprefix("test_"), [])
                if key not in names:
                    names.append(key)
    return list(groups.items())[:2]


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
    itself) or every one did (a run's one member among them)."""
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


# how each curve is drawn: (line style, line width, alpha); a run's in matplotlib's colours by
# curve, a population's in each member's colour
_STYLES = {"step loss": ("-", 0.8, 0.5), "val_loss": ("s-", 1.5, 1.0)}
_MEMBER_STYLES = {"step loss": ("-", 0.8, 0.6)}
_EPOCH_STYLE, _MEMBER_TRAIN, _MEMBER_VAL = ("o-", 1.5, 1.0), ("o-", 1.0, 1.0), ("o--", 1.0, 1.0)


class CurveFigure:
    """The loss per step with the epoch means and `val_loss`, and one plot per metric by epoch;
    for a population (`labels`: each member's settings), every member's curves in its colour
    on the same plots (its step loss and validation curves; the epoch means are a run's), and
    a last plot that names each member.

    `png(data)` redraws in place; the figure is rebuilt only when the set of curves changes.
    """

    def __init__(self, labels: Sequence[str] | None = None, pixel_ratio: int = PIXEL_RATIO):
        self.labels = None if labels is None else list(labels)
        self.pixel_ratio = pixel_ratio
        self._colours = member_colours(len(self.labels)) if self.labels is not None else []
        self._figure = None
        self._layout: tuple | None = None
        self._lines: dict[tuple[int, str, int], Any] = {}
        self._legends: dict[int, tuple] = {}
        self._marks: list[Any] = []  # the artists of the drawn swap markers
        self._marked: list[tuple[int, str]] = []
        self._dimmed: list[Any] = []  # the artists of the abandoned branches
        self._branched: list = []
        self._above = None  # the loss plot's note of the members above it

    @property
    def members(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def css_width(self) -> int:
        return CSS_PANEL_WIDTH * (len(self._figure.axes) if self._figure is not None else 1)

    def _style(self, name: str, member: int) -> tuple[str, float, float]:
        if self.labels is None:
            return _STYLES.get(name, _EPOCH_STYLE)
        val = _MEMBER_VAL if name.startswith(("val_", "test_")) else _MEMBER_TRAIN
        return _MEMBER_STYLES.get(name, val)

    def _build(self, layout: tuple) -> None:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        has_steps, groups = layout
        named = self.labels is not None
        panels = 1 + len(groups) + named
        dpi = 100 * self.pixel_ratio
        figure = Figure(figsize=(CSS_PANEL_WIDTH * panels / 100, CSS_HEIGHT / 100), dpi=dpi)
        # each plot in its own slice of the figure, CSS_PANEL_WIDTH wide: `pngs` cuts there
        axes = [
            figure.add_axes(((index + 0.16) / panels, 0.2, 0.82 / panels, 0.68))
            for index in range(panels)
        ]
        kinds = [["step loss"] if has_steps else [], *[names for _, names in groups]]
        kinds[0] += ["val_loss"] if named else ["loss", "val_loss"]
        lines: dict[tuple[int, str, int], Any] = {}
        for index, names in enumerate(kinds):
            for name in names:
                for member in range(self.members):
                    style, width, alpha = self._style(name, member)
                    colour = {"color": self._colours[member]} if named else {}
                    (lines[index, name, member],) = axes[index].plot(
                        [], [], style, lw=width, alpha=alpha, markersize=3, label=name, **colour
                    )
        axes[0].set_xlabel("step", fontsize=8)
        axes[0].set_title("loss", fontsize=9, loc="left")
        for index, (base, _) in enumerate(groups, start=1):
            axes[index].set_xlabel("epoch", fontsize=8)
            axes[index].set_title(base, fontsize=9, loc="left")
        for ax in axes[: panels - named]:
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            # steps and epochs are whole numbers: no tick at epoch 0.98
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        if named:
            self._name_members(axes[-1])
        self._above = axes[0].text(
            0.99, 0.98, "", transform=axes[0].transAxes, ha="right", va="top", fontsize=6.5,
            color="#c0392b",
        )  # fmt: skip
        self._figure, self._layout, self._lines = figure, layout, lines
        self._dimmed, self._branched = [], []
        self._legends, self._marks, self._marked = {}, [], []

    def _name_members(self, ax) -> None:
        """The last plot: each member's colour and settings (the first `LEGEND_MEMBERS`)."""
        from matplotlib.lines import Line2D

        labels = self.labels or []
        shown = min(len(labels), LEGEND_MEMBERS)
        handles: list[Any] = [
            Line2D([], [], color=self._colours[i], lw=2, label=f"{i}: {labels[i] or 'member'}")
            for i in range(shown)
        ]
        if len(labels) > shown:
            handles.append(Line2D([], [], lw=0, label=f"... and {len(labels) - shown} more"))
        ax.set_axis_off()
        ax.set_title("members", fontsize=9, loc="left")
        ax.legend(
            handles=handles, fontsize=6.5, loc="upper left", bbox_to_anchor=(-0.1, 1.0),
            frameon=False, borderaxespad=0.0,
        )  # fmt: skip

    @property
    def figure(self):
        """The matplotlib `Figure` as the latest `png()` or `pngs()` drew it (None before
        the first)."""
        return self._figure

    def _draw_marks(self, marks: list[tuple[int, str]]) -> None:
        """Vertical lines on the loss plot at the steps of live edits, each labelled."""
        if marks == self._marked:
            return
        for artist in self._marks:
            artist.remove()
        ax = self._figure.axes[0]
        self._marks = []
        for step, label in marks:
            color = "#c0392b" if label.endswith("(rolled back)") else "#8e44ad"
            color = "#7f8c8d" if label.startswith("rewound") else color
            color = "#27ae60" if label.startswith(("PBT", "halving")) else color
            self._marks.append(ax.axvline(step, color=color, lw=0.8, ls="--", alpha=0.8))
            self._marks.append(
                ax.text(
                    step,
                    0.98,
                    f" {label} ",
                    transform=ax.get_xaxis_transform(),
                    rotation=90,
                    va="top",
                    fontsize=6,
                    color=color,
                )
            )
        self._marked = list(marks)

    def _draw_branches(self, branches: list) -> None:
        """The branches rewinds left, dimmed, under the run's curves."""
        if branches == self._branched:
            return
        for artist in self._dimmed:
            artist.remove()
        self._dimmed = []
        for steps, losses, rows in branches:
            for (index, name, member), line in self._lines.items():
                if member:
                    continue
                if name == "step loss":
                    xs, ys = steps, losses
                else:
                    x = "step" if index == 0 else "epoch"
                    points = [(r[x], r[name]) for r in rows if name in r and x in r]
                    xs, ys = [p[0] for p in points], [p[1] for p in points]
                if xs:
                    (dimmed,) = self._figure.axes[index].plot(
                        xs, ys, line.get_linestyle(), color=line.get_color(), alpha=0.25, lw=1
                    )
                    self._dimmed.append(dimmed)
        self._branched = branches

    def _place_mark_labels(self) -> None:
        """Each edit's label beside its line, inside the plot: to the line's left in the
        plot's right fifth (where it would run past the plot's edge), else to its right."""
        low, high = self._figure.axes[0].get_xlim()
        for text in self._marks[1::2]:
            late = text.get_position()[0] > low + 0.8 * (high - low)
            text.set_horizontalalignment("right" if late else "left")

    def png(self, data: CurveData) -> bytes | None:
        """Every plot in one PNG (a run's record), or None before any data."""
        if not self._update(data):
            return None
        buffer = io.BytesIO()
        self._figure.savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
        return buffer.getvalue()

    def pngs(self, data: CurveData) -> list[bytes]:
        """One PNG per plot, each `CSS_PANEL_WIDTH` wide at the pixel ratio (the live panel
        lays them out side by side, or under each other where it is narrow); [] before any
        data."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from PIL import Image

        if not self._update(data):
            return []
        canvas = FigureCanvasAgg(self._figure)
        canvas.draw()
        pixels = np.asarray(canvas.buffer_rgba())
        width = pixels.shape[1] // len(self._figure.axes)
        images = []
        for index in range(len(self._figure.axes)):
            buffer = io.BytesIO()
            piece = Image.fromarray(pixels[:, index * width : (index + 1) * width])
            piece.save(buffer, format="png", compress_level=1)
            images.append(buffer.getvalue())
        return images

    def _update(self, data: CurveData) -> bool:
        """Bring the figure up to `data`; False when there is nothing to draw yet."""
        steps, losses, rows, _ = data.snapshot()
        if not steps and not any(rows):
            return False
        layout = (bool(steps), tuple((b, tuple(n)) for b, n in metric_groups(rows)))
        if layout != self._layout:
            self._build(layout)
        self._draw_marks(data.marks())
        self._draw_branches(data.branches())
        for (index, name, member), line in self._lines.items():
            if name == "step loss":
                line.set_data(steps, losses[:, member])
                continue
            x = "step" if index == 0 else "epoch"
            points = [(r[x], r[name]) for r in rows[member] if name in r and x in r]
            line.set_data([p[0] for p in points], [p[1] for p in points])
            line.set_markersize(3 if len(points) <= 40 else 0)  # markers while they are few
        plots = self._figure.axes[: len(self._figure.axes) - (self.labels is not None)]
        for index, ax in enumerate(plots):
            ax.relim()
            ax.autoscale_view()
            self._legend(index, ax)
        validation = [[(r["step"], r["val_loss"]) for r in m if "val_loss" in r] for m in rows]
        limits, above = readable_limits(losses, validation)
        if limits is not None:
            plots[0].set_ylim(*limits)
        self._above.set_text(
            f"member{'s' * (len(above) > 1)} {', '.join(map(str, above))} above the plot (diverged)"
            if above
            else ""
        )
        self._place_mark_labels()
        return True

    def _legend(self, index: int, ax) -> None:
        """The curves of a plot named above it, right of its title (never over the latest
        points): a run's each, a population's by kind (its colours are the members')."""
        from matplotlib.lines import Line2D

        drawn = [
            line
            for (i, _, member), line in self._lines.items()
            if i == index and len(line.get_xdata())
        ]
        if self.labels is not None:  # one grey sample per kind of curve
            kinds = dict.fromkeys(line.get_label() for line in drawn)
            drawn = [
                Line2D([], [], color="#555", ls=line.get_linestyle(), marker=line.get_marker(),
                       lw=line.get_linewidth(), ms=3, label=kind)
                for kind in kinds
                for line in [next(d for d in drawn if d.get_label() == kind)]
            ]  # fmt: skip
        key = tuple(line.get_label() for line in drawn)
        if not drawn or self._legends.get(index) == key:
            return
        self._legends[index] = key
        ax.legend(
            handles=drawn,
            fontsize=7,
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            ncol=len(drawn),
            frameon=False,
            borderaxespad=0.1,
            handlelength=1.2,
            columnspacing=0.8,
        )


_IDLE_FIGURES: list[CurveFigure] = []
_POOL_LOCK = threading.Lock()


def acquire_figure(labels: Sequence[str] | None = None) -> CurveFigure:
    """A figure for one run (a population's: `labels`, its members' settings): an idle one
    when there is one for a run (building one costs ~0.1 s)."""
    with _POOL_LOCK:
        if labels is None and _IDLE_FIGURES:
            return _IDLE_FIGURES.pop()
    return CurveFigure(labels)


def release_figure(figure: CurveFigure) -> None:
    """Give a run's figure back; a few of one member are kept (each holds a few MB of
    pixels)."""
    with _POOL_LOCK:
        if figure.labels is None and len(_IDLE_FIGURES) < 2:
            _IDLE_FIGURES.append(figure)


class CurveRenderer:
    """Redraws the curves on its own thread while a run trains, so the training thread never
    waits for matplotlib: every `interval` seconds when the data changed (calling `tick`
    first). `stop()` ends the thread; a run starts a new one."""

    def __init__(self, data: CurveData, show, interval: float = 0.5, tick=None):
        self.data = data
        self.interval = interval
        self._show = show
        self._tick = tick
        self._stop = threading.Event()
        self._ended = threading.Event()
        self._ended.set()
        self.thread: threading.Thread | None = None

    def start(self, figure: CurveFigure) -> None:
        self.stop()
        self._stop.clear()
        self._ended.clear()
        # the thread runs in the starting thread's context: what it displays (the panel's
        # stand-in) goes to the cell that thread writes to, not to whichever cell runs now
        context = contextvars.copy_context()
        self.thread = threading.Thread(
            target=context.run, args=(self._main, figure), name="nitro-curves", daemon=True
        )
        self.thread.start()

    def _main(self, figure: CurveFigure) -> None:
        drawn = self.data.version  # a run shorter than `interval` is drawn by its record
        deadline = time.monotonic() + self.interval
        try:
            while not self._stop.wait(max(0.0, deadline - time.monotonic())):
                deadline = time.monotonic() + self.interval  # every interval, or back to back
                if self._tick is not None:
                    self._tick()
                version = self.data.version
                if version != drawn:
                    drawn = version
                    self._draw(figure)
        finally:
            self._ended.set()

    def _draw(self, figure: CurveFigure) -> None:
        try:
            images = figure.pngs(self.data)  # one image per plot
            if images:
                self._show(images, CSS_PANEL_WIDTH)
        except Exception as error:  # noqa: BLE001 - a plot must never break a run
            print(f"nitro: could not draw the curves: {error!r}")

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (after the draw under way) and wait for it."""
        self._stop.set()
        self._ended.wait(timeout)
