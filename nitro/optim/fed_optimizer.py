"""What the engine needs of a run's optimizer: `FedOptimizer`.

Two kinds satisfy it: `OptimizerSetup` (one optax transformation over the whole model, the
default step's) and `nitro.manual.ModelOptimizers` (one per model, which a `train_step` hook
applies itself). Both feed every numeric hyperparameter to each step as one float32 vector
(`names` orders it), so a schedule or a new constant never recompiles; the setup, the
schedules, the binding report and both train steps program against this protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from nitro.optim import ranges
from nitro.optim.optimizer import FedHyperparameter
from nitro.optim.param_groups import ParamGroup

__all__ = ["FedOptimizer", "describe_optimizer"]


@runtime_checkable
class FedOptimizer(Protocol):
    """A run's optimizer, its hyperparameters fed to every train step.

    Inside the trace a step calls `opt_state = inject(opt_state, hparams)`, runs the update,
    then `strip(new_state)`; `hparams[i]` is the value of `names[i]` at that step."""

    @property
    def description(self) -> str:
        """One line for the binding report (`optax.adam(learning_rate=0.001)`)."""
        ...

    @property
    def fed(self) -> tuple[FedHyperparameter, ...]:
        """The fed hyperparameters, sorted by name."""
        ...

    @property
    def groups(self) -> tuple[ParamGroup, ...]:
        """The parameter groups (none: one group)."""
        ...

    @property
    def decayed(self) -> tuple[str, ...]:
        """Paths of the parameter leaves that decoupled weight decay reaches."""
        ...

    @property
    def decay_to(self) -> str | None:
        """Where decoupled weight decay pulls ("zero", "init", "given"); None: no decay."""
        ...

    @property
    def names(self) -> tuple[str, ...]:
        """The fed hyperparameters, in the order of the vector a step receives."""
        ...

    @property
    def hyperparams(self) -> dict[str, float]:
        """Fed name -> the value a step uses without a schedule."""
        ...

    @property
    def dtypes(self) -> dict[str, Any]: ...

    @property
    def schedulable(self) -> dict[str, float]:
        """Names a schedule key can bind to, with their values without one."""
        ...

    def sources(self) -> dict[str, tuple[str, float]]:
        """Fed name -> (the bare name whose schedule also reaches it, the factor applied)."""
        ...

    def check_schedules(self, keys: Iterable[str]) -> None:
        """Refuse schedules that contradict the optimizer's own settings."""
        ...

    def updates(self) -> Mapping[str, Callable[..., Any]]:
        """The update functions a train step runs, by the name a change to their code is
        explained with (`optimizer update`, `optimizer update of gen`): they key the compiled
        train step."""
        ...

    def inject(self, opt_state: Any, hparams: Any) -> Any:
        """Inside the trace: this step's hyperparameters put into the state the update reads."""
        ...

    def strip(self, opt_state: Any) -> Any:
        """Inside the trace: the new state without the injected hyperparameters (they are fed
        again next step)."""
        ...


def describe_optimizer(optimizer: FedOptimizer) -> str:
    """The optimizer and the switches that shape its state, in one line (a checkpoint records
    it, and a resume whose state does not fit names it): `optax.adam(learning_rate=0.001),
    gradient_clip_norm=1.0, weight decay toward zero, parameter groups body, head`."""
    parts = [optimizer.description]
    clip = getattr(optimizer, "gradient_clip_norm", None)
    if clip is not None:
        parts.append(f"gradient_clip_norm={ranges.show(float(clip))}")
    if optimizer.decay_to is not None:
        parts.append(f"weight decay toward {optimizer.decay_to}")
    if optimizer.groups:
        parts.append(f"parameter groups {', '.join(g.name for g in optimizer.groups)}")
    return ", ".join(parts)
