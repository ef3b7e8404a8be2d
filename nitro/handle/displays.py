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
    """The handle as a notebook shows it: its run (id, directory), where training stands, the
    model and its parameter groups, the batch, the devices, the weights and the latest row."""
    setup = handle.setup
    train = setup.splits.get("train")
    groups = setup.optimizer.groups if setup.optimizer is not None else ()
    rows = [
        ("experiment", handle.owner),
        *([("preset", handle.preset)] if handle.preset else []),
        ("run", f"{handle.run_id} in {handle.run_dir}"),
        ("phase", handle.phase),
        ("epoch", f"{handle.epoch} / {handle.target_epoch}"),
        ("step", f"{handle.step}"),
        *([("schedule horizon", f"{handle.total_steps:,} steps")] if handle.total_steps else []),
        ("elapsed", f"{handle.elapsed:.1f} s"),
        ("stop reason", handle.stop_reason or "-"),
        ("parameters", f"{handle.param_count:,}"),
        *(
            [("parameter groups", ", ".join(f"{g.name} ({g.size:,})" for g in groups))]
            if groups
            else []
        ),
        *([("batch size", train.global_width)] if train is not None else []),
        *([("accumulation", f"{setup.accum} micro-batches a step")] if setup.accum > 1 else []),
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
    table = f"<table><caption>Nitro: {escape(handle.cls.__name__)}</caption>{body}</table>"
    return table + history_html(handle.history(), *handle.best_by)


def history_html(frame: Any, metric: str, mode: str, head: int = 3, tail: int = 8) -> str:
    """The history as a table, thinned for a long run (its first `head` epochs, its last
    `tail`, and the best one by `metric`, with a row saying how many are left out), the best
    epoch marked; "" before the first epoch."""
    from nitro.handle.plotting import best_row

    if frame.empty:
        return ""
    frame = frame.drop(columns=[c for c in TIMING_COLUMNS if c in frame])
    best = best_row(frame, metric, mode)
    shown = list(frame.index)
    if len(shown) > head + tail + 1:
        shown = sorted({*shown[:head], *shown[-tail:], *([best] if best is not None else [])})
    cells = "".join(f"<th>{escape(str(c))}</th>" for c in ["epoch", *frame.columns])
    lines, previous = [f"<tr>{cells}</tr>"], None
    for epoch in shown:
        position = frame.index.get_loc(epoch)
        if previous is not None and position > previous + 1:
            left = position - previous - 1
            lines.append(
                f"<tr><td colspan='{len(frame.columns) + 1}'>... {left} epochs ...</td></tr>"
            )
        previous = position
        values = [_cell(v) for v in frame.loc[epoch]]
        mark = f" &#9733; best {escape(metric)}" if epoch == best else ""
        style = " style='font-weight:bold'" if epoch == best else ""
        row = "".join(f"<td>{v}</td>" for v in [f"{epoch}{mark}", *values])
        lines.append(f"<tr{style}>{row}</tr>")
    return f"<table class='nitro-history'>{''.join(lines)}</table>"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return escape(str(value))
