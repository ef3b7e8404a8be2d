"""How a handle shows itself: a one-line repr and an HTML table for notebooks."""

from __future__ import annotations

from html import escape
from typing import Any

__all__ = ["handle_html", "short_repr"]


def short_repr(handle: Any) -> str:
    return (
        f"Nitro({handle.cls.__name__}, {handle.phase}, epoch {handle.epoch}/"
        f"{handle.target_epoch}, step {handle.step}, {handle.param_count:,} params)"
    )


def handle_html(handle: Any) -> str:
    rows = [
        ("experiment", handle.owner),
        ("phase", handle.phase),
        ("epoch", f"{handle.epoch} / {handle.target_epoch}"),
        ("step", f"{handle.step}"),
        *([("schedule horizon", f"{handle.total_steps:,} steps")] if handle.total_steps else []),
        ("stop reason", handle.stop_reason or "-"),
        ("parameters", f"{handle.param_count:,}"),
        ("devices", handle.placement.describe()),
        ("weights", handle.weights_origin),
        ("seed", handle.seed),
    ]
    if handle.last_metrics:
        metrics = ", ".join(
            f"{k} {v:.4g}"
            for k, v in handle.last_metrics.items()
            if isinstance(v, float) and k not in ("epoch_seconds", "data_wait_frac")
        )
        rows.append(("latest", metrics))
    body = "".join(
        f"<tr><th style='text-align:left'>{escape(str(k))}</th>"
        f"<td style='text-align:left'>{escape(str(v))}</td></tr>"
        for k, v in rows
    )
    return f"<table><caption>Nitro: {escape(handle.cls.__name__)}</caption>{body}</table>"
