"""`Nitro`: the handle of one run of an experiment.

`Nitro(e)` sets up and compiles nothing: it resolves the run keywords and builds a frozen
`RunSetup` (data, model, optimizer, routing, schedules, code fingerprints), the run-time record
(`RunTime`: step feed, dispatch measurement, prefetchers, the live experiment copy) and the
initial `TrainState`. `train()` runs the loop on a worker thread; `validate`, `evaluate` and
`predict` work on a handle that never trained. The handle composes a setup, a run-time record,
a state, the programs it holds, an event path and a run guard; its public attributes read from
them. A restored checkpoint is a new state, swapped in while nothing runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from nitro.core import events as events_module
from nitro.core import progress
from nitro.core.events import Events
from nitro.core.provenance import Resolved
from nitro.core.run_setup import RunSetup, SavedWeights
from nitro.core.train_state import TrainState
from nitro.engine import evaluation, loop
from nitro.engine.member_axis import SINGLE
from nitro.engine.resolved import RunKeywords
from nitro.engine.run_keywords import KEYWORD_ONLY, RUN_KEYWORDS, resolve_run_keywords
from nitro.engine.run_time import RunTime
from nitro.engine.runner import RunGuard
from nitro.engine.setup import build
from nitro.engine.weights_copy import copy_weights
from nitro.errors import ExperimentError, SetupError, did_you_mean
from nitro.experiments.declaration import (
    REQUIRED_HOOKS,
    FieldKind,
    check_field_type,
    edit_generation,
    field_specs,
    has_method,
    is_experiment,
)
from nitro.experiments.presets import from_preset, replace
from nitro.handle.binding_report import BindingReport, binding_report
from nitro.handle.displays import handle_html, short_repr
from nitro.handle.run_handle import RunHandle
from nitro.handle.signature import keyword_signature, keywords_doc
from nitro.handle.summary import ModelSummary
from nitro.handle.time_travel import TimeTravel
from nitro.optim.schedules import bind_schedules, check_schedule_values
from nitro.programs.specs import ProgramSet
from nitro.runs.checkpoint_reads import read_checkpoint, resolve_checkpoint
from nitro.runs.checkpoint_trees import leaves_from
from nitro.runs.initial_weights import AveragedWeights, CheckpointWeights, WeightsSource
from nitro.runs.resume import restore
from nitro.runs.run_files import RunFiles
from nitro.runs.run_origin import OriginProbe
from nitro.runs.watched_metrics import check_watched_metrics
from nitro.weights.partial import Partial

__all__ = ["EXTENSIONS", "Nitro", "check_experiment", "experiment_to_run", "weights_source"]

# Methods of the handle built on the layer above it (a population): that layer registers
# them here on import (`nitro.handle` imports it), so the handle never imports it.
# "lr_find": `nitro.handle.lr_find.lr_find`.
EXTENSIONS: dict[str, Callable[..., Any]] = {}


def experiment_to_run(
    experiment: Any,
    preset: str | None,
    keywords: dict[str, Any],
    call: str = "Nitro",
    take_fields: bool = True,
) -> Any:
    """The experiment instance `Nitro(experiment, preset=..., **keywords)` runs. A class is
    built from `preset` (None: its defaults) with its fields among `keywords`, taken out of
    them (a name that is both a field and a run keyword stays a run keyword; `take_fields`
    False leaves them: a population sets them itself, a list being an axis). An instance
    runs as it is: `preset=` is refused, naming `call`."""
    if not (isinstance(experiment, type) and is_experiment(experiment)):
        if preset is not None and is_experiment(experiment):
            name = type(experiment).__name__
            raise ExperimentError(
                f"{call}(preset={preset!r}) builds the experiment from its class: "
                f"{call}({name}, preset={preset!r}, ...); this {name} instance has its field "
                f"values already ({name}.from_preset({preset!r}, ...) builds one from the "
                f"preset)"
            )
        return experiment
    if not take_fields:
        return from_preset(experiment, preset)
    specs = [spec.name for spec in field_specs(experiment)]
    known = set(RUN_KEYWORDS) | set(KEYWORD_ONLY)
    for name in keywords:
        if name not in known and name not in specs:
            raise TypeError(
                f"{call}({experiment.__name__}, ...) got an unknown keyword {name!r}, neither a "
                f"field of {experiment.__name__} nor a run keyword."
                f"{did_you_mean(name, [*specs, *known])} Fields: {', '.join(specs)}; run "
                f"keywords: {', '.join(sorted(known))}."
            )
    fields = {name: keywords.pop(name) for name in specs if name in keywords and name not in known}
    return from_preset(experiment, preset, **fields)


def check_experiment(experiment: Any) -> type:
    cls = type(experiment)
    try:
        field_specs(cls)
    except ExperimentError:
        raise ExperimentError(
            f"Nitro() takes an experiment instance (a class decorated with "
            f"@nitro.experiment); got {type(experiment).__name__}"
        ) from None
    required = [h for h in REQUIRED_HOOKS if h != "loss" or not has_method(cls, "train_step")]
    missing = [h for h in required if not has_method(cls, h)]
    if missing:
        raise ExperimentError(
            f"{cls.__qualname__} is missing required hook{'s' * (len(missing) > 1)} "
            f"{', '.join(missing)}. An experiment defines build_data(self), "
            f"build_model(self, rngs), forward(self, model, *, <fields>) and "
            f"loss(self, outputs, *, <fields>)."
        )
    return cls


class Nitro(TimeTravel, RunHandle):
    """The handle of one run of an experiment.

    >>> import nitro
    >>> from nitro.examples.digits import Digits
    >>> n = nitro.Nitro(Digits(max_epochs=1), seed=0, progress=False)   # compiles nothing
    >>> n.train().step
    9

    `experiment` is an instance, or the class with `preset=` and field values among the
    keywords: `Nitro(Digits, preset="small", width=64, seed=0)` runs
    `Digits.from_preset("small", width=64)` with `seed=0` (a name that is both a field and a
    run keyword, such as `max_epochs`, is the run keyword). The run records the preset's
    name (`n.preset`); an instance built by `from_preset` records it too.
    """

    def __init__(self, experiment: Any, *, preset: str | None = None, **keywords: Any):
        experiment = experiment_to_run(experiment, preset, keywords)
        cls = check_experiment(experiment)
        origin = OriginProbe(cls)  # git runs beside the setup
        instance = replace(experiment)  # frozen copy of the configuration
        weights = keywords.pop("weights", None)
        data = keywords.pop("data", None)
        self._data = data  # `data=` as given: a fork takes the same splits
        resolved = RunKeywords.of(resolve_run_keywords(instance, keywords))
        if resolved.restore_best and resolved.checkpointer is None:
            raise SetupError(
                "restore_best=True loads the run's best checkpoint at the end of train(), and "
                "checkpointer=None saves none: keep the default checkpointer (or pass "
                "checkpointer=nitro.Checkpointer(...)), or leave restore_best out"
            )
        if weights is not None and resolved.resume:
            raise SetupError(
                "resume= and weights= are exclusive: resume= continues a run (its weights, "
                "optimizer state, counters and history); weights= starts a new run from "
                "weights only. Pass one of them."
            )
        self._progress = progress.make_reporter(resolved.progress)
        self._state: TrainState  # built below; monitors see setup phases first (without it)
        self._events = Events([self._progress], context=self._phase_context)
        self._logging = None
        if resolved.logger is not None and jax.process_index() == 0:  # of several, one logs
            from nitro.loggers import LoggingReporter

            self._logging = LoggingReporter(resolved.logger)
            self._events.add(self._logging)
        self._guard_with(RunGuard(lambda: f"this {cls.__name__} handle"))
        self._checkpoint: SavedWeights | None = None
        self._live_scheduled: set[str] = set()  # Device fields scheduled by set_schedule
        # each set_schedule's (step, schedules): a rewind or fork replays those up to its step
        self._schedule_edits: list[tuple[int, dict[str, Any]]] = []
        self._stale_checked = (edit_generation(), 0.0)
        source = weights_source(weights)
        with events_module.using(self._events):
            self._setup, self._runtime, self._state = build(
                instance,
                resolved,
                keywords,
                events=self._events,
                data=data,
                weights=source,
                dispatch=weights.dispatch if isinstance(weights, Nitro) else None,
            )
        self._programs = ProgramSet(self._setup)
        runtime = self._runtime
        check_watched_metrics(
            self._setup, self._state, runtime.experiment, runtime.feed.current_device()
        )
        guard = self._guard  # not the handle: the lock must not keep the handle alive
        self._files = RunFiles.plan(
            self._setup,
            self._events,
            say=self._say,
            busy=lambda: guard.activity is not None,
            state=self._state,
            origin=origin,
        )
        if self._logging is not None:
            self._files.saves.logger_state = self._logging.logger.state
        self._checkpoint = self._setup.model.weights_checkpoint
        if self._files.resume_from is not None:
            with events_module.using(self._events):
                self._state, record = restore(
                    self._files,
                    self._setup,
                    self._state,
                    self._events,
                    runtime.device_values(),
                    say=self._say,
                    fresh_optimizer=resolved.restore_optimizer is False,
                )
                if self._state.seed != self._setup.seed:
                    self._continue_seed(instance, resolved, keywords, data)
            if self._logging is not None:
                self._logging.reattach(record.member.logger)
            found = self._files.resume_from
            self._checkpoint = SavedWeights(
                paths=(str(found.path),),
                run_id=record.run_id,
                steps=(found.step,),
                epochs=(record.epoch,),
                metrics=(record.metrics,),
            )
        if weights is not None and resolved.restore_optimizer:
            self._state.variables = dataclasses.replace(
                self._state.variables, opt_state=self._optimizer_of(weights)
            )
        self._files.claim_planned()
        self._target_epoch = max(self._setup.max_epochs, self._state.epoch)
        self._run_target = self._target_epoch  # the latest run's aim, `train(steps=)`'s too
        self._events.phase("ready")

    def _optimizer_of(self, weights: Any) -> list[Any]:
        """`restore_optimizer=True` with `weights=`: the optimizer state of the handle or the
        single run's checkpoint the weights came from, which must fit this run's optimizer."""
        template = self._state.variables.opt_state
        what = "weights=" + (
            type(weights).__name__ if not isinstance(weights, str) else repr(weights)
        )
        if template is None:
            raise SetupError("restore_optimizer=True: this run has no optimizer (no 'train' split)")
        if isinstance(weights, Nitro):
            with weights._guard.hold("copying its optimizer state"):
                leaves = weights._state.variables.opt_state
                found = None if leaves is None else [jax.numpy.array(x, copy=True) for x in leaves]
            where = f"the handle given as weights= ({weights.cls.__name__} at step {weights.step})"
        elif isinstance(weights, (str, os.PathLike, tuple)) and not (
            isinstance(weights, tuple) and isinstance(weights[1], int)
        ):
            found_at = resolve_checkpoint(weights)
            saved, _ = read_checkpoint(*found_at)
            where = f"the checkpoint {str(found_at.path)!r}"
            found = leaves_from(
                "optimizer state",
                saved.get("opt_state", {}),
                self._setup.model.leaf_paths["optimizer state"],
                template,
                misfit=f"restore_optimizer=True: the optimizer state of {where} does not fit "
                f"this run's optimizer ({self._optimizer_text()}): give the optimizer it was "
                f"trained with, or leave restore_optimizer out:",
                here="this run's",
            )
        else:
            raise SetupError(
                f"restore_optimizer=True continues the optimizer state of what {what} names: a "
                f"Nitro handle or a single run's checkpoint; an average, a population member "
                f"or a weights file holds none. Leave restore_optimizer out for a fresh one"
            )
        if (
            found is None
            or len(found) != len(template)
            or any(np.shape(a) != np.shape(b) for a, b in zip(found, template, strict=False))
        ):
            raise SetupError(
                f"restore_optimizer=True: the optimizer state of {where} does not fit this "
                f"run's optimizer ({self._optimizer_text()}): give the optimizer it was "
                f"trained with, or leave restore_optimizer out"
            )
        put = self._setup.placement.put_like
        return put(found, template)

    def _optimizer_text(self) -> str:
        optimizer = self._setup.optimizer
        return optimizer.description if optimizer is not None else "none"

    def _continue_seed(
        self, instance: Any, resolved: RunKeywords, given: Mapping[str, Any], data: Any
    ) -> None:
        """A resumed run goes on with the seed it was trained with (the restore said so): the
        setup is built again with it, so the data order and the step keys continue the run's,
        and `n.seed`, the binding report and the handle's table show the seed in force."""
        seed = self._state.seed
        source = (
            f"the checkpoint's, the run it resumes was trained with it; "
            f"{resolved.source('seed')} gave {resolved.seed}"
        )
        keywords = RunKeywords.of({**resolved.resolved, "seed": Resolved(seed, source)})
        self._setup, self._runtime, _ = build(
            instance, keywords, given, events=self._events, data=data
        )
        self._programs = ProgramSet(self._setup)

    def _phase_context(self) -> tuple[Nitro | None, int | None, int | None]:
        """(handle, step, epoch) for phase monitors; nothing while the handle is built."""
        state: TrainState | None = getattr(self, "_state", None)
        return (None, None, None) if state is None else (self, state.step, state.epoch)

    @property
    def logger(self):
        """The run's logger (a `nitro.loggers.LoggerGroup`), or None when it logs nothing."""
        return self._logging.logger if self._logging is not None else None

    def logger_info(self) -> dict[str, Any]:
        """What identifies the run's logger(s): type, path, run id."""
        from nitro.loggers import logger_info

        return logger_info(self.logger) if self.logger is not None else {}

    # ------------------------------------------------------------------------------------------
    # what the handle holds

    @property
    def setup(self) -> RunSetup:
        """What this run decided at construction (frozen)."""
        return self._setup

    @property
    def state(self) -> TrainState:
        """The train state: variables, counters and the committed history. Read it; while a
        run trains, the loop updates it."""
        return self._state

    @property
    def runtime(self) -> RunTime:
        """What changes while this handle's runs live: the step feed, the steps-per-dispatch
        measurement, the prefetchers (one per split) and the live experiment copy."""
        return self._runtime

    @property
    def experiment(self) -> Any:
        """The handle's copy of the experiment (Device fields follow `set_device`)."""
        return self._runtime.experiment

    @property
    def keywords(self) -> Mapping[str, Resolved]:
        """Every run keyword, resolved: `.value` and `.source` (where it came from)."""
        return self._setup.keywords

    @property
    def given_keywords(self) -> dict[str, Any]:
        """The run keywords passed to `Nitro(...)` (not `weights` or `data`)."""
        return dict(self._setup.given_keywords)

    @property
    def batch_specs(self) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
        """Split name -> {field moved to the device: (its batch's shape, dtype name)}, as the
        split's first batch had them."""
        return {name: dict(split.batch_spec) for name, split in self._setup.splits.items()}

    @property
    def placement(self):
        return self._setup.placement

    @property
    def optimizer(self):
        return self._setup.optimizer

    @property
    def schedules(self) -> tuple:
        return self._setup.schedules

    @property
    def seed(self) -> int:
        return self._setup.seed

    @property
    def name(self) -> str | None:
        """The run's name (the `name=` keyword; `%nitro train exp` names its runs `exp_run`),
        recorded in run.json; `resume='auto'` continues the run its name last trained."""
        return self._setup.name

    @property
    def total_steps(self) -> int | None:
        """The schedules' horizon: max_epochs x batches per epoch."""
        return self._setup.total_steps

    @property
    def param_count(self) -> int:
        return self._setup.model.param_count

    @property
    def weights_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint the current weights came from (path, run id, step, epoch, metrics):
        `weights=` a checkpoint, `resume=`, or `restore_best()`; None otherwise."""
        return self._checkpoint.as_dict() if self._checkpoint is not None else None

    @property
    def weights_origin(self) -> str:
        """Where the initial weights came from: "build_model" (naming the file a module of it was
        loaded from, as `nitro.models.create(pretrained=...)` does) or the `weights=` source."""
        return self._setup.model.weights_origin

    @property
    def last_metrics(self) -> dict[str, Any]:
        """The latest history row (loss, validation metrics, timing)."""
        return dict(self._state.last_row)

    # ------------------------------------------------------------------------------------------
    # training

    def profile(self, steps: int = 20, *, trace: bool = True, python: bool = False):
        """Train `steps` more steps under `jax.profiler` and say where a call's time went:
        a `ProfileReport` (HTML in a notebook, text elsewhere) of each call's wait for data,
        host-side Python (the feed and dispatch; the bookkeeping and reporters), the device
        program and the readback; each program's FLOPs, bytes and memory as XLA reports them,
        and the FLOP/s it reached against the device's peak; what to change for the part
        that dominates.

        **These are training steps**, as `train(steps=steps)` trains them: the weights, the
        optimizer state, `n.step` and the epoch under way move on (an epoch that ends among
        them validates and checkpoints as usual). Each call is waited for before the next,
        so the parts are apart; training overlaps them and runs a little faster (the
        history's `host_ms` and `device_ms` split every epoch without waiting).

        `trace=True` writes the trace to `<run_dir>/profile/plugins/profile/<timestamp>/`
        (`tensorboard --logdir <run_dir>/profile` opens it; so does ui.perfetto.dev, its
        `perfetto_trace.json.gz`); `python=True` records every Python call in it too, which
        slows host-side Python several times (the host parts then read high). Refused while
        the handle runs. See docs/performance.md#where-did-my-time-go.
        """
        from nitro.handle.profile import profile_handle

        return profile_handle(self, steps, trace=trace, python=python)

    def _saving(self, state: TrainState) -> tuple[Sequence[Mapping[str, Any]], Callable]:
        runtime, saves = self._runtime, self._files.saves
        device, lazy = runtime.device_values(), runtime.restores is True
        return state.history, lambda reason, best: saves.snapshot(
            self._setup, state, device, reason, best, lazy
        )

    def _verdict(self, state: TrainState) -> str | None:
        stopping = self._setup.early_stop
        stops = stopping is not None and stopping.should_stop(state.history)
        return "early_stop" if stops else None

    @property
    def _counters(self) -> TrainState:
        return self._state

    @property
    def _lead_setup(self) -> RunSetup:
        return self._setup

    def _check_trainable(self) -> None:
        self._check_stale("train")
        if "train" not in self._setup.splits:
            raise SetupError(
                f"this handle has no 'train' split (splits: "
                f"{', '.join(self._setup.splits) or 'none'}); it can validate, evaluate "
                f"and predict"
            )

    def _loop_left(self, state: TrainState) -> None:
        self._state = state

    # ------------------------------------------------------------------------------------------
    # evaluation and prediction

    def _trainees(self) -> tuple[Any, TrainState]:
        return SINGLE, self._state

    def _evaluate(self, split: str, weights: str | None) -> dict[str, Any] | None:
        """On 'val', an epoch trained but not validated (a stop during its validation) is
        validated and its history row committed."""
        if split == "val" and self._state.epoch_trained and weights is None:
            row = loop.finish_epoch(
                self._setup,
                self._runtime,
                self._state,
                self._programs,
                self._events,
                self._control,
            )
            if row is not None:
                self._files.open(self._setup, self._events)
                self._after_epoch(self._state, row)
            return None if row is None else {k: v for k, v in row.items() if k[:4] == "val_"}
        return super()._evaluate(split, weights)

    def export(
        self,
        directory: str,
        name: str | None = None,
        *,
        platforms: tuple[str, ...] | None = None,
        weights: str | None = None,
        dtype: str | None = None,
        echo: tuple[str, ...] = (),
        batch_sizes: tuple[int, ...] | None = None,
        axes: Mapping[str, tuple[str | None, ...]] | None = None,
    ) -> dict[str, Any]:
        """Write the current weights and eval-mode forward as a bundle that runs without Nitro
        (`nitro.bundle.load(directory)`) and serves with `nitro serve`; returns its manifest.

        `name` names the bundle (default: the experiment class, lower case); `platforms`
        defaults to cpu, cuda, rocm and tpu; `weights="ema"` exports the moving average of
        the weights; `dtype` is the bundle's: "float32" (the default), "bfloat16", "float16"
        or "compute" (the run's `precision=`); `echo` names wire inputs returned unchanged as
        outputs (an id passed through); `batch_sizes` (e.g. (1, 8, 32)) the sizes a loader or
        server pads a call to, the smallest that fits (`nitro serve` compiles each as it loads
        the bundle); `axes` names the axes of inputs and outputs, "batch" first (e.g.
        `{"image": ("batch", "height", "width")}`). See docs/export.md.
        """
        from nitro.serving.export import DEFAULT_PLATFORMS, export_handle

        self._check_stale("export")
        with self._guard.hold("exporting"):
            self._files.wait()  # the bundle's run has its checkpoints on disk
            variables = evaluation.weights_of(self._setup, self._state, weights)
            return export_handle(
                self,
                directory,
                name,
                platforms=DEFAULT_PLATFORMS if platforms is None else platforms,
                variables=variables,
                dtype=dtype,
                echo=echo,
                batch_sizes=batch_sizes,
                axes=axes,
            )

    def publish(
        self,
        name: str,
        *,
        to: str,
        weights: str | None = None,
        dtype: str | None = None,
        axes: Mapping[str, tuple[str | None, ...]] | None = None,
    ) -> dict[str, Any]:
        """Replace the weights of the model `name` served by `nitro serve` at `to` with this
        handle's: exports into the directory the server serves it from and has it load that.
        With the program unchanged only the weights are swapped (nothing compiles); a changed
        program is a full reload. Requests get the old weights or the new, never a mix.

        The served client contract is kept: inputs, outputs, axis names (`axes`: by default
        the served ones) and the postprocess hook must be the served ones, or nothing is
        written and `PublishError` names what differs.

        Returns `replaced` ("weights" or "program"), `program`, `directory` and `manifest`.
        `weights` and `dtype` as for `export`. See docs/export.md.
        """
        from nitro.serving.publish import publish

        self._check_stale("publish")
        with self._guard.hold("publishing"):
            self._files.wait()
            variables = evaluation.weights_of(self._setup, self._state, weights)
            return publish(self, to, name, variables=variables, dtype=dtype, axes=axes)

    # ------------------------------------------------------------------------------------------
    # finding a learning rate

    def lr_find(
        self,
        *,
        start: float = 1e-5,
        end: float = 1.0,
        num: int = 11,
        steps: int | None = None,
        method: str = "grid",
        progress: Any = None,
    ) -> Any:
        """Try `num` learning rates on a log grid from `start` to `end` (default 11: every
        half decade from 1e-5 to 1), each trained for `steps` steps (default 50, rounded up
        to whole program calls) from this handle's current weights on the train split, with
        its other settings (optimizer, schedules other than the learning rate's, seed, ...),
        all of them side by side in one program (a `nitro.Population`).

        Returns an `LRFindResult`: each rate's mean training loss over the last quarter of
        its steps, the rates that diverged, and a `suggestion`, the smallest rate whose loss
        is within 10% of the best rate's drop from the starting loss (`.frame`, `.plot()`).
        Nothing on the handle changes (weights, optimizer state, step, history):
        `result.apply()` sets the suggestion as its learning rate.

        `method="ramp"` is the classic one-run range test instead (Smith 2015, fastai): the
        rate grows geometrically from `start` to `end` over `steps` steps (default 100) and
        stops once the smoothed loss passes 4x its minimum; its suggestion is a tenth of the
        rate at the smoothed loss's minimum. See docs/lr-find.md.
        """
        return EXTENSIONS["lr_find"](
            self, start=start, end=end, num=num, steps=steps, method=method, progress=progress
        )

    # ------------------------------------------------------------------------------------------
    # Device fields

    def set_device(self, **values: Any) -> Nitro:
        """Change Device fields on the live handle (also while it trains); never recompiles.
        The run-time record takes the change; the setup stays as it was decided."""
        experiment = self._setup.experiment
        runtime = self._runtime
        for name, value in values.items():
            spec = next((s for s in field_specs(self.cls) if s.name == name), None)
            if spec is None:
                raise AttributeError(
                    f"{self.cls.__qualname__} has no field {name!r}; Device fields: "
                    f"{', '.join(experiment.device_specs) or 'none'}"
                )
            if spec.kind is not FieldKind.DEVICE:
                hint = (
                    "it bakes into the program: build a new handle, "
                    f"Nitro({self.cls.__name__}({name}=...), weights=n)"
                    if spec.kind is FieldKind.GRAPHCONST
                    else "the tracer never sees it: change it on the experiment and build a new "
                    "handle"
                )
                raise TypeError(
                    f"set_device({name}=...) changes Device fields only; {name!r} is "
                    f"{spec.kind.value} ({hint})"
                )
            if name in self._live_scheduled or any(
                s.target == "device" and s.name == name for s in self.schedules
            ):
                raise TypeError(
                    f"Device field {name!r} is scheduled; its value comes from the schedule"
                )
            check_field_type(self.cls, spec, value, call="set_device")
            runtime.feed.set_constant(name, value)
            setattr(runtime.experiment, name, value)
        return self

    def set_schedule(self, **schedules: Any) -> Nitro:
        """Change the schedules of optimizer hyperparameters or Device fields on the live
        handle, also while it trains: the next call follows them, and nothing recompiles
        (they are fed like every step's values). Keys and values as `schedules=` takes them
        (`learning_rate=optax.cosine_decay_schedule(...)`, a callable of the step, a factory
        of the total step count, or a number for a constant); checked the same way.

        The change lasts for this handle: a resumed run follows its `schedules=` keyword. A
        rewind (`n.rewind`) to a step before the change undoes it, and a fork (`n.fork`)
        inherits the changes made up to its step."""
        self._apply_schedules(schedules)
        self._schedule_edits.append((self.step, dict(schedules)))
        return self

    def _replay_schedules(self, step: int, edits: Sequence[tuple[int, dict[str, Any]]]) -> None:
        """The run's own schedules, then the live changes of `edits` made at `step` or
        before, as this handle's: what a rewind or fork to `step` follows."""
        self._runtime.feed.reset_schedules()
        self._live_scheduled = set()
        self._schedule_edits = [(at, dict(s)) for at, s in edits if at <= step]
        for _, schedules in self._schedule_edits:
            self._apply_schedules(schedules)

    def _apply_schedules(self, schedules: Mapping[str, Any]) -> None:
        setup = self._setup
        optimizer = setup.optimizer
        bound = bind_schedules(
            schedules,
            hyperparams=optimizer.schedulable if optimizer else {},
            device_fields=setup.experiment.device_specs,
            other_fields={
                s.name: s.kind.value
                for s in field_specs(self.cls)
                if s.kind is not FieldKind.DEVICE
            },
            total_steps=setup.total_steps,
            device_values={
                n: self._runtime.feed.device_value(n) for n in setup.experiment.device_specs
            },
            device_sets=tuple(setup.experiment.device_sets),
        )
        feed = self._runtime.feed
        check_schedule_values(
            bound,
            total_steps=setup.total_steps,
            device_shapes={name: np.shape(feed.device_value(name)) for name in feed.device_dtypes},
            device_dtypes=setup.experiment.device_dtypes,
        )
        if optimizer:
            optimizer.check_schedules(s.name for s in bound if s.target == "opt")
        feed.set_schedules(bound)
        self._live_scheduled.update(s.name for s in bound if s.target == "device")

    def fine_tune(
        self,
        epochs: int,
        *,
        freeze_epochs: int = 1,
        base_lr: float | None = None,
        backbone: str | Iterable[str] = "backbone",
        unfrozen_ratio: float = 0.1,
        pct_start: float = 0.3,
        div: float = 5.0,
        background: bool = False,
    ) -> Nitro:
        """Fine-tune a pretrained backbone, as fastai's `fine_tune`: train `freeze_epochs`
        epochs with the `backbone` parameter group frozen (learning rate 0) and the other
        groups on a one-cycle schedule to `base_lr` (default: the run's `learning_rate`),
        then `epochs` epochs with every group on a one-cycle schedule to `base_lr / 2`, the
        backbone's at `unfrozen_ratio` times it. One program for both phases: the rates are
        per-group schedules (`set_schedule`), fed to every step, so nothing recompiles.

        Groups come from the experiment's `param_group` hook; `Nitro(..., freeze_batch_stats=
        True)` also keeps a frozen group's BatchNorm statistics. See docs/fine-tuning.md."""
        from nitro.optim.fine_tuning import fine_tune_schedules, steps_per_epoch

        self._check_trainable()
        backbone = (backbone,) if isinstance(backbone, str) else tuple(backbone)
        optimizer = self._setup.optimizer
        groups = tuple(g.name for g in optimizer.groups) if optimizer else ()
        if optimizer is None or not groups:
            raise SetupError(
                "fine_tune trains parameter groups, and this experiment has none: define "
                "`param_group(self, path) -> str` naming each parameter's group, e.g. "
                "`return 'backbone' if path.startswith('backbone') else 'head'`"
            )
        unknown = [g for g in backbone if g not in groups]
        if unknown or set(backbone) == set(groups):
            raise SetupError(
                f"fine_tune(backbone={backbone!r}) must name some of the parameter groups "
                f"{groups!r} and leave at least one (the head) to train while it is frozen"
                + (did_you_mean(unknown[0], groups) if unknown else "")
            )
        ratios = {g.name: g.lr_ratio for g in optimizer.groups if g.lr_ratio is not None}
        if ratios:
            raise SetupError(
                f"fine_tune sets every group's learning rate, and group_lr={ratios!r} sets "
                f"some too: drop group_lr (unfrozen_ratio= sets the backbone's ratio)"
            )
        for name, value in (("epochs", epochs), ("freeze_epochs", freeze_epochs)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SetupError(f"fine_tune's {name} must be an int >= 0, got {value!r}")
        for name, value, valid, bounds in (
            ("base_lr", base_lr, base_lr is None or base_lr > 0, "> 0"),
            ("unfrozen_ratio", unfrozen_ratio, unfrozen_ratio >= 0, ">= 0"),
            ("pct_start", pct_start, 0 < pct_start < 1, "in (0, 1)"),
            ("div", div, div > 0, "> 0"),
        ):
            if value is not None and not (math.isfinite(value) and valid):
                raise SetupError(
                    f"fine_tune's {name} must be a finite number {bounds}, got {value!r}"
                )
        if epochs + freeze_epochs == 0:
            raise SetupError("fine_tune needs epochs or freeze_epochs > 0: nothing to train")
        batches = self._setup.splits["train"].batches
        if batches is None:
            raise SetupError(
                "fine_tune counts its phases in epochs, and the train split has no len(): "
                "give it a length, or set per-group schedules yourself with set_schedule"
            )
        rate = self._setup.keywords["learning_rate"].value if base_lr is None else base_lr
        schedules = fine_tune_schedules(
            groups,
            backbone,
            start=self.step,
            steps_per_epoch=steps_per_epoch(batches, self._setup.accum),
            epochs=epochs,
            freeze_epochs=freeze_epochs,
            base_lr=rate,
            unfrozen_ratio=unfrozen_ratio,
            pct_start=pct_start,
            div=div,
        )
        self.set_schedule(**schedules)
        return self.train(epochs=freeze_epochs + epochs, background=background)

    def set_host(self, **values: Any) -> Nitro:
        """Change Host fields (the unmarked ones) of the live experiment, also while it trains:
        host hooks (host `metrics`, `train_metrics`, `finalize_metrics`) see the new values from
        their next call. What `build_data` or `build_model` read from them at setup stays as
        it was built; GraphConst and Device fields have their own ways (a new handle,
        `set_device`)."""
        for name, value in values.items():
            spec = next((s for s in field_specs(self.cls) if s.name == name), None)
            if spec is None:
                hosts = [s.name for s in field_specs(self.cls) if s.kind is FieldKind.HOST]
                raise AttributeError(
                    f"{self.cls.__qualname__} has no field {name!r}; Host fields: "
                    f"{', '.join(hosts) or 'none'}"
                )
            if spec.kind is not FieldKind.HOST:
                how = "set_device(...)" if spec.kind is FieldKind.DEVICE else "a new handle"
                raise TypeError(
                    f"set_host({name}=...) changes Host fields only; {name!r} is "
                    f"{spec.kind.value} (change it with {how})"
                )
            check_field_type(self.cls, spec, value, call="set_host")
            setattr(self._runtime.experiment, name, value)
        return self

    def device_value(self, name: str) -> Any:
        """The current value of a Device field, as a host value."""
        if name not in self._setup.experiment.device_specs:
            raise AttributeError(f"{name!r} is not a Device field of {self.cls.__qualname__}")
        return self._runtime.feed.device_value(name)

    # ------------------------------------------------------------------------------------------
    # weights

    def _trees(self):
        model = self._setup.model
        variables = self._state.variables
        params = jax.tree.unflatten(model.params_def, variables.params)
        rest = jax.tree.unflatten(model.model_state_def, variables.model_state)
        return params, rest

    def _weights_copy(self) -> WeightsSource:
        return copy_weights(self._setup, lambda: self._state, self._guard, self._control)

    @property
    def model(self) -> nnx.Module:
        """A copy of the current model (train mode), safe to keep and modify. While the
        handle trains, taken at the next step boundary."""
        source = self._weights_copy()
        return nnx.merge(self._setup.model.graphdef_train, source.params, source.model_state)

    def restore_best(self) -> Nitro:
        """Load the weights (parameters and model state) of this run's best checkpoint by the
        checkpointer's metric; the optimizer state, counters and history stay.
        `Nitro(..., restore_best=True)` does it at the end of each `train()`."""
        with self._guard.hold("restoring its best weights"):
            self._load_best()
        return self

    def _load_best(self) -> None:
        """`restore_best()`'s work, under the guard (or on the run's thread, at its end)."""
        self._files.wait()
        source = CheckpointWeights.of((str(self._files.run_dir), "best"))
        found = source.resolve(*self._trees())
        place = self._setup.placement.put_like  # on the live leaves' shardings
        state = self._state
        variables = dataclasses.replace(
            state.variables,
            params=place(jax.tree.leaves(found.params), state.variables.params),
            model_state=place(jax.tree.leaves(found.model_state), state.variables.model_state),
        )
        # a new state, swapped in under the guard: the loop stays its only in-place writer
        self._state = dataclasses.replace(state, variables=variables)
        self._checkpoint = found.checkpoint
        self._say(f"restored the weights of {found.origin}")

    def _finish(self, reason: str) -> None:
        """`restore_best=True`: the run ends on its best checkpoint's weights (none saved
        yet: it keeps the last step's, and says so)."""
        if not self._setup.keywords["restore_best"].value:
            return
        if self.best_checkpoint is None:
            self._say("restore_best: no checkpoint saved yet; the weights stay the last step's")
            return
        self._load_best()

    @property
    def best_checkpoint(self) -> str | None:
        """The path of this run's best checkpoint by the checkpointer's metric (the newest
        when it watches none); None before the first save or with `checkpointer=None`."""
        if self._files.store is None:
            return None
        self._files.wait()
        try:
            found = resolve_checkpoint((str(self._files.run_dir), "best"), read=False)
        except SetupError:  # nothing saved yet
            return None
        return str(found.path)

    @property
    def elapsed(self) -> float:
        """Seconds this run has trained: its epochs' `epoch_seconds` (a resumed run's earlier
        epochs too) and the epoch under way."""
        state = self._state
        done = sum(float(row.get("epoch_seconds") or 0.0) for row in state.history)
        return done + (state.totals.seconds if state.totals is not None else 0.0)

    @property
    def hyperparameters(self) -> dict[str, float]:
        """The optimizer's injected hyperparameters as the last step used them."""
        if self.optimizer is None:
            return {}
        return self._runtime.feed.hyperparams_now()

    # ------------------------------------------------------------------------------------------
    # results and reports

    def plot(self, path: str | None = None, metrics: Iterable[str] | None = None):
        """Draw the history (loss and metric curves), with a dashed line at each live edit's
        swap; save a PNG when `path` is given."""
        from nitro.handle.plotting import plot_history

        return plot_history(
            self.history(),
            path=path,
            metrics=metrics,
            title=self.cls.__name__,
            swaps=self._state.swaps,
            best=self.best_by,
        )

    @property
    def best_by(self) -> tuple[str, str]:
        """(metric, "min" or "max"): what "best" means for this run, as its checkpointer ranks
        (else its early stopping watches; else `val_loss` with a 'val' split, else `loss`)."""
        watcher = self._setup.checkpointer or self._setup.early_stop
        if watcher is not None and any(watcher.metric in row for row in self._state.history):
            return watcher.metric, watcher.mode
        return ("val_loss" if "val" in self._setup.eval_splits else "loss"), "min"

    def summary(
        self, batch: Mapping[str, Any] | None = None, *, split: str | None = None, depth=None
    ) -> ModelSummary:
        """The model as a table: each module's path, type, output shape for one batch,
        parameters and bytes, and the totals (HTML in a notebook, text elsewhere). Compiles
        nothing: `forward` is traced on the shapes of one batch of `split` (default "train",
        else the first split) or of `batch=` (a dict of arrays or `jax.ShapeDtypeStruct`s);
        `depth=` keeps the modules at most that deep (0: the model alone).

        >>> import nitro
        >>> from nitro.examples.digits import Digits
        >>> print(nitro.Nitro(Digits(width=32), progress=False).summary())
        MLP: output shapes for one batch (the 'train' split's batch: x f32[128,64])
        ------------------------------------------------
        module     type    output       params     bytes
        ------------------------------------------------
        (model)    MLP     f32[128,10]   3,466  13.5 KiB
          hidden1  Linear  f32[128,32]   2,080   8.1 KiB
          hidden2  Linear  f32[128,32]   1,056   4.1 KiB
          out      Linear  f32[128,10]     330   1.3 KiB
        ------------------------------------------------
        forward returns: f32[128,10]
        parameters: 3,466 (13.5 KiB)
        model state: 0 B
        total: 13.5 KiB
        """
        from nitro.handle.summary import model_summary

        state = self._state
        return model_summary(
            self._setup,
            list(state.variables.params),
            list(state.variables.model_state),
            self._runtime.feed.current_device(),
            batch=batch,
            split=split,
            depth=depth,
        )

    def binding_report(self) -> BindingReport:
        """Where every value came from: splits, hook fields, run keywords, schedules, optimizer."""
        return binding_report(
            self._setup,
            self._runtime,
            self.step,
            self.run_dir,
            self.run_id,
            history=self._state.history,
            programs=self._programs,
        )

    @property
    def _lead_runtime(self) -> RunTime:
        return self._runtime

    def _edit_variables(self) -> Any:
        return self._state.variables

    def _adopt_code(self, setup: RunSetup, programs: ProgramSet) -> None:
        """A swap or a roll-back: the handle's code is the code the run trains on."""
        self._setup, self._programs = setup, programs

    def __repr__(self) -> str:
        return short_repr(self)

    def _repr_html_(self) -> str:
        return handle_html(self)


# `help(Nitro)` and `inspect.signature(Nitro)` name every run keyword, from its declaration
Nitro.__init__.__signature__ = keyword_signature(Nitro.__init__)
if Nitro.__doc__ is not None:  # None under python -OO
    Nitro.__doc__ = f"{inspect.cleandoc(Nitro.__doc__)}\n\n{keywords_doc()}"


def weights_source(weights: Any):
    """What `weights=` names, as a source of initial weights (None: fresh ones)."""
    if weights is None:
        return None
    if isinstance(weights, Nitro):
        return weights._weights_copy()
    if isinstance(weights, (WeightsSource, CheckpointWeights, AveragedWeights, Partial)):
        return weights
    if isinstance(weights, (str, os.PathLike, tuple)):
        return CheckpointWeights.of(weights)
    raise SetupError(
        f"weights= takes a Nitro handle, a run directory or checkpoint path, (run_dir, "
        f"'best' | 'latest'), nitro.average(run_dir, k=3), or nitro.Partial(file, "
        f"into='backbone') (a PyTorch or safetensors file); got {type(weights).__name__}"
    )
