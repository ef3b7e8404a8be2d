"""`RunSetup`: what `Nitro(e)` decided before anything compiles, as one deep-frozen, typed
record.

Built once by the setup sequence (`nitro.engine.setup`) and never written afterwards: the
experiment's frozen configuration and code fingerprints, the batch routing and geometry of
each split, the placement, the model's tree definitions, the optimizer and the schedules.
Every record in it is a frozen dataclass, every mapping a `FrozenDict`, every sequence a
tuple; a value a user gave (a data source, a logger, a GraphConst value) is held as given.

What changes while a run lives is elsewhere: the step feed, the steps-per-dispatch
measurement, the prefetchers and the live experiment copy are the handle's run-time record
(`nitro.engine.run_time.RunTime`), and the arrays and counters are the `TrainState`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from nitro.core.frozen import FrozenDict
from nitro.core.provenance import Resolved

# jax.tree_util.PyTreeDef, a class of jaxlib's that type checkers see as a variable
PyTreeDef = Any

if TYPE_CHECKING:  # lower layers, named for the annotations only (importing them costs)
    from flax import nnx
    from numpy.typing import DTypeLike

    from nitro.core.placement import Placement
    from nitro.data.prefetch import PrefetchSettings
    from nitro.experiments.declaration import FieldSpec
    from nitro.experiments.fingerprint import CodeFingerprint
    from nitro.experiments.routing import HookFields
    from nitro.optim.ema import EMA
    from nitro.optim.fed_optimizer import FedOptimizer
    from nitro.optim.precision import Precision
    from nitro.optim.sam import SAM
    from nitro.optim.schedules import BoundSchedule

__all__ = [
    "CheckpointPolicy",
    "CheckpointRef",
    "ExperimentSetup",
    "ModelSetup",
    "RunSetup",
    "SavedWeights",
    "SplitSetup",
    "StopPolicy",
]


class CheckpointPolicy(Protocol):
    """How a run saves checkpoints: `nitro.Checkpointer` (defined with the checkpoints, in
    `nitro.runs`, above this layer)."""

    @property
    def k(self) -> int: ...
    @property
    def metric(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def every(self) -> int: ...
    @property
    def budget(self) -> float | None: ...
    def better(self, a: float, b: float) -> bool: ...
    def name_of(self, *, epoch: int, step: int, score: float | None) -> str | None: ...


class StopPolicy(Protocol):
    """When a run ends early: `nitro.EarlyStopping` (in `nitro.runs`)."""

    @property
    def metric(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def patience(self) -> int: ...
    def check(
        self,
        splits: Sequence[str],
        metrics: Collection[str] | None,
        evaluated: Sequence[str] | None = None,
    ) -> None: ...
    def should_stop(self, history: Sequence[Mapping[str, Any]]) -> bool: ...


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
    """A checkpoint named by the user: a run directory (its `which` checkpoint: the newest,
    or the best by the run's checkpointer metric) or one checkpoint's directory (a step)."""

    path: str
    which: Literal["best", "latest"] = "latest"


@dataclasses.dataclass(frozen=True)
class SavedWeights:
    """The checkpoint(s) weights were read from, one entry each: one checkpoint, or several
    averaged (`nitro.average`, best first; the run id is the first's)."""

    paths: tuple[str, ...]
    run_id: str | None
    steps: tuple[int, ...]
    epochs: tuple[int | None, ...]
    metrics: tuple[Mapping[str, Any] | None, ...]
    averaged: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The public form (`Nitro.weights_checkpoint`): path, run_id, step, epoch, metrics;
        for an average: averaged (how many), paths, run_id, steps, epochs, metrics."""
        plain = lambda m: dict(m) if m is not None else None  # noqa: E731
        if self.averaged:
            return {
                "averaged": len(self.paths),
                "paths": list(self.paths),
                "run_id": self.run_id,
                "steps": list(self.steps),
                "epochs": list(self.epochs),
                "metrics": [plain(m) for m in self.metrics],
            }
        return {
            "path": self.paths[0],
            "run_id": self.run_id,
            "step": self.steps[0],
            "epoch": self.epochs[0],
            "metrics": plain(self.metrics[0]),
        }


@dataclasses.dataclass(frozen=True)
class ExperimentSetup:
    """The experiment as the handle froze it: configuration, hooks and their code. The live
    copy of the experiment (its Device fields follow `set_device`) is in the run-time record."""

    cls: type
    owner: str  # "module.QualName", the cache's name for the experiment
    graphconst: Mapping[str, Hashable]  # GraphConst field -> value
    device_specs: Mapping[str, FieldSpec]
    device_dtypes: Mapping[str, DTypeLike]  # Device field (a buffer set's part) -> its dtype
    hooks: Mapping[str, Callable]  # name -> callable taking the (view of the) experiment first
    hook_functions: Mapping[str, Callable]  # name -> the frozen function, for host hooks
    hook_fields: Mapping[str, HookFields]  # traced/metric hook -> the batch fields it takes
    residency: Mapping[str, Literal["host", "device"]]  # "metrics"/"train_metrics" -> where
    code: Mapping[str, CodeFingerprint]  # hook name, "model", "optimizer" -> fingerprint
    model_classes: tuple[type, ...]
    preset: str | None = None  # the preset the experiment was built from
    # field -> its value at setup, as JSON (`setting_token`), frozen
    values: Mapping[str, Any] = dataclasses.field(default_factory=FrozenDict)
    # a buffer set's Device field -> (its tree's structure, its parts' names, fed one by one)
    device_sets: Mapping[str, tuple[Any, tuple[str, ...]]] = dataclasses.field(
        default_factory=FrozenDict
    )

    @property
    def manual(self) -> bool:
        """True when a `train_step` hook trains the models itself."""
        return "train_step" in self.hooks

    @property
    def train_metrics_residency(self) -> str | None:
        if self.manual:
            return "device"  # what train_step returns besides its loss
        return self.residency["train_metrics"] if "train_metrics" in self.hooks else None


@dataclasses.dataclass(frozen=True)
class ModelSetup:
    """The model's graph definitions and the tree definitions of the variables' leaf lists."""

    graphdef_train: nnx.GraphDef
    graphdef_eval: nnx.GraphDef
    params_def: PyTreeDef  # of the parameters' leaf list
    model_state_def: PyTreeDef
    opt_state_def: PyTreeDef | None  # None without an optimizer
    structure: Hashable  # keys programs on the model's structure (classes by code)
    leaf_paths: Mapping[str, tuple[str, ...]]  # "parameter", ... -> dotted leaf paths
    param_count: int
    weights_origin: str  # "build_model", or where `weights=` came from
    weights_checkpoint: SavedWeights | None = None  # when they came from a checkpoint
    # leaf path -> the file and key it came from, or "build_model" (`weights=nitro.Partial`)
    weights_from: Mapping[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class SplitSetup:
    """One split: its source, batch geometry and routing (its prefetcher is run-time)."""

    name: str
    source: Any  # what build_data (or data=) gave, held as given
    batches: int | None  # len(source), when it has one
    width: int  # rows per batch this process feeds
    global_width: int  # rows per global batch (all processes)
    samples: int | None
    dropped: int  # samples left out by drop_last (train only)
    fields: tuple[str, ...]  # fields a batch has
    device_fields: tuple[str, ...]  # fields moved to the device
    batch_spec: Mapping[str, tuple[tuple[int, ...], str]]  # device field -> (shape, dtype)
    hook_fields: Mapping[str, tuple[str, ...]]  # hook -> fields it receives from this split

    @property
    def training(self) -> bool:
        return self.name == "train"


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """Everything a run decided at construction. Frozen: build a new handle to change it."""

    experiment: ExperimentSetup
    keywords: Mapping[str, Resolved]  # every run keyword, resolved, with where it came from
    given_keywords: Mapping[str, Any]  # the run keywords passed to Nitro(...)
    seed: int
    max_epochs: int
    run_dir: str | None  # the run_dir keyword; None: runs/<Experiment>/<run id>
    check_divergence: bool
    checkpointer: CheckpointPolicy | None
    early_stop: StopPolicy | None
    resume: CheckpointRef | Literal["auto"] | None  # None: a new run
    splits: Mapping[str, SplitSetup]
    placement: Placement
    model: ModelSetup
    optimizer: FedOptimizer | None  # None without a 'train' split
    schedules: tuple[BoundSchedule, ...]
    total_steps: int | None  # the schedules' horizon
    prefetch: PrefetchSettings
    accum: int = 1  # micro-batches per optimizer step
    ema: EMA | None = None
    sam: SAM | None = None
    precision: Precision | None = None  # how the step computes (None: float32)
    name: str | None = None  # the name keyword: the run's name in run.json, for resume
    eval_splits: tuple[str, ...] = ()  # evaluated at each epoch's end
    max_steps: int | None = None  # the optimizer step training stops at
    val_every_steps: int | None = None  # eval splits also every N steps, within epochs
    # freeze_batch_stats=True: (model-state leaf, its group's fed learning rate), the leaf
    # kept while that rate is 0
    frozen_statistics: tuple[tuple[int, str], ...] = ()
    # compile_options=: the XLA options each program kind compiles with (None: XLA's defaults)
    compile_options: Any = None
    # remat=: the modules the train step rematerializes, resolved against the model (a Remat)
    remat: Any = None

    @property
    def cls(self) -> type:
        return self.experiment.cls

    @property
    def owner(self) -> str:
        return self.experiment.owner

    def split(self, name: str) -> SplitSetup:
        """The named split, or a KeyError listing the splits this run has."""
        split = self.splits.get(name)
        if split is None:
            have = ", ".join(map(repr, self.splits)) or "none"
            raise KeyError(f"no split {name!r}: this handle has {have} (build_data returns them)")
        return split
