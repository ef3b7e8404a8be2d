"""A copy of the weights a handle holds, safe to keep (`n.model`, `Nitro(e2, weights=n)`).

While the handle trains, the copy is taken on the training thread at its next step boundary,
before the next step donates the arrays (`runner.at_step_boundary`).
"""

from __future__ import annotations

from collections.abc import Callable

from nitro.core.run_setup import RunSetup
from nitro.core.train_state import TrainState
from nitro.engine.runner import RunControl, RunGuard, at_step_boundary
from nitro.runs.initial_weights import WeightsSource

__all__ = ["copy_weights"]


def copy_weights(
    setup: RunSetup, state: Callable[[], TrainState], guard: RunGuard, control: RunControl
) -> WeightsSource:
    """Copies of the parameters and model state of `state()`, the handle's current state,
    taken when no other work holds the handle."""

    def copy() -> WeightsSource:
        current = state()
        return WeightsSource.of(
            setup.model,
            current.variables,
            f"the weights of a {setup.cls.__name__} run at epoch {current.epoch}, "
            f"step {current.step}",
        )

    return at_step_boundary(guard, control, copy, "copying its weights")
