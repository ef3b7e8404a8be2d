"""Setup: what `Nitro(e)` does before anything compiles, one function per step.

In order: freeze the hooks, build the data, convert the Device fields, build the model (and
copy `weights=`), build the optimizer state, route batch fields from each split's first batch,
bind schedules, and freeze the code fingerprints the compile cache keys programs on. The result
is a frozen `RunSetup`, the handle's run-time record (`RunTime`: the step feed, the dispatch
plan, the prefetchers, the live experiment copy) and the initial `TrainState`; nothing is
written anywhere else.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
import types
from collections.abc import Iterable, Mapping, Sized
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nitro.core.events import Events
from nitro.core.frozen import FrozenDict, freeze
from nitro.core.placement import Placement
from nitro.core.run_setup import (
    CheckpointRef,
    ExperimentSetup,
    ModelSetup,
    RunSetup,
    SavedWeights,
    SplitSetup,
)
from nitro.core.sharding import build_model
from nitro.core.train_state import TrainState, Variables
from nitro.data import (
    ArrayLoader,
    FromFactory,
    HFIterableSource,
    IndexedBatches,
    NoPrefetch,
    Prefetcher,
    PrefetchSettings,
    adopt,
    is_index_addressable,
    is_one_shot,
)
from nitro.engine.dispatch import DispatchChoice, DispatchPlan
from nitro.engine.feed import StepFeed
from nitro.engine.resolved import RunKeywords
from nitro.engine.run_time import RunTime
from nitro.errors import PlacementError, RoutingError, SetupError
from nitro.experiments.declaration import FieldKind, field_specs, has_method
from nitro.experiments.equinox import as_nnx_model
from nitro.experiments.field_types import buffer_set_type
from nitro.experiments.fingerprint import CodeFingerprint, Fingerprinter
from nitro.experiments.linen import bridge_linen, is_linen
from nitro.experiments.presets import preset_of
from nitro.experiments.routing import hook_fields
from nitro.optim.fed_optimizer import FedOptimizer
from nitro.optim.fine_tuning import steps_per_epoch
from nitro.optim.optimizer import OptimizerSettings, build_optimizer
from nitro.optim.param_groups import leaf_paths
from nitro.optim.precision import Precision
from nitro.optim.schedules import bind_schedules, check_schedule_values, optimizer_keys
from nitro.programs.compile_cache import configure_persistent_cache
from nitro.programs.tracing import EVAL_SEED
from nitro.runs.checkpoint_record import setting_token
from nitro.runs.initial_weights import AveragedWeights, CheckpointWeights, WeightsSource, copy_array
from nitro.weights.partial import Partial, origin_in_model

__all__ = [
    "batch_size",
    "build",
    "freeze_hook_code",
    "freeze_hooks",
    "hooks_fields",
    "model_graphdefs",
    "resolve_residency",
]

OPTIONAL_HOOKS = ("metrics", "train_metrics", "finalize_metrics", "train_step")
HOOK_POSITIONAL = {
    "train_step": ("step",),
    "forward": ("model",),
    "loss": ("outputs",),
    "metrics": ("outputs",),
    "train_metrics": ("outputs",),
}
DEFAULT_RESIDENCY = {"train_metrics": "device", "metrics": "host"}
TRACED_CODE_HOOKS = ("forward", "loss", "metrics", "train_metrics", "train_step")
REBUILD_SECONDS = 0.05  # the most `_peek` spends building a cheap first batch again


def build(
    instance: Any,
    keywords: RunKeywords,
    given: Mapping[str, Any],
    *,
    events: Events,
    data: Mapping[str, Any] | None = None,
    weights: WeightsSource | CheckpointWeights | AveragedWeights | Partial | None = None,
    dispatch: DispatchChoice | None = None,
) -> tuple[RunSetup, RunTime, TrainState]:
    """The setup sequence of `Nitro(e, **keywords)`: nothing compiles here. `dispatch` is an
    earlier handle's steps-per-dispatch choice (`weights=` a handle) to continue, unless
    `steps_per_dispatch` says otherwise."""
    configure_persistent_cache()  # before build_model, so its init ops are cached too
    if keywords.hooks is not None:  # hooks=: the class with those methods, the same fields
        instance = keywords.hooks.experiment(instance)
    cls = type(instance)
    hooks, hook_functions = freeze_hooks(cls)
    residency = resolve_residency(instance)
    if keywords.hooks is not None:
        try:
            keywords.hooks.check(residency)
        except ValueError as error:
            raise SetupError(str(error)) from None
    fields_by_hook = hooks_fields(cls, hooks)
    splits_given = _build_data(instance, data, events, keywords.seed, keywords.validation_split)
    placement = _placement(keywords)
    device_specs, device_dtypes, device_values, device_sets = _device_fields(instance, placement)
    model = _build_model(
        instance,
        keywords.seed,
        weights,
        events,
        linen_init=(splits_given, hooks, fields_by_hook),
    )
    remat = _remat(instance, keywords, model)
    params, rest = placement.lay_out(model.params, model.model_state)
    optimizer, opt_state = _build_optimizer(instance, keywords, splits_given, params, placement)
    precision = _precision(cls, keywords)
    prefetch_mode = keywords.prefetch
    if prefetch_mode == "auto" and keywords.given("prefetch_workers"):
        prefetch_mode = "threads"  # asking for workers means wanting them
    prefetch = PrefetchSettings(
        workers=keywords.prefetch_workers,
        device_batches=keywords.device_batches,
        host_batches=keywords.host_batches,
        ordered=keywords.ordered,
        persistent=keywords.persistent_workers,
    )
    events.phase("routing")
    splits, prefetchers = {}, {}
    for name, source in splits_given.items():
        splits[name], prefetchers[name] = _setup_split(
            name, source, placement, hooks, fields_by_hook, residency, prefetch, prefetch_mode
        )
    eval_splits = _eval_splits(keywords, splits)
    takes_rngs = any(spec.takes_rngs for spec in fields_by_hook.values())
    total_steps, schedules, feed = _bind_schedules(
        instance,
        keywords,
        splits,
        optimizer,
        device_specs,
        device_dtypes,
        device_values,
        placement,
        device_sets,
    )
    if takes_rngs:  # the train step's keys: fold_in(key(seed), step), fed with each step
        feed.seed_keys(keywords.seed)
    code, model_setup = _freeze_code(
        cls, hook_functions, model.graphdefs, params, rest, opt_state, optimizer
    )
    experiment = ExperimentSetup(
        cls=cls,
        owner=f"{cls.__module__}.{cls.__qualname__}",
        graphconst=FrozenDict(
            (s.name, getattr(instance, s.name))
            for s in field_specs(cls)
            if s.kind is FieldKind.GRAPHCONST
        ),
        device_specs=FrozenDict(device_specs),
        device_dtypes=FrozenDict(device_dtypes),
        device_sets=FrozenDict(device_sets),
        hooks=FrozenDict(hooks),
        hook_functions=FrozenDict(hook_functions),
        hook_fields=FrozenDict(fields_by_hook),
        residency=FrozenDict(residency),
        code=code,
        model_classes=model_setup.pop("classes"),
        preset=preset_of(instance),
        values=freeze({s.name: setting_token(getattr(instance, s.name)) for s in field_specs(cls)}),
    )
    setup = RunSetup(
        experiment=experiment,
        keywords=keywords.resolved,
        given_keywords=freeze(dict(given)),
        seed=keywords.seed,
        max_epochs=keywords.max_epochs,
        run_dir=keywords.run_dir,
        check_divergence=keywords.check_divergence,
        checkpointer=keywords.checkpointer,
        early_stop=keywords.early_stop,
        resume=_resume_from(keywords.resume),
        splits=FrozenDict(splits),
        placement=placement,
        model=ModelSetup(
            **model_setup,
            param_count=int(sum(np.size(x) for x in jax.tree.leaves(params))),
            weights_origin=model.origin,
            weights_checkpoint=model.checkpoint,
            weights_from=freeze(model.leaves_from),
        ),
        optimizer=optimizer,
        schedules=tuple(schedules),
        total_steps=total_steps,
        prefetch=prefetch,
        accum=keywords.accum,
        ema=keywords.ema,
        sam=keywords.sam,
        precision=precision,
        name=keywords.name,
        eval_splits=eval_splits,
        max_steps=keywords.max_steps,
        val_every_steps=keywords.val_every_steps,
        frozen_statistics=_frozen_statistics(instance, keywords, model.model_state, optimizer),
        compile_options=keywords.compile_options,
        remat=remat,
    )
    runtime = RunTime(
        experiment=instance,
        feed=feed,
        dispatch=DispatchPlan(
            _dispatch_start(keywords, dispatch),
            agree=placement.agree if placement.multi_process else None,
        ),
        prefetchers=FrozenDict(prefetchers),
    )
    with_ema = keywords.ema is not None and optimizer is not None
    state = TrainState(
        variables=Variables(
            params=jax.tree.leaves(params),
            model_state=jax.tree.leaves(rest),
            opt_state=jax.tree.leaves(opt_state) if opt_state is not None else None,
            ema=[copy_array(x) for x in jax.tree.leaves(params)] if with_ema else None,
            ema_steps=placement.put_replicated(jnp.zeros((), jnp.int32)) if with_ema else None,
            loss_scale=[placement.put_replicated(x) for x in precision.initial_state()]
            if precision.scaled and optimizer is not None
            else None,
        ),
        seed=keywords.seed,
    )
    return setup, runtime, state


def _remat(instance: Any, keywords: RunKeywords, model: BuiltModel):
    """`remat=` resolved against the model: the modules it names (refused for a path the
    model does not have, and for a `train_step` hook, which differentiates by itself)."""
    if keywords.remat is None:
        return None
    if has_method(type(instance), "train_step"):
        raise SetupError(
            f"remat= applies to the train step Nitro builds; {type(instance).__qualname__} "
            f"defines train_step, which takes its gradients itself: leave remat= out and wrap "
            f"the modules in nnx.remat inside it"
        )
    try:
        merged = nnx.merge(model.graphdefs[0], model.params, model.model_state)
        return keywords.remat.resolve(merged)
    except ValueError as error:
        raise SetupError(str(error)) from None


def _frozen_statistics(
    instance: Any, keywords: RunKeywords, model_state: Any, optimizer: Any
) -> tuple[tuple[int, str], ...]:
    """`freeze_batch_stats=True`: each batch statistic (`nnx.BatchStat`) of the model state,
    by leaf index, with the fed learning rate of its group (`param_group` of its path)."""
    if not keywords.freeze_batch_stats or optimizer is None:
        return ()
    names = set(optimizer.names)
    if "learning_rate" in names:  # no groups: the run's learning rate
        group_of = lambda path: None  # noqa: E731
    elif not has_method(type(instance), "param_group") or not optimizer.groups:
        raise SetupError(
            "freeze_batch_stats=True keeps a group's batch statistics while the group's "
            "learning rate is 0, and this optimizer feeds no learning rate per group: define "
            "`param_group(self, path)`, or drop freeze_batch_stats"
        )
    else:
        group_of = instance.param_group
    variables = jax.tree.leaves(model_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    frozen = []
    for i, (path, variable) in enumerate(zip(leaf_paths(model_state), variables, strict=True)):
        if not isinstance(variable, nnx.BatchStat):
            continue
        group = group_of(path)
        name = "learning_rate" if group is None else f"{group}/learning_rate"
        if name not in names:
            raise SetupError(
                f"param_group({path!r}) returned {group!r} for a batch statistic "
                f"(freeze_batch_stats=True groups them with the parameters), and no parameter "
                f"is in that group; return the group of the layer's parameters"
            )
        frozen.append((i, name))
    return tuple(frozen)


def _placement(keywords: RunKeywords) -> Placement:
    """The devices and the state's layout: `mesh=` sets the device count (an `n_devs` given
    as well must agree); `sharding=` the strategy."""
    n_devs = keywords.n_devs if keywords.mesh is None or keywords.given("n_devs") else None
    try:
        return Placement(n_devs, mesh=keywords.mesh, sharding=keywords.sharding)
    except PlacementError as error:
        source = keywords.source("mesh" if keywords.mesh is not None else "n_devs")
        raise PlacementError(f"{error} [{source}]") from None


def _eval_splits(keywords: RunKeywords, splits: Mapping[str, Any]) -> tuple[str, ...]:
    """The splits evaluated at each epoch's end: `eval_splits=`, each one of build_data's, or
    ('val',) when there is one."""
    names = keywords.eval_splits
    if names is None:
        names = ("val",) if "val" in splits else ()
    unknown = [name for name in names if name not in splits]
    if unknown:
        have = ", ".join(repr(name) for name in splits if name != "train") or "none"
        raise SetupError(
            f"eval_splits names {', '.join(map(repr, unknown))}, which build_data does not "
            f"return (its evaluation splits: {have}); name those, or add the split to "
            f"build_data [{keywords.source('eval_splits')}]"
        )
    return tuple(names)


def _precision(cls: type, keywords: RunKeywords) -> Precision:
    """The `precision` keyword, refused with a `train_step` hook (which computes its own
    gradients, so casts and scales them itself)."""
    precision = keywords.precision
    if precision.mixed and has_method(cls, "train_step"):
        raise SetupError(
            f"precision={precision.compute!r} does not combine with a train_step hook, which "
            f"computes its own gradients: build the models in {precision.compute} inside it "
            f"(Flax NNX layers take dtype=jnp.{precision.compute}, param_dtype=jnp.float32), "
            f"or leave precision='float32' [{keywords.source('precision')}]"
        )
    return precision


def _resume_from(resume: Any) -> CheckpointRef | Literal["auto"] | None:
    """The `resume` keyword as the setup keeps it: None (a new run), "auto", or a checkpoint."""
    if resume is False:
        return None
    if resume == "auto":
        return "auto"
    if isinstance(resume, tuple):
        return CheckpointRef(resume[0], resume[1])
    return CheckpointRef(resume)


def _dispatch_start(keywords: RunKeywords, inherited: DispatchChoice | None) -> DispatchChoice:
    """Where steps per dispatch starts: a given K, a given choice (`steps_per_dispatch=
    n.dispatch`), the choice of the handle `weights=` came from, or "auto" afresh."""
    setting = keywords.steps_per_dispatch
    if isinstance(setting, DispatchChoice):
        setting, inherited = setting.setting, setting
    if setting == "auto" and inherited is not None:
        if inherited.setting == "auto" and not inherited.probing:  # measured: carry it over
            return inherited
    return DispatchChoice.of(setting)


# ---------------------------------------------------------------------------------------------
# hooks


def _frozen_copy(fn):
    """A copy of a function with today's code: an in-place patch of the original (IPython's
    autoreload swaps `__code__`) does not reach a handle that froze its hooks."""
    if not isinstance(fn, types.FunctionType):
        return fn
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__module__ = fn.__module__
    copy.__doc__ = fn.__doc__
    copy.__dict__.update(fn.__dict__)
    return copy


def _hook_function(cls: type, name: str):
    """(the function to fingerprint, the callable taking the view first), frozen now."""
    attr = inspect.getattr_static(cls, name)
    if isinstance(attr, staticmethod):
        fn = _frozen_copy(attr.__func__)
        return fn, (lambda view, *a, **k: fn(*a, **k))
    if isinstance(attr, classmethod):
        fn = _frozen_copy(attr.__func__)
        return fn, (lambda view, *a, **k: fn(cls, *a, **k))
    fn = _frozen_copy(attr)
    return fn, fn


def hooks_fields(cls: type, hooks: Mapping[str, Any]) -> dict[str, Any]:
    """Hook -> the batch fields it takes (`HookFields`), for the hooks that take batches."""
    return {
        name: hook_fields(cls, name, HOOK_POSITIONAL[name])
        for name in HOOK_POSITIONAL
        if name in hooks
    }


def freeze_hooks(cls: type) -> tuple[dict, dict]:
    """Copies of the hook functions as they are now: (callables, functions)."""
    hooks, functions = {}, {}
    for name in ("forward", "loss") + OPTIONAL_HOOKS:
        if has_method(cls, name):
            functions[name], hooks[name] = _hook_function(cls, name)
    return hooks, functions


def resolve_residency(instance: Any) -> dict[str, str]:
    residency = dict(DEFAULT_RESIDENCY)
    if has_method(type(instance), "metrics_residency"):
        for hook in residency:
            chosen = instance.metrics_residency(hook)
            if chosen not in ("host", "device"):
                raise SetupError(
                    f"metrics_residency({hook!r}) returned {chosen!r}; it must return "
                    f"'host' or 'device'"
                )
            residency[hook] = chosen
    return residency


# ---------------------------------------------------------------------------------------------
# data, Device fields, model, optimizer


def _build_data(
    instance: Any, data: Any, events: Events, seed: int, validation_split: float | None = None
) -> dict[str, Any]:
    events.phase("building data")
    if data is None:
        data = instance.build_data()
    if not isinstance(data, Mapping):
        raise SetupError(
            f"build_data must return a dict of split name -> loader, e.g. "
            f"{{'train': ..., 'val': ...}}; got {type(data).__name__}"
        )
    size = getattr(instance, "batch_size", None)
    size = size if isinstance(size, int) and not isinstance(size, bool) else None
    adopted = {split: adopt(split, source, size) for split, source in data.items()}
    if validation_split is not None:
        adopted = _held_out(adopted, validation_split)
    return {split: _seeded(_restartable(split, source), seed) for split, source in adopted.items()}


def _held_out(splits: Mapping[str, Any], fraction: float) -> dict[str, Any]:
    """`validation_split=`: a 'val' split of the last `fraction` of the 'train' arrays."""
    where = f"validation_split={fraction}"
    if "val" in splits:
        raise SetupError(
            f"{where} holds out a 'val' split from 'train', and build_data returns a 'val' "
            f"split already: leave validation_split out, or return no 'val' split"
        )
    train = splits.get("train")
    if not isinstance(train, ArrayLoader):
        raise SetupError(
            f"{where} holds out the last part of array data, and the 'train' split is "
            f"{'missing' if train is None else type(train).__name__}: give 'train' as a "
            f"nitro.data.ArrayLoader (or a dict of arrays), or return a 'val' split from "
            f"build_data"
        )
    held = int(train.num_samples) - int(train.num_samples * (1.0 - fraction))
    if held < 1 or train.num_samples - held < train.global_batch_size:
        raise SetupError(
            f"{where} of {train.num_samples} samples holds out {held}, leaving "
            f"{train.num_samples - held} to train on in batches of {train.global_batch_size}: "
            f"give a fraction that leaves at least one sample out and one batch in"
        )
    kept, val = train.holding_out(fraction)
    return {**splits, "train": kept, "val": val}


def _seeded(source: Any, seed: int) -> Any:
    """A loader left without a seed (`ArrayLoader(seed=None)`, the default) shuffles by the
    run's `seed=`: a copy of it that does, so one loader can feed handles of several seeds."""
    if isinstance(source, NoPrefetch):
        return NoPrefetch(_seeded(source.source, seed))
    if isinstance(source, (ArrayLoader, IndexedBatches, HFIterableSource)):
        return source.with_seed(seed)
    return source


