"""Sharpness-aware minimization: the gradient taken at weights nudged uphill.

`sam=0.05` (`nitro.SAM(rho=0.05)`) computes the gradient g at the weights w, moves to
`w + rho * g / ||g||`, takes the gradient there, and updates w with that second gradient
(Foret et al., 2021). `nitro.ASAM(rho=0.5, eta=0.01)` scales the step by the weights' size,
`T_w = |w| + eta`: `w + rho * T_w^2 g / ||T_w g||` (Kwon et al., 2021). With gradient
accumulation both gradients are accumulated over every micro-batch of the step; on a mesh the
norm is of the global gradient. Each step costs two gradient evaluations.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from nitro.errors import SetupError
from nitro.optim import ranges

__all__ = ["ASAM", "SAM"]

# the radius, and ASAM's offset of the weights' scale
RANGES = {"rho": ranges.POSITIVE.with_example(0.05), "eta": ranges.NON_NEGATIVE.with_example(0.01)}


@dataclasses.dataclass(frozen=True)
class SAM:
    """Sharpness-aware minimization with radius `rho`."""

    rho: float = 0.05

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in dataclasses.fields(self):
            bound = RANGES[field.name]
            ranges.check(
                f"{name}'s {field.name}",
                getattr(self, field.name),
                bound,
                fix=f"sam=nitro.{name}({field.name}={ranges.show(bound.example)})",
            )

    def perturbation(self, params: Any, grads: Any) -> Any:
        """The step from w to the weights where the second gradient is taken."""
        import jax
        import optax

        norm = optax.tree.norm(grads)
        scale = self.rho / (norm + 1e-12)
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)

    @classmethod
    def of(cls, value) -> SAM | None:
        """What the `sam` run keyword accepts: None, a radius > 0, SAM or ASAM."""
        if value is None or isinstance(value, SAM):
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise SetupError(
                f"sam must be a radius > 0 such as 0.05, nitro.SAM(rho=...), "
                f"nitro.ASAM(rho=..., eta=...), or None; got {value!r}"
            )
        return SAM(ranges.check("sam", value, RANGES["rho"], fix="sam=0.05"))


@dataclasses.dataclass(frozen=True)
class ASAM(SAM):
    """Adaptive SAM: the radius scales with the weights, `T_w = |w| + eta`."""

    rho: float = 0.5
    eta: float = 0.01

    def perturbation(self, params: Any, grads: Any) -> Any:
        import jax
        import jax.numpy as jnp
        import optax

        scaled = jax.tree.map(lambda w, g: (jnp.abs(w) + self.eta) * g, params, grads)
        norm = optax.tree.norm(scaled)
        scale = self.rho / (norm + 1e-12)
        return jax.tree.map(
            lambda w, g: ((jnp.abs(w) + self.eta) ** 2 * g * scale).astype(g.dtype),
            params,
            grads,
        )
