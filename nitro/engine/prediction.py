"""Prediction: a batch dict through the predict program, in chunks of one compiled width.

A batch is split into chunks of one width, the last one padded (repeating its last row); each
chunk's outputs come back to host numpy and the padded rows are dropped. The width is an
evaluation split's batch width when the handle has splits (one program, at a width known to
fit), else the request's own bucket: its row count rounded up to a power of two, at most
`MAX_PREDICT_WIDTH` (as `nitro serve` pads). So the width depends on the request alone, never
on earlier calls, and a handle compiles at most one predict program per bucket
(log2(MAX_PREDICT_WIDTH) + 1 of them) however many batch sizes it sees. A stop request ends it
cleanly between chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from nitro.core.run_setup import RunSetup
from nitro.core.train_state import TrainState
from nitro.data import pad_batch
from nitro.engine.evaluation import delete, weights_of
from nitro.engine.member_axis import SINGLE
from nitro.engine.run_time import RunTime
from nitro.engine.runner import RunControl
from nitro.engine.setup import batch_size
from nitro.errors import Interrupted, SetupError
from nitro.programs.specs import ProgramSet

__all__ = [
    "check_batches",
    "MAX_PREDICT_WIDTH",
    "check_fields",
    "in_chunks",
    "input_spec",
    "predict_batch",
    "prediction_width",
    "shape_mismatch",
    "width_bucket",
]

MAX_PREDICT_WIDTH = 1024  # the widest bucket; `nitro serve --max-batch` defaults to the same


def check_batches(setup: RunSetup, batches: Any) -> None:
    """Refuse what is neither a dict of batch fields nor an iterable of such dicts (a string
    is iterable, of characters: refused too)."""
    if isinstance(batches, (np.ndarray, jax.Array, str, bytes)) or not isinstance(
        batches, Iterable
    ):
        forward = setup.experiment.hook_fields["forward"]
        raise TypeError(
            f"predict takes a dict of batch fields (forward needs: {forward.describe()}) or "
            f"an iterable of such dicts; got {type(batches).__name__}. For example: "
            f"n.predict({{'{(forward.required or ('x',))[0]}': xs}})"
        )


def input_spec(setup: RunSetup, field: str) -> tuple[tuple[int, ...], str, str] | None:
    """The shape (the batch axis first) and dtype a split's batches give `field`, and the
    split's name; None when no split holds it (a handle built with data={})."""
    splits = setup.splits
    for name in dict.fromkeys(("val", "test", "train", *splits)):
        if name in splits and field in splits[name].batch_spec:
            shape, dtype = splits[name].batch_spec[field]
            return tuple(shape), dtype, name
    return None


def _wanted(setup: RunSetup, name: str) -> tuple[tuple[int, ...], str] | None:
    """The shape the splits' batches give field `name` and its description, or None."""
    spec = input_spec(setup, name)
    if spec is None:
        return None
    shape, dtype, split = spec
    trailing = "".join(f", {d}" for d in shape[1:])
    return shape, (
        f"{dtype}[batch{trailing}], the batch axis first, as the {split!r} split's batches give it"
    )


def _got(array: np.ndarray) -> str:
    numeric = array.dtype.kind in "biufc"
    return f"{array.dtype.name if numeric else array.dtype}{list(array.shape)}"