def _restartable(split: str, source: Any) -> Any:
    """Every epoch iterates a split again: refuse one-shot iterators, and turn a function that
    returns a fresh iterator into a source."""
    if isinstance(source, NoPrefetch):
        return NoPrefetch(_restartable(split, source.source))
    if is_index_addressable(source):
        return source
    if is_one_shot(source):
        raise SetupError(
            f"split '{split}' is a one-shot iterator ({type(source).__name__}): it can be "
            f"iterated once, but setup reads its first batch and every epoch iterates it "
            f"again. Give a list of batches, a nitro.data.ArrayLoader, or a function that "
            f"returns a fresh iterator (e.g. {{'{split}': lambda: make_batches()}})."
        )
    if callable(source) and not isinstance(source, Iterable):
        return FromFactory(source)
    return source


def _device_dtype(spec_type: Any, value: Any):
    if spec_type is float or spec_type == "float":
        return jnp.float32
    if spec_type is int or spec_type == "int":
        return jnp.int32
    if spec_type is bool or spec_type == "bool":
        return jnp.bool_
    return jnp.asarray(value).dtype


def _device_fields(instance: Any, placement: Placement):
    """Device fields, converted to their declared dtype once and replicated. A buffer set (a
    dict or tuple of arrays) is fed as its parts, each under its path (`table['w']`), and
    put together again where a hook reads the field (`device_sets`)."""
    specs = {s.name: s for s in field_specs(type(instance)) if s.kind is FieldKind.DEVICE}
    dtypes, values, sets = {}, {}, {}
    for name, spec in specs.items():
        raw = getattr(instance, name)
        parts = [(name, spec.type, raw)]
        if buffer_set_type(spec.type) is not None:
            leaves, treedef = jax.tree_util.tree_flatten_with_path(raw)
            parts = [(name + jax.tree_util.keystr(path), None, v) for path, v in leaves]
            sets[name] = (treedef, tuple(part for part, _, _ in parts))
        for part, tp, value in parts:
            dtypes[part] = _device_dtype(tp, value)
            values[part] = placement.put_replicated(jnp.asarray(value, dtype=dtypes[part]))
    return specs, dtypes, values, sets


