"""The evaluation loop: a split's batches through the eval programs, K fused per call on long
splits, each batch read back one call late; the weights evaluation uses; metrics finalized.

An eval batch's inputs and outputs are deleted once its metrics have their values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from nitro.core import events as events_module
from nitro.core.metrics import MetricAccumulator, flatten_metrics, split_modes
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import EvalOutput, TrainState, Variables
from nitro.engine.feed import StepFeed
from nitro.engine.member_axis import SINGLE
from nitro.engine.run_time import RunTime
from nitro.engine.runner import RunControl
from nitro.engine.sample_rows import ValSamples
from nitro.errors import SetupError
from nitro.experiments.routing import select
from nitro.programs.specs import ProgramSet

__all__ = ["delete", "device_metrics", "evaluate_split", "finalize_metrics", "weights_of"]


def delete(tree: Any) -> None:
    """Delete the device buffers of every array in `tree` now."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def finalize_metrics(setup: RunSetup, runtime: RunTime, results: dict, split: str) -> dict:
    if "finalize_metrics" in setup.experiment.hooks:
        results = runtime.call_host_hook(setup, "finalize_metrics", dict(results), split)
        if not isinstance(results, dict):
            raise TypeError(
                f"finalize_metrics must return a dict of metrics, got {type(results).__name__}"
            )
    return flatten_metrics(results)


def weights_of(setup: RunSetup, state: TrainState, weights: str | None = None):
    """The variables evaluation uses: the trained weights ("current"), their moving
    average ("ema"), or by default the average when `EMA(evaluate=True)`; with the model
    state, and without the optimizer state (evaluation never reads it, and every array
    passed costs dispatch time). Same structure either way, so the same programs run."""
    variables = state.variables
    if weights is None:
        weights = "ema" if setup.ema is not None and setup.ema.evaluate else "current"
    if weights == "current":
        return Variables(params=variables.params, model_state=variables.model_state)
    if weights != "ema":
        raise ValueError(f"weights must be 'current' or 'ema', got {weights!r}")
    if variables.ema is None:
        raise SetupError(
            "weights='ema' needs a moving average of the weights: build the handle with "
            "ema=0.999 (or nitro.EMA(...)); it is kept while the handle trains"
        )
    return Variables(params=variables.ema, model_state=variables.model_state)


def evaluate_split(
    setup: RunSetup,
    runtime: RunTime,
    state: TrainState,
    programs: ProgramSet,
    control: RunControl,
    split: str,
    weights: str | None = None,
    members: Any = SINGLE,
) -> Any:
    """Loss and metrics over one split, prefixed with its name (`val_loss`, `val_acc`); None
    when a stop request cut it short (partial results are never returned). With `members`
    (a `Stacked` members object: `nitro.engine.member_axis`), every member's, from one vmapped
    forward per batch: a list of one dict per member, each member's metrics hook on its own
    outputs."""
    stacked = members.stacked
    parts, feed = members.parts(setup, runtime), members.feed(runtime)
    info = setup.split(split)
    fields = info.hook_fields
    with_loss = "loss" in fields
    has_metrics = "metrics" in setup.experiment.hooks
    residency = setup.experiment.residency.get("metrics", "host")
    accumulators = [MetricAccumulator("metrics") for _ in parts]
    loss_sums, samples = [0.0] * len(parts), 0
    programs_by_count: dict[int, Any] = {}
    variables = weights_of(setup, state, weights)
    block = (
        1 if stacked else _eval_block(setup, runtime, info, has_metrics and residency == "device")
    )
    stream = runtime.prefetcher(split).epoch(0, block=block)
    device = feed.current_device() if stacked else None  # stacked once: one transfer

    def account_batch(result: EvalOutput, host_fields, n_real: int, outputs=None) -> None:
        nonlocal samples
        if with_loss:
            if stacked:
                for i, value in enumerate(np.asarray(result.loss_sum, np.float64).tolist()):
                    loss_sums[i] += value
            else:
                loss_sums[0] += float(result.loss_sum)
        if has_metrics:
            host: dict[str, Any] = {}
            if residency == "host":
                rows = (slice(None), slice(0, n_real)) if stacked else slice(0, n_real)
                outputs = jax.tree.map(lambda a, rows=rows: a[rows], outputs)
                host = setup.placement.gather(select(host_fields, fields["metrics"]))
                host = {k: v[:n_real] for k, v in host.items()}
            for i, (own_setup, own_runtime) in enumerate(parts):
                if residency == "host":
                    mine = outputs if not stacked else jax.tree.map(lambda a, i=i: a[i], outputs)
                    values = own_runtime.call_host_hook(own_setup, "metrics", mine, **host)
                    specs, leaves = split_modes(values, "metrics")
                else:
                    mine = result.outputs
                    if stacked:
                        mine = jax.tree.map(lambda a, i=i: a[i], result.outputs)
                    specs, leaves = device_metrics(
                        own_setup, own_runtime.feed, programs, split, mine, staged_now, n_real
                    )
                    if stacked:
                        delete(mine)
                accumulators[i].add(specs, leaves, n_real)
        samples += n_real

    def account(staged, result: EvalOutput, n_real) -> None:
        """Read one call's results back (loss sums, metrics: of one batch or a block of
        them, in order) and free it."""
        nonlocal staged_now
        staged_now = staged
        try:
            if watching is not None and staged.index == 0:
                watching.val_samples(ValSamples(setup, split, staged, result))
            if staged.count == 1:
                outputs = None
                if has_metrics and residency == "host":
                    outputs = setup.placement.gather(result.outputs)
                account_batch(result, staged.host, int(n_real), outputs)
                return
            read = jax.device_get(result)  # one transfer for the block
            for i, real in enumerate(np.asarray(n_real).tolist()):
                one = jax.tree.map(lambda a, i=i: a[i], read)
                host_fields = staged.host[i] if staged.host is not None else None
                account_batch(one, host_fields, real, one.outputs)
        finally:
            staged.free()
            delete(result)

    staged_now = None
    watching = events_module.current()  # a reporter that draws samples gets the first call
    if stacked or watching is None or not watching.wants("val_samples"):
        watching = None

    def dispatch(staged) -> EvalOutput:
        count = staged.count
        real = _real(staged)
        args = (variables, device if stacked else feed.current_device(), staged.device, real)
        program = programs_by_count.get(count)
        if program is None:
            program = programs_by_count[count] = programs.eval_forward(
                split, args, with_loss=with_loss, return_outputs=has_metrics, batches=count
            )
        return program(*args)

    try:
        stopped = not read_one_late(
            stream, control, dispatch, lambda staged, result: account(staged, result, _real(staged))
        )
    finally:
        if stacked:
            delete(device)
    if stopped:
        return None
    out = []
    for (own_setup, own_runtime), accumulator, loss_sum in zip(
        parts, accumulators, loss_sums, strict=True
    ):
        results: dict[str, Any] = {}
        if with_loss and samples:
            results["loss"] = loss_sum / samples
        if not accumulator.empty:
            results.update(accumulator.result())
        results = finalize_metrics(own_setup, own_runtime, results, split)
        out.append({f"{split}_{k}": v for k, v in results.items()})
    return out if stacked else out[0]


