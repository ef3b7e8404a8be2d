"""Progress reporters for IPython: a live widget panel in notebooks, a tqdm bar in a terminal.

Both keep the `RunStats` that `%nitro status` reads. `step()` runs once per training step on
the training thread, so it only stores numbers; the panel is refreshed at most `refresh` times
a second and the curves are drawn on their own thread (`panel.CurveRenderer`).
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from nitro.progress import LineReporter, TqdmReporter

from . import worker
from .runs import RunStats, stats_of

__all__ = [
    "LineTracker",
    "PanelReporter",
    "TerminalReporter",
    "add_note",
    "make_factory",
    "panel_of",
    "show_panel",
]

_PANELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def panel_of(handle: Any):
    """The live panel of `handle`'s latest run in this notebook, or None."""
    reporter = _PANELS.get(handle)
    return reporter.panel if reporter is not None else None


def show_panel(handle: Any):
    """The live panel of `handle`'s latest run, made for it if the run has none yet (a run
    started off the main thread, e.g. by an agent); None when the run reports no panel."""
    reporter = _PANELS.get(handle)
    if reporter is None:
        return None
    if reporter.panel is None:
        from .panel import LivePanel

        reporter.attach(LivePanel())
    return reporter.panel


class _Tracking:
    """Keeps the `RunStats` of the handle being run, for `%nitro status`."""

    stats: RunStats | None = None

    def start_run(self, handle, epochs):
        self.stats = stats_of(handle, create=True)
        self.stats.start_run()
        super().start_run(handle, epochs)

    def start_epoch(self, epoch, max_epochs, batches, start):
        self.stats.start_epoch()
        super().start_epoch(epoch, max_epochs, batches, start)

    def step(self, step, loss):
        self.stats.observe(step, loss)
        super().step(step, loss)

    def end_epoch(self, row):
        self.stats.refresh_rate()
        super().end_epoch(row)


class TerminalReporter(_Tracking, TqdmReporter):
    """The engine's tqdm bar, plus the numbers `%nitro status` shows."""


class LineTracker(_Tracking, LineReporter):
    """One line per epoch (output that is not a terminal), plus the numbers for status."""


