"""`Nitro`: the handle of one run of an experiment.

`Nitro(e)` sets up and compiles nothing: it builds the data, the model and the optimizer
state, resolves the run keywords, the batch routing and the schedules, and freezes the
experiment's configuration and code fingerprints. `train()` runs the loop on a worker thread;
`validate`, `evaluate` and `predict` work on a handle that never trained.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import loop, progress, report
from .compile_cache import CACHE, Program, configure_persistent_cache
from .data import NoPrefetch, Prefetcher, PrefetchSettings, is_index_addressable
from .experiment import (
    REQUIRED_HOOKS,
    ExperimentError,
    FieldKind,
    edit_generation,
    field_specs,
    has_method,
)
from .fingerprint import CodeFingerprint, Fingerprinter
from .optimizer import build_optimizer
from .placement import Placement
from .programs import ProgramContext, device_metrics_spec, eval_spec, train_step_spec
from .routing import HookFields, RoutingError, hook_fields
from .run_keywords import resolve_run_keywords
from .schedules import bind_schedules
from .step_feed import StepFeed

__all__ = ["Nitro", "SetupError"]

TRACED_HOOKS = ("forward", "loss")
OPTIONAL_HOOKS = ("metrics", "train_metrics", "finalize_metrics")
HOOK_POSITIONAL = {
    "forward": ("model",),
    "loss": ("outputs",),
    "metrics": ("outputs",),
    "train_metrics": ("outputs",),
}
DEFAULT_RESIDENCY = {"train_metrics": "device", "metrics": "host"}


class SetupError(ValueError):
    """The experiment, its data or its keywords cannot make a run."""


def _owner(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


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


def _batch_size(batch: Mapping[str, Any], split: str) -> int:
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


class Nitro:
    """The handle of one run of an experiment.

    >>> import nitro
    >>> from nitro.examples.digits import Digits
    >>> n = nitro.Nitro(Digits(max_epochs=1), seed=0, progress=False)   # compiles nothing
    >>> n.train().step                                                   # doctest: +SKIP
    9
    """

    def __init__(self, experiment: Any, **keywords: Any):
        if isinstance(experiment, type) and hasattr(experiment, "__nitro_fields__"):
            raise ExperimentError(
                f"Nitro() takes an experiment instance, not the class: "
                f"Nitro({experiment.__name__}())"
            )
        cls = type(experiment)
        try:
            field_specs(cls)
        except ExperimentError:
            raise ExperimentError(
                f"Nitro() takes an experiment instance (a class decorated with "
                f"@nitro.experiment); got {type(experiment).__name__}"
            ) from None
        missing = [h for h in REQUIRED_HOOKS if not has_method(cls, h)]
        if missing:
            raise ExperimentError(
                f"{cls.__qualname__} is missing required hook{'s' * (len(missing) > 1)} "
                f"{', '.join(missing)}. An experiment defines build_data(self), "
                f"build_model(self, rngs), forward(self, model, *, <fields>) and "
                f"loss(self, outputs, *, <fields>)."
            )
        self._reporter = progress.SilentReporter()
        self.cls = cls
        self.owner = _owner(cls)
        self.experiment = dataclasses.replace(experiment)  # frozen copy of the configuration
        self.phase = "setup"
        self.step = 0
        self.epoch = 0
        self.stop_reason: str | None = None
        self.last_metrics: dict[str, Any] = {}
        self._history: list[dict[str, Any]] = []
        self._position = 0
        self._dispatched = 0
        self._epoch_stats = loop._EpochStats()
        self._upcoming = None  # (epoch, stream) started early, during validation
        self._serving_width: int | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._run = None
        self._programs: dict[tuple, Program] = {}
        self._train_program_aux: dict = {}
        self._stale_seen: tuple = ()
        self._stale_checked = (edit_generation(), 0.0)

        configure_persistent_cache()  # before build_model, so its init ops are cached too
        weights = keywords.pop("weights", None)
        data = keywords.pop("data", None)
        self.run = resolve_run_keywords(self.experiment, keywords)
        value = {k: r.value for k, r in self.run.items()}
        self.seed = value["seed"]
        self.max_epochs = value["max_epochs"]
        self.run_dir = value["run_dir"]
        self._check_divergence = value["check_divergence"]
        self._progress_setting = value["progress"]
        self._reporter = progress.make_reporter(value["progress"])
        self._prefetch_mode = value["prefetch"]
        if (
            self._prefetch_mode == "auto"
            and self.run["prefetch_workers"].source != "framework default"
        ):
            self._prefetch_mode = "threads"  # asking for workers means wanting them
        self._prefetch_settings = PrefetchSettings(
            workers=value["prefetch_workers"],
            device_batches=value["device_batches"],
            host_batches=value["host_batches"],
            ordered=value["ordered"],
        )

        specs = field_specs(cls)
        self._graphconst = {
            s.name: getattr(self.experiment, s.name)
            for s in specs
            if s.kind is FieldKind.GRAPHCONST
        }
        self._hooks = {}
        self._hook_functions = {}
        for name in REQUIRED_HOOKS[2:] + OPTIONAL_HOOKS:
            if has_method(cls, name):
                self._hook_functions[name], self._hooks[name] = _hook_function(cls, name)
        self._residency = self._resolve_residency()
        self._train_metrics_residency = (
            self._residency["train_metrics"] if "train_metrics" in self._hooks else None
        )

        # data
        self.phase = "building data"
        if data is None:
            data = self.experiment.build_data()
        if not isinstance(data, Mapping):
            raise SetupError(
                f"build_data must return a dict of split name -> loader, e.g. "
                f"{{'train': ..., 'val': ...}}; got {type(data).__name__}"
            )
        self.splits: dict[str, Any] = dict(data)
        self.placement = Placement(value["n_devs"])

        # Device fields, converted once and replicated
        self._device_specs = {s.name: s for s in specs if s.kind is FieldKind.DEVICE}
        self._device_dtypes = {}
        device_values = {}
        for name, spec in self._device_specs.items():
            raw = getattr(self.experiment, name)
            dtype = _device_dtype(spec.type, raw)
            self._device_dtypes[name] = dtype
            device_values[name] = self.placement.put_replicated(jnp.asarray(raw, dtype=dtype))

        # model
        self.phase = "building model"
        model = self.experiment.build_model(nnx.Rngs(self.seed))
        if not isinstance(model, nnx.Module):
            raise SetupError(
                f"build_model must return a flax.nnx.Module; got {type(model).__name__}"
            )
        model.train()
        graphdef_train, params, rest = nnx.split(model, nnx.Param, ...)
        model.eval()
        graphdef_eval, _, _ = nnx.split(model, nnx.Param, ...)
        model.train()
        self.weights_origin = "build_model"
        if weights is not None:
            params, rest = self._weights_from(weights, params, rest)
        params = self.placement.put_replicated(params)
        rest = self.placement.put_replicated(rest)
        self.param_count = int(sum(np.size(x) for x in jax.tree.leaves(params)))

        # optimizer (only when there is something to train)
        self.optimizer = None
        opt_state = None
        if "train" in self.splits:
            lr_explicit = self.run["learning_rate"].source != "framework default"
            self.optimizer, opt_state = build_optimizer(
                value["optimizer"], value["learning_rate"], lr_explicit, params
            )
            if self.optimizer.hyperparams:
                # Injected hyperparameters are fed to every step as arguments; carrying them
                # in the state as well would only add outputs to every step.
                opt_state = opt_state._replace(hyperparams={})
            opt_state = self.placement.put_replicated(opt_state)

        # routing, from the first batch of each split
        self.phase = "routing"
        self._hook_fields: dict[str, HookFields] = {
            name: hook_fields(cls, name, HOOK_POSITIONAL[name])
            for name in HOOK_POSITIONAL
            if name in self._hooks
        }
        self._fields: dict[str, dict[str, tuple[str, ...]]] = {}
        self._split_info: dict[str, dict[str, Any]] = {}
        self._prefetchers: dict[str, Prefetcher] = {}
        for split, source in self.splits.items():
            self._setup_split(split, source)

        # schedules
        total = None
        if "train" in self.splits:
            try:
                total = self.max_epochs * len(self.splits["train"])
            except TypeError:
                total = None
        self.total_steps = total
        hyperparams = dict(self.optimizer.hyperparams) if self.optimizer else {}
        self.schedules = bind_schedules(
            value["schedules"],
            hyperparams=hyperparams,
            device_fields=self._device_specs,
            other_fields={s.name: s.kind.value for s in specs if s.kind is not FieldKind.DEVICE},
            total_steps=total,
        )
        constants = dict(hyperparams)
        if self.optimizer and self.optimizer.uses_learning_rate and "learning_rate" in constants:
            constants["learning_rate"] = value["learning_rate"]
        self._feed = StepFeed(
            hyper_names=self.optimizer.names if self.optimizer else (),
            hyper_constants=constants,
            schedules=self.schedules,
            device_values=device_values,
            device_dtypes=self._device_dtypes,
            placement=self.placement,
        )

        # code fingerprints, frozen
        fingerprinter = Fingerprinter()
        model_structure = fingerprinter.structure(graphdef_train)
        self._model_classes = tuple(fingerprinter.classes)
        self._code = self._hook_fingerprints()
        self._code["model"] = fingerprinter.fingerprint()
        if self.optimizer is not None:
            opt_fp = Fingerprinter()
            opt_fp.value(self.optimizer.tx.update, "optimizer update")
            self._code["optimizer"] = opt_fp.fingerprint()
        self._ctx = ProgramContext(
            cls=cls,
            owner=self.owner,
            graphconst=self._graphconst,
            hooks=self._hooks,
            graphdef_train=graphdef_train,
            graphdef_eval=graphdef_eval,
            params_def=jax.tree.structure(params),
            rest_def=jax.tree.structure(rest),
            opt_def=jax.tree.structure(opt_state) if opt_state is not None else None,
            tx=self.optimizer.tx if self.optimizer else None,
            hyper_names=self.optimizer.names if self.optimizer else (),
            hyper_dtypes=self.optimizer.dtypes if self.optimizer else {},
            check_divergence=self._check_divergence,
            residency=self._residency,
            code=self._code,
            model_structure=model_structure,
            leaf_paths={
                "parameter": _leaf_paths(params),
                "model state": _leaf_paths(rest),
                "optimizer state": _leaf_paths(opt_state) if opt_state is not None else (),
            },
            device_names=tuple(self._device_specs),
        )
        healthy = self.placement.put_replicated(jnp.asarray(True))
        self._carry = (
            jax.tree.leaves(params),
            jax.tree.leaves(rest),
            jax.tree.leaves(opt_state) if opt_state is not None else None,
            healthy,
        )
        self.phase = "ready"

    # ------------------------------------------------------------------------------------------
    # setup helpers

    def _resolve_residency(self) -> dict[str, str]:
        residency = dict(DEFAULT_RESIDENCY)
        if has_method(self.cls, "metrics_residency"):
            for hook in residency:
                chosen = self.experiment.metrics_residency(hook)
                if chosen not in ("host", "device"):
                    raise SetupError(
                        f"metrics_residency({hook!r}) returned {chosen!r}; it must return "
                        f"'host' or 'device'"
                    )
                residency[hook] = chosen
        return residency

    def _setup_split(self, split: str, source: Any) -> None:
        if not isinstance(source, Iterable) and not is_index_addressable(source):
            raise SetupError(
                f"split '{split}' is a {type(source).__name__}; a split is a restartable "
                f"iterable of batches (dicts of arrays), e.g. nitro.data.ArrayLoader"
            )
        inner = source.source if isinstance(source, NoPrefetch) else source
        first, build_seconds = _peek(inner, split)
        width = getattr(inner, "batch_size", None) or _batch_size(first, split)
        self.placement.check_batch(width, split)
        available = tuple(first)
        fields: dict[str, tuple[str, ...]] = {}
        training = split == "train"
        for hook, spec in self._hook_fields.items():
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
        if training and self._train_metrics_residency == "device":
            traced.add("train_metrics")
        if not training and self._residency.get("metrics") == "device":
            traced.add("metrics")
        route = frozenset(f for hook in traced for f in fields.get(hook, ()))
        keep_host = (not training and "metrics" in self._hooks) or (
            training and self._train_metrics_residency == "host"
        )
        self._fields[split] = fields
        self._prefetchers[split] = Prefetcher(
            source,
            place=self.placement.put_batch,
            route=route,
            settings=self._prefetch_settings,
            pad_to=None if training else width,
            keep_host=keep_host,
            name=split,
            mode=self._prefetch_mode,
            build_seconds=build_seconds,
        )
        num_samples = getattr(inner, "num_samples", None)
        try:
            batches = len(source)
        except TypeError:
            batches = None
        self._split_info[split] = {
            "batches": batches,
            "width": width,
            "global_width": width * self.placement.n_devs // self.placement.local_share
            if self.placement.multi_process
            else width,
            "samples": num_samples,
            "dropped": getattr(inner, "dropped", 0) if training else 0,
            "fields": available,
            "device_fields": tuple(sorted(route)),
        }

    def _hook_fingerprints(self) -> dict[str, CodeFingerprint]:
        code = {}
        for name, fn in self._hook_functions.items():
            if name in ("forward", "loss", "metrics", "train_metrics"):
                fp = Fingerprinter(self_class=self.cls)
                fp.hook(name, fn)
                code[name] = fp.fingerprint()
        return code

    def _weights_from(self, source: Any, params, rest):
        if not isinstance(source, Nitro):
            raise SetupError(
                f"weights= takes a Nitro handle to start from; got {type(source).__name__}"
            )
        with source._lock:
            src_params = jax.tree.unflatten(source._ctx.params_def, source._carry[0])
            src_rest = jax.tree.unflatten(source._ctx.rest_def, source._carry[1])
            report.check_same_tree("parameters", params, src_params)
            report.check_same_tree("model state", rest, src_rest)
            self.weights_origin = f"weights of {source!r}"
            return jax.tree.map(_copy_array, src_params), jax.tree.map(_copy_array, src_rest)

    # ------------------------------------------------------------------------------------------
    # programs

    def _program(self, slot: tuple, make_spec, args) -> Program:
        program = self._programs.get(slot)
        if program is None:
            program = CACHE.lookup(make_spec(), args)
            self._programs[slot] = program
        return program

    def _train_program(self, args) -> Program:
        fields = self._fields["train"]
        program = self._program(("train",), lambda: train_step_spec(self._ctx, fields), args)
        self._train_program_aux = program.aux
        return program

    def _eval_program(self, split: str, args, with_loss: bool, return_outputs: bool) -> Program:
        fields = self._fields[split]
        slot = ("eval", split, self._split_info[split]["width"])
        return self._program(
            slot,
            lambda: eval_spec(
                self._ctx, fields, with_loss=with_loss, return_outputs=return_outputs
            ),
            args,
        )

    def _metrics_program(self, split: str, args) -> Program:
        width = jax.tree.leaves(args[0])[0].shape[0]
        fields = self._fields[split]
        return self._program(
            ("metrics", split, width), lambda: device_metrics_spec(self._ctx, fields), args
        )

    def _train_shape_error(self, staged, error) -> Exception:
        shapes = {k: tuple(v.shape) for k, v in staged.device.items()}
        first = self._split_info["train"]
        return SetupError(
            f"train batch {staged.index} has shapes {shapes}, but the program was compiled for "
            f"batches of {first['width']}. Training batches must all have the same shape: "
            f"drop the partial final batch (ArrayLoader(..., drop_last=True)). ({error})"
        )

    def _reset_health(self) -> None:
        params, rest, opt, _ = self._carry
        self._carry = (params, rest, opt, self.placement.put_replicated(jnp.asarray(True)))

    def _call_host_hook(self, name: str, *args, **kwargs):
        return self._hook_functions[name](self.experiment, *args, **kwargs)

    def _eval_prefetcher(self, split: str) -> Prefetcher:
        if split not in self.splits:
            raise KeyError(
                f"no split {split!r}: this handle has {', '.join(map(repr, self.splits)) or 'none'}"
                f" (build_data returns them)"
            )
        return self._prefetchers[split]

    # ------------------------------------------------------------------------------------------
    # entry points

    def train(self, epochs: int | None = None, *, background: bool = False) -> Nitro:
        """Train until `max_epochs` (or for `epochs` more epochs) on a worker thread.

        Blocks unless `background=True`. Ctrl-C stops after the current step; the handle
        stays usable and `train()` again continues from where it stopped.
        """
        self._check_stale("train")
        if "train" not in self.splits:
            raise SetupError(
                f"this handle has no 'train' split (splits: {', '.join(self.splits) or 'none'}); "
                f"it can validate, evaluate and predict"
            )
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"epochs must be a positive int, got {epochs!r}")
        if epochs is None and self.epoch >= self.max_epochs:
            progress.note(
                f"already trained {self.epoch} of max_epochs={self.max_epochs} epochs; "
                f"n.train(epochs=N) trains N more"
            )
            return self
        self._start(lambda: loop.train_epochs(self, epochs), "training")
        if not background:
            self.wait()
        return self

    def _start(self, target, what: str) -> None:
        from .runner import Run

        with self._lock:
            if self._run is not None and self._run.running:
                raise RuntimeError(
                    f"{self!r} is already {self.phase}; wait with n.wait() or stop it with n.stop()"
                )
            self._stop.clear()
            self.stop_reason = None

            def body():
                with self._lock, progress.using(self._reporter):
                    try:
                        target()
                        self.phase = "done" if self.stop_reason == "completed" else "stopped"
                    except BaseException:
                        self.phase = "failed"
                        self.stop_reason = "error"
                        raise

            self._run = Run(body, name=f"nitro-{what}-{self.cls.__name__}", context=self)
            self._run.start()

    def wait(self) -> Nitro:
        """Wait for a background run; Ctrl-C turns into a stop request."""
        from .runner import wait_interruptibly

        run = self._run
        if run is None:
            return self
        wait_interruptibly(run, self.stop)
        if run.error is not None:
            error, run.error = run.error, None
            raise error
        return self

    def stop(self) -> Nitro:
        """Ask a running loop to stop after the current step (returns at once)."""
        self._stop.set()
        return self

    request_stop = stop

    @property
    def running(self) -> bool:
        return self._run is not None and self._run.running

    def _guard(self, what: str) -> None:
        if self.running:
            raise RuntimeError(
                f"cannot {what} while this handle is {self.phase} in the background; "
                f"n.stop() then n.wait(), or wait for it to finish"
            )

    def validate(self) -> dict[str, Any]:
        """Loss and metrics on the 'val' split, e.g. {'val_loss': ..., 'val_acc': ...}."""
        return self.evaluate(split="val")

    def evaluate(self, split: str = "test") -> dict[str, Any]:
        """Loss and metrics on any split, prefixed with the split's name."""
        self._check_stale("evaluate")
        self._guard("evaluate")
        self._eval_prefetcher(split)
        with self._lock, progress.using(self._reporter):
            self._stop.clear()
            previous, self.phase = self.phase, f"evaluating {split}"
            try:
                return loop.evaluate_split(self, split)
            finally:
                self.phase = previous

    def predict(self, batch: Any):
        """Run `forward` in eval mode. A dict of arrays -> host numpy outputs; an iterable of
        such dicts -> an iterator of outputs, one per batch."""
        self._check_stale("predict")
        if isinstance(batch, Mapping):
            return self._predict_batch(batch)
        if isinstance(batch, (np.ndarray, jax.Array)) or not isinstance(batch, Iterable):
            needed = self._hook_fields["forward"].describe()
            raise TypeError(
                f"predict takes a dict of batch fields (forward needs: {needed}) or an iterable "
                f"of such dicts; got {type(batch).__name__}. For example: n.predict({{"
                f"'{(self._hook_fields['forward'].required or ('x',))[0]}': xs}})"
            )
        return (self._predict_batch(b) for b in batch)

    def _predict_width(self, n: int) -> int:
        """The compiled width predictions are padded or split to: an evaluation split's batch
        width, else the first prediction's size (so later sizes compile nothing new)."""
        for split in ("val", "test", "train", *self._split_info):
            if split in self._split_info:
                return self._split_info[split]["global_width"]
        if self._serving_width is None:
            self._serving_width = n
        return self._serving_width

    def _predict_batch(self, batch: Mapping[str, Any]):
        self._guard("predict")
        fields = self._hook_fields["forward"].resolve(tuple(batch), "predict")
        host = {k: np.asarray(batch[k]) for k in fields}
        n = _batch_size(host, "predict")
        width = self._predict_width(n)
        chunks = []
        with self._lock, progress.using(self._reporter):
            for start in range(0, n, width):
                from .data import pad_batch

                part, n_real = pad_batch(
                    {k: v[start : start + width] for k, v in host.items()}, width
                )
                device = self.placement.put_batch(self.placement.local_rows(part))
                args = (
                    self._carry[0],
                    self._carry[1],
                    self._feed.current_device(),
                    device,
                    np.int32(n_real),
                )
                program = self._program(
                    ("predict", width, fields),
                    lambda: eval_spec(
                        self._ctx,
                        {"forward": fields},
                        with_loss=False,
                        return_outputs=True,
                    ),
                    args,
                )
                result = program(*args)
                outputs = self.placement.gather(result["outputs"])
                loop._delete(result)
                loop._delete(device)
                chunks.append(jax.tree.map(lambda a, n=n_real: np.asarray(a)[:n], outputs))
        if len(chunks) == 1:
            return chunks[0]
        return jax.tree.map(lambda *parts: np.concatenate(parts, axis=0), *chunks)

    def set_device(self, **values: Any) -> Nitro:
        """Change Device fields on the live handle; never recompiles."""
        for name, value in values.items():
            spec = next((s for s in field_specs(self.cls) if s.name == name), None)
            if spec is None:
                raise AttributeError(
                    f"{self.cls.__qualname__} has no field {name!r}; Device fields: "
                    f"{', '.join(self._device_specs) or 'none'}"
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
            if any(s.target == "device" and s.name == name for s in self.schedules):
                raise TypeError(
                    f"Device field {name!r} is scheduled; its value comes from the schedule"
                )
            self._feed.set_constant(name, value)
            setattr(self.experiment, name, value)
        return self

    def device_value(self, name: str) -> Any:
        """The current value of a Device field, as a host value."""
        if name not in self._device_specs:
            raise AttributeError(f"{name!r} is not a Device field of {self.cls.__qualname__}")
        return (
            np.asarray(self._feed.current_device()[name]).item()
            if np.ndim(self._feed.current_device()[name]) == 0
            else np.asarray(self._feed.current_device()[name])
        )

    # ------------------------------------------------------------------------------------------
    # results

    def history(self):
        """A pandas DataFrame indexed by epoch: loss, val_loss, metrics, timing."""
        import pandas as pd

        rows = [{k: v for k, v in row.items() if np.ndim(v) == 0} for row in self._history]
        frame = pd.DataFrame(rows)
        if not frame.empty:
            frame = frame.set_index("epoch")
        return frame

    def plot(self, path: str | None = None, metrics: Iterable[str] | None = None):
        """Draw the history (loss and metric curves); save a PNG when `path` is given."""
        from .plotting import plot_history

        return plot_history(self.history(), path=path, metrics=metrics, title=self.cls.__name__)

    @property
    def model(self) -> nnx.Module:
        """A copy of the current model (eval mode off), safe to keep and modify."""
        self._guard("copy the model")
        with self._lock:
            params = jax.tree.unflatten(self._ctx.params_def, self._carry[0])
            rest = jax.tree.unflatten(self._ctx.rest_def, self._carry[1])
            return nnx.merge(
                self._ctx.graphdef_train,
                jax.tree.map(_copy_array, params),
                jax.tree.map(_copy_array, rest),
            )

    @property
    def hyperparameters(self) -> dict[str, float]:
        """The optimizer's injected hyperparameters as the last step used them."""
        if self.optimizer is None:
            return {}
        return self._feed.hyperparams_now()

    def binding_report(self) -> report.BindingReport:
        """Where every value came from: splits, hook fields, run keywords, schedules, optimizer."""
        return report.binding_report(self)

    def stale_report(self) -> str | None:
        """What changed in the experiment's code since this handle was built, or None."""
        return report.stale_report(self)

    def stale_changes(self) -> dict[str, list[str]]:
        """Code that changed since this handle was built: unit (a hook name or "model") ->
        the parts that changed in it ("helper mlp_block", "method MLP.__call__"; empty when
        the hook itself changed). `nitro.programs.programs_using(unit)` names the programs
        each unit reaches."""
        return report.stale_changes(self)

    @property
    def reporter(self) -> progress.Reporter:
        """The progress reporter this handle's runs report to."""
        return self._reporter

    def _check_stale(self, entry: str) -> None:
        import time

        generation, last = self._stale_checked
        now = time.monotonic()
        if generation == edit_generation() and now - last < 1.0:
            return
        self._stale_checked = (edit_generation(), now)
        text = report.stale_report(self)
        key = (text,)
        if text and key != self._stale_seen:
            self._stale_seen = key
            progress.note(text)
        elif not text:
            self._stale_seen = ()

    @property
    def phase(self) -> str:
        """Where the handle is: setup, ready, training, validating, evaluating <split>,
        predicting, done, stopped or failed."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        try:
            self._reporter.phase(value)
        except Exception:  # noqa: BLE001 - a display must never break a run
            pass

    def __repr__(self) -> str:
        return report.short_repr(self)

    def _repr_html_(self) -> str:
        return report.handle_html(self)


def _copy_array(x: jax.Array) -> jax.Array:
    """A fresh copy on the same devices (no compile; across processes a jitted copy)."""
    if x.is_fully_addressable:
        return jax.device_put(x, x.sharding, may_alias=False)
    return jnp.array(x, copy=True)


def _leaf_paths(tree: Any) -> tuple[str, ...]:
    return tuple(
        jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    )