class BuiltModel(NamedTuple):
    """What `build_model` (and `weights=`) gave: graph definitions and weights."""

    graphdefs: tuple[Any, Any]  # train mode, eval mode
    params: Any  # nnx.State of the parameters
    model_state: Any  # nnx.State of the other variables
    origin: str  # "build_model", or where `weights=` came from
    checkpoint: SavedWeights | None  # when the weights came from a checkpoint
    leaves_from: Mapping[str, str] | None = None  # leaf -> its source, for `weights=Partial`


def _build_model(
    instance: Any,
    seed: int,
    weights: WeightsSource | CheckpointWeights | AveragedWeights | Partial | None,
    events: Events,
    linen_init,
) -> BuiltModel:
    """The model's graph definitions and weights (`weights=` copied over the new ones)."""
    events.phase("building model")
    model = build_model(lambda: as_nnx_model(instance.build_model(nnx.Rngs(seed))))
    if isinstance(model, Mapping):  # several models, by name (GANs, teacher and student, ...)
        bad = {k: type(v).__name__ for k, v in model.items() if not isinstance(v, nnx.Module)}
        if not model or bad:
            raise SetupError(
                f"build_model returned a dict, which must map names to flax.nnx.Modules; "
                f"got {bad or 'an empty dict'}"
            )
        model = nnx.Dict({str(k): v for k, v in model.items()})
    elif has_method(type(instance), "train_step"):
        raise SetupError(
            f"{type(instance).__qualname__} defines train_step, which trains models by name: "
            f"build_model must return a dict of them, e.g. {{'gen': Generator(...), "
            f"'disc': Critic(...)}} (or {{'model': model}} for one)"
        )
    if is_linen(model):
        model = bridge_linen(model, nnx.Rngs(seed), _first_forward(instance, *linen_init))
    if not isinstance(model, nnx.Module):
        raise SetupError(
            f"build_model must return a flax.nnx.Module, a flax.linen.Module or an "
            f"equinox.Module; got {type(model).__name__}"
        )
    if isinstance(weights, Partial):  # into the model itself: layouts follow its modules' types
        loaded = weights.load_into(model)
        graphdefs, params, rest = model_graphdefs(model)
        return BuiltModel(graphdefs, params, rest, loaded.origin, None, loaded.leaves)
    graphdefs, params, rest = model_graphdefs(model)
    if weights is None:
        return BuiltModel(graphdefs, params, rest, origin_in_model(model), None)
    found = weights.resolve(params, rest)
    return BuiltModel(graphdefs, found.params, found.model_state, found.origin, found.checkpoint)


