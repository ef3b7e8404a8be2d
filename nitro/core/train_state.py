"""The train state: everything a run changes, in one typed record.

`TrainState` is what the loop takes and returns, what checkpoints save and restore whole, and
what export reads. Its arrays travel through the compiled programs as `Variables` (named
fields of flat leaf lists, in the order of the tree definitions in `RunSetup.model`), so a
step flattens nothing but lists. Everything else is host data: counters, the seed and the
committed history.

The data order is a function of the seed and the epoch (`ArrayLoader` draws epoch `e`'s
permutation from `(seed, e)`), so `(epoch, position)` locates the next batch exactly, and the
model's RNG streams are variables in `model_state`: nothing else is needed to resume.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import numpy as np

__all__ = [
    "TIMING_COLUMNS",
    "EpochTotals",
    "EvalOutput",
    "HistoryRows",
    "StepOutput",
    "TrainState",
    "Variables",
]

# the history's columns that time an epoch rather than measure the model: tables of results,
# curves and progress lines leave them out
TIMING_COLUMNS = frozenset({"epoch_seconds", "data_wait_frac", "host_ms", "device_ms"})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Variables:
    """The arrays a train step takes and returns (flat leaf lists)."""

    params: list
    model_state: list
    opt_state: list | None = None
    ema: list | None = None  # the moving average of `params` (`ema=`), same leaves
    ema_steps: Any = None  # int32: steps averaged so far (for the EMA's warmup)
    # precision="float16": [scale f32, finite steps in a row i32, steps skipped i32]
    loss_scale: list | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one train step returns: the new variables, whether every step so far was finite,
    its report (f32[2]: the loss, and 0 when the step was finite or what was not: 1 the loss,
    2 a gradient, 3 a fed hyperparameter, 4 an earlier step, 5 the weights after a manual
    step) read back in one transfer, and its device train metrics (or the outputs, for host
    train metrics)."""

    variables: Variables
    healthy: Any
    report: Any
    metrics: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EvalOutput:
    """What one eval forward or predict call returns: the sum of the per-sample losses over
    the real samples (f32[], eval forward only), `forward`'s outputs (when asked for) and,
    with them, each sample's loss (f32[batch], padded rows included; None when the loss
    couples samples); None where not computed. A fused call over K batches stacks each on a
    leading axis."""

    loss_sum: Any = None
    outputs: Any = None
    losses: Any = None


@dataclasses.dataclass
class EpochTotals:
    """Running sums of the epoch under way; kept across a stop, so a resumed epoch reports
    the mean over all of its steps. Owned by the loop."""

    loss_sum: float = 0.0
    loss_count: int = 0
    nonfinite: int = 0
    steps: int = 0
    wait_seconds: float = 0.0
    seconds: float = 0.0
    train_metrics: Any = None  # a MetricAccumulator, created by the loop
    # the loop thread's wait for each call's results (the readback of its report), and its
    # time that is no step's (compiles, the pipeline's fill, evaluations within the epoch):
    # the history's host_ms and device_ms (see `step_times`)
    device_seconds: float = 0.0
    untimed_seconds: float = 0.0

    _SUMS: ClassVar = (
        "loss_sum",
        "loss_count",
        "nonfinite",
        "steps",
        "wait_seconds",
        "seconds",
        "device_seconds",
        "untimed_seconds",
    )

    def to_json(self) -> dict[str, float | int]:
        """The running sums, as a checkpoint of a run stopped mid-epoch records them (the
        train metrics start again from there)."""
        return {name: getattr(self, name) for name in self._SUMS}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EpochTotals:
        """The running sums `to_json` recorded (a sum not recorded is 0), with fresh train
        metrics."""
        from nitro.core.metrics import MetricAccumulator

        # each sum as its default's type (float or int)
        sums = {name: type(getattr(cls, name))(data.get(name, 0)) for name in cls._SUMS}
        return cls(**sums, train_metrics=MetricAccumulator("train_metrics"))

    def add_losses(self, values: np.ndarray) -> list[float]:
        """Add a call's losses to the sums, one by one, in order (as one step at a time adds
        them); a non-finite one, which `check_divergence=False` trains through, is counted
        apart. Returns them."""
        finite = values[np.isfinite(values)].tolist()
        loss_sum = self.loss_sum
        for value in finite:
            loss_sum += value
        self.loss_sum = loss_sum
        self.loss_count += len(finite)
        self.nonfinite += len(values) - len(finite)
        return values.tolist()

    def step_times(self) -> dict[str, float]:
        """`host_ms` and `device_ms` a step: the loop thread's time a step, split into its own
        work (staging, dispatch, bookkeeping, reporters: what is not waiting) and its wait for
        the device's results; data waits and `untimed_seconds` are neither."""
        if not self.steps:
            return {}
        host = self.seconds - self.wait_seconds - self.device_seconds - self.untimed_seconds
        return {
            "host_ms": max(0.0, host) * 1e3 / self.steps,
            "device_ms": self.device_seconds * 1e3 / self.steps,
        }


