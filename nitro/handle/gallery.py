"""Samples drawn in one matplotlib figure: the experiment's `visualize` hook, or the default
views, in a grid titled with each sample's label and prediction.

`visualize(self, sample, output=None)` draws one sample (a dict of its fields, the batch axis
dropped) on the current matplotlib Axes (`plt.gca()`; a hook with an `ax` parameter gets it
as `ax=`), or returns an image array (H, W[, C]) that is shown there; `output` is forward's
output for the sample, None when only the data is shown. A title the hook leaves unset is
Nitro's: the label, the prediction and the loss. Without the hook: an image-like input field
(H, W), (H, W, C) or (C, H, W) as an image, a vector as bars, class logits as the top
classes under it. A hook that raises is reported once, with its line, and switched off for
the handle (the default view draws from then on) until its code changes.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["Gallery", "Roles", "Shown", "Visualizer", "draw_grid", "prediction_of"]

COLUMNS = 8  # the widest row of a grid


@dataclasses.dataclass(frozen=True)
class Roles:
    """Which fields of a split's samples are inputs (what forward takes) and which are the
    labels (what the loss takes besides)."""

    inputs: tuple[str, ...]
    labels: tuple[str, ...]

    @classmethod
    def of(cls, hook_fields: Mapping[str, tuple[str, ...]]) -> Roles:
        inputs = tuple(hook_fields.get("forward", ()))
        labels = tuple(f for f in hook_fields.get("loss", ()) if f not in inputs)
        return cls(inputs, labels)


@dataclasses.dataclass(frozen=True)
class Shown:
    """One sample to draw: its row in the split, its fields, forward's output for it (None
    in data mode) and its loss (None when not computed)."""

    index: int
    sample: Mapping[str, np.ndarray]
    output: Any = None
    loss: float | None = None


def _scalar(value: Any) -> Any:
    array = np.asarray(value)
    if array.size != 1:
        return None
    item = array.reshape(()).item()
    return item


def _text(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _is_logits(output: Any) -> bool:
    return isinstance(output, np.ndarray) and output.ndim == 1 and output.shape[0] > 1


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits.astype(np.float64) - logits.max())
    return shifted / shifted.sum()


def prediction_of(output: Any) -> Any:
    """The prediction an output stands for: the top class of logits, a scalar's value; None
    for anything else."""
    if _is_logits(output):
        return int(np.argmax(output))
    return _scalar(output) if isinstance(output, np.ndarray) else None


def _image(array: np.ndarray) -> np.ndarray | None:
    """`array` as an (H, W) or (H, W, C) image, or None when it does not look like one."""
    if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[2] not in (1, 3, 4):
        array = array.transpose(1, 2, 0)  # channels first
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 2 and min(array.shape) > 1:
        return array
    if array.ndim == 3 and array.shape[2] in (3, 4) and min(array.shape[:2]) > 1:
        low, high = float(array.min()), float(array.max())
        if array.dtype == np.uint8 or high <= 1.0 and low >= 0.0:
            return array
        return (array - low) / (high - low or 1.0)
    return None


def default_view(ax: Any, shown: Shown, roles: Roles) -> None:
    """The default drawing of a sample: its first image-like input as an image, else its
    first vector input as bars; class logits as the top classes under it."""
    drawn = False
    for name in roles.inputs or tuple(shown.sample):
        array = np.asarray(shown.sample.get(name))
        image = _image(array) if array.dtype.kind in "biuf" else None
        if image is not None:
            ax.imshow(image, cmap="gray" if image.ndim == 2 else None)
            drawn = True
            break
    if not drawn:
        for name in roles.inputs or tuple(shown.sample):
            array = np.asarray(shown.sample.get(name))
            if array.ndim == 1 and array.dtype.kind in "biuf":
                ax.bar(np.arange(array.shape[0]), array, width=1.0, color="0.4")
                drawn = True
                break
    ax.set_xticks([])
    ax.set_yticks([])
    if _is_logits(shown.output):
        probabilities = _softmax(shown.output)
        top = np.argsort(probabilities)[::-1][:3]
        ax.set_xlabel(
            "  ".join(f"{c} {probabilities[c]:.0%}" for c in top.tolist()), fontsize="x-small"
        )


def _title(ax: Any, shown: Shown, roles: Roles) -> None:
    label = _scalar(shown.sample.get(roles.labels[0])) if roles.labels else None
    parts, color = [], "black"
    if label is not None:
        parts.append(_text(label))
    if shown.output is not None:
        predicted = prediction_of(shown.output)
        if predicted is not None:
            parts.append(f"→ {_text(predicted)}")
            if label is not None and _is_logits(shown.output):
                color = "tab:green" if predicted == label else "tab:red"
    title = " ".join(parts) or f"#{shown.index}"
    if shown.loss is not None:
        title += f"\nloss {shown.loss:.3g}"
    ax.set_title(title, fontsize="small", color=color)


class Visualizer:
    """Draws samples with the experiment's `visualize` hook while it works: one that raises
    is reported once (`say`) with the line it raised on and switched off, the default view
    drawing instead, until the hook's code changes (an edit)."""

    def __init__(self) -> None:
        self.failed: Any = None  # the code object of the hook that raised

    def hook(self, experiment: Any) -> Callable[..., Any] | None:
        hook = getattr(experiment, "visualize", None)
        if hook is None or getattr(hook, "__code__", None) is self.failed:
            return None
        return hook

    def draw(
        self, ax: Any, experiment: Any, shown: Shown, roles: Roles, say, pyplot: bool = True
    ) -> None:
        hook = self.hook(experiment)
        if hook is not None:
            if pyplot:
                import matplotlib.pyplot as plt

                plt.sca(ax)
            takes_ax = "ax" in inspect.signature(hook).parameters
            try:
                sample = dict(shown.sample)
                if takes_ax:
                    drawn = hook(sample, shown.output, ax=ax)
                else:
                    drawn = hook(sample, shown.output)
                if isinstance(drawn, str):
                    ax.set_title(drawn, fontsize="small")
                elif drawn is not None:
                    image = np.asarray(drawn)
                    ax.imshow(image if _image(image) is None else _image(image), cmap="gray")
                    ax.set_xticks([])
                    ax.set_yticks([])
            except Exception as error:  # noqa: BLE001 - a drawing hook never stops the run
                self.failed = hook.__code__
                say(_failure(hook, error))
                ax.clear()
            else:
                if not ax.get_title():
                    _title(ax, shown, roles)
                return
        default_view(ax, shown, roles)
        _title(ax, shown, roles)


