"""The train step: forward, loss, gradient, the divergence guard and the optimizer update,
traced into one program over donated variables; and K of them fused with `lax.scan`.

The step is assembled from the named stages of `nitro.optim.stages`, one line per switch:

```
gradients  jax.value_and_grad of the loss hook over the forward hook, in the compute
           dtype (precision=), of the scaled loss (float16)
           -> accumulate (accum=)  -> sharpness_aware (sam=)
           -> keep a frozen group's batch statistics (freeze_batch_stats=)
update     inject the fed hyperparameters -> apply_update (the optimizer) -> strip them
finish     moving_average (ema=) -> skip an overflow, adjust the loss scale (float16)
           -> the guard (check_divergence=): check, keep
```

A `train_step` hook's step (`manual_step_function`) replaces the first two lines by the hook,
which runs `apply_update` through `nitro.manual.Step`, and shares the third.

One step is a pure function `step(variables, healthy, device, hparams, batch) -> StepOutput`.
The train-step program is that function; the multi-step program scans it over K stacked
batches, with the Device fields and hyperparameters given per step (arrays of length K), so a
schedule changes values, never programs. The guard works per step inside the scan: from the
first non-finite step on, the later ones leave the variables as they were, and each step's
report (loss, finiteness code) comes back in one array.

A program may instead leave the keeping to the loop (`restore=True`): it checks each step
and reports the verdicts, but selects nothing, and it does not donate its variables, so the
loop still holds the call's input when it reads a verdict back. At a
non-finite step the loop goes back to that input and replays the steps before it one at a time
(`nitro.engine.loop`), which gives the variables the per-step select would have kept. On a
small model the select is most of what the guard costs: it makes XLA copy the optimizer
moments each step, beside the new ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nitro.core.metrics import split_modes
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import StepOutput, Variables
from nitro.experiments.routing import select
from nitro.optim import guard, stages
from nitro.optim.fine_tuning import keep_frozen_statistics
from nitro.optim.guard import Failure
from nitro.optim.optimizer import OptimizerSetup
from nitro.optim.precision import FLOAT32
from nitro.programs import tracing
from nitro.programs.compile_cache import Opaque, ProgramKind, ProgramSpec, Traced
from nitro.programs.remat import remat_options

__all__ = ["TRAIN_UNITS", "step_function", "train_step_spec"]

# The code a train step runs: hooks, the model's classes, the optimizer's update.
TRAIN_UNITS = ("forward", "loss", "train_metrics", "train_step", "model", "optimizer")


def step_function(
    setup: RunSetup,
    fields: Mapping[str, tuple[str, ...]],
    reads: set[str],
    traced: Traced,
    micro: int = 1,
    keep: bool = True,
) -> Callable[..., StepOutput]:
    """One training step as a traceable function of (variables, healthy, device fields,
    hyperparameters, batch). With `micro > 1` the batch holds `micro` stacked micro-batches
    and the step accumulates their gradients (a scan: the memory of one micro-batch), then
    updates once: for a loss that is a mean over its batch, exactly one step on the merged
    batch."""
    residency = setup.experiment.train_metrics_residency
    optimizer = setup.optimizer
    assert isinstance(optimizer, OptimizerSetup)  # a train_step hook takes the manual step
    model = setup.model
    precision = setup.precision or FLOAT32

    def step(variables: Variables, healthy, device, hparams, batch) -> StepOutput:
        params, rest = tracing.unflatten(setup, variables)
        scaling = variables.loss_scale if precision.scaled else None
        scale = precision.dynamic(scaling) if scaling is not None else None
        assert variables.opt_state is not None  # a train step's variables carry it
        opt_state = jax.tree.unflatten(model.opt_state_def, variables.opt_state)
        device, key = tracing.pop_step_key(device)
        view = tracing.view(setup, device, reads)
        # forward sees the floating Device fields in the compute dtype too, so `x * self.scale`
        # stays in it (a float32 array would promote it back); the loss sees them as they are
        forward_view = tracing.view(setup, precision.cast_compute(device), reads)
        if key is not None:  # the step's key rides with the batch: micro-batches split it
            keys = (
                key
                if micro == 1
                else jax.vmap(lambda i: jax.random.fold_in(key, i))(
                    jnp.arange(micro, dtype=jnp.uint32)
                )
            )
            batch = {**batch, tracing.RNG_FIELD: keys}

        def objective(params, rest, batch):
            # the forward pass in the compute dtype: the parameters and the floating inputs
            # cast to it, the outputs back to float32 for the loss (precision=); the cast's
            # gradient is float32, so the gradients are
            module = nnx.merge(
                model.graphdef_train, precision.cast_compute(params), rest, copy=True
            )
            if setup.remat is not None:  # remat=: the named modules recompute in the backward
                setup.remat.apply(module)
            # made inside the differentiated function, so the model may draw from it
            key = batch.get(tracing.RNG_FIELD)
            rngs = nnx.Rngs(key) if key is not None else None
            inputs = precision.cast_compute(select(batch, fields["forward"]))
            outputs = tracing.call(setup, "forward", forward_view, module, rngs=rngs, **inputs)
            outputs = precision.cast_output(outputs)
            loss = tracing.check_scalar_loss(
                tracing.call(
                    setup, "loss", view, outputs, rngs=rngs, **select(batch, fields["loss"])
                )
            )
            _, _, new_rest = nnx.split(module, nnx.Param, ...)
            new_rest = precision.like(new_rest, rest)
            scaled = scale.scale(loss) if scale is not None else loss  # float16: loss scaling
            return scaled, (loss, outputs, new_rest)

        def measured(outputs, batch):
            """What the step reports besides its loss: device train metrics, or the outputs
            for a host train-metrics hook."""
            if residency == "host":
                tracing.check_batch_axis(outputs, select(batch, fields["forward"]))
                return outputs
            if residency == "device":
                values = tracing.call(
                    setup, "train_metrics", view, outputs, **select(batch, fields["train_metrics"])
                )
                traced.metric_specs, leaves = split_modes(values, "train_metrics")
                return leaves
            return []

        # `rest` (batch statistics, RNG counts) is an argument too, so the model's variables
        # live at one trace level; only `params` is differentiated.
        grad_fn = jax.value_and_grad(objective, has_aux=True)

        def value_and_grads(params, rest, batch) -> stages.Gradients:
            (_, (loss, outputs, new_rest)), grads = grad_fn(params, rest, batch)
            if scale is not None:
                grads = scale.unscale(grads)
            return stages.Gradients(loss, new_rest, grads, measured(outputs, batch))

        gradients: stages.GradientFn = value_and_grads

        if micro > 1:
            gradients = stages.accumulate(gradients, micro)
        if setup.sam is not None:
            gradients = stages.sharpness_aware(gradients, setup.sam)
        loss, new_rest, grads, metrics = gradients(params, rest, batch)
        new_rest = keep_frozen_statistics(
            setup.frozen_statistics, optimizer.names, hparams, rest, new_rest
        )
        opt_state = optimizer.inject(opt_state, hparams)
        new_params, new_opt = stages.apply_update(optimizer.tx, grads, opt_state, params)

        finite = guard.all_finite(grads)
        overflow = None
        if scaling is not None:  # float16: an overflow skips the step and lowers the scale
            overflow = (finite, precision.adjusted(scaling, finite))

        def checks():
            # A fed hyperparameter is checked too: a NaN learning rate from a schedule. An
            # update that overflows from finite inputs (an absurd learning rate) is applied,
            # and the next step's loss stops the run. Under loss scaling a non-finite
            # gradient is a skipped step, unless the scale is at its floor already.
            hparams_ok = jnp.all(jnp.isfinite(hparams)) if optimizer.names else jnp.bool_(True)
            grads_ok = finite if scaling is None else finite | ~precision.at_floor(scaling)
            return (
                (Failure.LOSS, jnp.isfinite(loss)),
                (Failure.GRADIENT, grads_ok),
                (Failure.HYPERPARAMETER, hparams_ok),
            )

        return _finish(
            setup,
            variables,
            healthy,
            loss,
            (new_params, new_rest, new_opt),
            checks,
            metrics,
            overflow,
            keep,
        )

    return step


def manual_step_function(
    setup: RunSetup,
    fields: Mapping[str, tuple[str, ...]],
    reads: set[str],
    traced: Traced,
    keep: bool = True,
) -> Callable[..., StepOutput]:
    """A step of a `train_step` hook: the hook gets a `nitro.manual.Step` (the models, their
    gradients, their optimizers) and the batch fields it names; the guard, the moving
    average and the fed hyperparameters are the default step's."""
    from nitro.programs.manual import ModelOptimizers, Step

    optimizer = setup.optimizer
    assert isinstance(optimizer, ModelOptimizers)
    model = setup.model

    def step(variables: Variables, healthy, device, hparams, batch) -> StepOutput:
        params, rest = tracing.unflatten(setup, variables)
        assert variables.opt_state is not None  # a train step's variables carry it
        opt_state = jax.tree.unflatten(model.opt_state_def, variables.opt_state)
        opt_state = optimizer.inject(opt_state, hparams)
        device, key = tracing.pop_step_key(device)
        view = tracing.view(setup, device, reads)
        work = Step(
            model.graphdef_train,
            {name: params[name] for name in params.keys()},
            rest,
            dict(opt_state),
            optimizer.transformations(),
        )
        values = tracing.call(
            setup,
            "train_step",
            view,
            work,
            rngs=nnx.Rngs(key) if key is not None else None,
            **select(batch, fields["train_step"]),
        )
        if not isinstance(values, Mapping) or "loss" not in values:
            raise TypeError(
                f"hook `train_step` must return a dict with a scalar 'loss' (and any other "
                f"scalars to track); it returned {type(values).__name__}"
                + (f" with keys {sorted(values)}" if isinstance(values, Mapping) else "")
            )
        loss = tracing.check_scalar_loss(values["loss"])
        traced.metric_specs, metrics = split_modes(
            {k: v for k, v in values.items() if k != "loss"}, "train_step"
        )
        new_params = jax.tree.map(lambda x: x, params)  # same structure, new values below
        for name, tree in work.params.items():
            new_params[name] = tree

        def checks():
            return (
                (Failure.LOSS, jnp.isfinite(loss)),
                (Failure.WEIGHTS, guard.all_finite(new_params)),
            )

        new = (new_params, work.rest, work.opt_states)
        return _finish(setup, variables, healthy, loss, new, checks, metrics, keep=keep)

    return step


