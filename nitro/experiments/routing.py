"""Batch routing: the keyword-only parameters of a hook name the batch fields it receives.

```python
def forward(self, model, *, x): ...          # receives batch["x"]
def loss(self, outputs, *, y, weight=None):  # "weight" is optional
def metrics(self, outputs, **fields): ...    # receives the whole batch
def forward(self, model, *, x, rngs):        # "rngs": Nitro's nnx.Rngs, not a field
```

`rngs` is the one reserved name: `forward`, `loss` and `train_step` that take it get an
`nnx.Rngs` from Nitro (derived from the run's seed and the step; see docs/experiments.md,
"Randomness"), never a batch field.

Resolved once at setup from the first batch. Only the fields some traced hook needs are moved
to the device; bookkeeping fields (ids, paths) stay on the host.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from nitro.errors import RoutingError

__all__ = ["RNG_HOOKS", "HookFields", "RoutingError", "hook_fields", "select"]

# The hooks that may take `rngs`: the ones a train step runs.
RNG_HOOKS = ("forward", "loss", "train_step")


@dataclasses.dataclass(frozen=True)
class HookFields:
    hook: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    takes_all: bool
    takes_rngs: bool = False  # the hook has a parameter `rngs`: Nitro passes an nnx.Rngs

    def resolve(self, available: Iterable[str], split: str) -> tuple[str, ...]:
        """The fields this hook receives from a batch with `available` fields."""
        available = tuple(available)
        missing = [f for f in self.required if f not in available]
        if missing:
            raise RoutingError(
                f"hook `{self.hook}` needs batch field{'s' * (len(missing) > 1)} "
                f"{', '.join(map(repr, missing))}, but the '{split}' loader yields "
                f"{sorted(available)}. Rename the parameter of `{self.hook}` or the field the "
                f"loader yields, or give the parameter a default to make it optional."
            )
        if self.takes_all:
            return tuple(sorted(available))
        return tuple(f for f in self.required + self.optional if f in available)

    def describe(self) -> str:
        parts = list(self.required) + [f"{f}?" for f in self.optional]
        if self.takes_all:
            parts.append("**all")
        if self.takes_rngs:
            parts.append("rngs (Nitro's)")
        return ", ".join(parts) or "(no batch fields)"


def hook_fields(cls: type, hook: str, positional: Iterable[str]) -> HookFields:
    """Read a hook's signature: after `self` come the `positional` parameters the framework
    passes (the model, the outputs), then keyword-only batch fields."""
    fn = getattr(cls, hook)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as error:
        raise RoutingError(f"cannot read the signature of hook `{hook}`: {error}") from None
    params = list(signature.parameters.values())
    is_static = isinstance(inspect.getattr_static(cls, hook), staticmethod)
    if not is_static:
        params = params[1:]  # self
    positional = tuple(positional)
    leading = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(leading) < len(positional) and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise RoutingError(
            f"hook `{hook}` must accept {len(positional)} positional argument"
            f"{'s' * (len(positional) != 1)} after self ({', '.join(positional)}); its "
            f"signature is {hook}{signature}"
        )
    named_rngs = [p for p in params if p.name == "rngs" and p.kind is not p.POSITIONAL_ONLY]
    if named_rngs and hook not in RNG_HOOKS:
        raise RoutingError(
            f"hook `{hook}{signature}` takes `rngs`, but only {', '.join(RNG_HOOKS)} get "
            f"Nitro's random keys (`{hook}` runs outside the train step, so it must be "
            f"deterministic). Draw the randomness in `forward` and return what it made, or "
            f"remove `rngs` from `{hook}`."
        )
    takes_rngs = bool(named_rngs)
    extra = [
        p.name for p in leading[len(positional) :] if p.default is p.empty and p.name != "rngs"
    ]
    if extra:
        wanted = ", ".join(positional)
        raise RoutingError(
            f"hook `{hook}{signature}`: batch fields must be keyword-only parameters. Write "
            f"`def {hook}(self, {wanted}, *, {', '.join(extra)})`."
        )
    required, optional, takes_all = [], [], False
    for p in params:
        if p.name == "rngs" and takes_rngs:
            continue
        if p.kind is p.KEYWORD_ONLY:
            (optional if p.default is not p.empty else required).append(p.name)
        elif p.kind is p.VAR_KEYWORD:
            takes_all = True
    return HookFields(hook, tuple(required), tuple(optional), takes_all, takes_rngs)


def select(batch: Mapping[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    return {name: batch[name] for name in fields}
