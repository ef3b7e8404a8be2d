"""What the training loop says when something goes wrong: a slow data pipeline, a batch whose
shapes differ from the compiled ones, a non-finite step. Texts only: the loop decides when."""

from __future__ import annotations

from nitro.core.run_setup import RunSetup
from nitro.core.train_state import TrainState
from nitro.data import Prefetcher
from nitro.engine.feed import StepFeed
from nitro.errors import SetupError

__all__ = ["data_wait_advice", "divergence_message", "shape_error"]


def data_wait_advice(setup: RunSetup, prefetcher: Prefetcher) -> str:
    """What to change when the loop waited for the train split's `prefetcher`."""
    path = prefetcher.path
    if path == "inline":
        if prefetcher.inline:
            return (
                "The train split is wrapped in NoPrefetch: remove it so worker threads build "
                "batches ahead of the loop."
            )
        return "prefetch='inline' builds batches on the loop thread: use 'threads' or 'auto'."
    if path == "single":
        if setup.prefetch.workers == 1:
            return "Raise prefetch_workers (now 1) so several threads build batches."
        return (
            "One thread builds its batches: make the source index-addressable "
            "(begin_epoch/batch_at, see docs/data.md) so prefetch_workers threads build them "
            "in parallel, or do less work per batch."
        )
    if path == "processes":
        return (
            f"Raise prefetch_workers (now {setup.prefetch.workers} worker processes; more "
            f"than the cores do not help) or host_batches, or do less work per batch in "
            f"batch_at."
        )
    return (
        f"Raise prefetch_workers (now {setup.prefetch.workers}) or host_batches, or do "
        f"less work per batch in batch_at; if that work is Python (augmenting, decoding), "
        f"prefetch='processes' runs it in worker processes, in parallel."
    )


def shape_error(setup: RunSetup, staged, error) -> Exception:
    """Say which field of a training batch differs from the first batch (whose shapes and
    dtypes the train step was compiled for)."""
    from nitro.programs.compile_cache import short_dtype

    split = setup.splits["train"]

    def fmt(shape, dtype):
        return f"{short_dtype(str(dtype))}[{','.join(map(str, shape))}]"

    changes = []
    device = {
        name: (tuple(a.shape[1:]) if staged.stacked else tuple(a.shape), str(a.dtype))
        for name, a in staged.device.items()
    }
    for name, (shape, dtype) in split.batch_spec.items():
        if name not in device:
            continue
        if device[name] != (tuple(shape), dtype):
            changes.append(f"{name!r} {fmt(shape, dtype)} -> {fmt(*device[name])}")
    if not changes:
        return error
    only_rows = all(
        device[n][0][1:] == tuple(split.batch_spec[n][0][1:])
        and device[n][1] == split.batch_spec[n][1]
        for n in split.batch_spec
        if n in device
    )
    fix = (
        "this looks like a partial final batch: drop it (ArrayLoader(..., drop_last=True))"
        if only_rows
        else "make the loader yield the same shapes and dtypes on every batch (cast in the "
        "loader, e.g. x.astype(np.float32))"
    )
    return SetupError(
        f"train batch {staged.index} differs from the first batch, whose shapes and dtypes the "
        f"train step was compiled for: {'; '.join(changes)}. Every training batch must match; "
        f"{fix}."
    )


_STAGES = {
    1: "the training loss is {loss}",
    2: "a gradient is non-finite (the loss, {loss}, is finite)",
    3: "a scheduled hyperparameter is non-finite (the loss, {loss}, and the gradients are finite)",
    4: "the step is non-finite",
    5: "the weights after the step are non-finite (the loss, {loss}, is finite)",
}
_ADVICE = {
    1: "Lower the learning rate or check the data",
    2: "Look for sqrt, log, division or pow at 0 in the loss or the model (their gradients "
    "are infinite there), or lower the learning rate",
    3: "Check the optimizer's schedules at that step",
    5: "Look for a non-finite gradient or update in the train_step hook, or lower the "
    "learning rate",
}


def divergence_message(
    setup: RunSetup, feed: StepFeed, state: TrainState, index: int, loss: float, code: int
) -> str:
    what = _STAGES.get(code, _STAGES[4]).format(loss=loss)
    advice = _ADVICE.get(code, _ADVICE[1])
    if code == 3 and setup.optimizer is not None:
        values = feed.hyperparams_at(index)
        shown = ", ".join(f"{k} = {v:g}" for k, v in values.items())
        advice += f" ({shown} at step {index + 1})"
    if setup.precision is not None and setup.precision.scaled and code in (1, 2):
        advice = (
            "Under precision='float16' "
            + (
                "the forward pass may overflow float16's range (65504) before the loss: "
                if code == 1
                else "the gradient overflowed even at the smallest loss scale (1), so it is "
                "non-finite whatever the scale: "
            )
            + "train in precision='bfloat16' (float32's range), or look for large "
            "activations; else: " + advice[0].lower() + advice[1:]
        )
    return (
        f"{what} at step {index + 1} (epoch {state.epoch + 1}, batch {state.position + 1}). "
        f"The handle keeps the weights from before that step (n.step == {state.step}). "
        f"{advice}; check_divergence=False trains on regardless."
    )
