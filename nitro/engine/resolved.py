"""The run keywords as the setup reads them: one typed, frozen record (`keywords.seed`).

`resolve_run_keywords` gives every keyword as a `Resolved` (its value and where it came from),
which `RunSetup.keywords` keeps for the binding report. `RunKeywords` is the same values with
attribute access and types, so the setup sequence reads `keywords.max_epochs` instead of
looking a name up; `source(name)` is the provenance, for messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from nitro.core.frozen import FrozenDict
from nitro.core.provenance import Resolved
from nitro.engine.run_keywords import DEFAULT

if TYPE_CHECKING:
    from nitro.engine.snapshots import Snapshots
    from nitro.engine.spikes import Spike
    from nitro.experiments.hooks import Hooks
    from nitro.optim.ema import EMA
    from nitro.optim.precision import Precision
    from nitro.optim.sam import SAM
    from nitro.programs.compile_options import CompileOptions
    from nitro.programs.remat import Remat
    from nitro.runs.checkpoints import Checkpointer
    from nitro.runs.early_stopping import EarlyStopping

__all__ = ["RunKeywords"]


@dataclasses.dataclass(frozen=True)
class RunKeywords:
    """Every run keyword's resolved value (see `RUN_KEYWORDS` for each one's doc), and the
    `Resolved` records they came from."""

    seed: int
    run_dir: str | None
    checkpointer: Checkpointer | None
    logger: Any  # a logger or a LoggerGroup (nitro.loggers), or None
    early_stop: EarlyStopping | None
    snapshots: Snapshots | None
    spike: Spike | None
    restore_best: bool
    restore_optimizer: bool | None
    resume: Literal[False, "auto"] | str | tuple[str, Literal["best", "latest"]]
    preemption: bool | Literal["auto"]
    name: str | None
    n_devs: int
    mesh: Mapping[str, int] | None
    sharding: Any  # "replicated", "fsdp", "rules", or a mapping of path pattern -> spec
    max_epochs: int
    max_steps: int | None
    val_every_steps: int | None
    eval_splits: tuple[str, ...] | None
    validation_split: float | None
    schedules: Mapping[str, Any]  # key -> schedule
    learning_rate: float
    optimizer: Any  # an optax GradientTransformation or factory, a dict of them, or None
    group_lr: Mapping[str, float] | None
    weight_decay: float | None
    decay_to: Any  # "zero", "init", a model or a tree of anchor weights
    decay_mask: Callable[[str, Any], bool] | None
    gradient_clip_norm: float | None
    freeze_batch_stats: bool
    check_divergence: bool
    prefetch_workers: int
    device_batches: int
    host_batches: int | None
    ordered: bool
    accum: int
    ema: EMA | None
    sam: SAM | None
    precision: Precision
    compile_options: CompileOptions | None
    remat: Remat | None
    hooks: Hooks | None
    steps_per_dispatch: Any  # "auto", an int K, or a DispatchChoice to continue
    prefetch: Literal["auto", "threads", "processes", "inline"]
    persistent_workers: bool
    progress: Any  # True, False, "lines", "bar" or a reporter object
    resolved: Mapping[str, Resolved] = dataclasses.field(repr=False)

    @classmethod
    def of(cls, resolved: Mapping[str, Resolved]) -> RunKeywords:
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "resolved"]
        missing = sorted(set(fields) - set(resolved))
        unknown = sorted(set(resolved) - set(fields))
        if missing or unknown:  # RUN_KEYWORDS and this record list the same names
            raise KeyError(f"run keywords out of step with RunKeywords: {missing or unknown}")
        return cls(**{name: resolved[name].value for name in fields}, resolved=FrozenDict(resolved))

    def source(self, name: str) -> str:
        """Where keyword `name` came from: "Nitro keyword", a method or field, the default."""
        return self.resolved[name].source

    def given(self, name: str) -> bool:
        """True when keyword `name` was set (by `Nitro(...)` or the experiment), not defaulted."""
        return self.source(name) != DEFAULT
