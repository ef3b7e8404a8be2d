"""A classifier's confusion matrix over a split, counted exactly from one evaluation pass,
and the per-class metrics it gives: precision, recall, F1 and support.

Rows are the true classes, columns the predicted ones (forward's top class). In a notebook
it shows as the counts table, the per-class table and a plot of the matrix.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Confusion"]


@dataclasses.dataclass
class Confusion:
    """`matrix[t, p]`: how many samples of true class `t` forward predicted as `p`.

    >>> c = Confusion(np.array([[3, 1], [0, 4]]), ("cat", "dog"), "val")
    >>> c.accuracy
    0.875
    >>> c.per_class().round(3).to_dict("index")["cat"]
    {'precision': 1.0, 'recall': 0.75, 'f1': 0.857, 'support': 4.0}
    """

    matrix: np.ndarray
    classes: Sequence[Any]
    split: str
    title: str = ""
    paths: list[str] = dataclasses.field(default_factory=list)  # the files written

    @functools.cached_property
    def figure(self):
        """The plot (`plot()`), drawn once."""
        return self.plot()

    @property
    def total(self) -> int:
        return int(self.matrix.sum())

    @property
    def accuracy(self) -> float:
        return float(np.trace(self.matrix) / max(self.total, 1))

    def table(self):
        """The counts as a pandas DataFrame: true classes down, predicted across."""
        import pandas as pd

        names = [str(c) for c in self.classes]
        return pd.DataFrame(
            self.matrix,
            index=pd.Index(names, name="true"),
            columns=pd.Index(names, name="predicted"),
        )

    def per_class(self):
        """Precision, recall, F1 and support of each class (a pandas DataFrame); a class
        never predicted (or never present) has precision (recall) 0."""
        import pandas as pd

        matrix = self.matrix.astype(np.float64)
        hits = np.diag(matrix)
        predicted, support = matrix.sum(0), matrix.sum(1)
        precision = np.divide(hits, predicted, out=np.zeros_like(hits), where=predicted > 0)
        recall = np.divide(hits, support, out=np.zeros_like(hits), where=support > 0)
        both = precision + recall
        f1 = np.divide(2 * precision * recall, both, out=np.zeros_like(hits), where=both > 0)
        return pd.DataFrame(
            {"precision": precision, "recall": recall, "f1": f1, "support": support},
            index=pd.Index([str(c) for c in self.classes], name="class"),
        )

    def most_confused(self, k: int = 5) -> list[tuple[Any, Any, int]]:
        """The `k` largest off-diagonal counts as (true, predicted, count), largest first."""
        off = self.matrix.copy()
        np.fill_diagonal(off, 0)
        order = np.argsort(off, axis=None)[::-1][:k]
        pairs = [np.unravel_index(i, off.shape) for i in order]
        return [
            (self.classes[t], self.classes[p], int(off[t, p])) for t, p in pairs if off[t, p] > 0
        ]

    def plot(self, path: str | None = None):
        """The matrix as a matplotlib figure, each cell with its count; saved when `path`."""
        import matplotlib.pyplot as plt

        size = len(self.classes)
        side = min(2.0 + 0.45 * size, 14.0)
        figure, ax = plt.subplots(figsize=(side, side), layout="constrained")
        try:
            ax.imshow(self.matrix, cmap="Blues")
            ticks = np.arange(size)
            names = [str(c) for c in self.classes]
            ax.set_xticks(ticks, names, rotation=90 if size > 10 else 0)
            ax.set_yticks(ticks, names)
            ax.set_xlabel("predicted")
            ax.set_ylabel("true")
            high = self.matrix.max() if self.matrix.size else 0
            if size <= 30:
                for (t, p), count in np.ndenumerate(self.matrix):
                    color = "white" if count > high / 2 else "black"
                    ax.text(p, t, str(count), ha="center", va="center", color=color, fontsize=8)
            ax.set_title(
                self.title or f"confusion on {self.split!r}: accuracy {self.accuracy:.3f}",
                fontsize="medium",
            )
            if path is not None:
                figure.savefig(path)
        finally:
            plt.close(figure)
        return figure

    def _repr_html_(self) -> str:
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png")
        image = base64.b64encode(buffer.getvalue()).decode()
        return (
            f"<div><img src='data:image/png;base64,{image}'/>"
            f"{self.table().to_html()}{self.per_class().round(3).to_html()}</div>"
        )

    def __repr__(self) -> str:
        return (
            f"Confusion({self.title or repr(self.split)}: {len(self.classes)} classes, "
            f"{self.total} samples, accuracy {self.accuracy:.3f})"
        )

    def __str__(self) -> str:
        return f"{self!r}\n{self.table().to_string()}\n\n{self.per_class().round(3).to_string()}"