def _real(staged) -> Any:
    """A call's real rows: of its batch, or per batch of a block (a training split's blocks
    are full batches, counted once)."""
    if staged.count == 1:
        return np.int32(staged.n_real)
    return np.broadcast_to(np.asarray(staged.n_real, np.int32), (staged.count,))


def read_one_late(stream, control, dispatch: Callable, account: Callable) -> bool:
    """Dispatch every call of `stream` (`dispatch(staged) -> result`) and read each back
    after the next is dispatched (`account(staged, result)`, which frees both): the device
    computes while the host reads, as training does. False when a stop request cut it
    short; a call dispatched but not read back is dropped unread."""
    pending = None
    try:
        for staged in stream:
            if control.stop.is_set():
                staged.free()
                return False
            try:
                result = dispatch(staged)
            except BaseException:
                staged.free()
                raise
            previous, pending = pending, (staged, result)
            if previous is not None:
                account(*previous)
        if pending is not None:
            previous, pending = pending, None
            account(*previous)
    finally:
        if pending is not None:  # a stop, an error or an interrupt: drop it unread
            pending[0].free()
            delete(pending[1])
        stream.close()
    return True


EVAL_BLOCK_MIN_CALLS = 4  # a split fuses its batches when that makes at least this many calls


def _eval_block(setup: RunSetup, runtime: RunTime, info, device_resident: bool) -> int:
    """Evaluation batches per program call: the steps per call the training measured (or was
    given), where it fuses, for splits long enough to make at least `EVAL_BLOCK_MIN_CALLS`
    fused calls; else 1. A forward pass costs less than a train step, so a K worth fusing
    for training is worth it here too. Not with device-resident metrics (their program runs
    per batch) or across processes."""
    plan = runtime.dispatch
    steps = plan.steps or 1
    if steps == 1 or plan.checking or device_resident or setup.placement.multi_process:
        return 1
    if info.batches is None or info.batches < EVAL_BLOCK_MIN_CALLS * steps:
        return 1
    return steps


def device_metrics(
    setup: RunSetup, feed: StepFeed, programs: ProgramSet, split: str, outputs, staged, n_real
):
    width = jax.tree.leaves(outputs)[0].shape[0]
    names = setup.splits[split].hook_fields["metrics"]
    fields = {k: staged.device[k] for k in names}
    sliced = []
    if n_real < width:
        outputs = jax.tree.map(lambda a: a[:n_real], outputs)
        fields = {k: v[:n_real] for k, v in fields.items()}
        sliced = [outputs, fields]
    args = (outputs, feed.current_device(), fields)
    program = programs.device_metrics(split, args)
    values = program(*args)
    leaves = jax.device_get(values)
    delete(values)
    for tree in sliced:
        delete(tree)
    return program.metric_specs, leaves
