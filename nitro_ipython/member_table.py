"""What a population's panel and status show beyond a run's: its members, their ranks, the table.

A run is a population of one: the panel, curves, reporter and magics work on a list of
members, one for a run. What only a population of several has is here: each member's view
(settings, colour, state, latest row), its rank by the sorting metric, the members' table (as
the live panel's rows and as the record's HTML), the count of members still training, the
best member (`%nitro status`, `%nitro runs`) and `%nitro stop POP I`, which prunes one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from nitro.progress import member_metrics, ranked_members, settings_label

__all__ = [
    "MemberView",
    "best_member",
    "stop_member",
    "head_html",
    "members_of",
    "members_table_html",
    "members_text",
    "ranked_views",
    "row_html",
]

_WIDTHS = {"#": 30, "rank": 40, "settings": 230, "state": 210, "epoch": 50}
_METRIC_WIDTH = 80


def members_of(handle: Any) -> list[dict[str, Any]] | None:
    """The settings of a population's members; None for a run (one member, no settings)."""
    import nitro

    return list(handle.members) if isinstance(handle, nitro.Population) else None


def members_text(training: int, total: int, running: bool) -> str:
    """`3 of 4 members training` while a run trains; after it, how many stopped."""
    if running:
        return f"{training} of {total} members training"
    stopped = total - training
    return f"{stopped} of {total} members stopped" if stopped else f"{total} members"


class MemberView:
    """What the panel shows of one member: its index, settings, colour, state, latest row."""

    def __init__(self, index: int, settings: Mapping[str, Any], colour: str = ""):
        self.index, self.settings, self.colour = index, dict(settings), colour
        self.label = settings_label(settings)
        self.row: dict[str, Any] | None = None  # its latest history row
        self.stopped: str | None = None  # why it stopped, once it did

    def metrics(self) -> dict[str, float]:
        return member_metrics(self.row or {}, self.settings)

    def state(self, active: bool) -> str:
        why = self.stopped
        if why is not None:  # "stopped by its Stop button ...", "diverged at step 12"
            return why if why.startswith(("stopped", "diverged")) else f"stopped: {why}"
        return "training" if active else "trained"

    def line(self, active: bool, rank: int | None) -> str:
        """`2: learning_rate=0.01  trained  rank 1  loss 0.41  val_loss 0.36`: the record's."""
        results = "  ".join(f"{k} {v:.4g}" for k, v in self.metrics().items())
        rank_text = "rank -" if rank is None else f"rank {rank}"
        return f"  {self.index}: {self.label}  {self.state(active)}  {rank_text}  {results}"


def ranked_views(
    views: Sequence[MemberView], metric: str | None, mode: str | None
) -> tuple[str, str, dict[int, int]]:
    """The metric the members rank by, its mode, and member -> its rank (1: the best) for
    the members with a finite value of it; the others have none."""
    metric, order = ranked_members(
        [{"member": v.index, **v.metrics()} for v in views], metric, mode
    )
    ranked = [int(row["member"]) for row in order if math.isfinite(row.get(metric, math.nan))]
    mode = mode or ("min" if "loss" in metric else "max")
    return metric, mode, {member: rank for rank, member in enumerate(ranked, 1)}


def _columns(views: Sequence[MemberView]) -> list[str]:
    """The results columns: every metric a member's latest row has, in first-seen order."""
    return list(dict.fromkeys(key for view in views for key in view.metrics()))


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) and value == value else "-"


def _heading(column: str, metric: str, mode: str) -> str:
    arrow = (" &#x25B2;" if mode == "min" else " &#x25BC;") if column == metric else ""
    return f"{escape(column)}{arrow}"


def _cells(view: MemberView, columns: Sequence[str], active: bool, rank: int | None) -> list[str]:
    """The member's `#`, rank, settings, state, epoch (a stopped member's: the epoch it
    stopped in, its last row's) and results, as HTML."""
    values = view.metrics()
    return [
        f"<span style='color:{view.colour}'>&#x25A0;</span> {view.index}",
        "-" if rank is None else str(rank),
        escape(view.label or "-"),
        escape(view.state(active)),
        str((view.row or {}).get("epoch", "-")),
        *(_fmt(values.get(c)) for c in columns),
    ]


