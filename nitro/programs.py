"""The programs a handle runs, as traceable functions plus the specs that key them.

Each program takes flat lists of leaves (model parameters, other model state, optimizer
state) so a call flattens nothing but lists, merges the NNX model inside the trace, and gives
hooks a `TraceView` of the experiment. Programs:

- train step: forward, loss, gradient, optimizer update and (device) train metrics, fused into
  one program over donated state. A non-finite loss leaves the state untouched from then on,
  so the handle keeps the last good weights.
- eval forward: forward and the per-sample loss of an evaluation batch, masked to the real
  samples (the final short batch is padded to the compiled width).
- predict: forward alone.
- device metrics: a metrics hook traced on device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .compile_cache import Opaque, ProgramKind, ProgramSpec
from .fingerprint import CodeFingerprint
from .metrics import split_modes
from .routing import select
from .trace_view import TraceView

__all__ = [
    "PROGRAM_UNITS",
    "ProgramContext",
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


@dataclasses.dataclass
class ProgramContext:
    """What a handle froze at construction that its programs need."""

    cls: type
    owner: str
    graphconst: Mapping[str, Any]
    hooks: Mapping[str, Callable]
    graphdef_train: Any
    graphdef_eval: Any
    params_def: Any
    rest_def: Any
    opt_def: Any
    tx: optax.GradientTransformation | None
    hyper_names: tuple[str, ...]
    hyper_dtypes: Mapping[str, Any]
    check_divergence: bool
    residency: Mapping[str, str]
    code: Mapping[str, CodeFingerprint]
    model_structure: Hashable
    leaf_paths: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    device_names: tuple[str, ...] = ()  # Device field names

    def view(self, device: Mapping[str, Any], reads: set[str]) -> TraceView:
        return TraceView(self.cls, self.graphconst, device, reads)

    def call(self, hook: str, view: TraceView, *args, **kwargs):
        return self.hooks[hook](view, *args, **kwargs)

    def fingerprint(self, *units: str) -> CodeFingerprint:
        return CodeFingerprint.combine(*(self.code[u] for u in units if u in self.code))

    def leaf_labels(self, batch: str, fields, *arguments: tuple[str, str]) -> dict[str, str]:
        """Readable names for arguments' leaves, for compile explanations."""
        labels = {f"{batch}['{name}']": name for hook in fields.values() for name in hook}
        labels.update({f"device fields['{name}']": name for name in self.device_names})
        for prefix, which in arguments:
            for i, path in enumerate(self.leaf_paths.get(which, ())):
                labels[f"{prefix}[{i}]"] = f"{which} {path}"
        return labels


def _check_scalar_loss(loss: Any) -> Any:
    if not hasattr(loss, "shape") or loss.shape != ():
        shape = getattr(loss, "shape", type(loss).__name__)
        raise TypeError(
            f"hook `loss` must return a scalar (reduce over the batch, e.g. `.mean()`); it "
            f"returned shape {shape}"
        )
    return loss


def train_step_spec(ctx: ProgramContext, fields: Mapping[str, tuple[str, ...]]) -> ProgramSpec:
    train_metrics = ctx.residency.get("train_metrics") if "train_metrics" in ctx.hooks else None
    uses_train_metrics = train_metrics == "device"

    def build(reads: set[str]):
        aux: dict[str, Any] = {}

        def train_step(carry, device, hparams, batch):
            params_l, rest_l, opt_l, healthy = carry
            params = jax.tree.unflatten(ctx.params_def, params_l)
            rest = jax.tree.unflatten(ctx.rest_def, rest_l)
            opt_state = jax.tree.unflatten(ctx.opt_def, opt_l)
            view = ctx.view(device, reads)

            def objective(params, rest):
                model = nnx.merge(ctx.graphdef_train, params, rest, copy=True)
                outputs = ctx.call("forward", view, model, **select(batch, fields["forward"]))
                loss = _check_scalar_loss(
                    ctx.call("loss", view, outputs, **select(batch, fields["loss"]))
                )
                _, _, new_rest = nnx.split(model, nnx.Param, ...)
                return loss, (outputs, new_rest)

            # `rest` (batch statistics, RNG counts) is an argument too, so the model's
            # variables live at one trace level; only `params` is differentiated.
            (loss, (outputs, new_rest)), grads = jax.value_and_grad(objective, has_aux=True)(
                params, rest
            )
            if ctx.hyper_names:
                injected = {
                    name: hparams[i].astype(ctx.hyper_dtypes[name])
                    for i, name in enumerate(ctx.hyper_names)
                }
                opt_state = opt_state._replace(hyperparams=injected)

            if ctx.check_divergence:
                # Once a loss is non-finite, every later step leaves the weights and the model
                # state as they were, so the handle holds the last good ones. Zeroing the
                # gradient and the update costs nothing (both fuse into existing loops); the
                # optimizer's own state sees a zero gradient for the skipped steps.
                healthy = jnp.logical_and(healthy, jnp.isfinite(loss))
                grads = jax.tree.map(lambda g: jnp.where(healthy, g, 0), grads)
                new_rest = jax.tree.map(
                    lambda new, old: jax.lax.select(healthy, new, old), new_rest, rest
                )
            updates, new_opt = ctx.tx.update(grads, opt_state, params)
            if ctx.check_divergence:
                updates = jax.tree.map(lambda u: jnp.where(healthy, u, 0), updates)
            new_params = optax.apply_updates(params, updates)
            metrics = []
            if train_metrics == "host":
                metrics = outputs  # read back and reduced by the host hook
            elif uses_train_metrics:
                values = ctx.call(
                    "train_metrics", view, outputs, **select(batch, fields["train_metrics"])
                )
                aux["specs"], metrics = split_modes(values, "train_metrics")
            if ctx.hyper_names:
                new_opt = new_opt._replace(hyperparams={})  # fed again next step
            new_carry = (
                jax.tree.leaves(new_params),
                jax.tree.leaves(new_rest),
                jax.tree.leaves(new_opt),
                healthy,
            )
            return new_carry, loss, metrics

        train_step.nitro_aux = aux
        return train_step

    units = [u for u in PROGRAM_UNITS[ProgramKind.TRAIN_STEP] if u != "train_metrics"]
    if uses_train_metrics:
        units.append("train_metrics")
    return ProgramSpec(
        kind=ProgramKind.TRAIN_STEP,
        owner=ctx.owner,
        build=build,
        code=ctx.fingerprint(*units),
        static={
            "model structure": Opaque(ctx.model_structure),
            "check_divergence": ctx.check_divergence,
            "train_metrics residency": ctx.residency.get("train_metrics", "none")
            if "train_metrics" in ctx.hooks
            else "none",
            "fields": _fields_key(fields, ("forward", "loss", "train_metrics")),
        },
        graphconst=ctx.graphconst,
        arg_names=("state", "device fields", "hyperparameters", "batch"),
        donate_argnums=(0,),
        leaf_labels=ctx.leaf_labels(
            "batch",
            fields,
            ("state[0]", "parameter"),
            ("state[1]", "model state"),
            ("state[2]", "optimizer state"),
        ),
    )


