"""Progress reporters for IPython: a live widget panel in notebooks, a tqdm bar in a terminal.

Both keep the `RunStats` that `%nitro status` reads. `step()` runs once per training step on
the training thread, so it only stores numbers; the panel is refreshed at most `refresh` times
a second and the curves are drawn on their own thread (`curves.CurveRenderer`). Notes (compile
messages, interrupts) go to the panel, or to stdout without one: a notebook paints stderr as
errors, and these are not.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Callable
from html import escape
from typing import Any

from nitro.progress import LineReporter, TqdmReporter

from . import failures, worker
from .runs import RunStats, stats_of

__all__ = [
    "LineTracker",
    "PanelReporter",
    "TerminalReporter",
    "add_note",
    "make_factory",
    "make_population_factory",
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

        panel = LivePanel()
        panel.show(visible=True)
        panel.cell_finished()  # the magic's cell ends at once: Stop reaches the kernel
        reporter.attach(panel)
    return reporter.panel


class _Tracking:
    """Keeps the `RunStats` of the handle being run, for `%nitro status`."""

    stats: RunStats | None = None
    _handle: Callable[[], Any] = staticmethod(lambda: None)

    def start_run(self, handle, epochs):
        self._handle = weakref.ref(handle)
        self.stats = stats_of(handle, create=True)
        self.stats.start_run(handle.step)
        super().start_run(handle, epochs)

    def start_epoch(self, epoch, max_epochs, batches, start):
        self.stats.resume()
        super().start_epoch(epoch, max_epochs, batches, start)

    def step(self, step, loss):
        self.stats.observe(step, loss)
        super().step(step, loss)

    def phase(self, phase):
        if self.stats is not None:
            self.stats.follow(phase)
        if phase == "failed" and (handle := self._handle()) is not None:
            failures.report(handle, self.note)
        super().phase(phase)

    def end_run(self, handle):
        self.stats.end_run()
        super().end_run(handle)


class TerminalReporter(_Tracking, TqdmReporter):
    """The engine's tqdm bar, plus the numbers `%nitro status` shows."""


class LineTracker(_Tracking, LineReporter):
    """One line per epoch (output that is not a terminal), plus the numbers for status."""


class PanelDrawing:
    """What a run's panel reporter and a population's (`PopulationPanelReporter`) share: the
    state of the run they draw, the curves drawn on their own thread, the panel's stand-in
    refreshed at most once a `STANDIN_INTERVAL`, its notes, and the record the run leaves.

    A subclass draws the rest: `_refresh` (the panel's widgets), `_record` (the run's state as
    HTML and text) and `_new_figure` (the figure the curves are drawn in).
    """

    STANDIN_INTERVAL = 1.0  # seconds between two refreshes of the panel's stand-in, at most

    def __init__(self, curves: Any, title: str, refresh: float, curve_interval: float):
        from .curves import CurveRenderer

        self.refresh_interval = 1.0 / refresh
        self.active = False
        self.panel = None
        self.stats = RunStats()
        self.curves = curves
        self.renderer = CurveRenderer(
            self.curves, self._show_curves, interval=curve_interval, tick=self._tick
        )
        self._lines = LineReporter(stream=sys.stdout)  # notes are progress, not errors
        self._title = title
        self._notes: list[str] = []
        self._epoch = 0
        self._target = 0
        self._position = 0
        self._batches: int | None = None
        self._in_epoch = False
        self._row: dict[str, Any] | None = None  # the latest epoch's (a population's: none)
        self._phase = "ready"
        self._figure = None
        self._ended = False  # the run ended and its panel still awaits the final phase
        self._last_refresh = 0.0
        self._stale = False
        self._standin_shown = 0.0
        self._standin_stale = False
        self._lock = threading.Lock()
        worker.panel_reporters.add(self)

    def start_epoch(self, epoch, target_epoch, batches, start):
        self._epoch, self._target, self._batches = epoch, target_epoch, batches
        self._position = start
        first, self._in_epoch = not self._in_epoch and self._phase == "starting", True
        self._phase = "training"
        self.stats.resume()
        self._refresh(force=first)  # shows "training" while the first step compiles

    def end_run(self, run):
        self.active, self._ended = False, self.panel is not None
        self._in_epoch = False
        self.stats.end_run()

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

    def _fraction(self) -> float:
        done = float(self._epoch)
        if self._in_epoch and self._batches:
            done += min(self._position, self._batches) / self._batches
        return min(1.0, done / self._target) if self._target else 0.0

    def _refresh(self, now: float | None = None, force: bool = False) -> None:
        raise NotImplementedError

    def _status_parts(self) -> list[str]:
        from .panel import status_text

        return status_text(
            self._phase,
            self._epoch,
            self._target,
            self._position,
            self._batches,
            self.stats,
            self._in_epoch,
            self._row,
        )

    def _record(self) -> tuple[str, str]:
        """The run's state so far as a record: its HTML and its text."""
        raise NotImplementedError

    def _standin(self) -> tuple[str, str]:
        """The run's state so far as its stand-in shows it (where its live panel is dead)."""
        return self._record()

    def _new_figure(self) -> Any:
        raise NotImplementedError

    def _release_figure(self, figure: Any) -> None:
        """The run is done with `figure` (it has drawn the record's curves)."""

    def _tick(self) -> None:
        """On the curve thread, twice a second: show what a throttled refresh skipped (a
        phase change, an epoch's end) even when no step follows soon."""
        if self._stale and self.active:
            self._refresh()
        if self._standin_stale and self.active:
            self._show_standin()

    def _show_standin(self, force: bool = False) -> None:
        """Refresh the panel's stand-in (its state as static HTML, for a notebook saved while
        the run lives): at a run's start and as epochs end, at most once a `STANDIN_INTERVAL`;
        the curve thread's tick shows what that skipped."""
        panel = self.panel
        if panel is None:
            return
        now = time.monotonic()
        if not force and now - self._standin_shown < self.STANDIN_INTERVAL:
            self._standin_stale = True
            return
        self._standin_shown, self._standin_stale = now, False
        panel.show_standin(*self._standin())

    def _show_curves(self, images: list[bytes], css_width: int) -> None:
        panel = self.panel
        if panel is not None:
            panel.show_plots(images, css_width)

    def _finish(self, phase: str) -> None:
        """The run ended (done, stopped, failed): stop drawing, leave the static record."""
        from .panel import BAR_STYLE

        panel = self.panel
        self._ended = False
        self.renderer.stop()
        self._phase = phase
        self._refresh(force=True)
        panel.progress.bar_style = BAR_STYLE[phase]
        panel.finish()
        figure, self._figure = self._figure or self._new_figure(), None
        png, css_width = figure.png(self.curves), figure.css_width
        self._release_figure(figure)
        html, text = self._record()
        panel.replace_with_record(html, text, png, css_width)


