"""The static record a run leaves in its cell: the summary as HTML and text, the curves as PNG.

Plain HTML (a table, a bar drawn with a `div`, no scripts, no widgets), so a reopened
notebook, nbconvert's HTML and GitHub's renderer all show it; the curves are a separate
`image/png` output, which every viewer shows.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from html import escape
from typing import Any

from .panel import BAR_STYLE, edits_html, metrics_html, notes_html, status_html

__all__ = ["record_html", "record_text"]

_BAR_COLOURS = {"success": "#4caf50", "warning": "#ff9800", "danger": "#f44336", "info": "#2196f3"}


def record_text(
    title: str, parts: list[str], last_seen: bool = False, lines: Sequence[str] = ()
) -> str:
    """`Digits: done · epoch 6/6 · step 168 · loss 0.1234 · 930 steps/s · 4.2 s`, then
    `lines` (a population's members); a stand-in's (`last_seen`): `Digits: last seen
    training · epoch 3/6 · ...`."""
    if last_seen:
        parts = [f"last seen {parts[0]}", *parts[1:]]
    return "\n".join([f"{title}: " + " · ".join(parts), *lines])


def record_html(
    title: str,
    parts: list[str],
    fraction: float,
    row: dict[str, Any] | None,
    notes: list[str],
    edits: Sequence[tuple[int, str]] = (),
    last_seen: bool = False,
    table: str = "",
    gallery: bytes | None = None,
) -> str:
    """The final panel as static HTML: title, bar, status line, latest metrics, a
    population's members' `table`, the key to the curves' marks of live edits (`edits`:
    (step, label)), notes, the gallery of validation samples (`gallery`, a PNG, kept as an
    image in the HTML); `last_seen`: a live run's stand-in, whose phase is what the run did
    when it was last updated."""
    colour = _BAR_COLOURS[BAR_STYLE.get(parts[0], "info")]
    percent = max(0.0, min(1.0, fraction)) * 100
    bar = (
        "<div style='background:#eee;height:8px;margin:4px 0'>"
        f"<div style='background:{colour};width:{percent:.1f}%;height:8px'></div></div>"
    )
    pieces = [
        "<div class='nitro-record' style='border:1px solid #ddd;padding:4px 8px'>",
        f"<b>{escape(title)}</b>",
        bar,
        f"<div>{status_html(parts, last_seen)}</div>",
        metrics_html(row),
        table,
        f"<div>{edits_html(list(edits))}</div>" if edits else "",
        _gallery_html(gallery) if gallery else "",
        f"<div>{notes_html(notes)}</div>" if notes else "",
        "</div>",
    ]
    return "".join(pieces)


def _gallery_html(png: bytes) -> str:
    data = base64.b64encode(png).decode()
    return (
        "<div class='nitro-gallery'><img alt='validation samples' style='max-width:100%' "
        f"src='data:image/png;base64,{data}'/></div>"
    )
