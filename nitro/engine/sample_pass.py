"""One pass over a split with the evaluation program validation runs: each batch's fields,
`forward`'s outputs and every sample's loss, back on the host, real rows only.

What looks at samples (`n.render`, `n.top_losses`, `n.confusion`) reads them here. The
program is the eval forward that returns outputs (the one validation compiles when the
experiment has a metrics hook), with the batches per call validation uses, so a handle that
validated compiles nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from nitro.core.run_setup import RunSetup
from nitro.core.train_state import EvalOutput, TrainState
from nitro.engine.evaluation import _eval_block, _real, delete, read_one_late, weights_of
from nitro.engine.member_axis import SINGLE
from nitro.engine.run_time import RunTime
from nitro.engine.runner import RunControl
from nitro.engine.sample_rows import SampleRows, rows_of
from nitro.programs.specs import ProgramSet

__all__ = ["sample_pass"]


class _First:
    """The calls of `stream` that hold its first `batches` batches (all: None)."""

    def __init__(self, stream: Any, batches: int | None):
        self.stream, self.batches = stream, batches

    def __iter__(self) -> Iterator[Any]:
        seen = 0
        for staged in self.stream:
            yield staged
            seen += staged.count
            if self.batches is not None and seen >= self.batches:
                return

    def close(self) -> None:
        self.stream.close()


def sample_pass(
    setup: RunSetup,
    runtime: RunTime,
    state: TrainState,
    programs: ProgramSet,
    control: RunControl,
    split: str,
    take: Callable[[SampleRows], None],
    *,
    batches: int | None = None,
    weights: str | None = None,
    members: Any = SINGLE,
) -> bool:
    """Call `take` with each batch's `SampleRows`, in order, for the first `batches` batches
    of `split` (None: all of them). False when a stop request cut the pass short."""
    stacked = members.stacked
    feed = members.feed(runtime)
    info = setup.split(split)
    with_loss = "loss" in info.hook_fields
    residency = setup.experiment.residency.get("metrics", "host")
    device_metrics = "metrics" in setup.experiment.hooks and residency == "device"
    block = 1 if stacked else _eval_block(setup, runtime, info, device_metrics)
    variables = weights_of(setup, state, weights)
    device = feed.current_device() if stacked else None  # stacked once: one transfer
    stream = _First(runtime.prefetcher(split).epoch(0, block=block), batches)
    programs_by_count: dict[int, Any] = {}
    start = 0

    def dispatch(staged) -> EvalOutput:
        count = staged.count
        args = (variables, device if stacked else feed.current_device(), staged.device)
        args = (*args, _real(staged))
        program = programs_by_count.get(count)
        if program is None:
            program = programs_by_count[count] = programs.eval_forward(
                split, args, with_loss=with_loss, return_outputs=True, batches=count
            )
        return program(*args)

    def account(staged, result: EvalOutput) -> None:
        nonlocal start
        try:
            for rows in rows_of(setup, staged, result, stacked, start):
                take(rows)
                start += rows.rows
        finally:
            staged.free()
            delete(result)

    try:
        return read_one_late(stream, control, dispatch, account)
    finally:
        if stacked:
            delete(device)
