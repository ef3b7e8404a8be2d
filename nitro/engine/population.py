"""A population's records: its members, each a run's setup, run-time record and train state
(`Member`), and the state they share (`PopulationState`: the train state of a run, its
variables stacked on a leading member axis, with one `healthy` flag per member).

A population trains through the run's loop, evaluation and prediction with a `Stacked`
members object (`nitro.engine.member_axis`); what is here is only what a population has and a
run has not: its members' records, their layout on the devices, and pruning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from nitro.core.run_setup import RunSetup
from nitro.core.train_state import EpochTotals, TrainState
from nitro.engine.run_time import RunTime
from nitro.errors import PopulationError

__all__ = [
    "Member",
    "PopulationState",
    "apply_prunes",
    "check_member_layout",
    "member_placement",
    "shown_settings",
    "stack",
    "unstack",
]


@dataclasses.dataclass(eq=False)
class Member:
    """One member: its settings (the values of the population's axes), and the records a
    single run of those settings would have. Its `state` holds its counters, history and
    validations; its variables live stacked in the `PopulationState`."""

    index: int
    settings: Mapping[str, Any]
    experiment: Any  # the experiment instance it was built from (its fields set)
    setup: RunSetup
    runtime: RunTime
    state: TrainState
    stopped: str | None = None  # why it stopped training ("diverged at step 12"), or None
    stopped_at: int | None = None  # the steps it trained before it stopped
    totals: EpochTotals | None = None  # its running sums of the epoch under way

    @property
    def label(self) -> str:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in self.settings.items())
        return f"member {self.index} ({shown})" if shown else f"member {self.index}"


def _short(value: Any) -> str:
    text = getattr(value, "__qualname__", None) or repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclasses.dataclass(eq=False)
class PopulationState(TrainState):
    """The train state the loop trains: every member's arrays stacked on a leading axis and
    the shared counters (the members' histories are theirs). The loop is its only in-place
    writer."""

    healthy: Any = None  # bool[N]
    prune: dict[int, str] = dataclasses.field(default_factory=dict)  # member -> why, asked
    batches: str = "shared"  # "shared": every member the same batches; "own": its seed's
    place: Callable[[Any], Any] | None = None  # lays out a member-stacked tree (the mesh)


def check_member_layout(setup: RunSetup) -> None:
    """A population lays its members out itself: refuse a sharded layout or a mesh of more
    than one axis."""
    placement = setup.placement
    if placement.sharded or len(placement.axes) > 1:
        raise PopulationError(
            f"a population lays its members out itself (mesh_axis='members' or 'batch'); "
            f"sharding={placement.sharding!r} and mesh={placement.axes} do not combine with it: "
            f"leave sharding='replicated' and mesh=None, or train the members as single runs"
        )


def member_placement(setup: RunSetup, mesh_axis: str) -> Callable[[Any], Any]:
    """How member-stacked arrays (variables, fed values) lie on the run's devices: on one
    device, replicated over the mesh with each batch split across it (`mesh_axis="batch"`),
    or their member axis split across the mesh, each device training its own members on
    whole batches (`mesh_axis="members"`)."""
    placement = setup.placement
    check_member_layout(setup)
    if placement.mesh is None or mesh_axis == "batch":
        return placement.put_replicated
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(placement.mesh, PartitionSpec("data"))
    return lambda tree: jax.device_put(tree, sharding)


def apply_prunes(members: Sequence[Member], state: PopulationState, say) -> None:
    """Stop the members `state.prune` names (`pop.stop(member)`, early stopping), between two
    calls: each one's `healthy` flag turns False, so from the next call on its variables stay
    as they are; the others train on as they would have."""
    asked, state.prune = state.prune, {}
    for index, why in asked.items():
        member = members[index]
        if member.stopped is not None:
            continue
        member.stopped, member.stopped_at = why, state.step
        state.healthy = state.healthy.at[index].set(False)
        say(f"{member.label} stopped at step {state.step}: {why}; the other members train on")


def shown_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Settings as history columns: numbers and strings as they are, others by their repr."""
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
        for k, v in settings.items()
    }


def stack(trees: Sequence[Any]) -> Any:
    """Trees of equal structure as one tree of arrays with a leading member axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def unstack(tree: Any, index: int) -> Any:
    """Member `index`'s slice of a stacked tree (new arrays)."""
    return jax.tree.map(lambda leaf: leaf[index], tree)