class PanelReporter(PanelDrawing):
    """Draws one handle's runs into `LivePanel`s; falls back to lines on stdout without one.

    Each run gets its own panel, in the cell that started it. The reporter follows the run by
    its events alone (it never reads the handle's phase, which still holds the previous run's
    at the start of the next). When the run ends, the panel is replaced by its static record.
    """

    def __init__(self, refresh: float = 4.0, curve_interval: float = 0.5):
        from .curves import CurveData

        super().__init__(CurveData(), "nitro", refresh, curve_interval)
        self._setup_notes: list[str] = []  # notes of the setup, for the run's panel
        self._shown_row: dict[str, Any] | None = None
        self._handle: Callable[[], Any] = lambda: None

    # ------------------------------------------------------------------------------------------
    # reporter events

    def start_run(self, handle, epochs):
        self._handle = weakref.ref(handle)
        self.active, self._ended = True, False
        self._phase = "starting"
        self._lines.start_run(handle, epochs)
        self.stats = stats_of(handle, create=True)
        self.stats.start_run(handle.step)
        self._title = handle.cls.__name__
        self._target = epochs
        self._epoch = handle.epoch
        self._position = 0
        self._in_epoch = False
        self._notes, self._setup_notes = self._setup_notes[-5:], []
        self._shown_row = None
        if not self.curves.rows:  # a resumed run: its curves start with the history it has
            for row in handle.history().reset_index().to_dict("records"):
                self.curves.add_row(row)
            for row in handle.state.swaps:
                self.curves.add_marker(dict(row))
        self.panel = worker.claim_panel()
        _PANELS[handle] = self
        if self.panel is not None:
            self.panel.claim(self._title, handle.stop)
            self._show_edits()
            self._refresh(force=True)
            self._show_standin(force=True)
            self._figure = self._new_figure()
            self.renderer.start(self._figure)

    def step(self, step, loss):
        self._position += 1
        self.stats.observe(step, loss)
        self.curves.add_step(step, loss)
        now = time.monotonic()
        if now - self._last_refresh >= self.refresh_interval:
            self._refresh(now=now)

    def phase(self, phase):
        from .panel import BAR_STYLE

        self.stats.follow(phase)
        if phase == "failed":  # called from the run's `except` clause
            handle = self._handle()
            if handle is not None:  # the cell that waits re-raises it; the record shows it
                failures.report(handle, self._failure_note)
        if self.active:
            self._phase = phase
            self._refresh()
        elif phase not in BAR_STYLE:  # setting up: the panel `%nitro train` showed for it
            panel = worker.reserved_panel()
            if panel is not None and phase != "ready":
                panel.status.value = f"<b>setting up</b> &middot; {escape(phase)} ..."
        elif self._ended:
            self._finish(phase)
        elif phase in BAR_STYLE:  # a run that failed before it started: its unused panel
            panel = worker.claim_panel()
            if panel is not None:
                self.panel = panel
                panel.claim(self._title, None)
                self._finish(phase)

    def end_epoch(self, row):
        self._epoch, self._in_epoch = row.get("epoch", self._epoch + 1), False
        self.curves.add_row(dict(row))
        self._row = dict(row)
        if self.panel is None:
            if not worker.is_quiet():  # an agent's run: the agent reads it through its tools
                self._lines.end_epoch(row)
            return
        self._refresh()
        self._show_standin()

    def swapped(self, row):
        """A live edit swapped in (or rolled back): a marker on the loss curve at its step,
        named below the curves (the note comes as a note)."""
        self.curves.add_marker(dict(row))
        self._show_edits()

    def _show_edits(self) -> None:
        from .panel import edits_html

        panel = self.panel
        if panel is not None and self.curves.markers:
            panel.edits.value = edits_html(self.curves.marks())

    def note(self, message, done=False):
        reserved = worker.reserved_panel() if not self.active else None
        if reserved is not None:  # the setup's notes ("resumed run ..."): in the run's panel
            self._setup_notes.append(message)
            from .panel import notes_html

            reserved.notes.value = notes_html(self._setup_notes[-5:])
        elif self.panel is None or not self.active:
            if not worker.is_quiet():  # an agent's run: the agent reads it through its tools
                self._lines.note(message, done)
        else:
            self.show_note(message, replace_pending=done)

    def _failure_note(self, message: str) -> None:
        """The failure's summary: into the record of the run's panel, or on stdout."""
        if self.panel is None:
            self._lines.note(message)
        else:
            self.show_note(message)

    def attach(self, panel) -> None:
        """Draw into `panel` from now on (a run started without one, e.g. by an agent); the
        curves show the whole run so far."""
        handle = self._handle()
        panel.claim(self._title, handle.stop if handle is not None else None)
        self.panel = panel
        self._show_edits()
        self._refresh(force=True)
        if self.active:
            self._show_standin(force=True)
            if self._figure is None:
                self._figure = self._new_figure()
            self.renderer.start(self._figure)
        else:  # the run has ended: show its record with the curves so far
            self._finish(self._phase if self._phase in ("done", "stopped", "failed") else "done")

    # ------------------------------------------------------------------------------------------
    # drawing

    def _refresh(self, now: float | None = None, force: bool = False) -> None:
        """Update the panel's widgets, at most `refresh` times a second unless forced, so
        short epochs do not flood the frontend."""
        panel = self.panel
        if panel is None:
            return
        from .panel import metrics_html, status_html

        now = now if now is not None else time.monotonic()
        if not force and now - self._last_refresh < self.refresh_interval:
            self._stale = True  # the curve thread's next tick shows it
            return
        self._last_refresh, self._stale = now, False
        if self._row is not self._shown_row:
            self._shown_row = self._row
            panel.metrics.value = metrics_html(self._row)
        panel.progress.value = self._fraction()
        panel.status.value = status_html(self._status_parts(), whole=True)

    def _record(self, last_seen: bool = False) -> tuple[str, str]:
        from .record import record_html, record_text

        parts = self._status_parts()
        with self._lock:
            notes = list(self._notes)
        edits = self.curves.marks()
        fraction = self._fraction()
        return (
            record_html(self._title, parts, fraction, self._row, notes, edits, last_seen),
            record_text(self._title, parts, last_seen),
        )

    def _standin(self) -> tuple[str, str]:
        return self._record(last_seen=True)

    def _new_figure(self):
        from .curves import acquire_figure

        return acquire_figure()

    def _release_figure(self, figure) -> None:
        from .curves import release_figure

        release_figure(figure)


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


def make_population_factory(shell: Any) -> Callable[[], Any]:
    """The reporter factory for populations with `progress=True`: their panel in a notebook, a
    tqdm bar over each epoch's steps in a terminal, a line per epoch otherwise."""

    def factory():
        if worker.widgets_available(shell):
            from .population_reporter import PopulationPanelReporter

            return PopulationPanelReporter()
        stream = sys.stderr
        if hasattr(stream, "isatty") and stream.isatty():
            return TqdmReporter()
        return LineReporter()

    return factory


def add_note(handle: Any, message: str) -> None:
    """Show a message in the live panel of `handle`'s latest run (if it has one)."""
    reporter = _PANELS.get(handle)
    if reporter is not None:
        reporter.show_note(message)