def model_graphdefs(model: nnx.Module) -> tuple[tuple[nnx.GraphDef, nnx.GraphDef], Any, Any]:
    """((graph definition in train mode, in eval mode), parameters, the rest of the state)."""
    model.train()
    graphdef_train, params, rest = nnx.split(model, nnx.Param, ...)
    model.eval()
    graphdef_eval, _, _ = nnx.split(model, nnx.Param, ...)
    model.train()
    return (graphdef_train, graphdef_eval), params, rest


def _first_forward(instance: Any, splits: Mapping[str, Any], hooks, hooks_fields):
    """A call of `forward` on the first batch (of 'train', else the first split): how a Linen
    module learns its input shapes."""
    if not splits:
        raise SetupError(
            "build_model returned a Linen module, which is initialized from the shapes of the "
            "first batch, but build_data returns no splits"
        )
    split = "train" if "train" in splits else next(iter(splits))
    source = splits[split]
    batch, _ = _peek(source.source if isinstance(source, NoPrefetch) else source, split)
    fields = hooks_fields["forward"].resolve(tuple(batch), split)
    inputs: dict[str, Any] = {name: jnp.asarray(batch[name]) for name in fields}
    if hooks_fields["forward"].takes_rngs:
        inputs["rngs"] = nnx.Rngs(EVAL_SEED)
    return lambda model: hooks["forward"](instance, model, **inputs)


