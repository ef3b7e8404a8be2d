"""Setup: what `Nitro(e)` does before anything compiles.

In order: resolve the run keywords, freeze the hooks, build the data, convert the Device
fields, build the model (and copy `weights=`), build the optimizer state, route batch fields
from each split's first batch, bind schedules, and freeze the code fingerprints the compile
cache keys programs on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import progress, report
from .compile_cache import configure_persistent_cache
from .data import NoPrefetch, Prefetcher, PrefetchSettings, is_index_addressable
from .errors import SetupError
from .experiments import REQUIRED_HOOKS, FieldKind, field_specs, has_method
from .fingerprint import CodeFingerprint, Fingerprinter
from .optimizer import build_optimizer
from .placement import Placement
from .programs import ProgramContext
from .routing import RoutingError, hook_fields
from .run_keywords import resolve_run_keywords
from .schedules import bind_schedules
from .step_feed import StepFeed

__all__ = ["SetupError", "batch_size", "build", "copy_array"]

OPTIONAL_HOOKS = ("metrics", "train_metrics", "finalize_metrics")
HOOK_POSITIONAL = {
    "forward": ("model",),
    "loss": ("outputs",),
    "metrics": ("outputs",),
    "train_metrics": ("outputs",),
}
DEFAULT_RESIDENCY = {"train_metrics": "device", "metrics": "host"}


def build(h, keywords: dict[str, Any]) -> None:
    """The setup sequence of `Nitro(e, **keywords)`: nothing compiles here."""
    configure_persistent_cache()  # before build_model, so its init ops are cached too
    weights = keywords.pop("weights", None)
    data = keywords.pop("data", None)
    value = _configure(h, keywords)
    _freeze_hooks(h)
    _build_data(h, data, value["n_devs"])
    device_values = _device_fields(h)
    graphdefs, params, rest = _build_model(h, weights)
    opt_state = _build_optimizer(h, value, params)
    _route(h)
    _bind_schedules(h, value, device_values)
    _freeze_programs(h, graphdefs, params, rest, opt_state)


def _configure(h, keywords: dict[str, Any]) -> dict[str, Any]:
    """Resolve the run keywords; returns their values by name."""
    h.run = resolve_run_keywords(h.experiment, keywords)
    value = {k: r.value for k, r in h.run.items()}
    h.seed = value["seed"]
    h.max_epochs = value["max_epochs"]
    h.run_dir = value["run_dir"]
    h._check_divergence = value["check_divergence"]
    h._reporter = progress.make_reporter(value["progress"])
    h._prefetch_mode = value["prefetch"]
    if h._prefetch_mode == "auto" and h.run["prefetch_workers"].source != "framework default":
        h._prefetch_mode = "threads"  # asking for workers means wanting them
    h._prefetch_settings = PrefetchSettings(
        workers=value["prefetch_workers"],
        device_batches=value["device_batches"],
        host_batches=value["host_batches"],
        ordered=value["ordered"],
    )
    return value


def _freeze_hooks(h) -> None:
    """GraphConst values and copies of the hook functions, as they are now."""
    h._graphconst = {
        s.name: getattr(h.experiment, s.name)
        for s in field_specs(h.cls)
        if s.kind is FieldKind.GRAPHCONST
    }
    h._hooks = {}
    h._hook_functions = {}
    for name in REQUIRED_HOOKS[2:] + OPTIONAL_HOOKS:
        if has_method(h.cls, name):
            h._hook_functions[name], h._hooks[name] = _hook_function(h.cls, name)
    h._residency = _resolve_residency(h)
    h._train_metrics_residency = (
        h._residency["train_metrics"] if "train_metrics" in h._hooks else None
    )


def _build_data(h, data: Any, n_devs: int) -> None:
    h.phase = "building data"
    if data is None:
        data = h.experiment.build_data()
    if not isinstance(data, Mapping):
        raise SetupError(
            f"build_data must return a dict of split name -> loader, e.g. "
            f"{{'train': ..., 'val': ...}}; got {type(data).__name__}"
        )
    h.splits = dict(data)
    h.placement = Placement(n_devs)


def _device_fields(h) -> dict[str, jax.Array]:
    """Device fields, converted to their declared dtype once and replicated."""
    h._device_specs = {s.name: s for s in field_specs(h.cls) if s.kind is FieldKind.DEVICE}
    h._device_dtypes = {}
    values = {}
    for name, spec in h._device_specs.items():
        raw = getattr(h.experiment, name)
        dtype = _device_dtype(spec.type, raw)
        h._device_dtypes[name] = dtype
        values[name] = h.placement.put_replicated(jnp.asarray(raw, dtype=dtype))
    return values


def _build_model(h, weights: Any):
    """(train and eval graph definitions), parameters, other model state."""
    h.phase = "building model"
    model = h.experiment.build_model(nnx.Rngs(h.seed))
    if not isinstance(model, nnx.Module):
        raise SetupError(f"build_model must return a flax.nnx.Module; got {type(model).__name__}")
    model.train()
    graphdef_train, params, rest = nnx.split(model, nnx.Param, ...)
    model.eval()
    graphdef_eval, _, _ = nnx.split(model, nnx.Param, ...)
    model.train()
    h.weights_origin = "build_model"
    if weights is not None:
        params, rest = _weights_from(h, weights, params, rest)
    params = h.placement.put_replicated(params)
    rest = h.placement.put_replicated(rest)
    h.param_count = int(sum(np.size(x) for x in jax.tree.leaves(params)))
    return (graphdef_train, graphdef_eval), params, rest


def _build_optimizer(h, value: dict[str, Any], params):
    """The optimizer and its state, when there is a train split to use them."""
    h.optimizer = None
    if "train" not in h.splits:
        return None
    lr_explicit = h.run["learning_rate"].source != "framework default"
    h.optimizer, opt_state = build_optimizer(
        value["optimizer"], value["learning_rate"], lr_explicit, params
    )
    if h.optimizer.hyperparams:
        # Injected hyperparameters are fed to every step as arguments; carrying them in the
        # state as well would only add outputs to every step.
        opt_state = opt_state._replace(hyperparams={})
    return h.placement.put_replicated(opt_state)


def _route(h) -> None:
    """Which batch fields each hook receives, from the first batch of each split."""
    h.phase = "routing"
    h._hook_fields = {
        name: hook_fields(h.cls, name, HOOK_POSITIONAL[name])
        for name in HOOK_POSITIONAL
        if name in h._hooks
    }
    h._fields = {}
    h._split_info = {}
    h._prefetchers = {}
    for split, source in h.splits.items():
        _setup_split(h, split, source)


def _bind_schedules(h, value: dict[str, Any], device_values) -> None:
    total = None
    if "train" in h.splits:
        try:
            total = h.max_epochs * len(h.splits["train"])
        except TypeError:
            total = None
    h.total_steps = total
    hyperparams = dict(h.optimizer.hyperparams) if h.optimizer else {}
    h.schedules = bind_schedules(
        value["schedules"],
        hyperparams=hyperparams,
        device_fields=h._device_specs,
        other_fields={
            s.name: s.kind.value for s in field_specs(h.cls) if s.kind is not FieldKind.DEVICE
        },
        total_steps=total,
    )
    constants = dict(hyperparams)
    if h.optimizer and h.optimizer.uses_learning_rate and "learning_rate" in constants:
        constants["learning_rate"] = value["learning_rate"]
    h._feed = StepFeed(
        hyper_names=h.optimizer.names if h.optimizer else (),
        hyper_constants=constants,
        schedules=h.schedules,
        device_values=device_values,
        device_dtypes=h._device_dtypes,
        placement=h.placement,
    )


def _freeze_programs(h, graphdefs, params, rest, opt_state) -> None:
    """Code fingerprints and everything the programs need; the initial train carry."""
    fingerprinter = Fingerprinter()
    model_structure = fingerprinter.structure(graphdefs[0])
    h._model_classes = tuple(fingerprinter.classes)
    h._code = _hook_fingerprints(h)
    h._code["model"] = fingerprinter.fingerprint()
    if h.optimizer is not None:
        opt_fp = Fingerprinter()
        opt_fp.value(h.optimizer.tx.update, "optimizer update")
        h._code["optimizer"] = opt_fp.fingerprint()
    h._ctx = ProgramContext(
        cls=h.cls,
        owner=h.owner,
        graphconst=h._graphconst,
        hooks=h._hooks,
        graphdef_train=graphdefs[0],
        graphdef_eval=graphdefs[1],
        params_def=jax.tree.structure(params),
        rest_def=jax.tree.structure(rest),
        opt_def=jax.tree.structure(opt_state) if opt_state is not None else None,
        tx=h.optimizer.tx if h.optimizer else None,
        hyper_names=h.optimizer.names if h.optimizer else (),
        hyper_dtypes=h.optimizer.dtypes if h.optimizer else {},
        check_divergence=h._check_divergence,
        residency=h._residency,
        code=h._code,
        model_structure=model_structure,
        leaf_paths={
            "parameter": _leaf_paths(params),
            "model state": _leaf_paths(rest),
            "optimizer state": _leaf_paths(opt_state) if opt_state is not None else (),
        },
        device_names=tuple(h._device_specs),
    )
    healthy = h.placement.put_replicated(jnp.asarray(True))
    h._carry = (
        jax.tree.leaves(params),
        jax.tree.leaves(rest),
        jax.tree.leaves(opt_state) if opt_state is not None else None,
        healthy,
    )


def _frozen_copy(fn):
    """A copy of a function with today's code: an in-place patch of the original (IPython's
    autoreload swaps `__code__`) does not reach a handle that froze its hooks."""
    import types

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
    import inspect

    attr = inspect.getattr_static(cls, name)
    if isinstance(attr, staticmethod):
        fn = _frozen_copy(attr.__func__)
        return fn, (lambda view, *a, **k: fn(*a, **k))
    if isinstance(attr, classmethod):
        fn = _frozen_copy(attr.__func__)
        return fn, (lambda view, *a, **k: fn(cls, *a, **k))
    fn = _frozen_copy(attr)
    return fn, fn


def _peek(source: Any, split: str) -> tuple[Mapping[str, Any], float | None]:
    """The first batch, and for an index-addressable source the time one batch takes to
    build (a cheap first batch is built once more, warm, to measure it)."""
    build_seconds = None
    try:
        if is_index_addressable(source):
            plan = source.begin_epoch(0)
            start = time.perf_counter()
            batch = source.batch_at(0, plan)
            build_seconds = time.perf_counter() - start
            if build_seconds < 1e-3:
                start = time.perf_counter()
                source.batch_at(0, plan)
                build_seconds = min(build_seconds, time.perf_counter() - start)
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


def batch_size(batch: Mapping[str, Any], split: str) -> int:
    lengths = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in batch.items()}
    if len(set(lengths.values())) != 1 or None in lengths.values():
        raise SetupError(
            f"the fields of a '{split}' batch must share their first (batch) axis; lengths: "
            f"{lengths}"
        )
    return next(iter(lengths.values()))


def _device_dtype(spec_type: Any, value: Any):
    if spec_type is float or spec_type == "float":
        return jnp.float32
    if spec_type is int or spec_type == "int":
        return jnp.int32
    if spec_type is bool or spec_type == "bool":
        return jnp.bool_
    return jnp.asarray(value).dtype


def _resolve_residency(h) -> dict[str, str]:
    residency = dict(DEFAULT_RESIDENCY)
    if has_method(h.cls, "metrics_residency"):
        for hook in residency:
            chosen = h.experiment.metrics_residency(hook)
            if chosen not in ("host", "device"):
                raise SetupError(
                    f"metrics_residency({hook!r}) returned {chosen!r}; it must return "
                    f"'host' or 'device'"
                )
            residency[hook] = chosen
    return residency


def _setup_split(h, split: str, source: Any) -> None:
    if not isinstance(source, Iterable) and not is_index_addressable(source):
        raise SetupError(
            f"split '{split}' is a {type(source).__name__}; a split is a restartable "
            f"iterable of batches (dicts of arrays), e.g. nitro.data.ArrayLoader"
        )
    inner = source.source if isinstance(source, NoPrefetch) else source
    first, build_seconds = _peek(inner, split)
    width = getattr(inner, "batch_size", None) or batch_size(first, split)
    h.placement.check_batch(width, split)
    available = tuple(first)
    fields: dict[str, tuple[str, ...]] = {}
    training = split == "train"
    for hook, spec in h._hook_fields.items():
        if hook == "train_metrics" and not training:
            continue
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
    if training and h._train_metrics_residency == "device":
        traced.add("train_metrics")
    if not training and h._residency.get("metrics") == "device":
        traced.add("metrics")
    route = frozenset(f for hook in traced for f in fields.get(hook, ()))
    keep_host = (not training and "metrics" in h._hooks) or (
        training and h._train_metrics_residency == "host"
    )
    h._fields[split] = fields
    h._prefetchers[split] = Prefetcher(
        source,
        place=h.placement.put_batch,
        route=route,
        settings=h._prefetch_settings,
        pad_to=None if training else width,
        keep_host=keep_host,
        name=split,
        mode=h._prefetch_mode,
        build_seconds=build_seconds,
    )
    num_samples = getattr(inner, "num_samples", None)
    try:
        batches = len(source)
    except TypeError:
        batches = None
    h._split_info[split] = {
        "batches": batches,
        "width": width,
        "global_width": width * h.placement.n_devs // h.placement.local_share
        if h.placement.multi_process
        else width,
        "samples": num_samples,
        "dropped": getattr(inner, "dropped", 0) if training else 0,
        "fields": available,
        "device_fields": tuple(sorted(route)),
    }


def _hook_fingerprints(h) -> dict[str, CodeFingerprint]:
    code = {}
    for name, fn in h._hook_functions.items():
        if name in ("forward", "loss", "metrics", "train_metrics"):
            fp = Fingerprinter(self_class=h.cls)
            fp.hook(name, fn)
            code[name] = fp.fingerprint()
    return code


def _weights_from(h, source: Any, params, rest):
    if type(source).__name__ != "Nitro" or not hasattr(source, "_carry"):
        raise SetupError(
            f"weights= takes a Nitro handle to start from; got {type(source).__name__}"
        )
    with source._lock:
        src_params = jax.tree.unflatten(source._ctx.params_def, source._carry[0])
        src_rest = jax.tree.unflatten(source._ctx.rest_def, source._carry[1])
        report.check_same_tree("parameters", params, src_params)
        report.check_same_tree("model state", rest, src_rest)
        h.weights_origin = (
            f"the weights of a {source.cls.__name__} run at epoch {source.epoch}, "
            f"step {source.step}"
        )
        return jax.tree.map(copy_array, src_params), jax.tree.map(copy_array, src_rest)


def copy_array(x: jax.Array) -> jax.Array:
    """A fresh copy on the same devices (no compile; across processes a jitted copy)."""
    if x.is_fully_addressable:
        return jax.device_put(x, x.sharding, may_alias=False)
    return jnp.array(x, copy=True)


def _leaf_paths(tree: Any) -> tuple[str, ...]:
    return tuple(
        jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    )
