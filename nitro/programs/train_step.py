"""The train step: forward, loss, gradient, the divergence guard and the optimizer update,
traced into one program over donated variables; and K of them fused with `lax.scan`.

One step is a pure function `step(variables, healthy, device, hparams, batch) -> StepOutput`.
The train-step program is that function; the multi-step program scans it over K stacked
batches, with the Device fields and hyperparameters given per step (arrays of length K), so a
schedule changes values, never programs. The guard works per step inside the scan: from the
first non-finite step on, the later ones leave the variables as they were, and each step's
report (loss, finiteness code) comes back in one array.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nitro.core.metrics import split_modes
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import StepOutput, Variables
from nitro.experiments.routing import select
from nitro.programs import tracing
from nitro.programs.compile_cache import Opaque, ProgramKind, ProgramSpec

__all__ = ["TRAIN_UNITS", "step_function", "train_step_spec"]

# The code a train step runs: hooks, the model's classes, the optimizer's update.
TRAIN_UNITS = ("forward", "loss", "train_metrics", "train_step", "model", "optimizer")


def step_function(
    setup: RunSetup,
    fields: Mapping[str, tuple[str, ...]],
    reads: set[str],
    aux: dict,
    micro: int = 1,
) -> Callable[..., StepOutput]:
    """One training step as a traceable function of (variables, healthy, device fields,
    hyperparameters, batch). With `micro > 1` the batch holds `micro` stacked micro-batches
    and the step accumulates their gradients (a scan: the memory of one micro-batch), then
    updates once: for a loss that is a mean over its batch, exactly one step on the merged
    batch."""
    residency = setup.experiment.train_metrics_residency
    optimizer = setup.optimizer
    check = setup.check_divergence
    model = setup.model
    ema, sam = setup.ema, setup.sam

    def step(variables: Variables, healthy, device, hparams, batch) -> StepOutput:
        params, rest = tracing.unflatten(setup, variables)
        opt_state = jax.tree.unflatten(model.opt_state_def, variables.opt_state)
        view = tracing.view(setup, device, reads)

        def objective(params, rest, batch):
            module = nnx.merge(model.graphdef_train, params, rest, copy=True)
            outputs = tracing.call(
                setup, "forward", view, module, **select(batch, fields["forward"])
            )
            loss = tracing.check_scalar_loss(
                tracing.call(setup, "loss", view, outputs, **select(batch, fields["loss"]))
            )
            _, _, new_rest = nnx.split(module, nnx.Param, ...)
            return loss, (outputs, new_rest)

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
                aux["specs"], leaves = split_modes(values, "train_metrics")
                return leaves
            return []

        # `rest` (batch statistics, RNG counts) is an argument too, so the model's variables
        # live at one trace level; only `params` is differentiated.
        grad_fn = jax.value_and_grad(objective, has_aux=True)

        def gradients(params, rest):
            """(loss, new model state, gradient, what to report): of the whole batch, or
            accumulated over its micro-batches."""
            if micro == 1:
                (loss, (outputs, new_rest)), grads = grad_fn(params, rest, batch)
                return loss, new_rest, grads, measured(outputs, batch)

            def accumulate(carry, micro_batch):
                rest, grad_sum, loss_sum = carry
                (loss, (outputs, rest)), grads = grad_fn(params, rest, micro_batch)
                grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
                return (rest, grad_sum, loss_sum + loss), measured(outputs, micro_batch)

            zeros = jax.tree.map(jnp.zeros_like, params)
            start = (rest, zeros, jnp.zeros((), jnp.float32))
            (new_rest, grad_sum, loss_sum), metrics = jax.lax.scan(accumulate, start, batch)
            grads = jax.tree.map(lambda g: g / micro, grad_sum)
            return loss_sum / micro, new_rest, grads, metrics

        loss, new_rest, grads, metrics = gradients(params, rest)
        if sam is not None:
            # the gradient again, at the weights nudged uphill; the model state and the
            # reported loss stay those of the first pass
            nudged = jax.tree.map(jnp.add, params, sam.perturbation(params, grads))
            grads = gradients(nudged, rest)[2]
        opt_state = optimizer.inject(opt_state, hparams)

        if check:
            # From the first non-finite step on, every later step leaves the weights and the
            # model state as they were, so the handle holds the last good ones. A step is
            # non-finite when its loss, a gradient or a fed hyperparameter is (a NaN learning
            # rate from a schedule). The gate is known before the optimizer runs, so it zeroes
            # the gradient and the update inside the kernels that compute them (in place, no
            # select of the state): the guard costs one reduction over the gradients. The
            # optimizer sees a zero gradient at a gated step (its moments decay by one step).
            # An update that overflows from finite inputs (an absurd learning rate) is applied,
            # and the next step's loss stops the run.
            loss_ok = jnp.isfinite(loss)
            grads_ok = tracing.all_finite(grads)
            hparams_ok = jnp.all(jnp.isfinite(hparams)) if optimizer.names else jnp.bool_(True)
            healthy_in = healthy
            healthy = healthy_in & loss_ok & grads_ok & hparams_ok
            grads = jax.tree.map(lambda g: jnp.where(healthy, g, 0), grads)
            new_rest = jax.tree.map(
                lambda new, old: jax.lax.select(healthy, new, old), new_rest, rest
            )
        updates, new_opt = optimizer.tx.update(grads, opt_state, params)
        if check:
            new_params = jax.tree.map(
                lambda p, u: (p + jnp.where(healthy, u, 0)).astype(p.dtype), params, updates
            )
            # 0: finite; else the first failing stage: 1 loss, 2 gradient, 3 hyperparameter;
            # 4: an earlier step in flight was already non-finite
            code = jnp.where(
                ~healthy_in,
                4,
                jnp.where(~loss_ok, 1, jnp.where(~grads_ok, 2, jnp.where(~hparams_ok, 3, 0))),
            )
            report = jnp.stack([loss.astype(jnp.float32), code.astype(jnp.float32)])
        else:
            new_params = optax.apply_updates(params, updates)
            report = jnp.stack([loss.astype(jnp.float32), jnp.zeros((), jnp.float32)])
        new_opt = optimizer.strip(new_opt)
        ema_leaves, ema_steps = _moving_average(ema, model, variables, new_params, healthy, check)
        new_variables = Variables(
            params=jax.tree.leaves(new_params),
            model_state=jax.tree.leaves(new_rest),
            opt_state=jax.tree.leaves(new_opt),
            ema=ema_leaves,
            ema_steps=ema_steps,
        )
        return StepOutput(new_variables, healthy, report, metrics)

    return step


def manual_step_function(
    setup: RunSetup, fields: Mapping[str, tuple[str, ...]], reads: set[str], aux: dict
) -> Callable[..., StepOutput]:
    """A step of a `train_step` hook: the hook gets a `nitro.manual.Step` (the models, their
    gradients, their optimizers) and the batch fields it names; the guard keeps the models,
    their state and the optimizers' states as they were from the first non-finite step on."""
    from nitro.programs.manual import Step

    optimizer = setup.optimizer
    check = setup.check_divergence
    model = setup.model
    ema = setup.ema

    def step(variables: Variables, healthy, device, hparams, batch) -> StepOutput:
        params, rest = tracing.unflatten(setup, variables)
        opt_state = jax.tree.unflatten(model.opt_state_def, variables.opt_state)
        opt_state = optimizer.inject(opt_state, hparams)
        view = tracing.view(setup, device, reads)
        work = Step(
            model.graphdef_train,
            {name: params[name] for name in params.keys()},
            rest,
            dict(opt_state),
            optimizer.transformations(),
        )
        values = tracing.call(
            setup, "train_step", view, work, **select(batch, fields["train_step"])
        )
        if not isinstance(values, Mapping) or "loss" not in values:
            raise TypeError(
                f"hook `train_step` must return a dict with a scalar 'loss' (and any other "
                f"scalars to track); it returned {type(values).__name__}"
                + (f" with keys {sorted(values)}" if isinstance(values, Mapping) else "")
            )
        loss = tracing.check_scalar_loss(values["loss"])
        aux["specs"], metrics = split_modes(
            {k: v for k, v in values.items() if k != "loss"}, "train_step"
        )
        new_params = jax.tree.map(lambda x: x, params)  # same structure, new values below
        for name, tree in work.params.items():
            new_params[name] = tree
        new_rest, new_opt = work.rest, work.opt_states
        if check:
            loss_ok = jnp.isfinite(loss)
            params_ok = tracing.all_finite(new_params)
            healthy_in = healthy
            healthy = healthy_in & loss_ok & params_ok
            keep = lambda new, old: jax.tree.map(  # noqa: E731
                lambda n, o: jnp.where(healthy, n, o), new, old
            )
            new_params, new_rest = keep(new_params, params), keep(new_rest, rest)
            new_opt = keep(new_opt, opt_state)
            code = jnp.where(~healthy_in, 4, jnp.where(~loss_ok, 1, jnp.where(~params_ok, 5, 0)))
        else:
            code = jnp.zeros((), jnp.int32)
        report = jnp.stack([loss.astype(jnp.float32), code.astype(jnp.float32)])
        ema_leaves, ema_steps = _moving_average(ema, model, variables, new_params, healthy, check)
        new_variables = Variables(
            params=jax.tree.leaves(new_params),
            model_state=jax.tree.leaves(new_rest),
            opt_state=jax.tree.leaves(optimizer.strip(new_opt)),
            ema=ema_leaves,
            ema_steps=ema_steps,
        )
        return StepOutput(new_variables, healthy, report, metrics)

    return step