def _build_optimizer(
    instance: Any,
    keywords: RunKeywords,
    splits: Mapping[str, Any],
    params: Any,
    placement: Placement,
) -> tuple[FedOptimizer | None, Any]:
    """The optimizer and its state, when there is a train split to use them."""
    if "train" not in splits:
        return None, None
    param_group = instance.param_group if has_method(type(instance), "param_group") else None
    settings = OptimizerSettings(
        optimizer=keywords.optimizer,
        learning_rate=keywords.learning_rate,
        learning_rate_explicit=keywords.given("learning_rate"),
        param_group=param_group,
        group_lr=keywords.group_lr,
        weight_decay=keywords.weight_decay,
        decay_to=keywords.decay_to,
        decay_mask=keywords.decay_mask,
        gradient_clip_norm=keywords.gradient_clip_norm,
        scheduled=optimizer_keys(keywords.schedules),
    )
    if has_method(type(instance), "train_step"):
        return _model_optimizers(settings, keywords, params, placement)
    if isinstance(settings.optimizer, Mapping):
        raise SetupError(
            "optimizer returned a dict of optimizers by model, which only a train_step hook "
            "can apply; define train_step(self, step, **fields), or return one optimizer"
        )
    optimizer, opt_state = build_optimizer(settings, params)
    # Injected hyperparameters are fed to every step as arguments, not carried in the state.
    opt_state = optimizer.strip(opt_state)
    return optimizer, placement.put_opt_state(opt_state)


