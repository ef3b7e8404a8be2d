"""`RunSetup`: what `Nitro(e)` decided before anything compiles, as one frozen, typed record.

Built once by the setup sequence (`setup.py`) and never written afterwards: the experiment's
frozen configuration and code fingerprints, the batch routing, one `SplitSetup` per split,
the placement, the model's tree definitions, the optimizer, the schedules and the step feed.
The programs, the loop and the reports read it; the train state (`state.py`) is what changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from nitro.core.keywords import Resolved
from nitro.experiments.declaration import FieldSpec
from nitro.experiments.fingerprint import CodeFingerprint
from nitro.experiments.routing import HookFields
from nitro.optim.fed_optimizer import FedOptimizer

__all__ = ["ExperimentSetup", "ModelSetup", "RunSetup", "SplitSetup"]


@dataclasses.dataclass(frozen=True)
class ExperimentSetup:
    """The experiment as the handle froze it: configuration, hooks and their code."""

    cls: type
    owner: str  # "module.QualName", the cache's name for the experiment
    instance: Any  # a copy of the experiment; set_device writes its Device fields
    graphconst: Mapping[str, Any]
    device_specs: Mapping[str, FieldSpec]
    device_dtypes: Mapping[str, Any]
    hooks: Mapping[str, Callable]  # name -> callable taking the (view of the) experiment first
    hook_functions: Mapping[str, Callable]  # name -> the frozen function, for host hooks
    hook_fields: Mapping[str, HookFields]  # traced/metric hook -> the batch fields it takes
    residency: Mapping[str, str]  # "metrics"/"train_metrics" -> "host" or "device"
    code: Mapping[str, CodeFingerprint]  # hook name, "model", "optimizer" -> fingerprint
    model_classes: tuple[type, ...]

    @property
    def manual(self) -> bool:
        """True when a `train_step` hook trains the models itself."""
        return "train_step" in self.hooks

    @property
    def train_metrics_residency(self) -> str | None:
        if self.manual:
            return "device"  # what train_step returns besides its loss
        return self.residency["train_metrics"] if "train_metrics" in self.hooks else None

    def call_host_hook(self, name: str, *args, **kwargs):
        return self.hook_functions[name](self.instance, *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class ModelSetup:
    """The model's graph definitions and the tree definitions of the variables' leaf lists."""

    graphdef_train: Any
    graphdef_eval: Any
    params_def: Any
    model_state_def: Any
    opt_state_def: Any  # None without an optimizer
    structure: Hashable  # keys programs on the model's structure (classes by code)
    leaf_paths: Mapping[str, tuple[str, ...]]  # "parameter", ... -> dotted leaf paths
    param_count: int
    weights_origin: str  # "build_model", or where `weights=` came from
    weights_checkpoint: Mapping[str, Any] | None = None  # when they came from a checkpoint


@dataclasses.dataclass(frozen=True)
class SplitSetup:
    """One split: its source, batch geometry, routing and prefetcher."""

    name: str
    source: Any
    batches: int | None  # len(source), when it has one
    width: int  # rows per batch this process feeds
    global_width: int  # rows per global batch (all processes)
    samples: int | None
    dropped: int  # samples left out by drop_last (train only)
    fields: tuple[str, ...]  # fields a batch has
    device_fields: tuple[str, ...]  # fields moved to the device
    batch_spec: Mapping[str, tuple[tuple[int, ...], str]]  # device field -> (shape, dtype)
    hook_fields: Mapping[str, tuple[str, ...]]  # hook -> fields it receives from this split
    prefetcher: Any  # data.Prefetcher

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
    checkpointer: Any  # checkpoints.Checkpointer, or None
    early_stop: Any  # early_stopping.EarlyStopping, or None
    resume: Any  # False, "auto", a path, or (path, "best" | "latest")
    splits: Mapping[str, SplitSetup]
    placement: Any  # placement.Placement
    model: ModelSetup
    optimizer: FedOptimizer | None  # None without a 'train' split
    schedules: tuple[Any, ...]  # schedules.BoundSchedule
    total_steps: int | None  # the schedules' horizon
    feed: Any  # step_feed.StepFeed: per-step hyperparameters and Device values
    prefetch: Any  # data.PrefetchSettings
    dispatch: Any  # dispatch.DispatchPlan: training steps per program call
    accum: int = 1  # micro-batches per optimizer step
    ema: Any = None  # ema.EMA, or None
    sam: Any = None  # sam.SAM or ASAM, or None

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