def _finish(
    setup: RunSetup,
    variables: Variables,
    healthy: jax.Array,
    loss: jax.Array,
    new: tuple[Any, Any, Any],
    checks: Callable[[], tuple[tuple[Failure, jax.Array], ...]],
    metrics: Any,
    overflow: tuple[jax.Array, list] | None = None,
    keep: bool = True,
) -> StepOutput:
    """The stages after the update, the same for both steps: the moving average, then the
    guard, which keeps every variable as it was at a skipped step (`nitro.optim.guard`);
    `keep=False` only checks (the loop restores: a `restore=True` program).
    `overflow` (float16's loss scaling): whether the gradient was finite, and the loss-scale
    variables after the step; a step that overflowed keeps the other variables as they were,
    without counting as a divergence."""
    params, rest, opt_state = new
    assert setup.optimizer is not None
    ema, ema_steps = variables.ema, variables.ema_steps
    if setup.ema is not None:
        ema, ema_steps = stages.moving_average(setup.ema, ema, ema_steps, jax.tree.leaves(params))
    new_variables = Variables(
        params=jax.tree.leaves(params),
        model_state=jax.tree.leaves(rest),
        opt_state=jax.tree.leaves(setup.optimizer.strip(opt_state)),
        ema=ema,
        ema_steps=ema_steps,
        loss_scale=variables.loss_scale,
    )
    new_variables = _constrained(setup, new_variables)
    if overflow is not None:
        finite, loss_scale = overflow
        new_variables = dataclasses.replace(
            guard.keep(finite, new_variables, variables), loss_scale=loss_scale
        )
    code = jnp.int32(0)
    if setup.check_divergence:
        healthy, code = guard.check(healthy, *checks())
        if keep:
            new_variables = guard.keep(healthy, new_variables, variables)
    report = jnp.stack([loss.astype(jnp.float32), code.astype(jnp.float32)])
    return StepOutput(new_variables, healthy, report, metrics)