def _model_optimizers(
    settings: OptimizerSettings, keywords: RunKeywords, params: Any, placement: Placement
) -> tuple[FedOptimizer, Any]:
    """Manual training: one optimizer per model (a dict by model name, or one optimizer for
    each), with its own state and hyperparameters (`gen/learning_rate`)."""
    from nitro.programs.manual import ModelOptimizers

    models = list(params.keys())
    given = settings.optimizer
    if isinstance(given, Mapping):
        unknown = sorted(set(given) - set(models))
        missing = sorted(set(models) - set(given))
        if unknown or missing:
            raise SetupError(
                f"optimizer returned optimizers for {sorted(given)}, but the models are "
                f"{models}"
                + (f": no model {unknown}" if unknown else "")
                + (f": none for {missing}" if missing else "")
            )
    for name, value in (("accum", keywords.accum), ("sam", keywords.sam)):
        if value not in (None, 1):
            raise SetupError(
                f"{name}= does not combine with a train_step hook, which computes its own "
                f"gradients: accumulate or perturb inside train_step [{keywords.source(name)}]"
            )
    setups, states = {}, {}
    for model in models:
        spec = given[model] if isinstance(given, Mapping) else given
        prefix = f"{model}/"  # the model's schedule keys, as its own optimizer names them
        scheduled = frozenset(k.removeprefix(prefix) for k in settings.scheduled)
        try:
            setups[model], states[model] = build_optimizer(
                dataclasses.replace(settings, optimizer=spec, scheduled=scheduled), params[model]
            )
        except SetupError as error:  # a hyperparameter out of its range: say whose
            raise SetupError(f"the optimizer of model {model!r}: {error}") from None
    optimizer = ModelOptimizers(setups)
    return optimizer, placement.put_opt_state(optimizer.strip(states))


# ---------------------------------------------------------------------------------------------
# splits and routing


