"""`%nitro cache` as tables: the cache's counts, one row per program (its calls, compile time,
FLOPs and memory), one row per compile."""

from __future__ import annotations

from html import escape
from typing import Any

from nitro.progress import format_bytes, format_flops

__all__ = ["CacheTable"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th style='text-align:left'>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td style='text-align:left'>{escape(c)}</td>" for c in row) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class CacheTable:
    """`nitro.cache_stats()` shown as tables in a notebook and as its text in a terminal.

    >>> import nitro
    >>> CacheTable(nitro.cache_stats())._repr_html_()[:30]   # doctest: +SKIP
    '<p><b>compile cache</b>: 3 hits'
    """

    def __init__(self, stats: Any):
        self.stats = stats

    def __repr__(self) -> str:
        return str(self.stats)

    def _repr_html_(self) -> str:
        s = self.stats
        parts = [
            f"<p><b>compile cache</b>: {s.hits} hits, {s.misses} misses, {s.entries} entries</p>"
        ]
        if s.programs:
            parts.append(
                _table(
                    [
                        "program",
                        "experiment",
                        "calls",
                        "compiled in",
                        "FLOPs a call",
                        "memory",
                        "of which scratch",
                        "GraphConst read",
                    ],
                    [
                        [
                            p["program"],
                            p["owner"],
                            f"{p['calls']:,}",
                            f"{p['compile_seconds']:.2f} s",
                            format_flops(p.get("flops")),
                            format_bytes(p.get("memory_bytes")),
                            format_bytes(p.get("temp_bytes")),
                            ", ".join(p["graphconst_read"]) or "none",
                        ]
                        for p in s.programs
                    ],
                )
            )
        if s.compiles:
            parts.append("<p><b>why each program compiled</b></p>")
            parts.append(
                _table(
                    ["program", "experiment", "compile", "why"],
                    [[r.program, r.owner, f"{r.seconds:.2f} s", r.reason] for r in s.compiles],
                )
            )
        return "".join(parts)