def eval_spec(
    ctx: ProgramContext,
    fields: Mapping[str, tuple[str, ...]],
    *,
    with_loss: bool,
    return_outputs: bool,
    label: str = "",
) -> ProgramSpec:
    """Eval forward (`with_loss`) or predict (forward alone)."""

    def build(reads: set[str]):
        aux: dict[str, Any] = {}

        def evaluate(params_l, rest_l, device, batch, n_real):
            params = jax.tree.unflatten(ctx.params_def, params_l)
            rest = jax.tree.unflatten(ctx.rest_def, rest_l)
            view = ctx.view(device, reads)
            model = nnx.merge(ctx.graphdef_eval, params, rest, copy=True)
            outputs = ctx.call("forward", view, model, **select(batch, fields["forward"]))
            result = {}
            if return_outputs:
                result["outputs"] = outputs
            if with_loss:
                result["loss_sum"], aux["exact"] = _masked_loss_sum(
                    ctx, view, outputs, select(batch, fields["loss"]), n_real
                )
            return result

        evaluate.nitro_aux = aux
        return evaluate

    kind = ProgramKind.EVAL_FORWARD if with_loss else ProgramKind.PREDICT
    units = PROGRAM_UNITS[kind]
    hooks = ("forward", "loss") if with_loss else ("forward",)
    return ProgramSpec(
        kind=kind,
        owner=ctx.owner,
        build=build,
        code=ctx.fingerprint(*units),
        static={
            "model structure": Opaque(ctx.model_structure),
            "returns outputs": return_outputs,
            "fields": _fields_key(fields, hooks),
        },
        graphconst=ctx.graphconst,
        arg_names=("parameters", "model state", "device fields", "batch", "real samples"),
        label=label,
        leaf_labels=ctx.leaf_labels(
            "batch", fields, ("parameters", "parameter"), ("model state", "model state")
        ),
    )


def _masked_loss_sum(ctx, view, outputs, fields, n_real):
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
            ctx.call(
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
        whole = _check_scalar_loss(ctx.call("loss", view, outputs, **fields))
        return whole.astype(jnp.float32) * n_real, False


def device_metrics_spec(ctx: ProgramContext, fields: Mapping[str, tuple[str, ...]]) -> ProgramSpec:
    def build(reads: set[str]):
        aux: dict[str, Any] = {}

        def metrics(outputs, device, fields):
            view = ctx.view(device, reads)
            values = ctx.call("metrics", view, outputs, **fields)
            aux["specs"], leaves = split_modes(values, "metrics")
            return leaves

        metrics.nitro_aux = aux
        return metrics

    return ProgramSpec(
        kind=ProgramKind.DEVICE_METRICS,
        owner=ctx.owner,
        build=build,
        code=ctx.fingerprint(*PROGRAM_UNITS[ProgramKind.DEVICE_METRICS]),
        static={"fields": _fields_key(fields, ("metrics",))},
        graphconst=ctx.graphconst,
        arg_names=("outputs", "device fields", "batch"),
    )


def _fields_key(fields: Mapping[str, tuple[str, ...]], hooks) -> tuple:
    return tuple((hook, tuple(fields.get(hook, ()))) for hook in hooks)