def _peek(source: Any, split: str) -> tuple[Mapping[str, Any], float | None]:
    """The first batch, and for an index-addressable source the time one batch takes to
    build (a cheap first batch is built a few times more, warm, and the fastest counts)."""
    build_seconds = None
    try:
        if is_index_addressable(source):
            plan = source.begin_epoch(0)
            start = time.perf_counter()
            batch = source.batch_at(0, plan)
            build_seconds = spent = time.perf_counter() - start
            # the fastest of a few more, warm, so a busy machine's pause (or a cold first
            # build) does not read as a slow source: within REBUILD_SECONDS, a cheap one only
            for _ in range(5 if build_seconds < REBUILD_SECONDS / 2 else 0):
                start = time.perf_counter()
                source.batch_at(0, plan)
                took = time.perf_counter() - start
                build_seconds, spent = min(build_seconds, took), spent + took
                if spent > REBUILD_SECONDS:
                    break
        else:
            iterator = iter(source)
            try:
                batch = next(iterator)
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:  # release what the probe started (generators, workers)
                    close()
    except StopIteration:
        raise SetupError(f"the '{split}' split yields no batches") from None
    if not isinstance(batch, Mapping):
        raise SetupError(
            f"the '{split}' split yields {type(batch).__name__}; a batch is a dict of arrays "
            f"with the batch axis first, e.g. {{'x': images, 'y': labels}}"
        )
    return batch, build_seconds


def _check_device_dtype(split: str, name: str, value: Any, fields: Mapping) -> None:
    dtype = np.asarray(value).dtype
    if dtype.kind in "biufc":
        return
    hooks = [hook for hook, names in fields.items() if name in names]
    what = {"U": "strings", "S": "bytes", "O": "Python objects"}.get(dtype.kind, dtype.name)
    raise SetupError(
        f"field {name!r} of the '{split}' split has dtype {dtype} ({what}), but "
        f"{' and '.join(hooks)} run{'s' * (len(hooks) == 1)} on the device, which takes numbers "
        f"and booleans only. Encode it as integers in the loader (e.g. "
        f"labels, {name} = np.unique({name}, return_inverse=True)), or read it only in a host "
        f"metrics hook."
    )


def batch_size(batch: Mapping[str, Any], split: str) -> int:
    lengths = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in batch.items()}
    if len(set(lengths.values())) != 1 or None in lengths.values():
        raise SetupError(
            f"the fields of a '{split}' batch must share their first (batch) axis; lengths: "
            f"{lengths}"
        )
    length = next(iter(lengths.values()))
    assert length is not None  # refused above
    return length


def _setup_split(
    split: str,
    source: Any,
    placement: Placement,
    hooks: Mapping[str, Any],
    hooks_fields: Mapping[str, Any],
    residency: Mapping[str, str],
    prefetch: PrefetchSettings,
    prefetch_mode: str,
) -> tuple[SplitSetup, Prefetcher]:
    """The split's geometry and routing, from its first batch, and its prefetcher."""
    if not isinstance(source, Iterable) and not is_index_addressable(source):
        raise SetupError(
            f"split '{split}' is a {type(source).__name__}; a split is a restartable "
            f"iterable of batches (dicts of arrays), e.g. nitro.data.ArrayLoader"
        )
    inner = source.source if isinstance(source, NoPrefetch) else source
    first, build_seconds = _peek(inner, split)
    if batch_size(first, split) == 0:
        raise SetupError(
            f"the first batch of the '{split}' split has 0 rows; a batch needs at least one "
            f"sample (filter empty batches out of the source)"
        )
    width = getattr(inner, "batch_size", None) or batch_size(first, split)
    placement.check_batch(width, split)
    available = tuple(first)
    training = split == "train"
    train_metrics = residency["train_metrics"] if "train_metrics" in hooks else None
    fields: dict[str, tuple[str, ...]] = {}
    for hook, spec in hooks_fields.items():
        if hook in ("train_metrics", "train_step") and not training:
            continue
        if hook == "loss" and training and "train_step" in hooks:
            continue  # train_step computes its own losses
        if hook == "metrics" and training:
            continue
        if hook == "loss" and not training:
            try:
                fields[hook] = spec.resolve(available, split)
            except RoutingError:
                continue  # no labels on this split: no loss, metrics only
            continue
        fields[hook] = spec.resolve(available, split)
    traced = {"forward", "loss"}
    if training and train_metrics == "device":
        traced.add("train_metrics")
    if training and "train_step" in hooks:
        traced.add("train_step")
    if not training and residency.get("metrics") == "device":
        traced.add("metrics")
    route = frozenset(f for hook in traced for f in fields.get(hook, ()))
    for name in sorted(route):
        _check_device_dtype(split, name, first[name], fields)
    keep_host = (not training and "metrics" in hooks) or (training and train_metrics == "host")
    prefetcher = Prefetcher(
        source,
        place=placement.put_batch,
        place_block=placement.put_block,
        direct=placement.mesh is None and not placement.multi_process,
        route=route,
        settings=prefetch,
        pad_to=None if training else width,
        keep_host=keep_host,
        name=split,
        mode=prefetch_mode,
        build_seconds=build_seconds,
    )
    try:  # a source's len() may refuse (FromFactory without a length)
        batches = len(source) if isinstance(source, Sized) else None
    except TypeError:
        batches = None
    geometry = SplitSetup(
        name=split,
        source=source,
        batches=batches,
        width=width,
        global_width=width * placement.n_devs // placement.local_share
        if placement.multi_process
        else width,
        samples=getattr(inner, "num_samples", None),
        dropped=getattr(inner, "dropped", 0) if training else 0,
        fields=available,
        device_fields=tuple(sorted(route)),
        batch_spec=FrozenDict(
            (name, (tuple(np.shape(first[name])), str(np.asarray(first[name]).dtype)))
            for name in sorted(route)
        ),
        hook_fields=FrozenDict(fields),
    )
    return geometry, prefetcher


