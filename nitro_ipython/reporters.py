"""Progress reporters for IPython: a live widget panel in notebooks, a tqdm bar in a terminal.

Both keep the `RunStats` that `%nitro status` reads. `step()` runs once per training step on
the training thread, so it only stores numbers; the panel is refreshed at most `refresh` times
a second and the curves are drawn on their own thread (`curves.CurveRenderer`). Notes (compile
messages, interrupts) go to the panel, or to stdout without one: a notebook paints stderr as
errors, and these are not.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from html import escape
from typing import Any

from nitro.progress import LineReporter, TqdmReporter

from . import failures, worker
from .member_table import (
    MemberView,
    head_html,
    members_of,
    members_table_html,
    members_text,
    ranked_views,
    row_html,
)
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
ENDED = ("done", "stopped", "failed")  # the phases a run ends in (its record's bar style)


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
        panel = reporter.make_panel()
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


class PanelReporter:
    """Draws a handle's runs into `LivePanel`s; falls back to lines on stdout without one.

    A run is a population of one: a `nitro.Population`'s reporter is this one too, and its
    panel adds what only several members have, a table of them (`member_table.py`) with a
    Stop button each, and their curves in the members' colours. `metric` (default `val_loss`,
    else `loss` until the rows have it) ranks a population's members in the table's rank
    column, `mode` "min" for a metric named like a loss, else "max".

    Each run gets its own panel, in the cell that started it. The reporter follows the run by
    its events alone (it never reads the handle's phase, which still holds the previous run's
    at the start of the next): `step`/`steps` and `member_steps` feed the curves and the
    status line, `end_epoch` and `member_rows` the metrics, the members' table and the
    stand-in. When the run ends, the panel is replaced by its static record.
    """

    STANDIN_INTERVAL = 1.0  # seconds between two refreshes of the panel's stand-in, at most

    def __init__(
        self,
        metric: str | None = None,
        mode: str | None = None,
        refresh: float = 4.0,
        curve_interval: float = 0.5,
        gallery: int | None = None,
    ):
        from .curves import CurveData, CurveRenderer

        if mode not in (None, "min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.metric, self.mode = metric, mode
        self.refresh_interval = 1.0 / refresh
        self.active = False
        self.panel = None
        self.stats = RunStats()
        self.curves = CurveData()
        self.renderer = CurveRenderer(
            self.curves, self._show_curves, interval=curve_interval, tick=self._tick
        )
        self._lines = LineReporter(stream=sys.stdout)  # notes are progress, not errors
        self._title = "nitro"
        self._notes: list[str] = []
        self._setup_notes: list[str] = []  # notes of the setup, for the run's panel
        self._views = [MemberView(0, {})]  # what the panel shows of each member
        self._members: list[dict[str, Any]] | None = None  # a population's settings
        self._epoch = 0
        self._target = 0
        self._position = 0
        self._batches: int | None = None
        self._in_epoch = False
        self._phase = "ready"
        self._figure = None
        self._ended = False  # the run ended and its panel still awaits the final phase
        self._last_refresh = 0.0
        self._stale = False
        self._shown_row: dict[str, Any] | None = None
        self._table_key: tuple | None = None
        self._standin_shown = 0.0
        self._standin_stale = False
        self._lock = threading.Lock()  # the notes
        self._drawing = threading.Lock()  # the training thread's and the curve thread's
        self._handle: Callable[[], Any] = lambda: None
        # the gallery's samples: None shows one when the experiment has a `visualize` hook
        self.gallery_samples = gallery
        self.gallery = None  # the run's `sample_gallery.GalleryRenderer`, when it shows one
        worker.panel_reporters.add(self)

    # ------------------------------------------------------------------------------------------
    # reporter events

    def start_run(self, handle, target_epoch):
        from .curves import CurveData, member_colours

        self._handle = weakref.ref(handle)
        self.active, self._ended = True, False
        self._phase = "starting"
        self._lines.start_run(handle, target_epoch)
        self._members = members_of(handle)
        settings = self._members or [{}]
        if [view.settings for view in self._views] != settings:  # the curves it keeps
            colours = member_colours(len(settings)) if self._members else [""]
            self._views = [MemberView(i, s, colours[i]) for i, s in enumerate(settings)]
            self.curves = self.renderer.data = CurveData(len(settings))
        name = handle.cls.__name__
        self._title = name if self._members is None else f"{name} population of {len(settings)}"
        self.stats = stats_of(handle, create=True)
        self.stats.start_run(handle.step)
        self._target, self._epoch = target_epoch, handle.epoch
        self._position, self._in_epoch = 0, False
        self._notes, self._setup_notes = self._setup_notes[-5:], []
        self._shown_row = self._table_key = None
        if self.curves.empty:  # a resumed run: its curves start with the history it has
            self._add_rows(handle.history().reset_index().to_dict("records"))
            for row in getattr(getattr(handle, "state", None), "swaps", ()):
                self.curves.add_marker(dict(row))
            forked = getattr(handle, "forked_from", None)
            if forked:
                self.curves.add_mark(int(forked["step"]), f"forked from {forked['run_id']}")
        self._overlay_parent(handle)
        self._sync_stopped()
        self._start_gallery(handle)
        self.panel = worker.claim_panel()
        _PANELS[handle] = self
        if self.panel is not None:
            self._claim(self.panel)
            self._refresh(force=True)
            self._show_standin(force=True)
            self._figure = self._new_figure()
            self.renderer.start(self._figure)

    def start_epoch(self, epoch, target_epoch, batches, start):
        self._epoch, self._target, self._batches = epoch, target_epoch, batches
        self._position = start
        first, self._in_epoch = not self._in_epoch and self._phase == "starting", True
        self._phase = "training"
        self.stats.resume()
        self._refresh(force=first)  # shows "training" while the first step compiles

    def step(self, step, loss):
        self._position += 1
        self.stats.observe(step, loss)
        self.curves.add_step(step, loss)
        now = time.monotonic()
        if now - self._last_refresh >= self.refresh_interval:
            self._refresh(now=now)

    def member_steps(self, first, losses):
        """A population's call: its steps, each member's loss (NaN once it stopped); the
        status line shows the best member's latest."""
        count = len(losses[0]) if len(losses) else 0
        if not count:
            return
        self._position += count
        latest = [float(row[-1]) for row in losses if math.isfinite(row[-1])]
        self.stats.observe(first + count - 1, min(latest) if latest else float("nan"))
        self.curves.add_steps(first, losses)
        now = time.monotonic()
        if now - self._last_refresh >= self.refresh_interval:
            self._refresh(now=now)

    def end_epoch(self, row):
        self._end_epoch([row])

    def member_rows(self, rows: Sequence[Mapping[str, Any]]):
        self._end_epoch(rows)

    def _overlay_parent(self, handle: Any) -> None:
        """A fork's panel: its parent's curves from the fork step on, dimmed beneath its own
        (read again at each epoch: the parent may train on beside it)."""
        parent = getattr(handle, "parent", None)
        forked = getattr(handle, "forked_from", None)
        if parent is None or not forked or self._members is not None:
            return
        after = [r for r in parent.history().reset_index().to_dict("records")]
        self.curves.overlay([r for r in after if r.get("step", 0) > forked["step"]])

    def _end_epoch(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self._epoch = int(rows[0].get("epoch", self._epoch + 1)) if rows else self._epoch + 1
        self._in_epoch = False
        self._add_rows(rows)
        handle = self._handle()
        if handle is not None:
            self._overlay_parent(handle)
        if self.panel is None:
            if not worker.is_quiet():  # an agent's run: the agent reads it through its tools
                if self._members is None:
                    self._lines.end_epoch(rows[0])
                else:
                    self._lines.member_rows(rows)
            return
        self._table_key = None
        self._refresh(force=self._members is not None)
        self._show_standin()

    def _add_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """History rows (a population's: each with its `member` and settings): each member's
        latest, and its curves."""
        for row in rows:
            index = int(row.get("member", 0))
            if not 0 <= index < len(self._views):
                continue
            view = self._views[index]
            if view.row is not None and "stopped" in view.row:
                continue  # its record ended with the epoch it stopped in: its epoch stays
            view.row = {k: v for k, v in row.items() if k != "member"}
            where = {k: row[k] for k in ("epoch", "step", "stopped") if k in row}
            self.curves.add_row({**where, **view.metrics()}, index)

    def swapped(self, row):
        """A live edit swapped in (or rolled back): a marker on the loss curve at its step,
        named below the curves (the note comes as a note)."""
        self.curves.add_marker(dict(row))
        self._show_edits()

    def searched(self, row):
        """A population's search acted (a PBT exploit, a halving rung): a mark on the loss
        curve at its step, named below the curves with the live edits."""
        self.curves.add_mark(int(row["step"]), str(row["label"]))
        self._show_edits()

    def rewound(self, row):
        """A rewind (or a spike's roll-back): the curves after its step dimmed, as an
        abandoned branch, and a mark where the run went back to."""
        if self._members is None:
            self.curves.rewind(dict(row))

    def val_samples(self, samples):
        """A validation's first call: the gallery's samples, when it will draw them."""
        gallery, handle = self.gallery, self._handle()
        if gallery is None or handle is None or self.panel is None or samples.split != "val":
            return
        if not gallery.wants():
            return
        step = handle.step
        edits = [label for at, label in self.curves.marks() if at <= step]
        title = f"{self._title} · 'val' · step {step}" + (f" · after {edits[-1]}" if edits else "")
        gallery.take(handle.experiment, handle.setup.split("val").hook_fields, samples, title)

    def _start_gallery(self, handle) -> None:
        from .sample_gallery import SAMPLES, GalleryRenderer

        if self.gallery is not None:
            self.gallery.stop()
        wanted = self.gallery_samples
        if wanted is None:
            wanted = SAMPLES if hasattr(handle.experiment, "visualize") else 0
        if wanted <= 0 or self._members is not None or "val" not in handle.splits:
            self.gallery = None
            return
        self.gallery = GalleryRenderer(self._show_gallery, self._gallery_note, samples=wanted)

    def _show_gallery(self, png: bytes) -> None:
        panel = self.panel
        if panel is not None:
            panel.show_gallery(png)
            self._standin_stale = True  # the stand-in keeps it too, at the next tick

    def _gallery_note(self, message: str) -> None:
        if self.panel is not None:
            self.show_note(message)
        else:
            self._lines.note(message)

    def phase(self, phase):
        self.stats.follow(phase)
        if phase == "failed":  # called from the run's `except` clause
            handle = self._handle()
            if handle is not None:  # the cell that waits re-raises it; the record shows it
                failures.report(handle, self._failure_note)
        if self.active:
            self._phase = phase
            self._refresh()
        elif phase not in ENDED:  # setting up: the panel `%nitro train` showed for it
            panel = worker.reserved_panel()
            if panel is not None and phase != "ready":
                panel.status.value = f"<b>setting up</b> &middot; {escape(phase)} ..."
        elif self._ended:
            self._finish(phase)
        else:  # a run that failed before it started: its unused panel
            panel = worker.claim_panel()
            if panel is not None:
                self.panel = panel
                panel.claim(self._title, None)
                self._finish(phase)

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

    def end_run(self, handle):
        self.active, self._ended = False, self.panel is not None
        self._in_epoch = False
        self.stats.end_run()
        self._sync_stopped()

    # ------------------------------------------------------------------------------------------
    # the panel

    def make_panel(self):
        """A panel for this reporter's runs (a population's has the members' table); main
        thread."""
        from .panel import LivePanel

        return LivePanel(self._members)

    def attach(self, panel) -> None:
        """Draw into `panel` from now on (a run started without one, e.g. by an agent); the
        curves show the whole run so far."""
        self.panel = panel
        self._claim(panel)
        self._refresh(force=True)
        if self.active:
            self._show_standin(force=True)
            if self._figure is None:
                self._figure = self._new_figure()
            self.renderer.start(self._figure)
        else:  # the run has ended: show its record with the curves so far
            self._finish(self._phase if self._phase in ENDED else "done")

    def _claim(self, panel) -> None:
        handle = self._handle()
        stop = handle.stop if handle is not None else None
        member_stop = self._stop_member if self._members is not None else None
        panel.claim(self._title, stop, member_stop=member_stop)
        for view in self._views:
            if view.stopped is not None and panel.member_buttons:
                panel.mark_stopped(view.index)
        self._show_edits()

    def _stop_member(self, index: int) -> None:
        """A member's Stop button: prune it (at the population's next call)."""
        handle = self._handle()
        if handle is not None:
            handle.stop(index, "stopped by its Stop button in the panel")

    def _sync_stopped(self) -> bool:
        """Take the members the population stopped (pruned or diverged); True if any is new."""
        handle = self._handle()
        if handle is None or self._members is None:
            return False
        changed = False
        for index, why in handle.stopped.items():
            view = self._views[index] if index < len(self._views) else None
            if view is not None and view.stopped is None:
                view.stopped, changed = why, True
                if self.panel is not None:
                    self.panel.mark_stopped(index)
        return changed

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

    def _failure_note(self, message: str) -> None:
        """The failure's summary: into the record of the run's panel, or on stdout."""
        if self.panel is None:
            self._lines.note(message)
        else:
            self.show_note(message)

    def _show_edits(self) -> None:
        from .panel import edits_html

        panel = self.panel
        if panel is not None and self.curves.markers:
            panel.edits.value = edits_html(self.curves.marks())

    # ------------------------------------------------------------------------------------------
    # drawing

    @property
    def _row(self) -> dict[str, Any] | None:
        """A run's latest history row (a population's members have the table)."""
        return self._views[0].row if self._members is None else None

    def _fraction(self) -> float:
        done = float(self._epoch)
        if self._in_epoch and self._batches:
            done += min(self._position, self._batches) / self._batches
        return min(1.0, done / self._target) if self._target else 0.0

    def _status_parts(self) -> list[str]:
        from .panel import status_text

        rows = [view.row for view in self._views if view.row]
        latest = max(rows, key=lambda row: row.get("epoch", 0)) if rows else None
        members = None
        if self._members is not None:
            training = sum(view.stopped is None for view in self._views)
            members = members_text(training, len(self._views), self.active)
        return status_text(
            self._phase,
            self._epoch,
            self._target,
            self._position,
            self._batches,
            self.stats,
            self._in_epoch,
            latest,  # a step's host and device time: one program for every member
            members,
        )

    def _refresh(self, now: float | None = None, force: bool = False) -> None:
        """Update the panel's widgets, at most `refresh` times a second unless forced, so
        short epochs do not flood the frontend."""
        panel = self.panel
        if panel is None:
            return
        from .panel import metrics_html, status_html

        now = now if now is not None else time.monotonic()
        with self._drawing:  # the training thread's and the curve thread's refreshes
            if self._sync_stopped():
                self._table_key, force = None, True
            if not force and now - self._last_refresh < self.refresh_interval:
                self._stale = True  # the curve thread's next tick shows it
                return
            self._last_refresh, self._stale = now, False
            row = self._row
            if row is not self._shown_row:
                self._shown_row = row
                panel.metrics.value = metrics_html(row)
            panel.progress.value = self._fraction()
            panel.status.value = status_html(self._status_parts(), whole=True)
            key = (self.active, tuple(view.stopped for view in self._views))
            if self._members is not None and key != self._table_key:
                self._table_key = key
                metric, mode, ranks = ranked_views(self._views, self.metric, self.mode)
                panel.show_table(
                    head_html(self._views, metric, mode),
                    [
                        row_html(view, self._views, metric, self.active, ranks.get(view.index))
                        for view in self._views
                    ],
                )

    def _record(self, last_seen: bool = False) -> tuple[str, str]:
        """The run's state so far as a record (its stand-in's, `last_seen`): HTML and text."""
        from .record import record_html, record_text

        parts = self._status_parts()
        with self._lock:
            notes = list(self._notes)
        table, lines = "", []
        if self._members is not None:
            metric, mode, ranks = ranked_views(self._views, self.metric, self.mode)
            table = members_table_html(self._views, metric, mode, self.active, ranks)
            lines = [view.line(self.active, ranks.get(view.index)) for view in self._views]
        edits, fraction = self.curves.marks(), self._fraction()
        gallery = self.gallery.png if self.gallery is not None else None
        return (
            record_html(
                self._title,
                parts,
                fraction,
                self._row,
                notes,
                edits,
                last_seen,
                table=table,
                gallery=gallery,
            ),
            record_text(self._title, parts, last_seen, lines),
        )

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
        panel.show_standin(*self._record(last_seen=True))

    def _show_curves(self, images: list[bytes], css_width: int) -> None:
        panel = self.panel
        if panel is not None:
            panel.show_plots(images, css_width)

    def _new_figure(self):
        from .curves import acquire_figure

        return acquire_figure(None if self._members is None else [v.label for v in self._views])

    def _finish(self, phase: str) -> None:
        """The run ended (done, stopped, failed): stop drawing, leave the static record."""
        from .curves import release_figure
        from .panel import BAR_STYLE

        panel = self.panel
        self._ended = False
        self.renderer.stop()
        if self.gallery is not None:
            self.gallery.stop()  # the drawing under way ends in the record
        self._phase = phase
        self._sync_stopped()
        self._table_key = None  # the final refresh draws the table as the run left it
        self._refresh(force=True)
        panel.progress.bar_style = BAR_STYLE[phase]
        panel.finish()
        figure, self._figure = self._figure or self._new_figure(), None
        png, css_width = figure.png(self.curves), figure.css_width
        release_figure(figure)
        html, text = self._record()
        panel.replace_with_record(html, text, png, css_width)


def make_factory(shell: Any) -> Callable[[], Any]:
    """The reporter factory for runs and populations with `progress=True`: a panel in a
    notebook, a tqdm bar in a terminal, plain lines when output is neither."""

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
