"""What every program needs from the setup while it is traced: the stripped view of the
experiment, hook calls, the code fingerprint, readable leaf names, and the checks that make a
hook's mistake an error at the first trace."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from nitro.core.run_setup import RunSetup
from nitro.core.train_state import Variables
from nitro.errors import SetupError
from nitro.experiments.fingerprint import CodeFingerprint
from nitro.experiments.trace_view import TraceView

__all__ = [
    "call",
    "check_batch_axis",
    "check_scalar_loss",
    "fields_key",
    "fingerprint",
    "leaf_labels",
    "unflatten",
    "view",
]


def view(setup: RunSetup, device: Mapping[str, Any], reads: set[str]) -> TraceView:
    return TraceView(setup.cls, setup.experiment.graphconst, device, reads)


def call(setup: RunSetup, hook: str, view: TraceView, *args, **kwargs):
    return setup.experiment.hooks[hook](view, *args, **kwargs)


def fingerprint(setup: RunSetup, *units: str) -> CodeFingerprint:
    code = setup.experiment.code
    return CodeFingerprint.combine(*(code[u] for u in units if u in code))


def leaf_labels(setup: RunSetup, batch: str, fields, *arguments: tuple[str, str]):
    """Readable names for arguments' leaves, for compile explanations."""
    labels = {f"{batch}['{name}']": name for hook in fields.values() for name in hook}
    labels.update({f"device fields['{name}']": name for name in setup.experiment.device_specs})
    for prefix, which in arguments:
        for i, path in enumerate(setup.model.leaf_paths.get(which, ())):
            labels[f"{prefix}[{i}]"] = f"{which} {path}"
    return labels


def unflatten(setup: RunSetup, variables: Variables):
    model = setup.model
    params = jax.tree.unflatten(model.params_def, variables.params)
    rest = jax.tree.unflatten(model.model_state_def, variables.model_state)
    return params, rest


def check_scalar_loss(loss: Any) -> Any:
    if not hasattr(loss, "shape") or loss.shape != ():
        shape = getattr(loss, "shape", type(loss).__name__)
        raise TypeError(
            f"hook `loss` must return a scalar (reduce over the batch, e.g. `.mean()`); it "
            f"returned shape {shape}"
        )
    return loss


def check_batch_axis(outputs: Any, batch: Mapping[str, Any]) -> None:
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


def fields_key(fields: Mapping[str, tuple[str, ...]], hooks) -> tuple:
    return tuple((hook, tuple(fields.get(hook, ()))) for hook in hooks)