# ---------------------------------------------------------------------------------------------
# schedules, code fingerprints


def _bind_schedules(
    instance: Any,
    keywords: RunKeywords,
    splits: Mapping[str, SplitSetup],
    optimizer: Any,
    device_specs: Mapping[str, Any],
    device_dtypes: Mapping[str, Any],
    device_values: Mapping[str, Any],
    placement: Placement,
    device_sets: Mapping[str, Any],
):
    total = None
    train = splits.get("train")
    accum = keywords.accum
    if train is not None and train.batches is not None:
        # an epoch's last optimizer step takes the micro-batches left, when accum does not
        # divide its batches
        total = keywords.max_epochs * steps_per_epoch(train.batches, accum)
    schedules = bind_schedules(
        keywords.schedules,
        hyperparams=optimizer.schedulable if optimizer else {},
        device_fields=device_specs,
        other_fields={
            s.name: s.kind.value
            for s in field_specs(type(instance))
            if s.kind is not FieldKind.DEVICE
        },
        total_steps=total,
        device_values=device_values,
        device_sets=tuple(device_sets),
    )
    check_schedule_values(
        schedules,
        total_steps=total,
        device_shapes={name: np.shape(value) for name, value in device_values.items()},
        device_dtypes=device_dtypes,
    )
    if optimizer:
        optimizer.check_schedules(s.name for s in schedules if s.target == "opt")
    feed = StepFeed(
        hyper_names=optimizer.names if optimizer else (),
        hyper_constants=optimizer.hyperparams if optimizer else {},
        hyper_sources=optimizer.sources() if optimizer else None,
        schedules=schedules,
        device_values=device_values,
        device_dtypes=device_dtypes,
        device_sets=device_sets,
        placement=placement,
    )
    return total, schedules, feed


def freeze_hook_code(cls: type, hook_functions: Mapping[str, Any]) -> dict[str, CodeFingerprint]:
    """The code fingerprint of each traced hook (with the helpers it calls)."""
    code: dict[str, CodeFingerprint] = {}
    for name, fn in hook_functions.items():
        if name in TRACED_CODE_HOOKS:
            fp = Fingerprinter(self_class=cls)
            fp.hook(name, fn)
            code[name] = fp.fingerprint()
    return code


def _freeze_code(
    cls, hook_functions, graphdefs, params, rest, opt_state, optimizer: FedOptimizer | None
):
    """Code fingerprints (hooks, model classes, optimizer update) and the model's tree
    definitions; returns (code, model fields)."""
    code = freeze_hook_code(cls, hook_functions)
    fingerprinter = Fingerprinter()
    structure = fingerprinter.structure(graphdefs[0])
    code["model"] = fingerprinter.fingerprint()
    if optimizer is not None:
        opt_fp = Fingerprinter()
        for label, update in optimizer.updates().items():
            opt_fp.value(update, label)
        code["optimizer"] = opt_fp.fingerprint()
    model = {
        "graphdef_train": graphdefs[0],
        "graphdef_eval": graphdefs[1],
        "params_def": jax.tree.structure(params),
        "model_state_def": jax.tree.structure(rest),
        "opt_state_def": jax.tree.structure(opt_state) if opt_state is not None else None,
        "structure": structure,
        "leaf_paths": FrozenDict(
            {
                "parameter": leaf_paths(params),
                "model state": leaf_paths(rest),
                "optimizer state": leaf_paths(opt_state) if opt_state is not None else (),
            }
        ),
        "classes": tuple(fingerprinter.classes),
    }
    frozen = {
        unit: dataclasses.replace(fp, parts=FrozenDict(fp.parts)) for unit, fp in code.items()
    }
    return FrozenDict(frozen), model