def _moving_average(ema, model, variables: Variables, new_params, healthy, check):
    """The EMA of the weights after a step (unchanged by a skipped one)."""
    if ema is None:
        return variables.ema, variables.ema_steps
    average = jax.tree.unflatten(model.params_def, variables.ema)
    steps = variables.ema_steps
    decay = ema.decay_at(steps)
    moved = jax.tree.map(
        lambda a, p: (decay * a + (1 - decay) * p).astype(a.dtype), average, new_params
    )
    if check:
        moved = jax.tree.map(lambda m, a: jnp.where(healthy, m, a), moved, average)
        steps = steps + healthy.astype(steps.dtype)
    else:
        steps = steps + 1
    return jax.tree.leaves(moved), steps


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
    setup: RunSetup, fields: Mapping[str, tuple[str, ...]], steps: int = 1, micro: int = 1
) -> ProgramSpec:
    """The train step (`steps == 1`), or `steps` fused steps (the multi-step train); each
    step accumulates `micro` micro-batches. The batches arrive stacked as
    `[steps * micro, batch, ...]` (unstacked for one step of one batch)."""
    residency = setup.experiment.train_metrics_residency
    model = setup.model

    def build(reads: set[str]):
        aux: dict[str, Any] = {}
        if setup.experiment.manual:
            step = manual_step_function(setup, fields, reads, aux)
        else:
            step = step_function(setup, fields, reads, aux, micro)
        fn = step if steps == 1 else _scanned(step)
        if steps > 1 and micro > 1:
            fn = _regrouped(fn, steps, micro)
        fn.nitro_aux = aux
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
            "train_metrics residency": residency or "none",
            "fields": tracing.fields_key(fields, ("forward", "loss", "train_metrics")),
            "steps per program": steps,
            "micro-batches per step": micro,
            "ema": repr(setup.ema),
            "sam": repr(setup.sam),
        },
        graphconst=setup.experiment.graphconst,
        arg_names=("variables", "healthy", "device fields", "hyperparameters", batch),
        donate_argnums=(0,),
        leaf_labels=tracing.leaf_labels(
            setup,
            batch,
            fields,
            ("variables.params", "parameter"),
            ("variables.model_state", "model state"),
            ("variables.opt_state", "optimizer state"),
        ),
    )