class PanelReporter:
    """Draws one handle's runs into `LivePanel`s; falls back to lines without a panel."""

    def __init__(self, refresh: float = 4.0, curve_interval: float = 0.5):
        from .panel import CurveData, CurveRenderer

        self.refresh_interval = 1.0 / refresh
        self.active = False
        self.panel = None
        self.stats = RunStats()
        self.curves = CurveData()
        self.renderer = CurveRenderer(self._draw_curves, min_interval=curve_interval)
        self._lines = LineReporter()
        self._handle: Callable[[], Any] = lambda: None
        self._notes: list[str] = []
        self._title = "nitro"
        self._epoch = 0
        self._epochs = 0
        self._position = 0
        self._batches: int | None = None
        self._in_epoch = False
        self._in_run_epochs = False
        self._row: dict[str, Any] | None = None
        self._shown_row: dict[str, Any] | None = None
        self._phase = "ready"
        self._last_refresh = 0.0
        self._last_curves = 0.0
        self._lock = threading.Lock()
        worker.panel_reporters.add(self)

    # ------------------------------------------------------------------------------------------
    # reporter events

    def start_run(self, handle, epochs):
        self.active = True
        self._handle = weakref.ref(handle)
        self.stats = stats_of(handle, create=True)
        self.stats.start_run()
        self._title = handle.cls.__name__
        self._epochs = epochs
        self._epoch = handle.epoch
        if self.panel is not None:
            self.panel.finish()
        self.panel = worker.claim_panel()
        _PANELS[handle] = self
        if self.panel is not None:
            self.panel.claim(self._title, handle.stop)
            self.panel.progress.bar_style = "info"
            self._notes = []
            self._shown_row = None
            self._in_run_epochs = False
            self._refresh(force=True)
            if self.curves.rows:
                self.renderer.request()

    def start_epoch(self, epoch, max_epochs, batches, start):
        self._epoch, self._epochs, self._batches, self._position = epoch, max_epochs, batches, start
        first = not self._in_run_epochs
        self._in_epoch = self._in_run_epochs = True
        self.stats.start_epoch()
        self._refresh(force=first)  # shows "training" while the first step compiles

    def step(self, step, loss):
        self._position += 1
        self.stats.observe(step, loss)
        self.curves.add_step(step, loss)
        now = time.monotonic()
        if now - self._last_refresh >= self.refresh_interval:
            self._refresh(now=now)
            if now - self._last_curves >= 4 * self.renderer.min_interval:
                self._last_curves = now
                self.renderer.request()  # the step-loss curve, during long epochs

    def phase(self, phase):
        self._phase = phase
        if phase == "failed":
            error = sys.exc_info()[1]  # called from the run's `except` clause
            if error is not None:  # the cell that waits re-raises it; the panel shows it
                self.show_note(f"failed: {type(error).__name__}: {error}")
        from .panel import BAR_STYLE

        self._refresh(force=phase in BAR_STYLE)

    def end_epoch(self, row):
        self._epoch, self._in_epoch = row.get("epoch", self._epoch + 1), False
        self.stats.refresh_rate()
        self.curves.add_row(dict(row))
        self._row = dict(row)
        if self.panel is None:
            self._lines.end_epoch(row)
            return
        self._refresh()
        self._last_curves = time.monotonic()
        self.renderer.request()

    def note(self, message, done=False):
        if self.panel is None or not self.active:
            self._lines.note(message, done)
        else:
            self.show_note(message, replace_pending=done)

    def show_note(self, message: str, replace_pending: bool = False) -> None:
        """Add a line to the panel's notes (the last few are kept); a "done" note replaces
        the "compiling ..." note it completes."""
        from .panel import notes_html

        panel = self.panel
        if panel is None:
            return
        with self._lock:
            if replace_pending and self._notes and self._notes[-1].endswith("..."):
                self._notes[-1] = message
            else:
                self._notes.append(message)
            del self._notes[:-5]
            panel.notes.value = notes_html(self._notes)

    def attach(self, panel) -> None:
        """Draw into `panel` from now on (a run started without one, e.g. by an agent); the
        curves show the whole run so far."""
        handle = self._handle()
        panel.claim(self._title, handle.stop if handle is not None else None)
        self.panel = panel
        self._refresh(force=True)
        if not self.active:
            panel.finish()
        if self.curves.rows or self.curves.steps:
            self.renderer.request()

    def end_run(self, handle):
        self.active = False
        if self.panel is not None:
            self._refresh(force=True)
            self.renderer.request()

    # ------------------------------------------------------------------------------------------
    # drawing

    def _refresh(self, now: float | None = None, force: bool = False) -> None:
        """Update the panel's widgets, at most `refresh` times a second unless forced (the
        start and the end of a run), so short epochs do not flood the frontend."""
        panel = self.panel
        if panel is None:
            return
        from .panel import BAR_STYLE, metrics_html, status_html

        now = now if now is not None else time.monotonic()
        if not force and now - self._last_refresh < self.refresh_interval:
            return
        self._last_refresh = now
        self.stats.refresh_rate()
        if self._row is not self._shown_row:
            self._shown_row = self._row
            panel.metrics.value = metrics_html(self._row)
        handle = self._handle()
        phase = handle.phase if handle is not None else self._phase
        done = float(self._epoch)
        if self._in_epoch and self._batches:
            done += min(self._position, self._batches) / self._batches
        if phase == "done":
            done = float(self._epochs)
        panel.progress.value = min(1.0, done / self._epochs) if self._epochs else 0.0
        panel.status.value = status_html(
            phase, self._epoch, self._epochs, self._position, self._batches, self.stats
        )
        if phase in BAR_STYLE:
            panel.progress.bar_style = BAR_STYLE[phase]
            panel.finish()

    def _draw_curves(self) -> None:
        from .panel import render_curves

        panel = self.panel
        png = render_curves(self.curves)
        if panel is not None and png is not None:
            panel.curves.value = png
            panel.curves.layout.display = ""


def make_factory(shell: Any) -> Callable[[], Any]:
    """The reporter factory for runs with `progress=True`: a panel in a notebook, a tqdm bar
    in a terminal, plain lines when output is neither."""

    def factory():
        if worker.widgets_available(shell):
            return PanelReporter()
        stream = sys.stderr
        if hasattr(stream, "isatty") and stream.isatty():
            return TerminalReporter()
        return LineTracker()

    return factory


def add_note(handle: Any, message: str) -> None:
    """Show a message in the live panel of `handle`'s latest run (if it has one)."""
    reporter = _PANELS.get(handle)
    if reporter is not None:
        reporter.show_note(message)
