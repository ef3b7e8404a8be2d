"""The programs a handle runs, as traceable functions plus the specs that key them.

Each program takes the run's `Variables` (flat leaf lists, so a call flattens nothing but
lists), merges the NNX model inside the trace, and gives hooks a `TraceView` of the
experiment. Programs:

- train step: forward, loss, gradient, optimizer update and (device) train metrics, fused into
  one program over donated variables. A non-finite loss leaves the variables untouched from
  then on, so the handle keeps the last good weights.
- eval forward: forward and the per-sample loss of an evaluation batch, masked to the real
  samples (the final short batch is padded to the compiled width).
- predict: forward alone.
- device metrics: a metrics hook traced on device.

`ProgramSet` holds the programs one handle uses, each looked up in the module-level cache
once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .compile_cache import CACHE, Opaque, Program, ProgramKind, ProgramSpec
from .errors import SetupError
from .fingerprint import CodeFingerprint
from .metrics import split_modes
from .routing import select
from .run_setup import RunSetup
from .state import StepOutput, Variables
from .trace_view import TraceView

__all__ = [
    "PROGRAM_UNITS",
    "ProgramSet",
    "device_metrics_spec",
    "eval_spec",
    "programs_using",
    "train_step_spec",
]

# The code each program kind runs: hooks, the model's classes, the optimizer's update.
PROGRAM_UNITS: dict[ProgramKind, tuple[str, ...]] = {
    ProgramKind.TRAIN_STEP: ("forward", "loss", "train_metrics", "model", "optimizer"),
    ProgramKind.EVAL_FORWARD: ("forward", "loss", "model"),
    ProgramKind.PREDICT: ("forward", "model"),
    ProgramKind.DEVICE_METRICS: ("metrics",),
}


def programs_using(unit: str) -> tuple[ProgramKind, ...]:
    """The program kinds whose code includes `unit` (a hook name, "model" or "optimizer")."""
    return tuple(kind for kind, units in PROGRAM_UNITS.items() if unit in units)


# ---------------------------------------------------------------------------------------------
# what every program needs from the setup


def _view(setup: RunSetup, device: Mapping[str, Any], reads: set[str]) -> TraceView:
    return TraceView(setup.cls, setup.experiment.graphconst, device, reads)


def _call(setup: RunSetup, hook: str, view: TraceView, *args, **kwargs):
    return setup.experiment.hooks[hook](view, *args, **kwargs)


def _fingerprint(setup: RunSetup, *units: str) -> CodeFingerprint:
    code = setup.experiment.code
    return CodeFingerprint.combine(*(code[u] for u in units if u in code))


def _leaf_labels(setup: RunSetup, batch: str, fields, *arguments: tuple[str, str]):
    """Readable names for arguments' leaves, for compile explanations."""
    labels = {f"{batch}['{name}']": name for hook in fields.values() for name in hook}
    labels.update({f"device fields['{name}']": name for name in setup.experiment.device_specs})
    for prefix, which in arguments:
        for i, path in enumerate(setup.model.leaf_paths.get(which, ())):
            labels[f"{prefix}[{i}]"] = f"{which} {path}"
    return labels


def _unflatten(setup: RunSetup, variables: Variables):
    model = setup.model
    params = jax.tree.unflatten(model.params_def, variables.params)
    rest = jax.tree.unflatten(model.model_state_def, variables.model_state)
    return params, rest


def _check_scalar_loss(loss: Any) -> Any:
    if not hasattr(loss, "shape") or loss.shape != ():
        shape = getattr(loss, "shape", type(loss).__name__)
        raise TypeError(
            f"hook `loss` must return a scalar (reduce over the batch, e.g. `.mean()`); it "
            f"returned shape {shape}"
        )
    return loss


def _check_batch_axis(outputs: Any, batch: Mapping[str, Any]) -> None:
    """Outputs are sliced per sample (padding, metrics, predict): each leaf needs the batch
    axis first. Checked at trace time, so the first compile says it, not an epoch later."""
    width = next((v.shape[0] for v in batch.values() if getattr(v, "ndim", 0)), None)
    if width is None:
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(outputs)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape or shape[0] != width:
            where = jax.tree_util.keystr(path) or "its output"
            inputs = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in batch.items())
            raise SetupError(
                f"hook `forward` must return outputs with the batch axis first, but "
                f"{where} has shape {shape} for a batch of {width} ({inputs}). Return one row "
                f"per sample (e.g. `model(x)`, not `model(x).mean(0)`)."
            )


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _fields_key(fields: Mapping[str, tuple[str, ...]], hooks) -> tuple:
    return tuple((hook, tuple(fields.get(hook, ()))) for hook in hooks)


# ---------------------------------------------------------------------------------------------
# train step


