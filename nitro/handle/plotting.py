"""History plots (matplotlib, imported only when a plot is drawn)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nitro.core.train_state import TIMING_COLUMNS

__all__ = ["best_row", "plot_history"]

_SKIP = {"step", *TIMING_COLUMNS}


def swap_epochs(frame, swaps: Iterable[Mapping[str, Any]]) -> list[tuple[float, str, bool]]:
    """(where on the epoch axis, label, rolled back) of each live edit's swap: its step placed
    between the epochs' end steps of the history."""
    import numpy as np

    ends = [0.0, *frame["step"].astype(float)] if "step" in frame else [0.0]
    epochs = [0.0, *map(float, frame.index)] if "step" in frame else [0.0]
    marks = []
    for row in swaps:
        changed = ", ".join(row.get("changed") or []) or "code"
        rolled = row.get("status") == "rolled back"
        label = f"edit: {changed}" + (" (rolled back)" if rolled else "")
        marks.append((float(np.interp(float(row["step"]), ends, epochs)), label, rolled))
    return marks


def best_row(frame, metric: str, mode: str) -> Any:
    """The index (epoch) of the history's best row by `metric` ("min" or "max"), or None
    when no row has a value of it."""
    if metric not in frame:
        return None
    series = frame[metric].dropna()
    if series.empty:
        return None
    return series.idxmin() if mode == "min" else series.idxmax()


def plot_history(
    frame,
    path=None,
    metrics: Iterable[str] | None = None,
    title: str = "",
    swaps: Iterable[Mapping[str, Any]] = (),
    best: tuple[str, str] | None = None,
):
    """One panel per quantity: the loss with its validation counterpart, then each metric;
    a dashed line at each live edit's swap (`swaps`: the rows of `n.state.swaps`), labelled
    with what changed; a dotted line at the best epoch by `best` (metric, "min" or "max"),
    its point starred.

    Returns the matplotlib Figure; writes a PNG when `path` is given.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'nitro[plot]'") from error
    if frame.empty:
        raise ValueError("the history is empty: train at least one epoch first")
    columns = [c for c in frame.columns if c not in _SKIP]
    if metrics is not None:
        wanted = set(metrics)
        unknown = wanted - set(columns)
        if unknown:
            raise KeyError(f"no history column {sorted(unknown)}; columns: {columns}")
        columns = [c for c in columns if c in wanted]
    groups: dict[str, list[str]] = {}
    for column in columns:
        base = column
        for prefix in ("val_", "test_"):
            if column.startswith(prefix):
                base = column[len(prefix) :]
        groups.setdefault(base, []).append(column)
    marks = swap_epochs(frame, swaps)
    best_epoch = best_row(frame, *best) if best is not None else None
    figure = Figure(figsize=(4.2 * len(groups), 3.2), layout="constrained")
    axes = figure.subplots(1, len(groups), squeeze=False)[0]
    for ax, (base, names) in zip(axes, groups.items(), strict=True):
        for name in names:
            series = frame[name].dropna()
            ax.plot(series.index, series.values, marker="o", markersize=3, label=name)
        for at, label, rolled in marks:
            color = "tab:red" if rolled else "0.4"
            ax.axvline(at, linestyle="--", linewidth=1, color=color, gid="live-edit")
            ax.annotate(
                label,
                (at, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color=color,
            )
        if best_epoch is not None:
            assert best is not None
            ax.axvline(best_epoch, linestyle=":", linewidth=1, color="tab:green", gid="best-epoch")
            if best[0] in names:
                ax.plot(
                    [best_epoch],
                    [frame[best[0]][best_epoch]],
                    marker="*",
                    markersize=12,
                    color="tab:green",
                    linestyle="none",
                    label=f"best {best[0]}",
                )
        ax.set_xlabel("epoch")
        ax.set_title(base)
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        figure.suptitle(title)
    if path is not None:
        figure.savefig(path, dpi=100)
    return figure
