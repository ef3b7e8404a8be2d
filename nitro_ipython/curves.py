"""Training curves: what a run collects, a figure redrawn in place, and the thread that redraws it.

The curves are PNGs in `ipywidgets.Image`s, one per plot (side by side, wrapping under each
other in a narrow panel), drawn with matplotlib's object API (no pyplot, safe off the main
thread) at twice the size they are displayed at, so they stay sharp on
high-density screens and are never stretched. The figure is built once per run and its lines
are moved as data arrives; a redraw costs a few tens of milliseconds. A live edit swapped in
(or rolled back) while the run trains is a labelled vertical line on the loss plot at its
step (`CurveData.add_marker`).
"""

from __future__ import annotations

import contextvars
import io
import threading
import time
from typing import Any

from nitro.progress import TIMING_COLUMNS

__all__ = [
    "CSS_HEIGHT",
    "CSS_PANEL_WIDTH",
    "CurveData",
    "CurveFigure",
    "CurveRenderer",
    "acquire_figure",
    "release_figure",
]

CSS_PANEL_WIDTH = 380  # displayed pixels per plot
CSS_HEIGHT = 230
PIXEL_RATIO = 2
_SKIP = {"epoch", "step", *TIMING_COLUMNS, "loss", "val_loss"}


class CurveData:
    """Loss per step (thinned to a bounded size) and history rows; `version` counts changes."""

    MAX_POINTS = 2000

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.rows: list[dict[str, Any]] = []
        self.markers: list[tuple[int, str]] = []  # (step, label): the live edits' swaps
        self.version = 0
        self._stride = 1
        self._skipped = 0

    def add_step(self, step: int, loss: float) -> None:
        self._skipped += 1
        if self._skipped < self._stride:
            return
        self._skipped = 0
        with self.lock:
            self.steps.append(step)
            self.losses.append(loss)
            if len(self.steps) > self.MAX_POINTS:
                del self.steps[::2], self.losses[::2]
                self._stride *= 2
            self.version += 1

    def add_row(self, row: dict[str, Any]) -> None:
        with self.lock:
            self.rows.append({k: v for k, v in row.items() if isinstance(v, (int, float))})
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

    def snapshot(self):
        with self.lock:
            return list(self.steps), list(self.losses), list(self.rows), self.version

    def marks(self) -> list[tuple[int, str]]:
        with self.lock:
            return list(self.markers)


def metric_groups(rows: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """Up to two metrics with their split variants: [("acc", ["acc", "val_acc"]), ...]."""
    groups: dict[str, list[str]] = {}
    for row in rows:
        for key in row:
            if key in _SKIP:
                continue
            names = groups.setdefault(key.removeprefix("val_").removeprefix("test_"), [])
            if key not in names:
                names.append(key)
    return list(groups.items())[:2]


class CurveFigure:
    """The loss per step with the epoch means and `val_loss`, and one plot per metric by epoch.

    `png(data)` redraws in place; the figure is rebuilt only when the set of curves changes.
    """

    def __init__(self, pixel_ratio: int = PIXEL_RATIO):
        self.pixel_ratio = pixel_ratio
        self._figure = None
        self._layout: tuple | None = None
        self._lines: dict[tuple[int, str], Any] = {}
        self._legends: dict[int, tuple] = {}
        self._marks: list[Any] = []  # the artists of the drawn swap markers
        self._marked: list[tuple[int, str]] = []

    @property
    def css_width(self) -> int:
        return CSS_PANEL_WIDTH * (1 + len(self._layout[1]) if self._layout else 1)

    def _build(self, layout: tuple) -> None:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        has_steps, groups = layout
        panels = 1 + len(groups)
        dpi = 100 * self.pixel_ratio
        figure = Figure(figsize=(CSS_PANEL_WIDTH * panels / 100, CSS_HEIGHT / 100), dpi=dpi)
        # each plot in its own slice of the figure, CSS_PANEL_WIDTH wide: `pngs` cuts there
        axes = [
            figure.add_axes(((index + 0.16) / panels, 0.2, 0.82 / panels, 0.68))
            for index in range(panels)
        ]
        lines: dict[tuple[int, str], Any] = {}
        if has_steps:
            (lines[0, "step loss"],) = axes[0].plot([], [], lw=0.8, alpha=0.5, label="step loss")
        for key, style in (("loss", "o-"), ("val_loss", "s-")):
            (lines[0, key],) = axes[0].plot([], [], style, markersize=3, label=key)
        self._legends = {}
        axes[0].set_xlabel("step", fontsize=8)
        axes[0].set_title("loss", fontsize=9, loc="left")
        for index, (base, names) in enumerate(groups, start=1):
            for name in names:
                (lines[index, name],) = axes[index].plot([], [], "o-", markersize=3, label=name)
            axes[index].set_xlabel("epoch", fontsize=8)
            axes[index].set_title(base, fontsize=9, loc="left")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            # steps and epochs are whole numbers: no tick at epoch 0.98
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        self._figure, self._layout, self._lines = figure, layout, lines
        self._marks, self._marked = [], []

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
        import numpy as np
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
        if not steps and not rows:
            return False
        layout = (bool(steps), tuple((b, tuple(n)) for b, n in metric_groups(rows)))
        if layout != self._layout:
            self._build(layout)
        if steps:
            self._lines[0, "step loss"].set_data(steps, losses)
        self._draw_marks(data.marks())
        for (index, name), line in self._lines.items():
            if name == "step loss":
                continue
            x = "step" if index == 0 else "epoch"
            points = [(r[x], r[name]) for r in rows if name in r and x in r]
            line.set_data([p[0] for p in points], [p[1] for p in points])
            line.set_markersize(3 if len(points) <= 40 else 0)  # markers while they are few
        for index, ax in enumerate(self._figure.axes):
            ax.relim()
            ax.autoscale_view()
            shown = tuple(h for h in ax.get_lines() if len(h.get_xdata()) and h not in self._marks)
            if shown and self._legends.get(index) != shown:
                self._legends[index] = shown
                # above the plot, right of its title: never over the latest points
                ax.legend(
                    handles=shown,
                    fontsize=7,
                    loc="lower right",
                    bbox_to_anchor=(1.0, 1.0),
                    ncol=len(shown),
                    frameon=False,
                    borderaxespad=0.1,
                    handlelength=1.2,
                    columnspacing=0.8,
                )
        self._place_mark_labels()
        return True


_IDLE_FIGURES: list[CurveFigure] = []
_POOL_LOCK = threading.Lock()


def acquire_figure() -> CurveFigure:
    """A figure for one run: an idle one when there is one (building one costs ~0.1 s)."""
    with _POOL_LOCK:
        return _IDLE_FIGURES.pop() if _IDLE_FIGURES else CurveFigure()


def release_figure(figure: CurveFigure) -> None:
    """Give a run's figure back; a few are kept (each holds a few MB of pixels)."""
    with _POOL_LOCK:
        if len(_IDLE_FIGURES) < 2:
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
            if hasattr(figure, "pngs"):  # one image per plot
                images, width = figure.pngs(self.data), CSS_PANEL_WIDTH
            else:
                image = figure.png(self.data)
                images, width = [image] if image is not None else [], figure.css_width
            if images:
                self._show(images, width)
        except Exception as error:  # noqa: BLE001 - a plot must never break a run
            print(f"nitro: could not draw the curves: {error!r}")

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (after the draw under way) and wait for it."""
        self._stop.set()
        self._ended.wait(timeout)
