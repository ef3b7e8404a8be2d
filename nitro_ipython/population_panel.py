"""A population's live panel: the single run's panel, with every member's curves on one plot
and a table of the members, each with its rank and its own Stop button.

`PopulationPanel` is a `LivePanel` (the same Stop button for the whole run, progress bar,
status line, notes, stand-in and static record), whose metrics line is replaced by the
members' table: a header row and one row per member, in member order (its colour, its rank
by the sorting metric, settings, state, latest results, and a Stop button that prunes it:
`pop.stop(i)`). The rows stay in place as the ranks change, so a Stop button never moves
under the pointer. The rows are built with the panel, on the main thread; the training thread
only assigns their traits.

As with the whole run's Stop button, a member's button takes clicks only once the cell that
started the run has ended (the kernel reads widget messages between cells): for a background
run (`%nitro train pop --background`, `pop.train(background=True)`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from html import escape
from typing import Any

import ipywidgets as widgets

from nitro.progress import member_metrics, settings_label

from .panel import LivePanel

__all__ = ["MemberView", "PopulationPanel", "member_ranks", "members_table_html", "table_columns"]

MEMBER_TIP = "Stop this member after the current call (prune it); the others train on."
MEMBER_FOREGROUND_TIP = (
    "This cell is still running, and the kernel handles widget clicks only between cells: "
    "train the population with --background to stop members from here."
)

_WIDTHS = {"#": 30, "rank": 40, "settings": 230, "state": 210, "epoch": 50}
_METRIC_WIDTH = 80


class MemberView:
    """What the table shows of one member: its index, settings, colour, state, latest row."""

    def __init__(self, index: int, settings: Mapping[str, Any], colour: str):
        self.index, self.settings, self.colour = index, dict(settings), colour
        self.label = settings_label(settings)
        self.row: Mapping[str, Any] = {}
        self.stopped: str | None = None  # why it stopped, once it did

    def metrics(self) -> dict[str, float]:
        return member_metrics(self.row, self.settings)

    def state(self, active: bool) -> str:
        why = self.stopped
        if why is not None:  # "stopped by its Stop button ...", "diverged at step 12"
            return why if why.startswith(("stopped", "diverged")) else f"stopped: {why}"
        return "training" if active else "trained"


def table_columns(views: Sequence[MemberView]) -> list[str]:
    """The results columns: every metric a member's latest row has, in first-seen order."""
    columns: dict[str, None] = {}
    for view in views:
        for key in view.metrics():
            columns.setdefault(key)
    return list(columns)


def member_ranks(ranked: Sequence[MemberView], metric: str) -> dict[int, int]:
    """Member -> its rank (1: the best) in `ranked` (best first), for the members with a
    finite `metric`; the others have none."""
    ranks: dict[int, int] = {}
    for view in ranked:
        value = view.metrics().get(metric)
        if value is not None and math.isfinite(value):
            ranks[view.index] = len(ranks) + 1
    return ranks


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) and value == value else "-"


def _heading(column: str, metric: str, mode: str) -> str:
    arrow = (" &#x25B2;" if mode == "min" else " &#x25BC;") if column == metric else ""
    return f"{escape(column)}{arrow}"


def _cell(text: str, width: int, bold: bool = False, title: str = "") -> str:
    weight = "font-weight:bold;" if bold else ""
    tip = f" title='{escape(title, quote=True)}'" if title else ""
    return (
        f"<span{tip} style='display:inline-block;width:{width}px;overflow:hidden;"
        f"text-overflow:ellipsis;white-space:nowrap;vertical-align:middle;{weight}'>"
        f"{text}</span>"
    )


def _swatch(colour: str) -> str:
    return f"<span style='color:{colour}'>&#x25A0;</span>"


def head_html(columns: Sequence[str], metric: str, mode: str) -> str:
    names = ("#", "rank", "settings", "state", "epoch")
    cells = [_cell(escape(name), _WIDTHS[name], bold=True) for name in names]
    cells += [_cell(_heading(c, metric, mode), _METRIC_WIDTH, bold=True) for c in columns]
    return f"<div style='font-size:90%;white-space:nowrap'>{''.join(cells)}</div>"


def row_html(
    view: MemberView, columns: Sequence[str], metric: str, active: bool, rank: int | None = None
) -> str:
    state = view.state(active)
    colour = "#b26a00" if view.stopped is not None else "inherit"
    values = view.metrics()
    cells = [
        _cell(f"{_swatch(view.colour)} {view.index}", _WIDTHS["#"]),
        _cell("-" if rank is None else str(rank), _WIDTHS["rank"]),
        _cell(escape(view.label or "-"), _WIDTHS["settings"], title=view.label),
        _cell(
            f"<span style='color:{colour}'>{escape(state)}</span>", _WIDTHS["state"], title=state
        ),
        _cell(str(view.row.get("epoch", "-")), _WIDTHS["epoch"]),
    ]
    cells += [_cell(_fmt(values.get(c)), _METRIC_WIDTH, bold=c == metric) for c in columns]
    return f"<div style='font-size:90%;white-space:nowrap'>{''.join(cells)}</div>"