def _constrained(setup: RunSetup, variables: Variables) -> Variables:
    """The updated variables held to the shardings their inputs have (a sharded layout): the
    SPMD partitioner would otherwise be free to return a donated leaf replicated, or laid out
    otherwise than the next step's input."""
    layout = setup.placement.layout
    if layout is None or not setup.placement.sharded:
        return variables

    def hold(leaves, shardings):
        if leaves is None or shardings is None:
            return leaves
        return [
            jax.lax.with_sharding_constraint(x, s) for x, s in zip(leaves, shardings, strict=True)
        ]

    return dataclasses.replace(
        variables,
        params=hold(variables.params, layout.params),
        model_state=hold(variables.model_state, layout.model_state),
        opt_state=hold(variables.opt_state, layout.opt_state),
        ema=hold(variables.ema, layout.params),
    )


def _scanned(step: Callable[..., StepOutput]) -> Callable[..., StepOutput]:
    """K steps in one program: `devices`, `hparams` and `batches` have a leading axis of K;
    the report and the metrics come back stacked the same way."""

    def train_steps(variables: Variables, healthy, devices, hparams, batches) -> StepOutput:
        def body(carry, per_step):
            variables, healthy = carry
            device, hp, batch = per_step
            out = step(variables, healthy, device, hp, batch)
            return (out.variables, out.healthy), (out.report, out.metrics)

        (variables, healthy), (reports, metrics) = jax.lax.scan(
            body, (variables, healthy), (devices, hparams, batches)
        )
        return StepOutput(variables, healthy, reports, metrics)

    return train_steps


