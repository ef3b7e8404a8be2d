"""Prediction: a batch dict through the predict program, in chunks of one compiled width.

A batch of any size is split into chunks of the width the predict program is compiled for
(an evaluation split's batch width, else the first prediction's size), the last one padded;
each chunk's outputs come back to host numpy and the padded rows are dropped, so a new batch
size compiles nothing new. A stop request ends it cleanly between chunks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from nitro.core.run_setup import RunSetup
from nitro.core.train_state import TrainState
from nitro.data import pad_batch
from nitro.engine.evaluation import delete, weights_of
from nitro.engine.run_time import RunTime
from nitro.engine.runner import RunControl
from nitro.engine.setup import batch_size
from nitro.errors import Interrupted
from nitro.programs.specs import ProgramSet

__all__ = ["check_batches", "predict_batch", "prediction_width"]


def check_batches(setup: RunSetup, batches: Any) -> None:
    """Refuse what is neither a dict of batch fields nor an iterable of such dicts."""
    if isinstance(batches, (np.ndarray, jax.Array)) or not isinstance(batches, Iterable):
        forward = setup.experiment.hook_fields["forward"]
        raise TypeError(
            f"predict takes a dict of batch fields (forward needs: {forward.describe()}) or "
            f"an iterable of such dicts; got {type(batches).__name__}. For example: "
            f"n.predict({{'{(forward.required or ('x',))[0]}': xs}})"
        )


def prediction_width(setup: RunSetup, rows: int, serving_width: int | None) -> int:
    """The compiled width predictions are padded or split to: an evaluation split's batch
    width, else the width of the first prediction (`serving_width`, or `rows` for the first)."""
    splits = setup.splits
    for name in ("val", "test", "train", *splits):
        if name in splits:
            return splits[name].global_width
    return rows if serving_width is None else serving_width


def predict_batch(
    setup: RunSetup,
    runtime: RunTime,
    state: TrainState,
    programs: ProgramSet,
    control: RunControl,
    batch: Mapping[str, Any],
    weights: str | None = None,
    *,
    serving_width: int | None = None,
) -> tuple[Any, int]:
    """`forward`'s outputs for every row of `batch`, as host numpy, and the width it ran at
    (pass it back as `serving_width`, so later batch sizes compile nothing new)."""
    variables = weights_of(setup, state, weights)
    fields = setup.experiment.hook_fields["forward"].resolve(tuple(batch), "predict")
    host = {k: np.asarray(batch[k]) for k in fields}
    n = batch_size(host, "predict")
    width = prediction_width(setup, max(n, 1), serving_width)
    chunks = []
    for start in range(0, max(n, 1), width):
        if control.stop.is_set():
            raise Interrupted(
                f"predict was interrupted after {start} of {n} rows; it stopped cleanly "
                f"between chunks"
            )
        part = {k: v[start : start + width] for k, v in host.items()}
        if n == 0:  # no rows: run one zero batch for the outputs' trailing shapes
            part = {k: np.zeros((1, *v.shape[1:]), v.dtype) for k, v in host.items()}
        part, n_real = pad_batch(part, width)
        device = setup.placement.put_batch(setup.placement.local_rows(part))
        args = (variables, runtime.feed.current_device(), device, np.int32(n_real))
        result = programs.predict(width, fields, args)(*args)
        outputs = setup.placement.gather(result.outputs)
        delete(result)
        delete(device)
        keep = n_real if n else 0
        chunks.append(jax.tree.map(lambda a, k=keep: np.asarray(a)[:k], outputs))
    if len(chunks) == 1:
        return chunks[0], width
    return jax.tree.map(lambda *parts: np.concatenate(parts, axis=0), *chunks), width
