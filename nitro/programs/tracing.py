"""What every program needs from the setup while it is traced: the stripped view of the
experiment, hook calls, the code fingerprint, readable leaf names, and the checks that make a
hook's mistake an error at the first trace."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from nitro.core.run_setup import RunSetup
from nitro.core.train_state import Variables
from nitro.errors import SetupError
from nitro.experiments.equinox import EquinoxModel
from nitro.experiments.fingerprint import CodeFingerprint
from nitro.experiments.trace_view import TraceView

__all__ = [
    "EVAL_SEED",
    "RNG_FIELD",
    "call",
    "eval_rngs",
    "pop_step_key",
    "check_batch_axis",
    "check_scalar_loss",
    "fields_key",
    "fingerprint",
    "leaf_labels",
    "unflatten",
    "view",
]


def view(setup: RunSetup, device: Mapping[str, Any], reads: set[str]) -> TraceView:
    return TraceView(setup.cls, setup.experiment.graphconst, with_sets(setup, device), reads)


def with_sets(setup: RunSetup, device: Mapping[str, Any]) -> Mapping[str, Any]:
    """`device` with each buffer set's parts put together as the field the hooks read."""
    sets = setup.experiment.device_sets
    if not sets:
        return device
    device = dict(device)
    for name, (treedef, parts) in sets.items():
        if parts and parts[0] in device:
            device[name] = treedef.unflatten([device.pop(part) for part in parts])
    return device


# The train step's random keys travel with its Device fields under this name (not an
# identifier, so no field can take it): the run's key data and the step, as uint32 words.
RNG_FIELD = "nitro.rng"
# What `rngs` holds outside the train step (validate, evaluate, predict, export): one fixed
# key, so those are deterministic, whatever the run's seed (and the model is in eval mode).
EVAL_SEED = 0

_NO_RNGS = "no `rngs` argument was provided"


def pop_step_key(device: Mapping[str, Any]) -> tuple[dict[str, Any], jax.Array | None]:
    """(the Device fields without the step's key words, the step's key): the key is
    `jax.random.fold_in(jax.random.key(seed), step)`; None when no hook takes `rngs`."""
    device = dict(device)
    words = device.pop(RNG_FIELD, None)
    if words is None:
        return device, None
    return device, jax.random.fold_in(jax.random.wrap_key_data(words[:-1]), words[-1])


def eval_rngs() -> nnx.Rngs:
    return nnx.Rngs(EVAL_SEED)


def takes_rngs(setup: RunSetup, hook: str) -> bool:
    fields = setup.experiment.hook_fields.get(hook)
    return fields is not None and fields.takes_rngs


def call(setup: RunSetup, hook: str, view: TraceView, *args, rngs=None, **kwargs):
    """Call a hook; `rngs` (an nnx.Rngs) reaches it when it takes them. A model whose Dropout
    finds no keys is named with the fix, instead of Flax's error from inside the trace."""
    if takes_rngs(setup, hook):
        kwargs["rngs"] = rngs if rngs is not None else eval_rngs()
    if args and isinstance(args[0], EquinoxModel):
        return call_equinox(setup.experiment.hooks[hook], hook, view, *args, **kwargs)
    try:
        return setup.experiment.hooks[hook](view, *args, **kwargs)
    except ValueError as error:
        if _NO_RNGS not in str(error) or isinstance(error, SetupError):
            raise
        raise SetupError(missing_rngs_message(hook, takes_rngs(setup, hook))) from error


def call_equinox(fn, hook: str, view, model: EquinoxModel, *args, **kwargs):
    """`fn` called with the equinox module of `model`; a shape error inside it names the hook
    and the usual cause (an equinox module called on a whole batch)."""
    try:
        return fn(view, model.equinox, *args, **kwargs)
    except (TypeError, ValueError) as error:
        if isinstance(error, SetupError):
            raise
        raise SetupError(
            f"hook `{hook}` raised {type(error).__name__} with an equinox model: {error}. "
            f"Equinox layers take one sample, without a batch axis: if `{hook}` calls the "
            f"model on the whole batch, map it over the batch, `return jax.vmap(model)(x)` "
            f"(and for eqx.nn.Dropout while training, a key per sample: "
            f"`jax.vmap(lambda x, k: model(x, key=k))(x, jax.random.split(rngs.dropout(), "
            f"len(x)))`)"
        ) from error


def missing_rngs_message(hook: str, takes: bool) -> str:
    call = "model(x, rngs=rngs)"
    if hook == "train_step":
        how = (
            "draw a key in train_step and give the model an nnx.Rngs of it inside the "
            "function step.grad differentiates: `key = rngs.dropout()`, then "
            "`step.grad('gen', lambda m: loss(m['gen'](z, rngs=nnx.Rngs(key))))`"
        )
        if takes:
            return f"a model inside `train_step` got no random keys for its Dropout: {how}."
        return (
            f"a model inside `train_step` needs random keys for its Dropout, but train_step "
            f"takes no `rngs`: add it (`def train_step(self, step, *, x, rngs):`) and {how}."
        )
    signature = {
        "forward": "def forward(self, model, *, x, rngs):",
        "loss": "def loss(self, outputs, *, y, rngs):",
    }.get(hook, f"def {hook}(self, ..., rngs):")
    if takes:
        return (
            f"hook `{hook}` takes `rngs`, but the model call inside it did not get them, and "
            f"the model's Dropout (in train mode inside the train step) needs random keys. "
            f"Pass them on: `{call}`."
        )
    return (
        f"hook `{hook}` runs a model whose Dropout (in train mode inside the train step) "
        f"needs random keys, but `{hook}` takes no `rngs`. Add the parameter and pass it on: "
        f"`{signature} return {call}`. Nitro passes an nnx.Rngs derived from the run's seed "
        f'and the step (docs/experiments.md, "Randomness: dropout and friends").'
    )


def fingerprint(setup: RunSetup, *units: str) -> CodeFingerprint:
    code = setup.experiment.code
    return CodeFingerprint.combine(*(code[u] for u in units if u in code))


def leaf_labels(setup: RunSetup, batch: str, fields, *arguments: tuple[str, str]):
    """Readable names for arguments' leaves, for compile explanations."""
    labels = {f"{batch}['{name}']": name for hook in fields.values() for name in hook}
    labels.update({f"device fields[{name!r}]": name for name in setup.experiment.device_dtypes})
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
