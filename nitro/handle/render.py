"""What a handle's model does to samples: `render` (a grid of samples with their labels and
predictions, inline, to files or to the loggers), `show_batch` (the data alone), `top_losses`
and `confusion`.

Data mode reads the split's source on the host and compiles nothing. Predictions, losses and
counts come from one pass of the evaluation program validation runs (`sample_pass`): on a
handle that validated, nothing compiles. A population answers per member.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nitro.data.loaders import is_one_shot
from nitro.data.prefetch import _source_iterator
from nitro.engine.sample_pass import sample_pass
from nitro.engine.sample_rows import SampleRows
from nitro.errors import SetupError
from nitro.handle.confusion import Confusion
from nitro.handle.gallery import Gallery, Roles, Shown, Visualizer, draw_grid

__all__ = ["confusion", "render", "show_batch", "top_losses"]

IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def _members(handle: Any) -> int | None:
    """A population's member count; None for a run."""
    members = handle._trainees()[0]
    return members.count if members.stacked else None


def _check_count(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _pass(handle: Any, split: str, take, batches: int | None, weights: str | None) -> None:
    """One pass of the eval program over `split`, held as evaluation holds the handle."""
    handle._check_stale("render")
    with handle._held(f"rendering {split}"):
        handle._lead_setup.split(split)
        members, state = handle._trainees()
        try:
            done = sample_pass(
                handle._lead_setup,
                handle._lead_runtime,
                state,
                handle._programs,
                handle._control,
                split,
                take,
                batches=batches,
                weights=weights,
                members=members,
            )
        finally:
            handle._lead_runtime.prefetcher(split).release_workers()
    if not done:
        from nitro.errors import Interrupted

        raise Interrupted(f"the pass over {split!r} was interrupted; it showed nothing")


def _data_rows(handle: Any, split: str, batches: int, samples: int) -> list[SampleRows]:
    """The first batches of `split` as its source gives them, on the host: no program, no
    device transfer."""
    source = handle._lead_setup.split(split).source
    if is_one_shot(source):
        raise SetupError(
            f"show_batch reads the {split!r} split from its source, and that source is an "
            f"iterator: reading it would take batches the run needs. Give the split as "
            f"something iterable again (a list, an ArrayLoader, nitro.data.FromFactory(fn))"
        )
    rows, start = [], 0
    for count, (_, batch) in enumerate(_source_iterator(source, 0, 0)):
        if count >= batches or start >= samples:
            break
        fields = {k: np.asarray(v) for k, v in dict(batch).items()}
        rows.append(SampleRows(fields, None, None, start))
        start += rows[-1].rows
    return rows


def _shown(rows: Sequence[SampleRows], samples: int, member: int | None) -> list[Shown]:
    out: list[Shown] = []
    for part in rows:
        for i in range(part.rows):
            if len(out) >= samples:
                return out
            outputs, losses = part.outputs, part.losses
            if member is not None:
                outputs = None if outputs is None else jax.tree.map(lambda a: a[member], outputs)
                losses = None if losses is None else losses[member]
            output = None if outputs is None else jax.tree.map(lambda a, i=i: a[i], outputs)
            loss = None if losses is None else float(losses[i])
            sample = {k: v[i] for k, v in part.fields.items()}
            out.append(Shown(part.start + i, sample, output, loss))
    return out


def _visualizer(handle: Any) -> Visualizer:
    if handle._visualizer is None:
        handle._visualizer = Visualizer()
    return handle._visualizer


def _draw(handle: Any, shown: list[Shown], split: str, title: str) -> Gallery:
    roles = Roles.of(handle._lead_setup.split(split).hook_fields)
    return draw_grid(
        shown, roles, title, handle._lead_runtime.experiment, _visualizer(handle), handle._say
    )


def _logger(handle: Any, member: int | None) -> Any:
    """The logger a figure of the run (or of a population's `member`) goes to: a run not
    trained yet opens its directory and binds its loggers to it first, as training would."""
    logging = getattr(handle, "_logging", None)
    if member is not None and logging is not None and logging.reporters:
        logging = logging.reporters[member]
        if logging._bound is None:
            raise SetupError(
                "render(where='logger') of a population's member logs to the member's run, "
                "which exists once the population has trained: train it first"
            )
    if logging is None:
        raise SetupError(
            "render(where='logger') sends the figure to the run's loggers, and this "
            "handle logs nothing: build it with logger=nitro.loggers.TensorBoardLogger() "
            "(or MLflowLogger, WandbLogger, a list of them), or give where= a directory"
        )
    from nitro.loggers import BaseLogger

    kinds = [type(one) for one in logging.logger.loggers]
    if all(getattr(kind, "log_figure", None) in (None, BaseLogger.log_figure) for kind in kinds):
        raise SetupError(
            f"render(where='logger'): the run's loggers "
            f"({', '.join(kind.__name__ for kind in kinds)}) store no images; add one that "
            f"does, logger=[nitro.loggers.JSONLinesLogger(), nitro.loggers.TensorBoardLogger()] "
            f"(or MLflowLogger, WandbLogger), or give where= a directory"
        )
    if logging._bound is None:
        handle._files.open(handle._lead_setup, handle._events)
        logging.start_run(handle, handle.target_epoch)
    return logging.logger


def _deliver(handle: Any, gallery: Any, where: Any, name: str, member: int | None = None) -> Any:
    """Send the figure of `gallery` (a `Gallery` or a `Confusion`) `where` it goes:
    "inline" (returned, shown by the notebook), "logger" (each of the run's loggers that
    stores images; a confusion also as the loggers' confusion matrix), a file name with an
    image suffix, or a directory (`<name>_step<step>.png` in it); or a list of them."""
    places = [where] if isinstance(where, (str, os.PathLike)) else list(where)
    for place in places:
        if place == "inline":
            continue
        if place == "logger":
            logger = _logger(handle, member)
            logger.log_figure(name, gallery.figure, step=handle.step)
            if isinstance(gallery, Confusion):
                logger.log_confusion(gallery.matrix, list(gallery.classes), epoch=handle.epoch)
            logger.flush()
            if not handle.running:  # a logger run it reopened (W&B's) ends again, written
                logger.finish(handle.stop_reason or "completed")
            continue
        if not isinstance(place, (str, os.PathLike)):
            raise TypeError(
                f"where takes 'inline', 'logger', a file or directory path, or a list of "
                f"them; got {type(place).__name__}"
            )
        path = Path(place)
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            path.mkdir(parents=True, exist_ok=True)
            path = path / f"{name.replace('/', '_')}_step{handle.step}.png"
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
        gallery.figure.savefig(path)
        gallery.paths.append(str(path))
    return gallery


def _title(handle: Any, split: str, what: str, member: int | None) -> str:
    who = handle.cls.__name__ + (f" member {member}" if member is not None else "")
    return f"{who} · {split!r} · step {handle.step} · {what}"


def render(
    handle: Any,
    split: str = "val",
    batches: int = 1,
    predictions: bool = True,
    where: Any = "inline",
    samples: int = 16,
    member: int | None = None,
    weights: str | None = None,
) -> Any:
    """See `RunHandle.render`."""
    _check_count("batches", batches)
    _check_count("samples", samples)
    if not predictions:
        shown = _shown(_data_rows(handle, split, batches, samples), samples, None)
        gallery = _draw(handle, shown, split, _title(handle, split, "data", None))
        return _deliver(handle, gallery, where, f"batch/{split}")
    rows: list[SampleRows] = []
    seen = [0]

    def take(part: SampleRows) -> None:
        if seen[0] < samples:
            rows.append(part)
        seen[0] += part.rows

    _pass(handle, split, take, batches, weights)
    galleries = []
    for one in _each_member(handle, member):
        shown = _shown(rows, samples, one)
        title = _title(handle, split, "predictions", one)
        gallery = _draw(handle, shown, split, title)
        name = f"render/{split}" + (f"/member_{one}" if one is not None else "")
        galleries.append(_deliver(handle, gallery, where, name, one))
    return _answer(handle, member, galleries)


def _answer(handle: Any, member: int | None, items: list) -> Any:
    """A run's one item; a population's list, one per member (one member's: its item)."""
    return items if member is None and _members(handle) is not None else items[0]


def _each_member(handle: Any, member: int | None) -> list[int | None]:
    count = _members(handle)
    if count is None:
        if member is not None:
            raise ValueError(f"member={member!r} is for a population; this handle is one run")
        return [None]
    if member is None:
        return list(range(count))
    if isinstance(member, bool) or not isinstance(member, int) or not 0 <= member < count:
        raise ValueError(f"member must be an int in 0..{count - 1}, got {member!r}")
    return [member]


def show_batch(
    handle: Any, split: str = "train", samples: int = 16, where: Any = "inline"
) -> Gallery:
    """See `RunHandle.show_batch`."""
    return render(handle, split, batches=1, predictions=False, where=where, samples=samples)


def top_losses(
    handle: Any,
    k: int = 9,
    split: str = "val",
    where: Any = "inline",
    member: int | None = None,
    weights: str | None = None,
) -> Any:
    """See `RunHandle.top_losses`."""
    _check_count("k", k)
    members = _each_member(handle, member)
    heaps: dict[int | None, list] = {one: [] for one in members}
    coupled = [False]

    def take(part: SampleRows) -> None:
        if part.losses is None:
            coupled[0] = True
            return
        for one in members:
            losses = part.losses if one is None else part.losses[one]
            heap = heaps[one]
            for i in np.argsort(losses)[::-1][:k].tolist():
                item = (float(losses[i]), -(part.start + i))
                if len(heap) < k:
                    heapq.heappush(heap, (*item, _row(part, i, one)))
                elif item > heap[0][:2]:
                    heapq.heapreplace(heap, (*item, _row(part, i, one)))

    _pass(handle, split, take, None, weights)
    if coupled[0]:
        raise SetupError(
            f"top_losses ranks samples by their own loss, and the loss hook of "
            f"{handle.cls.__name__} couples the samples of a batch (it cannot be applied to a "
            f"batch of one): write it as a mean of per-sample terms"
        )
    galleries = []
    for one in members:
        ranked = sorted(heaps[one], key=lambda e: (-e[0], -e[1]))
        shown = [entry[2] for entry in ranked]
        title = _title(handle, split, f"top {k} losses", one)
        gallery = _draw(handle, shown, split, title)
        name = f"top_losses/{split}" + (f"/member_{one}" if one is not None else "")
        galleries.append(_deliver(handle, gallery, where, name, one))
    return _answer(handle, member, galleries)


def _row(part: SampleRows, i: int, member: int | None) -> Shown:
    outputs = part.outputs if member is None else jax.tree.map(lambda a: a[member], part.outputs)
    losses = part.losses if member is None else part.losses[member]
    sample = {k: np.array(v[i]) for k, v in part.fields.items()}
    output = jax.tree.map(lambda a: np.array(a[i]), outputs)
    return Shown(part.start + i, sample, output, float(losses[i]))


def confusion(
    handle: Any,
    split: str = "val",
    labels: str | None = None,
    classes: Sequence[Any] | None = None,
    member: int | None = None,
    weights: str | None = None,
    where: Any = "inline",
) -> Any:
    """See `RunHandle.confusion`."""
    setup = handle._lead_setup
    roles = Roles.of(setup.split(split).hook_fields)
    label = labels if labels is not None else _label_field(handle, split, roles)
    members = _each_member(handle, member)
    counts: dict[int | None, np.ndarray] = {}

    def take(part: SampleRows) -> None:
        if label not in part.fields:
            raise SetupError(
                f"confusion(labels={label!r}): the {split!r} split's batches have no field "
                f"{label!r}; they have {', '.join(map(repr, part.fields))}"
            )
        truth = np.asarray(part.fields[label])
        if truth.ndim != 1 or truth.dtype.kind not in "biu":
            raise SetupError(
                f"confusion counts integer class labels, one per sample; field {label!r} is "
                f"{truth.dtype}{list(truth.shape)}: name the label field with labels=..."
            )
        for one in members:
            outputs = (
                part.outputs
                if one is None
                else jax.tree.map(lambda a, one=one: a[one], part.outputs)
            )
            logits = _logits(handle, outputs)
            width = logits.shape[-1]
            matrix = counts.setdefault(one, np.zeros((width, width), np.int64))
            predicted = logits.argmax(-1)
            if truth.size and (truth.min() < 0 or truth.max() >= width):
                raise SetupError(
                    f"confusion: label field {label!r} holds class {int(truth.max())} but "
                    f"forward scores {width} classes (0..{width - 1})"
                )
            np.add.at(matrix, (truth, predicted), 1)

    _pass(handle, split, take, None, weights)
    out = []
    for one in members:
        matrix = counts.get(one, np.zeros((0, 0), np.int64))
        names = list(range(len(matrix))) if classes is None else list(classes)
        if len(names) != len(matrix):
            raise ValueError(
                f"classes names {len(names)} classes, but forward scores {len(matrix)}"
            )
        who = handle.cls.__name__ + (f" member {one}" if one is not None else "")
        result = Confusion(matrix, tuple(names), split)
        result.title = f"{who} on {split!r}: accuracy {result.accuracy:.3f}"
        name = f"confusion/{split}" + (f"/member_{one}" if one is not None else "")
        out.append(_deliver(handle, result, where, name, one))
    return _answer(handle, member, out)


def _label_field(handle: Any, split: str, roles: Roles) -> str:
    """The label field: the one field the loss takes besides forward's inputs whose batches
    are integers of one value a sample."""
    spec = handle._lead_setup.split(split).batch_spec
    found = [
        name
        for name in roles.labels
        if name in spec and len(spec[name][0]) == 1 and np.dtype(spec[name][1]).kind in "biu"
    ]
    if len(found) != 1:
        raise SetupError(
            f"confusion needs the field of class labels: the loss of {handle.cls.__name__} "
            f"takes {', '.join(map(repr, roles.labels)) or 'no field'} besides forward's "
            f"inputs, {'none' if not found else 'several'} of them integers of one value a "
            f"sample; name it with confusion(labels='y')"
        )
    return found[0]


def _logits(handle: Any, outputs: Any) -> np.ndarray:
    if isinstance(outputs, np.ndarray) and outputs.ndim == 2:
        return outputs
    shape = jax.tree.map(lambda a: list(np.shape(a)), outputs)
    raise SetupError(
        f"confusion needs forward to return class scores, an array [batch, classes]; "
        f"forward of {handle.cls.__name__} returns {shape}"
    )
