"""The live training panel: progress bar, phase, epoch/step, throughput, metrics, curves, Stop.

The panel is displayed on the main thread, in the cell that starts the run (see `worker.py`).
After that, the training thread and the curve renderer only assign widget traits (`value`,
`disabled`, `bar_style`, `layout.display`): never `with out:`, never a new `display()`. Trait
updates reach the frontend from any thread; output contexts do not.

While the run lives, a second output below the panel holds a stand-in: the panel's latest
state as static HTML, refreshed as epochs end, hidden by a style rule while the widget beside
it lives and shown (with the dead widget hidden) where it does not: a notebook saved during
the run (JupyterLab autosaves every two minutes) and reopened after the kernel died,
nbconvert's HTML, GitHub. When the run ends, the panel replaces its own output with a static
record (the summary as HTML, the final curves as a PNG in place of the stand-in) and closes
its widgets: a saved notebook shows the record, and a kernel that runs many trainings keeps
no widgets behind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from html import escape
from typing import Any

import ipywidgets as widgets
from IPython.display import display

from nitro.progress import TIMING_COLUMNS

from .runs import RunStats

__all__ = [
    "BAR_STYLE",
    "PANEL_FALLBACK",
    "LivePanel",
    "edits_html",
    "metrics_html",
    "notes_html",
    "standin_html",
    "status_html",
    "status_text",
]

_SKIP_COLUMNS = {"epoch", "step", *TIMING_COLUMNS}
BAR_STYLE = {"done": "success", "stopped": "warning", "failed": "danger"}

# What the Stop button says while the cell that started the run still runs: the kernel reads
# widget messages only between cells, so a click would wait for the run to end.
FOREGROUND_STOP = "Interrupt ■ to stop"
FOREGROUND_TIP = (
    "This cell is still running, and the kernel handles widget clicks only between cells: "
    "stop the run with the notebook's interrupt button (■). It stops after the current step."
)
BACKGROUND_TIP = "Stop the run after the current step."
MEMBER_TIP = "Stop this member after the current call (prune it); the others train on."
MEMBER_FOREGROUND_TIP = (
    "This cell is still running, and the kernel handles widget clicks only between cells: "
    "train the population with --background to stop members from here."
)

PLOTS = 4  # the most plots the curves draw: the loss, two metrics, a population's members

# What the panel's output shows where its widget cannot be drawn (no live kernel behind it).
PANEL_FALLBACK = "nitro: live training panel (its latest state is in the output below)"

# The stand-in hides while the widget before it lives (its view is a `.widget-vbox`, which
# ipywidgets marks `.jupyter-widgets-disconnected` when the kernel restarts); where the widget
# is dead ("model not found", "Loading widget...", a text/plain fallback, a restarted kernel),
# the widget's output hides and the stand-in shows. Both outputs are children of one output
# area, in JupyterLab, Notebook 7 and nbconvert's HTML alike.
_LIVE = ":has(.widget-vbox:not(.jupyter-widgets-disconnected))"
_STANDIN_STYLE = (
    "<style>"
    f".jp-OutputArea-child{_LIVE} + .jp-OutputArea-child:has(.nitro-standin)"
    "{display:none}"
    f".jp-OutputArea-child:not({_LIVE}):has(+ .jp-OutputArea-child .nitro-standin)"
    "{display:none}"
    "</style>"
)


def standin_html(record: str) -> str:
    """The stand-in output for a live panel: `record` (the panel's state as static HTML) and
    the style rule that shows it only where the panel's widget is dead."""
    said = (
        "<div style='font-size:85%;color:#666;margin-top:2px'>the run as of its last update "
        "here; its live panel shows only while the kernel that runs it does</div>"
    )
    return f"{_STANDIN_STYLE}<div class='nitro-standin'>{record}{said}</div>"


_EMPTY = {"text/html": "", "text/plain": ""}  # an output that shows nothing


class _Record:
    """A display bundle: the static record that replaces a panel's output."""

    def __init__(self, data: dict[str, Any], metadata: dict[str, Any] | None = None):
        self.data, self.metadata = data, metadata or {}

    def _repr_mimebundle_(self, **kwargs):
        return self.data, self.metadata


class LivePanel(widgets.VBox):
    """One run's panel. Hidden until a run (or its setup) shows it.

    A population's (`members`: each member's settings) has a table of the members below its
    curves: `member_rows` in member order (the rank is a column: a row that moved could take a
    click meant for another member's button), each with its `member_buttons[i]`, which prunes
    member `i`. The rows are built with the panel, on the main thread; the training thread
    only assigns their traits.

    >>> panel = nitro_ipython.live_panel(exp_run)         # doctest: +SKIP
    >>> panel.progress.value, panel.stop_button.description  # doctest: +SKIP
    (0.42, 'Stop')
    >>> nitro_ipython.live_panel(pop).member_buttons[2].click()  # doctest: +SKIP
    """

    def __init__(self, members: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.title = widgets.HTML("<b>nitro</b>")
        self.stop_button = widgets.Button(
            description=FOREGROUND_STOP,
            button_style="danger",
            disabled=True,
            tooltip=FOREGROUND_TIP,
            layout=widgets.Layout(width="auto"),
        )
        self.progress = widgets.FloatProgress(
            value=0.0, min=0.0, max=1.0, bar_style="info", layout=widgets.Layout(width="auto")
        )
        self.status = widgets.HTML()
        self.metrics = widgets.HTML()
        # one image per plot, side by side, wrapping under each other in a narrow panel (a
        # notebook beside an editor) instead of shrinking to thumbnails
        self.plots = [
            widgets.Image(format="png", layout=widgets.Layout(display="none", max_width="100%"))
            for _ in range(PLOTS)
        ]
        self.curves = widgets.Box(
            self.plots, layout=widgets.Layout(display="none", flex_flow="row wrap")
        )
        # validation samples with the current predictions (`sample_gallery.py`), when shown
        self.gallery = widgets.Image(
            format="png", layout=widgets.Layout(display="none", max_width="100%")
        )
        self.gallery.add_class("nitro-gallery-live")
        self.edits = widgets.HTML()  # the key to the curves' marks of live edits
        self.notes = widgets.HTML()
        # what the live panel alone says (a background run's commands): never in its record
        self.hint = widgets.HTML(layout=widgets.Layout(flex="1 1 auto", margin="0 8px"))
        self.header = widgets.HBox(
            [self.title, self.hint, self.stop_button],
            layout=widgets.Layout(
                justify_content="space-between", align_items="center", flex_flow="row wrap"
            ),
        )
        self.member_cells: list[widgets.HTML] = []
        self.member_buttons: list[widgets.Button] = []
        self.member_rows: list[widgets.HBox] = []
        self.table: widgets.VBox | None = None
        parts = [self.header, self.progress, self.status, self.metrics, self.curves, self.gallery]
        if members is not None:
            self._build_table(len(members))
            parts.append(self.table)
        super().__init__(
            [*parts, self.edits, self.notes],
            layout=widgets.Layout(
                display="none", border="1px solid #ddd", padding="4px 8px", overflow="hidden"
            ),
        )
        self._lock = threading.Lock()
        self._stop_callback = None
        self._member_stop: Callable[[int], Any] | None = None
        self._stopped: set[int] = set()
        self._cell_running = True
        self._displays: tuple[Any, Any] | None = None
        self.closed = False  # its widgets are closed: the run left its record, or none ran
        self.stop_button.on_click(self._on_stop)

    def _build_table(self, count: int) -> None:
        self.table_head = widgets.HTML()
        self.member_cells = [widgets.HTML() for _ in range(count)]
        self.member_buttons = [
            widgets.Button(
                description="Stop",
                disabled=True,
                tooltip=MEMBER_FOREGROUND_TIP,
                layout=widgets.Layout(width="auto"),
            )
            for _ in range(count)
        ]
        self.member_rows = [
            widgets.HBox([cell, button], layout=widgets.Layout(align_items="center"))
            for cell, button in zip(self.member_cells, self.member_buttons, strict=True)
        ]
        self.table = widgets.VBox([self.table_head, *self.member_rows])
        for index, button in enumerate(self.member_buttons):
            button.on_click(partial(self._on_member_stop, index))

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        if data:  # what a viewer without the live kernel shows until the run leaves its record
            data["text/plain"] = PANEL_FALLBACK
        return data

    # ------------------------------------------------------------------------------------------
    # main thread

    def show(self, visible: bool = False) -> None:
        """Display the panel (hidden until a run claims it, unless `visible`) and, below it,
        the output that holds its stand-in while the run lives and its final curves after."""
        if visible:
            self.layout.display = ""
        self._displays = (
            display(self, display_id=True),
            display(_Record(_EMPTY), display_id=True),
        )

    def show_standin(self, html: str, text: str) -> None:
        """Put the panel's latest state (`html`, `text`: a record of it so far) in the output
        below it, for a notebook saved while the run lives (any thread)."""
        if self._displays is not None and not self.closed:
            self._displays[1].update(_Record({"text/html": standin_html(html), "text/plain": text}))

    def show_plots(self, images: list[bytes], css_width: int) -> None:
        """Show `images` (PNGs, one per plot, each drawn for `css_width` pixels) in the
        curves, in order, and hide the plots left over (any thread)."""
        for plot, image in zip(self.plots, images, strict=False):
            plot.value = image
            plot.layout.width = f"{css_width}px"
            plot.layout.display = ""
        for plot in self.plots[len(images) :]:
            plot.layout.display = "none"
        self.curves.layout.display = ""

    def show_gallery(self, png: bytes) -> None:
        """Show the gallery of validation samples (a PNG; any thread)."""
        self.gallery.value = png
        self.gallery.layout.display = ""

    def say(self, text: str) -> None:
        """A line beside the title while the panel lives ("training in the background;
        `%nitro status` ..."); its record and its stand-in do not keep it."""
        self.hint.value = f"<span style='font-size:85%;color:#555'>{escape(text)}</span>"

    def cell_finished(self) -> None:
        """The cell that displayed the panel ended: from now on a click reaches the kernel."""
        with self._lock:
            self._cell_running = False
            if self._stop_callback is not None:
                self._enable_stop()
            if self._member_stop is not None:
                self._enable_members()

    # ------------------------------------------------------------------------------------------
    # training thread

    def claim(self, title: str, stop, member_stop: Callable[[int], Any] | None = None) -> None:
        """Show the panel for a run (trait updates only); `member_stop(i)` prunes member `i`
        of a population."""
        with self._lock:
            self._stop_callback = stop
            self._member_stop = member_stop
            if member_stop is not None and not self._cell_running:
                self._enable_members()
            self.title.value = f"<b>{escape(title)}</b>"
            self.progress.bar_style = "info"
            if self._cell_running:
                self.stop_button.description = FOREGROUND_STOP
                self.stop_button.icon = ""
                self.stop_button.tooltip = FOREGROUND_TIP
                self.stop_button.disabled = True
            else:
                self._enable_stop()
        self.layout.display = ""

    def _enable_stop(self) -> None:
        self.stop_button.description = "Stop"
        self.stop_button.icon = "stop"
        self.stop_button.tooltip = BACKGROUND_TIP
        self.stop_button.disabled = False

    def _on_stop(self, _button) -> None:
        with self._lock:
            callback = self._stop_callback
        if callback is not None:
            self.stop_button.disabled = True
            self.stop_button.description = "Stopping"
            callback()

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

    def show_table(self, head: str, rows: Sequence[str]) -> None:
        """The members' table: `head`, and each member's row (in member order) into its
        place, which stays where it is whatever the ranks."""
        self.table_head.value = head
        for cell, html in zip(self.member_cells, rows, strict=True):
            cell.value = html

    def finish(self) -> None:
        """The run ended: nothing left to stop."""
        with self._lock:
            self._stop_callback = self._member_stop = None
        self.stop_button.disabled = True
        for button in self.member_buttons:
            button.disabled = True

    def replace_with_record(
        self, html: str, text: str, png: bytes | None, png_width: int | None = None
    ) -> None:
        """Replace the panel's output by its static record (the PNG shown `png_width` pixels
        wide) and close the widgets."""
        if self._displays is not None:
            summary, curves = self._displays
            summary.update(_Record({"text/html": html, "text/plain": text}))
            if png is not None:
                size = {"image/png": {"width": png_width}} if png_width else {}
                curves.update(_Record({"image/png": png, "text/plain": "[training curves]"}, size))
            else:  # no curves: the stand-in goes
                curves.update(_Record(_EMPTY))
        self.close_all()

    def discard(self) -> None:
        """Remove a panel no run used (its setup failed): empty its output, close it."""
        if self._displays is not None:
            for shown in self._displays:
                shown.update(_Record(_EMPTY))
        self.close_all()

    def _parts(self) -> list[Any]:
        """Every widget the panel shows, itself first."""
        parts = [self, self.header, *self.header.children, *self.children, *self.plots]
        if self.table is not None:
            parts += [self.table_head, *self.member_rows, *self.member_cells]
            parts += self.member_buttons
        return parts

    def close_all(self) -> None:
        """Close every widget of the panel, with their layouts and styles."""
        self.closed = True
        for part in self._parts():
            for extra in (getattr(part, "layout", None), getattr(part, "style", None)):
                if isinstance(extra, widgets.Widget):
                    extra.close()
            part.close()


def status_text(
    phase: str,
    epoch: int,
    target: int,
    position: int,
    batches: int | None,
    stats: RunStats,
    in_epoch: bool,
    row: dict[str, Any] | None = None,
    members: str | None = None,
) -> list[str]:
    """The status line's parts: phase, epochs finished of the target, the batch under way,
    step, a population's `members` ("5 of 6 members training"), the latest loss (its best
    member's), throughput and, from the latest history row `row`, a step's split between
    the host's work and the wait for the device (`host_ms`, `device_ms`), elapsed time."""
    rate = stats.steps_per_second
    parts = [phase, f"epoch {epoch}/{target}"]
    if in_epoch:
        parts.append(f"batch {position}/{batches}" if batches else f"batch {position}")
    parts.append(f"step {stats.step}")
    if members is not None:
        parts.append(members)
    if stats.loss == stats.loss:
        parts.append(f"{'best loss' if members else 'loss'} {stats.loss:.4g}")
    if rate == rate:
        parts.append(f"{rate:,.0f} steps/s")
    if row and isinstance(row.get("host_ms"), float) and isinstance(row.get("device_ms"), float):
        # the history's device_ms: the wait for the device the host's work did not hide
        parts.append(f"host {row['host_ms']:.3g} ms + device wait {row['device_ms']:.3g} ms a step")
    parts.append(f"{stats.elapsed:.1f} s")
    return parts


def status_html(parts: list[str], last_seen: bool = False, whole: bool = False) -> str:
    """The status line, its phase in bold; `last_seen`: a stand-in's, whose phase is only
    what the run was doing when it was last updated ("last seen validating"); `whole`: each
    part kept on one line, so a narrow panel wraps the line between parts only."""
    phase = f"last seen {escape(parts[0])}" if last_seen else f"<b>{escape(parts[0])}</b>"
    shown = [phase, *map(escape, parts[1:])]
    if whole:
        shown = [f"<span style='white-space:nowrap'>{part}</span>" for part in shown]
    return " &middot; ".join(shown)


def metrics_html(row: dict[str, Any] | None) -> str:
    if not row:
        return ""
    cells = [
        f"<span style='white-space:nowrap'>{escape(k)} <b>{v:.4g}</b></span>"
        for k, v in row.items()
        if k not in _SKIP_COLUMNS and isinstance(v, (int, float))
    ]
    if not cells:
        return ""
    # one item per metric, wrapping between them in a narrow panel (spaced where a viewer
    # drops the style)
    epoch = f"<span style='white-space:nowrap'>epoch {row.get('epoch')}:</span>"
    return (
        f"<div style='display:flex;flex-wrap:wrap;column-gap:10px'>{epoch} {' '.join(cells)}</div>"
    )


def edits_html(marks: list[tuple[int, str]]) -> str:
    """The key to the dashed lines on the loss curve: "┆ edit: loss at step 292", one per
    live edit swapped in (or rolled back)."""
    return "".join(
        f"<span style='font-size:85%;margin-right:12px;color:"
        f"{'#c0392b' if label.endswith('(rolled back)') else '#8e44ad'}'>"
        f"&#x2506; {escape(label)} at step {step}</span>"
        for step, label in marks
    )


def notes_html(notes: list[str]) -> str:
    return "".join(
        f"<div style='font-family:monospace;font-size:85%;line-height:1.4'>{escape(note)}</div>"
        for note in notes
    )
