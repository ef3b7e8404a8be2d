"""History plots (matplotlib, imported only when a plot is drawn)."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["plot_history"]

_SKIP = {"step", "epoch_seconds", "data_wait_frac"}


def plot_history(frame, path=None, metrics: Iterable[str] | None = None, title: str = ""):
    """One panel per quantity: the loss with its validation counterpart, then each metric.

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
    figure = Figure(figsize=(4.2 * len(groups), 3.2), layout="constrained")
    axes = figure.subplots(1, len(groups), squeeze=False)[0]
    for ax, (base, names) in zip(axes, groups.items(), strict=True):
        for name in names:
            series = frame[name].dropna()
            ax.plot(series.index, series.values, marker="o", markersize=3, label=name)
        ax.set_xlabel("epoch")
        ax.set_title(base)
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        figure.suptitle(title)
    if path is not None:
        figure.savefig(path, dpi=100)
    return figure
