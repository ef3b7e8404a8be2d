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

from . import loop, progress, report, setup
from .compile_cache import CACHE, Program
from .data import Prefetcher
from .experiments import (
    REQUIRED_HOOKS,
    ExperimentError,
    FieldKind,
    edit_generation,
    field_specs,
    has_method,
)
from .programs import device_metrics_spec, eval_spec, train_step_spec
from .setup import SetupError, batch_size, copy_array

__all__ = ["Nitro", "SetupError"]


def _owner(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


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

        setup.build(self, keywords)
        self.phase = "ready"

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
        n = batch_size(host, "predict")
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

    def export(
        self, directory: str, name: str | None = None, *, platforms: tuple[str, ...] | None = None
    ) -> dict[str, Any]:
        """Write the current weights and eval-mode forward as a bundle that runs without Nitro
        (`nitro.bundle.load(directory)`) and serves with `nitro serve`; returns its manifest.

        `name` names the bundle (default: the experiment class, lower case); `platforms`
        defaults to cpu, cuda, rocm and tpu. See docs/export.md.
        """
        from .export import DEFAULT_PLATFORMS, export_handle

        self._check_stale("export")
        self._guard("export")
        return export_handle(self, directory, name, platforms=platforms or DEFAULT_PLATFORMS)

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
                jax.tree.map(copy_array, params),
                jax.tree.map(copy_array, rest),
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
