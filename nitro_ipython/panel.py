"""The live training panel: progress bar, phase, epoch/step, throughput, metrics, curves, Stop.

The panel is built and displayed on the main thread, in the cell that starts the run (see
`worker.py`). After that, the training thread and the curve renderer only assign widget traits
(`value`, `disabled`, `bar_style`, `layout.display`): never `with out:`, never `display()`.
Trait updates reach the frontend from any thread; output contexts do not.
"""

from __future__ import annotations

import io
import sys
import threading
import time
from html import escape
from typing import Any

import ipywidgets as widgets

from .runs import RunStats

__all__ = ["BAR_STYLE", "CurveData", "CurveRenderer", "LivePanel", "render_curves"]

_SKIP_COLUMNS = {"epoch", "step", "epoch_seconds", "data_wait_frac"}
BAR_STYLE = {"done": "success", "stopped": "warning", "failed": "danger"}


class LivePanel(widgets.VBox):
    """One run's panel. Hidden until a run claims it, so an unused panel shows nothing."""

    def __init__(self) -> None:
        self.title = widgets.HTML("<b>nitro</b>")
        self.stop_button = widgets.Button(
            description="Stop",
            icon="stop",
            button_style="danger",
            disabled=True,
            tooltip="stop after the current step; a run in a cell that is still running "
            "stops with the kernel's interrupt button instead",
            layout=widgets.Layout(width="90px"),
        )
        self.progress = widgets.FloatProgress(
            value=0.0, min=0.0, max=1.0, bar_style="info", layout=widgets.Layout(width="100%")
        )
        self.status = widgets.HTML()
        self.metrics = widgets.HTML()
        self.curves = widgets.Image(format="png", layout=widgets.Layout(display="none"))
        self.notes = widgets.HTML()
        header = widgets.HBox(
            [self.title, self.stop_button],
            layout=widgets.Layout(justify_content="space-between", align_items="center"),
        )
        super().__init__(
            [header, self.progress, self.status, self.metrics, self.curves, self.notes],
            layout=widgets.Layout(display="none", border="1px solid #ddd", padding="4px 8px"),
        )
        self._stop_callback = None
        self.stop_button.on_click(self._on_stop)

    def _on_stop(self, _button) -> None:
        if self._stop_callback is not None:
            self._stop_callback()
            self.stop_button.disabled = True
            self.stop_button.description = "Stopping"

    def claim(self, title: str, stop) -> None:
        """Show the panel for a run; called from the training thread (trait updates only)."""
        self._stop_callback = stop
        self.title.value = f"<b>{escape(title)}</b>"
        self.stop_button.disabled = False
        self.stop_button.description = "Stop"
        self.layout.display = ""

    def finish(self) -> None:
        self._stop_callback = None
        self.stop_button.disabled = True
        if self.stop_button.description == "Stopping":
            self.stop_button.description = "Stopped"


class CurveData:
    """Loss per step (thinned to a bounded size) and history rows, for the curves."""

    MAX_POINTS = 2000

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.rows: list[dict[str, Any]] = []
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

    def add_row(self, row: dict[str, Any]) -> None:
        with self.lock:
            self.rows.append({k: v for k, v in row.items() if isinstance(v, (int, float))})

    def snapshot(self):
        with self.lock:
            return list(self.steps), list(self.losses), list(self.rows)


def render_curves(data: CurveData) -> bytes | None:
    """PNG bytes of the loss curve (per step, with epoch means and validation) and one panel
    per metric (per epoch). Uses matplotlib's object API, so it is safe off the main thread."""
    from matplotlib.figure import Figure

    steps, losses, rows = data.snapshot()
    if not steps and not rows:
        return None
    metric_groups: dict[str, list[str]] = {}
    for row in rows:
        for key in row:
            if key in _SKIP_COLUMNS or key in ("loss", "val_loss"):
                continue
            base = key.removeprefix("val_").removeprefix("test_")
            names = metric_groups.setdefault(base, [])
            if key not in names:
                names.append(key)
    groups = list(metric_groups.items())[:2]
    figure = Figure(figsize=(3.6 * (1 + len(groups)), 2.5), dpi=80, layout="constrained")
    axes = figure.subplots(1, 1 + len(groups), squeeze=False)[0]
    ax = axes[0]
    if steps:
        ax.plot(steps, losses, lw=0.8, alpha=0.5, label="step loss")
    for key, style in (("loss", "o-"), ("val_loss", "s-")):
        points = [(r["step"], r[key]) for r in rows if key in r and "step" in r]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, style, markersize=3, label=key)
    ax.set_xlabel("step")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for ax, (base, names) in zip(axes[1:], groups):
        for name in names:
            points = [(r["epoch"], r[name]) for r in rows if name in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, "o-", markersize=3, label=name)
        ax.set_xlabel("epoch")
        ax.set_title(base)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


class CurveRenderer:
    """Redraws the curves on its own thread, at most once per `min_interval` seconds, so the
    training thread never waits for matplotlib. `request()` marks the curves out of date; the
    thread ends after `idle_exit` seconds without requests and restarts on the next one."""

    def __init__(self, draw, min_interval: float = 0.5, idle_exit: float = 30.0):
        self._draw = draw
        self.min_interval = min_interval
        self.idle_exit = idle_exit
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        self._wake.set()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name="nitro-curves", daemon=True)
                self._thread.start()

    def _main(self) -> None:
        while True:
            if not self._wake.wait(self.idle_exit):
                with self._lock:
                    if not self._wake.is_set():
                        self._thread = None
                        return
            self._wake.clear()
            try:
                self._draw()
            except Exception as error:  # noqa: BLE001 - a plot must never break a run
                print(f"nitro: could not draw the curves: {error!r}", file=sys.stderr)
            time.sleep(self.min_interval)


def status_html(
    phase: str, epoch: int, epochs: int, position: int, batches: int | None, stats: RunStats
) -> str:
    rate = stats.steps_per_second
    parts = [
        f"<b>{escape(phase)}</b>",
        f"epoch {min(epoch + 1, max(epochs, 1))}/{epochs}",  # the epoch under way
        f"batch {position}/{batches}" if batches else f"batch {position}",
        f"step {stats.step}",
    ]
    if stats.loss == stats.loss:
        parts.append(f"loss {stats.loss:.4g}")
    if rate == rate:
        parts.append(f"{rate:,.1f} steps/s")
    parts.append(f"{stats.elapsed:.1f} s")
    return " &middot; ".join(parts)


def metrics_html(row: dict[str, Any] | None) -> str:
    if not row:
        return ""
    cells = [
        f"<td style='padding:0 10px 0 0'>{escape(k)} <b>{v:.4g}</b></td>"
        for k, v in row.items()
        if k not in _SKIP_COLUMNS and isinstance(v, (int, float))
    ]
    if not cells:
        return ""
    return f"<table><tr><td style='padding-right:10px'>epoch {row.get('epoch')}:</td>" + (
        "".join(cells) + "</tr></table>"
    )


def notes_html(notes: list[str]) -> str:
    return "<br>".join(f"<code style='font-size:85%'>{escape(note)}</code>" for note in notes)