def _regrouped(fn: Callable[..., StepOutput], steps: int, micro: int):
    """`[steps * micro, batch, ...]` batches as `[steps, micro, batch, ...]`."""

    def train_steps(variables, healthy, devices, hparams, batches):
        batches = jax.tree.map(lambda b: b.reshape(steps, micro, *b.shape[1:]), batches)
        return fn(variables, healthy, devices, hparams, batches)

    return train_steps


def train_step_spec(
    setup: RunSetup,
    fields: Mapping[str, tuple[str, ...]],
    steps: int = 1,
    micro: int = 1,
    restore: bool = False,
) -> ProgramSpec:
    """The train step (`steps == 1`), or `steps` fused steps (the multi-step train); each
    step accumulates `micro` micro-batches. The batches arrive stacked as
    `[steps * micro, batch, ...]` (unstacked for one step of one batch). `restore=True`
    (under the guard): the guard checks and reports but keeps nothing, and the variables are
    not donated; the loop restores them (see the module's docstring)."""
    restore = restore and setup.check_divergence
    residency = setup.experiment.train_metrics_residency
    model = setup.model

    def build(reads: set[str]):
        traced = Traced()
        if setup.experiment.manual:
            step = manual_step_function(setup, fields, reads, traced, keep=not restore)
        else:
            step = step_function(setup, fields, reads, traced, micro, keep=not restore)
        fn = step if steps == 1 else _scanned(step)
        if steps > 1 and micro > 1:
            fn = _regrouped(fn, steps, micro)
        fn.nitro_traced = traced
        return fn

    units = [u for u in TRAIN_UNITS if u != "train_metrics"]
    if residency == "device":
        units.append("train_metrics")
    batch = "batch" if steps == 1 else "batches"
    return ProgramSpec(
        kind=ProgramKind.TRAIN_STEP if steps == 1 else ProgramKind.MULTI_STEP,
        owner=setup.owner,
        build=build,
        code=tracing.fingerprint(setup, *units),
        static={
            "model structure": Opaque(model.structure),
            "check_divergence": setup.check_divergence,
            "guard keeps": "by the loop, from the input" if restore else "by a select per step",
            "train_metrics residency": residency or "none",
            "fields": tracing.fields_key(fields, ("forward", "loss", "train_metrics")),
            "steps per program": steps,
            "micro-batches per step": micro,
            "ema": repr(setup.ema),
            "sam": repr(setup.sam),
            "precision": (setup.precision or FLOAT32).program_key,
            **({"frozen statistics": setup.frozen_statistics} if setup.frozen_statistics else {}),
            **({"remat": setup.remat.program_key} if setup.remat is not None else {}),
            # the argument shardings key it too; named, so an explanation says which
            **({"sharding": setup.placement.sharding} if setup.placement.sharded else {}),
        },
        graphconst=setup.experiment.graphconst,
        compile_options=remat_options(setup.remat, setup.placement.devices[0].platform),
        arg_names=("variables", "healthy", "device fields", "hyperparameters", batch),
        donate_argnums=() if restore else (0,),
        leaf_labels=tracing.leaf_labels(
            setup,
            batch,
            fields,
            ("variables.params", "parameter"),
            ("variables.model_state", "model state"),
            ("variables.opt_state", "optimizer state"),
        ),
    )