@dataclasses.dataclass(slots=True)
class TrainState:
    """Parameters, model variables, optimizer state, counters, seed and committed history.

    One in-place writer: the loop updates it as steps complete and returns it; read it, do
    not write it, while the handle runs. Restoring a checkpoint makes a new state
    (`CheckpointRecord.train_state`, or `dataclasses.replace` for new weights) that the handle
    swaps in while nothing runs.

    Attributes:
      variables: the arrays (`Variables`).
      step: optimizer steps completed.
      epoch: epochs completed (committed to the history).
      position: batches completed in the epoch under way.
      seed: seeds the model's initialization and the data order.
      history: one row per committed epoch (loss, validation metrics, timing).
      validations: one row per evaluation within an epoch (`val_every_steps=`): step,
        epoch (the one under way) and the eval splits' metrics.
      swaps: one row per live edit swapped in (or rolled back) while training: the step
        its code first ran at, what changed, the code's digest, what compiled.
      totals: the running sums of the epoch under way (None at an epoch boundary).
      epoch_trained: the epoch under way has trained all its batches but is not committed
        yet (its validation has not completed); the next `train()` or `validate()` validates
        it first.
      data_state: the training source's iterator state after batch `position` of the epoch
        under way (a `grain.IterDataset`'s, a `datasets.IterableDataset`'s: see
        `nitro.data.iter_state`); None when it has none, and at an epoch boundary. A resume
        restores it rather than replaying the epoch to `position`.
      skipped_batches: one row per training batch a spike's roll-back left out (`spike=`):
        its epoch (counted from 1, as the history's), its index in the source's epoch, the
        step and loss of the spike. The loop's streams leave them out.
      rewinds: one row per rewind (`n.rewind`, a spike's roll-back): the step it left and
        the one it went back to, why, and the abandoned branch's history rows.
    """

    variables: Variables
    step: int = 0
    epoch: int = 0
    position: int = 0
    seed: int = 0
    history: list[Mapping[str, Any]] = dataclasses.field(default_factory=list)
    validations: list[Mapping[str, Any]] = dataclasses.field(default_factory=list)
    swaps: list[Mapping[str, Any]] = dataclasses.field(default_factory=list)
    totals: EpochTotals | None = None
    epoch_trained: bool = False
    data_state: Any = None
    skipped_batches: list[Mapping[str, Any]] = dataclasses.field(default_factory=list)
    rewinds: list[Mapping[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def last_row(self) -> Mapping[str, Any]:
        return self.history[-1] if self.history else {}

    def skipped_in(self, epoch: int) -> frozenset[int]:
        """The source's batch indices the epoch `epoch` (counted from 0, as `self.epoch`)
        leaves out."""
        if not self.skipped_batches:
            return frozenset()
        return frozenset(r["index"] for r in self.skipped_batches if r["epoch"] == epoch + 1)

    def steps_sat_out(self) -> int:
        """The steps a population's member sat out: its spikes' roll-backs (`spike=`), each
        the steps of the call that spiked. Its own step is the population's less these."""
        return sum(int(r.get("steps", 0)) for r in self.rewinds if r.get("reason") == "spike")


def scalars(row: Mapping[str, Any]) -> dict[str, Any]:
    """A history row's scalar columns (what a checkpoint records of it)."""
    return {k: v for k, v in row.items() if np.ndim(v) == 0}


class HistoryRows:
    """A history (or validations) as a checkpoint records it, `to_json`, and back,
    `from_json`. Each row is converted once: a handle that trained a thousand one-epoch
    calls does not convert a thousand rows per save. Rows are never changed once committed;
    a history that is not the one seen last (another handle's, or one replaced by a resume)
    is converted afresh."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: list[Mapping[str, Any]] = []
        self._rows: list[dict[str, Any]] = []

    def to_json(self, history: list[Mapping[str, Any]]) -> tuple[dict[str, Any], ...]:
        with self._lock:
            n = len(self._seen)
            if n > len(history) or (n and history[n - 1] is not self._seen[-1]):
                self._seen, self._rows, n = [], [], 0
            for row in history[n:]:
                self._seen.append(row)
                self._rows.append(scalars(row))
            return tuple(self._rows)

    @staticmethod
    def from_json(rows: Any) -> list[Mapping[str, Any]]:
        """The rows a checkpoint recorded, as a history (none where it recorded none)."""
        return [dict(row) for row in rows or () if isinstance(row, Mapping)]