def _failure(hook: Any, error: Exception) -> str:
    """`visualize raised ...` naming the hook's line that raised (else the last line run)."""
    frames = traceback.extract_tb(error.__traceback__)
    code = hook.__code__
    mine = [f for f in frames if f.filename == code.co_filename and f.name == code.co_name]
    frame = (mine or frames)[-1]
    line = f" at {frame.filename}:{frame.lineno}" + (f": `{frame.line}`" if frame.line else "")
    return (
        f"visualize raised {type(error).__name__}: {error}{line}. It is switched off for this "
        f"handle and the default view draws the samples; fix it and the next render uses it"
    )


@dataclasses.dataclass
class Gallery:
    """Samples drawn in one figure (`figure`), shown inline in a notebook; `rows`: each
    sample's index in the split, label, prediction and loss; `paths`: the files written."""

    figure: Any
    title: str
    rows: list[dict[str, Any]]
    paths: list[str] = dataclasses.field(default_factory=list)

    def png(self) -> bytes:
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png")
        return buffer.getvalue()

    def _repr_png_(self) -> bytes:
        return self.png()

    def table(self):
        """The samples as a pandas DataFrame indexed by their row in the split."""
        import pandas as pd

        return pd.DataFrame(self.rows).set_index("index")

    def __repr__(self) -> str:
        where = f"; written to {', '.join(self.paths)}" if self.paths else ""
        return f"Gallery({self.title}: {len(self.rows)} samples{where})"


def draw_grid(
    shown: Sequence[Shown],
    roles: Roles,
    title: str,
    experiment: Any,
    visualizer: Visualizer,
    say: Callable[[str], None],
    pyplot: bool = True,
) -> Gallery:
    """One figure of `shown`, a grid of at most `COLUMNS` a row, each drawn by `visualizer`.
    `pyplot` False: with matplotlib's object API alone, safe off the main thread (a hook then
    draws on its `ax` or returns an image; `plt.gca()` is not its cell)."""
    count = max(len(shown), 1)
    columns = min(count, COLUMNS)
    rows = -(-count // columns)
    size = {"figsize": (1.9 * columns, 2.2 * rows), "layout": "constrained"}
    if pyplot:
        import matplotlib.pyplot as plt

        figure = plt.figure(**size)
    else:
        from matplotlib.figure import Figure

        figure = Figure(**size)
    try:
        cells = figure.subplots(rows, columns, squeeze=False).ravel().tolist()
        for ax, one in zip(cells, shown, strict=False):
            visualizer.draw(ax, experiment, one, roles, say, pyplot)
        for ax in cells[len(shown) :]:
            ax.axis("off")
        figure.suptitle(title, fontsize="medium")
    finally:
        if pyplot:
            plt.close(figure)  # drawn here, shown by the Gallery: never twice by pyplot
    table = []
    for one in shown:
        row: dict[str, Any] = {"index": one.index}
        for name in roles.labels:
            row[name] = _scalar(one.sample.get(name))
        if one.output is not None:
            row["prediction"] = prediction_of(one.output)
        if one.loss is not None:
            row["loss"] = one.loss
        table.append(row)
    return Gallery(figure, title, table)