def _line(cells: Sequence[tuple[str, int, bool, str]]) -> str:
    """A row of the live table: (HTML, width, bold, title) per cell."""
    spans = []
    for text, width, bold, title in cells:
        tip = f" title='{escape(title, quote=True)}'" if title else ""
        spans.append(
            f"<span{tip} style='display:inline-block;width:{width}px;overflow:hidden;"
            f"text-overflow:ellipsis;white-space:nowrap;vertical-align:middle;"
            f"{'font-weight:bold;' * bold}'>{text}</span>"
        )
    return f"<div style='font-size:90%;white-space:nowrap'>{''.join(spans)}</div>"


def head_html(views: Sequence[MemberView], metric: str, mode: str) -> str:
    """The live table's header row."""
    columns = _columns(views)
    cells = [(escape(name), width, True, "") for name, width in _WIDTHS.items()]
    return _line(cells + [(_heading(c, metric, mode), _METRIC_WIDTH, True, "") for c in columns])


def row_html(
    view: MemberView, views: Sequence[MemberView], metric: str, active: bool, rank: int | None
) -> str:
    """A member's row of the live table (its Stop button is a widget beside it)."""
    columns, state = _columns(views), view.state(active)
    number, shown_rank, label, _, epoch, *values = _cells(view, columns, active, rank)
    colour = "#b26a00" if view.stopped is not None else "inherit"
    widths = list(_WIDTHS.values())
    cells = [
        (number, widths[0], False, ""),
        (shown_rank, widths[1], False, ""),
        (label, widths[2], False, view.label),
        (f"<span style='color:{colour}'>{escape(state)}</span>", widths[3], False, state),
        (epoch, widths[4], False, ""),
    ]
    return _line(
        cells + [(v, _METRIC_WIDTH, c == metric, "") for v, c in zip(values, columns, strict=True)]
    )


def members_table_html(
    views: Sequence[MemberView], metric: str, mode: str, active: bool, ranks: Mapping[int, int]
) -> str:
    """The members' table as static HTML (the stand-in's and the record's), in member order
    as the live table, with each member's rank."""
    columns = _columns(views)
    style = "style='padding:1px 8px 1px 0;text-align:left'"
    head = "".join(f"<th {style}>{_heading(c, metric, mode)}</th>" for c in [*_WIDTHS, *columns])
    body = []
    for view in views:
        cells = _cells(view, columns, active, ranks.get(view.index))
        cells[5:] = [
            f"<b>{v}</b>" if c == metric else v for v, c in zip(cells[5:], columns, strict=True)
        ]
        body.append("<tr>" + "".join(f"<td {style}>{c}</td>" for c in cells) + "</tr>")
    return (
        "<table class='nitro-members' style='font-size:90%;border-collapse:collapse'>"
        f"<tr>{head}</tr>{''.join(body)}</table>"
    )


def best_member(pop: Any) -> tuple[str, float, int] | None:
    """(metric, value, member) of the best member still training (`pop.ranking()`: by
    `val_loss` when the rows have it, else `loss`); None before any row."""
    metric, ranked = pop.ranking()
    return (metric, ranked[0][1], ranked[0][0]) if ranked else None


def stop_member(pop: Any, name: str, member: str, timeout: float = 600.0) -> None:
    """`%nitro stop POP I`: prune member I (`pop.stop(I)`); a running population stops it at
    its next call, and the magic waits for that, so `pop.stopped` names it afterwards."""
    from IPython.core.error import UsageError

    last = len(pop.members) - 1
    index = int(member) if member.isdigit() else -1
    if not 0 <= index <= last:
        raise UsageError(
            f"%nitro stop {name} {member}: {name} has {last + 1} members, numbered 0 to "
            f"{last}; name one of them (`%nitro stop {name} {last}`), or none to stop the run"
        )
    label = f"member {index} ({settings_label(pop.members[index])})"
    if index in pop.stopped:
        print(f"nitro: {label} of {name} already stopped: {pop.stopped[index]}")
        return
    why = f"stopped by %nitro stop {name} {index}"
    pop.stop(index, why)
    deadline = time.monotonic() + timeout
    while index not in pop.stopped and time.monotonic() < deadline:
        if not pop.running:  # the run ended before its next call: stop it now
            pop.stop(index, why)
            break
        time.sleep(0.02)
    if index not in pop.stopped:
        print(
            f"nitro: {label} of {name} stops at the population's next call (it asked at step "
            f"{pop.step}); `%nitro status {name}` lists it once it has"
        )
        return
    training = last + 1 - len(pop.stopped)
    print(  # the step it stopped at, as its record has it: the run has gone on since
        f"nitro: stopped {label} of {name} at step {pop.stopped_at[index]}; {training} of "
        f"{last + 1} members train on"
        + ("" if pop.running else f" when `%nitro train {name}` trains it again")
    )