def check_fields(setup: RunSetup, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The fields forward takes as host arrays, refused (SetupError, naming the field, the
    shape and dtype the splits give it, and the fix) when they cannot be forward's input:
    not an array of numbers, or not of the rank of the splits' batches (one example without
    its batch axis). A different trailing shape is let through: a forward may take several
    (a sequence length); `shape_mismatch` explains it if forward then fails on it."""
    host = {}
    for name, value in batch.items():
        wanted = _wanted(setup, name)
        give = f"; give {wanted[1]}" if wanted else "; encode it as numbers"
        try:
            array = np.asarray(value)
        except (TypeError, ValueError) as error:
            raise SetupError(
                f"predict: batch[{name!r}] cannot be read as an array ({error})"
                + (f"; give {wanted[1]}" if wanted else "")
            ) from None
        if array.dtype.kind not in "biufc":
            what = {"U": "strings", "S": "bytes", "O": "Python objects"}.get(
                array.dtype.kind, array.dtype.name
            )
            raise SetupError(
                f"predict: batch[{name!r}] holds {what} ({_got(array)}), but forward runs on "
                f"the device, which takes numbers and booleans only{give}"
            )
        if wanted is not None and array.ndim != len(wanted[0]):
            shape = wanted[0]
            if array.shape == shape[1:]:
                fix = f"For a single example, add the batch axis: {{{name!r}: {name}[None]}}"
            elif array.ndim == 0:
                fix = "Give an array, with the batch axis first."
            else:
                fix = f"Reshape it to [rows{''.join(f', {d}' for d in shape[1:])}]."
            raise SetupError(
                f"predict: batch[{name!r}] must be {wanted[1]}; got {_got(array)}. {fix}"
            )
        host[name] = array
    return host


def shape_mismatch(
    setup: RunSetup, host: Mapping[str, np.ndarray], error: Exception
) -> SetupError | None:
    """forward failed to trace: when a field's trailing shape differs from the splits'
    batches, the error that names it (the raw error is its cause); else None."""
    for name, array in host.items():
        wanted = _wanted(setup, name)
        if wanted is not None and array.shape[1:] != wanted[0][1:]:
            cause = f"{type(error).__name__}: {str(error).rstrip('.')}"
            return SetupError(
                f"predict: batch[{name!r}] must be {wanted[1]}; got {_got(array)}, and forward "
                f"fails on it ({cause}). Each example must be {list(wanted[0][1:])}, not "
                f"{list(array.shape[1:])}: give the features the model was trained on."
            )
    return None


def width_bucket(rows: int, devices: int = 1, cap: int = MAX_PREDICT_WIDTH) -> int:
    """The compiled width for a request of `rows` rows: the power of two at or above it, at
    most `cap`, rounded up to a multiple of `devices` (the batch axis is split over them).

    >>> [width_bucket(rows) for rows in (1, 7, 8, 300, 1024, 5000)]
    [1, 8, 8, 512, 1024, 1024]
    >>> width_bucket(3, devices=6)
    6
    """
    width = min(1 << (max(rows, 1) - 1).bit_length(), cap)
    return -(-width // devices) * devices


def prediction_width(setup: RunSetup, rows: int) -> int:
    """The compiled width a prediction of `rows` rows is padded or split to: an evaluation
    split's batch width, else the request's bucket (`width_bucket`)."""
    splits = setup.splits
    for name in ("val", "test", "train", *splits):
        if name in splits:
            return splits[name].global_width
    return width_bucket(rows, setup.placement.n_devs)


def predict_batch(
    setup: RunSetup,
    runtime: RunTime,
    state: TrainState,
    programs: ProgramSet,
    control: RunControl,
    batch: Mapping[str, Any],
    weights: str | None = None,
    members: Any = SINGLE,
) -> Any:
    """`forward`'s outputs for every row of `batch`, as host numpy: `ceil(rows / width)`
    device calls of one compiled width (`prediction_width`), whatever ran before. With
    `members` (a `Stacked` members object), every member's, with a leading member axis
    (`[members, rows, ...]`), from one vmapped forward per chunk."""
    stacked = members.stacked
    variables = weights_of(setup, state, weights)
    fields = setup.experiment.hook_fields["forward"].resolve(tuple(batch), "predict")
    host = check_fields(setup, {k: batch[k] for k in fields})
    feed = members.feed(runtime)
    values = feed.current_device() if stacked else None  # stacked once: one transfer

    def run(part: Mapping[str, np.ndarray], n_real: int, width: int) -> Any:
        device = setup.placement.put_batch(setup.placement.local_rows(part))
        fed = values if stacked else feed.current_device()
        args = (variables, fed, device, np.int32(n_real))
        try:
            result = programs.predict(width, fields, args)(*args)
        except (TypeError, ValueError) as error:
            explained = shape_mismatch(setup, host, error)
            if explained is None:
                raise
            raise explained from error
        outputs = setup.placement.gather(result.outputs)
        delete(result)
        delete(device)
        return outputs

    try:
        return in_chunks(setup, control, host, run, axis=1 if stacked else 0)
    finally:
        if stacked:
            delete(values)


def in_chunks(
    setup: RunSetup,
    control: RunControl,
    host: Mapping[str, np.ndarray],
    run: Callable[[Mapping[str, np.ndarray], int, int], Any],
    axis: int = 0,
) -> Any:
    """`run(chunk, real rows, width)` over `host` in chunks of one compiled width
    (`prediction_width`), the last one padded; the outputs' padded rows dropped and the
    chunks joined on their rows' `axis` (1 when a leading member axis comes first)."""
    n = batch_size(host, "predict")
    width = prediction_width(setup, n)
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
        outputs = run(part, n_real, width)
        keep = n_real if n else 0
        rows = (slice(None),) * axis + (slice(0, keep),)
        chunks.append(jax.tree.map(lambda a, rows=rows: np.asarray(a)[rows], outputs))
    if len(chunks) == 1:
        return chunks[0]
    return jax.tree.map(lambda *parts: np.concatenate(parts, axis=axis), *chunks)