def members_table_html(
    views: Sequence[MemberView],
    metric: str,
    mode: str,
    active: bool = False,
    ranks: Mapping[int, int] | None = None,
) -> str:
    """The members' table as static HTML (for the stand-in and the record), in `views`'
    order (member order, as the live table), with each member's rank (`ranks`)."""
    columns = table_columns(views)
    ranks = ranks or {}
    style = "style='padding:1px 8px 1px 0;text-align:left'"
    head = "".join(
        f"<th {style}>{_heading(c, metric, mode)}</th>"
        for c in ["#", "rank", "settings", "state", "epoch", *columns]
    )
    body = []
    for view in views:
        values = view.metrics()
        rank = ranks.get(view.index)
        cells = [
            f"{_swatch(view.colour)} {view.index}",
            "-" if rank is None else str(rank),
            escape(view.label or "-"),
            escape(view.state(active)),
            str(view.row.get("epoch", "-")),
            *(
                f"<b>{_fmt(values.get(c))}</b>" if c == metric else _fmt(values.get(c))
                for c in columns
            ),
        ]
        body.append("<tr>" + "".join(f"<td {style}>{c}</td>" for c in cells) + "</tr>")
    return (
        "<table class='nitro-members' style='font-size:90%;border-collapse:collapse'>"
        f"<tr>{head}</tr>{''.join(body)}</table>"
    )


class PopulationPanel(LivePanel):
    """A population's panel: `stop_button` stops the run, `member_buttons[i]` prunes member
    `i`; `member_rows` are shown in member order in `table`, whatever the ranks.

    >>> panel = nitro_ipython.live_panel(pop)                     # doctest: +SKIP
    >>> panel.member_buttons[2].click()                           # doctest: +SKIP
    """

    def __init__(self, members: Sequence[Mapping[str, Any]], colours: Sequence[str]):
        super().__init__()
        self.table_head = widgets.HTML()
        self.member_cells = [widgets.HTML() for _ in members]
        self.member_buttons = [
            widgets.Button(
                description="Stop",
                disabled=True,
                tooltip=MEMBER_FOREGROUND_TIP,
                layout=widgets.Layout(width="auto"),
            )
            for _ in members
        ]
        self.member_rows = [
            widgets.HBox([cell, button], layout=widgets.Layout(align_items="center"))
            for cell, button in zip(self.member_cells, self.member_buttons, strict=True)
        ]
        self.table = widgets.VBox([self.table_head, *self.member_rows])
        self.children = (
            self.header,
            self.progress,
            self.status,
            self.curves,
            self.table,
            self.notes,
        )
        self.colours = list(colours)
        self._member_stop: Callable[[int], Any] | None = None
        self._stopped: set[int] = set()
        for index, button in enumerate(self.member_buttons):
            button.on_click(partial(self._on_member_stop, index))

    # ------------------------------------------------------------------------------------------
    # main thread

    def cell_finished(self) -> None:
        super().cell_finished()
        with self._lock:
            if self._member_stop is not None:
                self._enable_members()

    # ------------------------------------------------------------------------------------------
    # training thread

    def claim(self, title: str, stop, member_stop: Callable[[int], Any] | None = None) -> None:
        """Show the panel for a run; `member_stop(i)` prunes member `i`."""
        super().claim(title, stop)
        with self._lock:
            self._member_stop = member_stop
            if member_stop is not None and not self._cell_running:
                self._enable_members()

    def _enable_members(self) -> None:
        for index, button in enumerate(self.member_buttons):
            if index not in self._stopped:
                button.description, button.icon = "Stop", "stop"
                button.tooltip, button.disabled = MEMBER_TIP, False

    def _on_member_stop(self, index: int, _button) -> None:
        with self._lock:
            callback = self._member_stop
        if callback is not None and index not in self._stopped:
            button = self.member_buttons[index]
            button.disabled, button.description = True, "Stopping"
            callback(index)

    def mark_stopped(self, index: int) -> None:
        """Member `index` stopped: its button says so, and takes no more clicks."""
        with self._lock:
            self._stopped.add(index)
        button = self.member_buttons[index]
        button.disabled, button.description, button.icon = True, "Stopped", ""
        button.tooltip = "This member stopped training."

    def show_table(self, head: str, rows: Sequence[tuple[int, str]]) -> None:
        """The table: `head`, and each `(member, html)` into that member's row, which stays
        where it is (the rank is a column: a row that moved could take a click meant for
        another member's Stop button)."""
        self.table_head.value = head
        for index, html in rows:
            self.member_cells[index].value = html

    def finish(self) -> None:
        super().finish()
        with self._lock:
            self._member_stop = None
        for button in self.member_buttons:
            button.disabled = True

    def _parts(self) -> list[Any]:
        """Every widget of the panel: those it shows, the single run's it does not (metrics,
        edits), and the members' table."""
        return [
            *super()._parts(),
            self.metrics,
            self.edits,
            self.table_head,
            *self.member_rows,
            *self.member_cells,
            *self.member_buttons,
        ]