def train_step_spec(setup: RunSetup, fields: Mapping[str, tuple[str, ...]]) -> ProgramSpec:
    residency = setup.experiment.train_metrics_residency
    optimizer = setup.optimizer
    check = setup.check_divergence
    model = setup.model

    def build(reads: set[str]):
        aux: dict[str, Any] = {}

        def train_step(variables: Variables, healthy, device, hparams, batch) -> StepOutput:
            params, rest = _unflatten(setup, variables)
            opt_state = jax.tree.unflatten(model.opt_state_def, variables.opt_state)
            view = _view(setup, device, reads)

            def objective(params, rest):
                module = nnx.merge(model.graphdef_train, params, rest, copy=True)
                outputs = _call(setup, "forward", view, module, **select(batch, fields["forward"]))
                loss = _check_scalar_loss(
                    _call(setup, "loss", view, outputs, **select(batch, fields["loss"]))
                )
                _, _, new_rest = nnx.split(module, nnx.Param, ...)
                return loss, (outputs, new_rest)

            # `rest` (batch statistics, RNG counts) is an argument too, so the model's
            # variables live at one trace level; only `params` is differentiated.
            (loss, (outputs, new_rest)), grads = jax.value_and_grad(objective, has_aux=True)(
                params, rest
            )
            opt_state = optimizer.inject(opt_state, hparams)

            if check:
                # From the first non-finite step on, every later step leaves the weights, the
                # model state and the optimizer's moments as they were, so the handle holds the
                # last good ones. A step is non-finite when its loss, a gradient or an update is
                # (a NaN learning rate makes finite gradients into NaN updates). Zeroing the
                # gradient and selecting the new parameters fuse into existing loops; the two
                # finiteness reductions read the gradients and updates once more.
                loss_ok = jnp.isfinite(loss)
                grads_ok = _all_finite(grads)
                healthy_in = healthy
                healthy = healthy_in & loss_ok & grads_ok
                grads = jax.tree.map(lambda g: jnp.where(healthy, g, 0), grads)
                new_rest = jax.tree.map(
                    lambda new, old: jax.lax.select(healthy, new, old), new_rest, rest
                )
            updates, new_opt = optimizer.tx.update(grads, opt_state, params)
            if check:
                updates_ok = _all_finite(updates)
                healthy = healthy & updates_ok
                new_params = jax.tree.map(
                    lambda p, u: jnp.where(healthy, p + u, p).astype(p.dtype), params, updates
                )
                # 0: finite; else the first failing stage: 1 loss, 2 gradient, 3 update;
                # 4: an earlier step in flight was already non-finite
                code = jnp.where(
                    ~healthy_in,
                    4,
                    jnp.where(~loss_ok, 1, jnp.where(~grads_ok, 2, jnp.where(~updates_ok, 3, 0))),
                )
                report = jnp.stack([loss.astype(jnp.float32), code.astype(jnp.float32)])
            else:
                new_params = optax.apply_updates(params, updates)
                report = jnp.stack([loss.astype(jnp.float32), jnp.zeros((), jnp.float32)])
            metrics = []
            if residency == "host":
                _check_batch_axis(outputs, select(batch, fields["forward"]))
                metrics = outputs  # read back and reduced by the host hook
            elif residency == "device":
                values = _call(
                    setup, "train_metrics", view, outputs, **select(batch, fields["train_metrics"])
                )
                aux["specs"], metrics = split_modes(values, "train_metrics")
            new_opt = optimizer.strip(new_opt)
            new_variables = Variables(
                params=jax.tree.leaves(new_params),
                model_state=jax.tree.leaves(new_rest),
                opt_state=jax.tree.leaves(new_opt),
            )
            return StepOutput(new_variables, healthy, report, metrics)

        train_step.nitro_aux = aux
        return train_step

    units = [u for u in PROGRAM_UNITS[ProgramKind.TRAIN_STEP] if u != "train_metrics"]
    if residency == "device":
        units.append("train_metrics")
    return ProgramSpec(
        kind=ProgramKind.TRAIN_STEP,
        owner=setup.owner,
        build=build,
        code=_fingerprint(setup, *units),
        static={
            "model structure": Opaque(model.structure),
            "check_divergence": check,
            "train_metrics residency": residency or "none",
            "fields": _fields_key(fields, ("forward", "loss", "train_metrics")),
        },
        graphconst=setup.experiment.graphconst,
        arg_names=("variables", "healthy", "device fields", "hyperparameters", "batch"),
        donate_argnums=(0,),
        leaf_labels=_leaf_labels(
            setup,
            "batch",
            fields,
            ("variables.params", "parameter"),
            ("variables.model_state", "model state"),
            ("variables.opt_state", "optimizer state"),
        ),
    )


# ---------------------------------------------------------------------------------------------
# eval forward and predict


