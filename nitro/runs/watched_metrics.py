"""The metrics a run watches, checked before it trains: an early stop or a checkpointer
watching a column the run does not produce is refused at setup, naming the columns it does
produce (found by probing the metrics hook on zeros of the outputs' shapes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from nitro.core.run_setup import RunSetup, SplitSetup
from nitro.core.train_state import TrainState, Variables
from nitro.errors import SetupError
from nitro.optim.plateau import ReduceOnPlateau

__all__ = ["check_watched_metrics", "metric_names"]


def check_watched_metrics(
    setup: RunSetup, state: TrainState, experiment: Any, device: Mapping[str, jax.Array]
) -> None:
    """Refuse at setup an early stop or a checkpointer watching a metric the run does not
    produce (the metrics hook's names are probed on `experiment`, the handle's live copy, with
    the `device` field arrays; see `metric_names`), or one of a split that is not among
    `eval_splits`. A checkpointer on `val_loss` in a run without a 'val' split keeps the
    newest checkpoint only."""
    early_stop, checkpointer = setup.early_stop, setup.checkpointer
    known = {"loss", "val_loss"} | {f"{split}_loss" for split in setup.eval_splits}
    names: set[str] | None = None
    plateaus = [s for s in setup.schedules if isinstance(s.fn, ReduceOnPlateau)]
    watched = [
        w.metric for w in (early_stop, checkpointer, *(s.fn for s in plateaus)) if w is not None
    ]
    if any(metric not in known for metric in watched):
        names = metric_names(setup, state, experiment, device)
    for schedule in plateaus:
        plateau = schedule.fn
        assert isinstance(plateau, ReduceOnPlateau)
        produced = None if names is None else names | {"loss"}
        plateau.check(schedule.key, produced, tuple(setup.splits), setup.eval_splits)
    if early_stop is not None:
        early_stop.check(
            tuple(setup.splits),
            names if early_stop.metric not in known else None,
            setup.eval_splits,
        )
    if checkpointer is not None:
        prefix = checkpointer.metric.split("_", 1)[0]
        if prefix in setup.splits and prefix not in ("train", "val", *setup.eval_splits):
            raise SetupError(
                f"Checkpointer(metric={checkpointer.metric!r}) ranks checkpoints by the "
                f"{prefix!r} split, which is not evaluated at the epochs' ends "
                f"(eval_splits={setup.eval_splits!r}); pass "
                f"eval_splits={(*setup.eval_splits, prefix)!r}"
            )
    if checkpointer is None or names is None or checkpointer.metric in known | names:
        return
    raise SetupError(
        f"Checkpointer(metric={checkpointer.metric!r}) ranks checkpoints by a column this run "
        f"does not produce; its metrics are {', '.join(sorted(names))}"
    )


def metric_names(
    setup: RunSetup, state: TrainState, experiment: Any, device: Mapping[str, jax.Array]
) -> set[str] | None:
    """The history columns a run produces, when they can be known without training: loss,
    each eval split's loss (val_loss, ...) and, by tracing forward on the first batch's
    shapes and calling the metrics hook on zeros, the metrics' names. None when they cannot
    be determined."""
    names = set()
    if "train" in setup.splits:
        names.add("loss")
    evaluated = [setup.splits[split] for split in setup.eval_splits]
    for split in evaluated:
        if "loss" in split.hook_fields:
            names.add(f"{split.name}_loss")
    hooks = setup.experiment.hooks
    if "train_metrics" in hooks or "finalize_metrics" in hooks:
        return None  # their names can depend on the data: checked when the first row arrives
    if "metrics" in hooks and evaluated:
        found = _probe_metrics(setup, state, evaluated[0], experiment, device)
        if found is None:
            return None
        names |= {f"{split.name}_{k}" for split in evaluated for k in found}
    return names


def _probe_metrics(
    setup: RunSetup,
    state: TrainState,
    val: SplitSetup,
    experiment: Any,
    device: Mapping[str, jax.Array],
) -> set[str] | None:
    """The keys the metrics hook returns: forward traced abstractly for the outputs' shapes,
    then the hook called on zeros of those shapes (host) or traced (device)."""
    from nitro.core.metrics import split_modes
    from nitro.programs.specs import eval_spec

    wanted = val.hook_fields.get("metrics", ())
    if not set(wanted) <= set(val.batch_spec):
        return None  # host-only fields: their shapes are not recorded
    abstract = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)  # noqa: E731
    try:
        evaluate = eval_spec(setup, val.hook_fields, with_loss=False, return_outputs=True).build(
            set()
        )
        variables = Variables(
            params=[abstract(x) for x in state.variables.params],
            model_state=[abstract(x) for x in state.variables.model_state],
        )
        abstract_device = {k: abstract(v) for k, v in device.items()}
        batch = {
            name: jax.ShapeDtypeStruct(shape, np.dtype(dtype))
            for name, (shape, dtype) in val.batch_spec.items()
        }
        result = jax.eval_shape(evaluate, variables, abstract_device, batch, np.int32(1))
        outputs = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), result.outputs)
        fields = {k: np.zeros(*val.batch_spec[k]) for k in wanted}
        values = setup.experiment.hook_functions["metrics"](experiment, outputs, **fields)
        specs, _ = split_modes(values, "metrics")
        return {path for path, _ in specs}
    except Exception:  # noqa: BLE001 - unknown here: checked at the first validation instead
        return None
