"""How a handle shows itself: a one-line repr and an HTML table for notebooks."""

from __future__ import annotations

from html import escape
from typing import Any

from nitro.core.train_state import TIMING_COLUMNS

__all__ = ["handle_html", "short_repr", "weights_line"]


def short_repr(handle: Any) -> str:
    return (
        f"Nitro({handle.cls.__name__}, {handle.phase}, epoch {handle.epoch}/"
        f"{handle.target_epoch}, step {handle.step}, {handle.param_count:,} params)"
    )


def weights_line(handle: Any) -> str:
    """Where the current weights came from: the checkpoint they were read from (a resume,
    `restore_best()`, `weights=` a checkpoint), else the initial weights' origin.

    >>> weights_line(resumed)  # doctest: +SKIP
    'checkpoint of run 20260101-120000-ab12 at epoch 2, step 12 (runs/Tiny/.../12)'
    """
    checkpoint = handle.weights_checkpoint
    if checkpoint is None:
        return handle.weights_origin
    if "averaged" in checkpoint:
        return f"average of {checkpoint['averaged']} checkpoints of run {checkpoint['run_id']}"
    epoch = checkpoint.get("epoch")
    at = (
        f"epoch {epoch}, step {checkpoint['step']}"
        if epoch is not None
        else (f"step {checkpoint['step']}")
    )
    return f"checkpoint of run {checkpoint['run_id']} at {at} ({checkpoint['path']})"


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
        ("weights", weights_line(handle)),
        ("seed", handle.seed),
    ]
    if handle.last_metrics:
        metrics = ", ".join(
            f"{k} {v:.4g}"
            for k, v in handle.last_metrics.items()
            if isinstance(v, float) and k not in TIMING_COLUMNS
        )
        rows.append(("latest", metrics))
    body = "".join(
        f"<tr><th style='text-align:left'>{escape(str(k))}</th>"
        f"<td style='text-align:left'>{escape(str(v))}</td></tr>"
        for k, v in rows
    )
    return f"<table><caption>Nitro: {escape(handle.cls.__name__)}</caption>{body}</table>"