def eval_spec(
    setup: RunSetup,
    fields: Mapping[str, tuple[str, ...]],
    *,
    with_loss: bool,
    return_outputs: bool,
) -> ProgramSpec:
    """Eval forward (`with_loss`) or predict (forward alone)."""
    model = setup.model

    def build(reads: set[str]):
        aux: dict[str, Any] = {}

        def evaluate(variables: Variables, device, batch, n_real):
            params, rest = _unflatten(setup, variables)
            view = _view(setup, device, reads)
            module = nnx.merge(model.graphdef_eval, params, rest, copy=True)
            inputs = select(batch, fields["forward"])
            outputs = _call(setup, "forward", view, module, **inputs)
            result = {}
            if return_outputs:
                _check_batch_axis(outputs, inputs)
                result["outputs"] = outputs
            if with_loss:
                result["loss_sum"], aux["exact"] = _masked_loss_sum(
                    setup, view, outputs, select(batch, fields["loss"]), n_real
                )
            return result

        evaluate.nitro_aux = aux
        return evaluate

    kind = ProgramKind.EVAL_FORWARD if with_loss else ProgramKind.PREDICT
    hooks = ("forward", "loss") if with_loss else ("forward",)
    return ProgramSpec(
        kind=kind,
        owner=setup.owner,
        build=build,
        code=_fingerprint(setup, *PROGRAM_UNITS[kind]),
        static={
            "model structure": Opaque(model.structure),
            "returns outputs": return_outputs,
            "fields": _fields_key(fields, hooks),
        },
        graphconst=setup.experiment.graphconst,
        arg_names=("variables", "device fields", "batch", "real samples"),
        leaf_labels=_leaf_labels(
            setup,
            "batch",
            fields,
            ("variables.params", "parameter"),
            ("variables.model_state", "model state"),
        ),
    )


def _masked_loss_sum(setup, view, outputs, fields, n_real):
    """Sum of per-sample losses over the real samples of a (padded) batch.

    Each sample's loss is the `loss` hook applied to a batch of one, which is exact for a loss
    that is a mean of per-sample terms; the padded rows are masked out. A loss that couples
    samples cannot be split per sample: it is then applied to the whole batch and weighted by
    the real count (exact for every full batch).
    """
    width = jax.tree.leaves(fields or outputs)[0].shape[0]
    mask = jnp.arange(width) < n_real

    def one(sample_outputs, sample_fields):
        expand = lambda a: a[None]  # noqa: E731
        return _check_scalar_loss(
            _call(
                setup,
                "loss",
                view,
                jax.tree.map(expand, sample_outputs),
                **jax.tree.map(expand, sample_fields),
            )
        )

    try:
        per_sample = jax.vmap(one)(outputs, fields)
        return jnp.sum(jnp.where(mask, per_sample.astype(jnp.float32), 0.0)), True
    except (TypeError, ValueError, IndexError):
        whole = _check_scalar_loss(_call(setup, "loss", view, outputs, **fields))
        return whole.astype(jnp.float32) * n_real, False


# ---------------------------------------------------------------------------------------------
# device metrics


def device_metrics_spec(setup: RunSetup, fields: Mapping[str, tuple[str, ...]]) -> ProgramSpec:
    def build(reads: set[str]):
        aux: dict[str, Any] = {}

        def metrics(outputs, device, batch):
            view = _view(setup, device, reads)
            values = _call(setup, "metrics", view, outputs, **batch)
            aux["specs"], leaves = split_modes(values, "metrics")
            return leaves

        metrics.nitro_aux = aux
        return metrics

    return ProgramSpec(
        kind=ProgramKind.DEVICE_METRICS,
        owner=setup.owner,
        build=build,
        code=_fingerprint(setup, *PROGRAM_UNITS[ProgramKind.DEVICE_METRICS]),
        static={"fields": _fields_key(fields, ("metrics",))},
        graphconst=setup.experiment.graphconst,
        arg_names=("outputs", "device fields", "batch"),
    )


# ---------------------------------------------------------------------------------------------
# one handle's programs


class ProgramSet:
    """The programs one handle uses. Each slot is looked up in the module cache once; later
    calls reuse the program the slot holds."""

    def __init__(self, setup: RunSetup):
        self.setup = setup
        self._slots: dict[tuple, Program] = {}

    def _get(self, slot: tuple, make_spec: Callable[[], ProgramSpec], args) -> Program:
        program = self._slots.get(slot)
        if program is None:
            program = CACHE.lookup(make_spec(), args)
            self._slots[slot] = program
        return program

    def train_step(self, args) -> Program:
        fields = self.setup.splits["train"].hook_fields
        return self._get(("train",), lambda: train_step_spec(self.setup, fields), args)

    def eval_forward(self, split: str, args, *, with_loss: bool, return_outputs: bool) -> Program:
        info = self.setup.splits[split]
        return self._get(
            ("eval", split, info.width),
            lambda: eval_spec(
                self.setup, info.hook_fields, with_loss=with_loss, return_outputs=return_outputs
            ),
            args,
        )

    def device_metrics(self, split: str, args) -> Program:
        width = jax.tree.leaves(args[0])[0].shape[0]
        fields = self.setup.splits[split].hook_fields
        return self._get(
            ("metrics", split, width), lambda: device_metrics_spec(self.setup, fields), args
        )

    def predict(self, width: int, fields: tuple[str, ...], args) -> Program:
        return self._get(
            ("predict", width, fields),
            lambda: eval_spec(
                self.setup, {"forward": fields}, with_loss=False, return_outputs=True
            ),
            args,
        )

    def held(self) -> list[str]:
        """Titles of the programs this handle holds, sorted."""
        return sorted({p.title for p in list(self._slots.values())})
