"""A population's reporter in a notebook: its live panel (`population_panel.py`), or lines.

`PopulationPanelReporter` is what `progress=True` gives a `nitro.Population` in a notebook (the
extension installs its factory with `nitro.progress.set_default_factory(...,
population=True)`). The worker initializer shows its panel in the cell that starts the run,
as it does a single run's; the reporter follows the run by its events: `member_steps` feeds the
curves and the status line, `member_rows` the members' table (in member order, ranked by
`metric` in a column) and the stand-in, and the end of the run leaves the static record (the table as HTML, the curves as
a PNG). Members pruned by their Stop button, by `%nitro stop pop 3` or by `pop.stop(3)` show
as stopped in the table, from the population's `stopped`. Without a panel (a run started off
the main thread) it prints a line per epoch, as the terminal's reporter does.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nitro.progress import ranked_members

from . import worker
from .reporters import PanelDrawing

__all__ = ["PopulationPanelReporter", "panel_of"]

_PANELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def panel_of(population: Any):
    """The live panel of `population`'s latest run in this notebook, or None."""
    reporter = _PANELS.get(population)
    return reporter.panel if reporter is not None else None


class PopulationPanelReporter(PanelDrawing):
    """Draws a population's runs into `PopulationPanel`s; lines on stdout without one.

    `metric` (default `val_loss`, else `loss` until the rows have it) ranks the members in
    the table's rank column, `mode` "min" for a metric named like a loss, else "max".
    """

    def __init__(
        self,
        metric: str | None = None,
        mode: str | None = None,
        refresh: float = 4.0,
        curve_interval: float = 0.5,
    ):
        from .population_curves import PopulationCurves

        if mode not in (None, "min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        super().__init__(PopulationCurves(), "nitro population", refresh, curve_interval)
        self.metric, self.mode = metric, mode
        self.curve_interval = curve_interval
        self._views: list[Any] = []
        self._step = 0
        self._table_key: tuple | None = None
        self._drawing = threading.Lock()
        self._population: Callable[[], Any] = lambda: None

    def make_panel(self, population: Any):
        """The panel the worker initializer shows for a run of `population`."""
        from .population_curves import member_colours
        from .population_panel import PopulationPanel

        return PopulationPanel(population.members, member_colours(len(population)))

    # ------------------------------------------------------------------------------------------
    # reporter events

    def start_run(self, population, target_epoch):
        from .population_curves import PopulationCurves, member_colours
        from .population_panel import MemberView

        self._population = weakref.ref(population)
        self.active, self._ended = True, False
        self._phase = "starting"
        self._lines.start_run(population, target_epoch)
        members = population.members
        if len(self._views) != len(members):  # the first run: the views and curves it keeps
            colours = member_colours(len(members))
            self._views = [MemberView(i, s, colours[i]) for i, s in enumerate(members)]
            self.curves = PopulationCurves(len(members))
            self.renderer.data = self.curves
        self._title = f"{population.cls.__name__} population of {len(members)}"
        self._target, self._epoch = target_epoch, population.epoch
        self._step, self._position, self._in_epoch = population.step, 0, False
        self.stats.start_run(population.step)
        self._notes = self._notes[-5:]
        self._table_key = None
        self._sync_stopped()
        self.panel = worker.claim_panel()
        _PANELS[population] = self
        if self.panel is not None:
            self.panel.claim(self._title, population.stop, member_stop=self._stop_member)
            self._refresh(force=True)
            self._show_standin(force=True)
            self._figure = self._new_figure()
            self.renderer.start(self._figure)

    def member_steps(self, first, losses):
        count = len(losses[0]) if len(losses) else 0
        self._position += count
        self._step = first + count - 1
        self.stats.observe(self._step, float("nan"))
        self.curves.add_steps(first, losses)
        now = time.monotonic()
        if now - self._last_refresh >= self.refresh_interval:
            self._refresh(now=now)

    def member_rows(self, rows: Sequence[Mapping[str, Any]]):
        if rows:
            self._epoch = int(rows[0].get("epoch", self._epoch + 1))
        self._in_epoch = False
        for row in rows:
            index = int(row.get("member", -1))
            if 0 <= index < len(self._views):
                self._views[index].row = dict(row)
        self.curves.add_rows(rows)
        if self.panel is None:
            if not worker.is_quiet():
                self._lines.member_rows(rows)
            return
        self._table_key = None
        self._refresh(force=True)
        self._show_standin()

    def phase(self, phase):
        from .panel import BAR_STYLE

        self.stats.follow(phase)
        if phase == "failed":  # called from the run's `except` clause
            self._failure_note()
        if self.active:
            self._phase = phase
            self._refresh()
        elif self._ended and phase in BAR_STYLE:
            self._finish(phase)

    def note(self, message, done=False):
        if self.panel is None or not self.active:
            if not worker.is_quiet():
                self._lines.note(message, done)
            return
        self.show_note(message, replace_pending=done)

    def end_run(self, population):
        super().end_run(population)
        self._sync_stopped()

    # ------------------------------------------------------------------------------------------
    # drawing

    def _stop_member(self, index: int) -> None:
        """A member's Stop button: prune it (at the population's next call)."""
        population = self._population()
        if population is not None:
            population.stop(index, "stopped by its Stop button in the panel")

    def _failure_note(self) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, Exception):
            return
        message = f"failed: {type(error).__name__}: {error}"
        if self.panel is None:
            self._lines.note(message)
            return
        with self._lock:
            self._notes.append(message)
            del self._notes[:-5]
        population = self._population()
        if population is not None and population.background:  # no cell re-raises it
            from .failures import folded_traceback

            print("\n".join(folded_traceback(error)), file=sys.stderr, flush=True)

    def _new_figure(self):
        from .population_curves import PopulationFigure

        return PopulationFigure([view.label for view in self._views])

    def _sync_stopped(self) -> bool:
        """Take the members the population stopped (pruned or diverged); True if any is new."""
        population = self._population()
        if population is None:
            return False
        changed = False
        for index, why in population.stopped.items():
            view = self._views[index] if index < len(self._views) else None
            if view is not None and view.stopped is None:
                view.stopped, changed = why, True
                if self.panel is not None:
                    self.panel.mark_stopped(index)
        return changed

    def _ranked(self) -> tuple[str, str, list[Any]]:
        rows = [{"member": v.index, **v.metrics()} for v in self._views]
        metric, order = ranked_members(rows, self.metric, self.mode)
        mode = self.mode or ("min" if "loss" in metric else "max")
        return metric, mode, [self._views[int(row["member"])] for row in order]

    def _training(self) -> int:
        return sum(view.stopped is None for view in self._views)

    def _status_parts(self) -> list[str]:
        from .populations import members_text

        parts = super()._status_parts()
        where = next(i for i, p in enumerate(parts) if p.startswith("step "))
        parts.insert(where + 1, members_text(self._training(), len(self._views), self.active))
        return parts

    def _refresh(self, now: float | None = None, force: bool = False) -> None:
        panel = self.panel
        if panel is None:
            return
        from .panel import status_html

        now = now if now is not None else time.monotonic()
        with self._drawing:  # the training thread's and the curve thread's refreshes
            if self._sync_stopped():
                self._table_key, force = None, True
            if not force and now - self._last_refresh < self.refresh_interval:
                self._stale = True
                return
            self._last_refresh, self._stale = now, False
            panel.progress.value = self._fraction()
            panel.status.value = status_html(self._status_parts())
            key = (self.active, tuple(view.stopped for view in self._views))
            if key != self._table_key:
                self._table_key = key
                self._show_table()

    def _show_table(self) -> None:
        from .population_panel import head_html, member_ranks, row_html, table_columns

        panel = self.panel
        if panel is None:
            return
        metric, mode, order = self._ranked()
        ranks = member_ranks(order, metric)
        columns = table_columns(self._views)
        panel.show_table(
            head_html(columns, metric, mode),
            [
                (view.index, row_html(view, columns, metric, self.active, ranks.get(view.index)))
                for view in self._views
            ],
        )

    def _record(self, last_seen: bool = False) -> tuple[str, str]:
        from .panel import notes_html
        from .population_panel import member_ranks, members_table_html
        from .record import record_html, record_text

        parts = self._status_parts()
        with self._lock:
            notes = list(self._notes)
        metric, mode, order = self._ranked()
        ranks = member_ranks(order, metric)
        html = _with_table(  # the table, then the notes
            record_html(self._title, parts, self._fraction(), None, [], last_seen=last_seen),
            members_table_html(self._views, metric, mode, active=self.active, ranks=ranks)
            + (f"<div>{notes_html(notes)}</div>" if notes else ""),
        )
        lines = [record_text(self._title, parts, last_seen)]
        for view in self._views:  # in member order, as the live table
            results = "  ".join(f"{k} {v:.4g}" for k, v in view.metrics().items())
            rank = f"rank {ranks[view.index]}" if view.index in ranks else "rank -"
            lines.append(
                f"  {view.index}: {view.label}  {view.state(self.active)}  {rank}  {results}"
            )
        return html, "\n".join(lines)

    def _standin(self) -> tuple[str, str]:
        return self._record(last_seen=True)

    def _finish(self, phase: str) -> None:
        self._sync_stopped()
        self._table_key = None  # the final refresh draws the table as the run left it
        super()._finish(phase)


def _with_table(html: str, table: str) -> str:
    """The record's HTML with the members' table inside its box (before its last `</div>`)."""
    cut = html.rfind("</div>")
    return html[:cut] + table + html[cut:]
