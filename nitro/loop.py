"""The training and evaluation loops, with lagged read-back and per-batch freeing.

The loss of step k is read back while the device runs step k+1, which also bounds the steps
in flight. Once a step's loss is read back, that step's batch buffers are deleted; an eval
batch's inputs and outputs are deleted once its metrics have their values. A stop, an error or
an interrupt drains the step in flight and frees its batch.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .errors import DivergenceError
from .metrics import MetricAccumulator, flatten_metrics, split_modes
from .routing import select

if TYPE_CHECKING:  # pragma: no cover
    from .handle import Nitro

__all__ = ["DivergenceError", "train_epochs", "evaluate_split"]

DATA_WAIT_WARN = 0.25
DATA_WAIT_MIN_STEPS = 50  # shorter epochs are dominated by filling the pipeline
_WARNED = {"data_wait": False}


def _delete(tree: Any) -> None:
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


class _EpochStats:
    def __init__(self):
        self.loss_sum = 0.0
        self.loss_count = 0
        self.nonfinite = 0
        self.train_metrics = MetricAccumulator("train_metrics")
        self.wait = 0.0
        self.seconds = 0.0
        self.steps = 0


def train_epochs(h: Nitro, epochs: int | None) -> None:
    """Run the training loop on the calling (worker) thread until the target epoch or a stop."""
    target = h.max_epochs if epochs is None else h.epoch + epochs
    reporter = h._reporter
    h._dispatched = h.step
    h._reset_health()
    reporter.start_run(h, target)
    try:
        while h.epoch < target:
            if h._stop.is_set():
                break
            h.phase = "training"
            completed = _train_epoch(h, target)
            if not completed:
                break
            stats = h._epoch_stats
            h._epoch_stats = _EpochStats()
            h.epoch += 1
            h._position = 0
            if h.epoch < target and not h._stop.is_set():
                # start producing the next epoch now, so validation overlaps with it
                h._upcoming = (h.epoch, h._prefetchers["train"].epoch(h.epoch))
            row = {"epoch": h.epoch, "step": h.step}
            if stats.loss_count:
                row["loss"] = stats.loss_sum / stats.loss_count
            if not stats.train_metrics.empty:
                row.update(_finalize(h, stats.train_metrics.result(), "train"))
            if "val" in h.splits and not h._stop.is_set():
                h.phase = "validating"
                row.update(evaluate_split(h, "val"))
            wait_frac = stats.wait / stats.seconds if stats.seconds > 0 else 0.0
            row["data_wait_frac"] = wait_frac
            row["epoch_seconds"] = stats.seconds
            h._history.append(row)
            h.last_metrics = row
            reporter.end_epoch(row)
            if (
                wait_frac > DATA_WAIT_WARN
                and stats.steps >= DATA_WAIT_MIN_STEPS
                and not _WARNED["data_wait"]
            ):
                _WARNED["data_wait"] = True
                warnings.warn_explicit(
                    f"the training loop waited for data {wait_frac:.0%} of epoch {h.epoch}. "
                    + _data_wait_advice(h),
                    RuntimeWarning,
                    filename="nitro",
                    lineno=0,
                    module="nitro.loop",
                )
        h.stop_reason = "requested" if h._stop.is_set() else "completed"
    finally:
        if h._upcoming is not None:
            h._upcoming[1].close()
            h._upcoming = None
        reporter.end_run(h)


def _data_wait_advice(h: Nitro) -> str:
    path = h._prefetchers["train"].path
    if path == "inline":
        return (
            "The train split is wrapped in NoPrefetch: remove it so worker threads build "
            "batches ahead of the loop."
        )
    if path == "single":
        if h._prefetch_settings.workers == 1:
            return "Raise prefetch_workers (now 1) so several threads build batches."
        return (
            "One thread builds its batches: make the source index-addressable "
            "(begin_epoch/batch_at, see docs/data.md) so prefetch_workers threads build them "
            "in parallel, or do less work per batch."
        )
    return (
        f"Raise prefetch_workers (now {h._prefetch_settings.workers}) or host_batches, or do "
        f"less work per batch in batch_at."
    )


def _train_epoch(h: Nitro, target: int) -> bool:
    """One (possibly resumed) epoch. False when a stop request cut it short."""
    prefetcher = h._prefetchers["train"]
    stats = h._epoch_stats
    try:
        batches = len(prefetcher.source)
    except TypeError:
        batches = None
    h._reporter.start_epoch(h.epoch, target, batches, h._position)
    feed = h._feed
    stop = h._stop
    program = None
    pending = None
    interrupted = False
    begin = time.perf_counter()
    upcoming, h._upcoming = h._upcoming, None
    if upcoming is not None and upcoming[0] == h.epoch and h._position == 0:
        stream = upcoming[1]
    else:
        if upcoming is not None:
            upcoming[1].close()
        stream = prefetcher.epoch(h.epoch, start=h._position)
    try:
        for staged in stream:
            if stop.is_set():
                staged.free()
                interrupted = True
                break
            step_index = h._dispatched
            args = (h._carry, feed.device(step_index), feed.hparams(step_index), staged.device)
            if program is None:
                program = h._train_program(args)
            try:
                carry, loss, metrics = program(*args)
            except TypeError as error:
                staged.free()
                raise h._train_shape_error(staged, error) from None
            h._carry = carry
            h._dispatched += 1
            previous, pending = pending, (step_index, loss, metrics, staged)
            if previous is not None:
                _complete(h, previous)
        if pending is not None:
            previous, pending = pending, None
            _complete(h, previous)
    except DivergenceError:
        if pending is not None:  # skipped by the guard: drain it, count nothing
            _drain(pending)
            pending = None
        raise
    finally:
        if pending is not None:  # another error: the step in flight still counts
            try:
                _complete(h, pending)
            except Exception:  # noqa: BLE001 - the original error matters more
                _drain(pending)
        stream.close()
        stats.wait += stream.wait_seconds
        stats.seconds += time.perf_counter() - begin
    return h._position >= batches if batches is not None else not interrupted


def _drain(item) -> None:
    try:
        jax.block_until_ready(item[1])
    except Exception:  # noqa: BLE001 - the error being raised matters more
        pass
    item[3].free()
    _delete(item[2])


def _complete(h: Nitro, item) -> None:
    """Read back one step (it has finished once its loss arrives), free its batch, account."""
    step_index, loss, metrics, staged = item
    try:
        value = float(loss)
        if h._train_metrics_residency is not None:
            metrics = h.placement.gather(metrics)
    finally:
        staged.free()
    stats = h._epoch_stats
    if not math.isfinite(value):
        if h._check_divergence:
            raise DivergenceError(
                f"the training loss is {value} at step {step_index + 1} (epoch {h.epoch + 1}, "
                f"batch {h._position + 1}). The handle keeps the weights from before that "
                f"step (n.step == {h.step}). Lower the learning rate or check the data; "
                f"check_divergence=False trains on regardless."
            )
        stats.nonfinite += 1
    else:
        stats.loss_sum += value
        stats.loss_count += 1
    h.step += 1
    h._position += 1
    stats.steps += 1
    if h._train_metrics_residency == "device":
        stats.train_metrics.add(h._train_program_aux["specs"], metrics, staged.n_real)
    elif h._train_metrics_residency == "host":
        fields = h.placement.gather(select(staged.host, h._fields["train"]["train_metrics"]))
        values = h._call_host_hook("train_metrics", metrics, **fields)
        specs, leaves = split_modes(values, "train_metrics")
        stats.train_metrics.add(specs, leaves, staged.n_real)
    h._reporter.step(h.step, value)


def _finalize(h: Nitro, results: dict, split: str) -> dict:
    if "finalize_metrics" in h._hooks:
        results = h._call_host_hook("finalize_metrics", dict(results), split)
        if not isinstance(results, dict):
            raise TypeError(
                f"finalize_metrics must return a dict of metrics, got {type(results).__name__}"
            )
    return flatten_metrics(results)


def evaluate_split(h: Nitro, split: str) -> dict[str, Any]:
    """Loss and metrics over one split, prefixed with its name (`val_loss`, `val_acc`)."""
    prefetcher = h._eval_prefetcher(split)
    fields = h._fields[split]
    with_loss = "loss" in fields
    has_metrics = "metrics" in h._hooks
    residency = h._residency.get("metrics", "host")
    accumulator = MetricAccumulator("metrics")
    loss_sum, samples = 0.0, 0
    program = None
    stream = prefetcher.epoch(0)
    try:
        for staged in stream:
            if h._stop.is_set():
                staged.free()
                break
            n_real = staged.n_real
            args = (
                h._carry[0],
                h._carry[1],
                h._feed.current_device(),
                staged.device,
                np.int32(n_real),
            )
            if program is None:
                program = h._eval_program(split, args, with_loss, return_outputs=has_metrics)
            result = program(*args)
            try:
                if with_loss:
                    loss_sum += float(result["loss_sum"])
                if has_metrics:
                    if residency == "host":
                        outputs = h.placement.gather(result["outputs"])
                        outputs = jax.tree.map(lambda a, n=n_real: a[:n], outputs)
                        host = h.placement.gather(select(staged.host, fields["metrics"]))
                        host = {k: v[:n_real] for k, v in host.items()}
                        values = h._call_host_hook("metrics", outputs, **host)
                        specs, leaves = split_modes(values, "metrics")
                    else:
                        specs, leaves = _device_metrics(h, split, result["outputs"], staged, n_real)
                    accumulator.add(specs, leaves, n_real)
                samples += n_real
            finally:
                staged.free()
                _delete(result)
    finally:
        stream.close()
    results: dict[str, Any] = {}
    if with_loss and samples:
        results["loss"] = loss_sum / samples
    if not accumulator.empty:
        results.update(accumulator.result())
    results = _finalize(h, results, split)
    return {f"{split}_{k}": v for k, v in results.items()}


def _device_metrics(h: Nitro, split: str, outputs, staged, n_real: int):
    width = jax.tree.leaves(outputs)[0].shape[0]
    names = h._fields[split]["metrics"]
    fields = {k: staged.device[k] for k in names}
    sliced = []
    if n_real < width:
        outputs = jax.tree.map(lambda a: a[:n_real], outputs)
        fields = {k: v[:n_real] for k, v in fields.items()}
        sliced = [outputs, fields]
    args = (outputs, h._feed.current_device(), fields)
    program = h._metrics_program(split, args)
    values = program(*args)
    leaves = jax.device_get(values)
    _delete(values)
    for tree in sliced:
        _delete(tree)
    return program.aux["specs"], leaves
