"""`spike=` in a population: each member's watch over its own losses, and what a member's
roll-back records.

A population's members train as one program, so a member's roll-back is its own: the loop
keeps the members' variables from the start of each call (`copy_members`, on the device),
and when member i's loss spikes in a call (`SpikeWatch`, as a run's), its slice goes back to
that copy by a select along the member axis (`take_members`) while the others keep theirs.
The member sits the call out: its batches are left out for it alone (`skipped_batches` in its
record), and from then on it is fed the values of its own step, the population's less the
steps it sat out (`Member.sat_out`), so it trains as a run whose data never yielded those
batches. Past `max_rollbacks`, the member stops with the weights from before the call, as a
diverged member stops, and the others train on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nitro.engine.spikes import Spike, SpikeWatch
from nitro.errors import SpikeError

__all__ = ["check_member_spike", "spike_stops", "watch_members"]


def watch_members(members: Sequence[Any], policy: Spike | None) -> None:
    """Each member's watch over its losses (on its run-time record), under `spike=`."""
    if policy is None:
        return
    for member in members:
        if member.runtime.spikes is None:
            member.runtime.spikes = SpikeWatch(policy)


def check_member_spike(
    member: Any,
    policy: Spike,
    state: Any,
    item: Any,
    reports: np.ndarray,
    say: Callable[[str], None],
) -> bool | None:
    """Member `member`'s part of the call `item` (`reports`: its steps' (loss, guard code)
    rows it trained): None when no step spiked (the losses join its window). Else the call
    is rolled back for it alone, recorded in its rewinds and skipped batches (and its logger
    runs hear of it); returns True when that was past `max_rollbacks`, and the member stops
    there (with its weights from before the call), False when it trains on."""
    watch = member.runtime.spikes
    own_first = item.index - member.sat_out  # the member's own steps before the call
    found = watch.first_spike(own_first, reports)
    if found is None:
        return None
    offset, why = found
    staged = item.staged
    loss, step = float(reports[offset, 0]), own_first + offset + 1
    batches = list(range(state.position, state.position + staged.count * staged.group))
    where = f"step {step} (epoch {state.epoch + 1}, {_batches(batches)})"
    rewinds = member.state.rewinds
    done = sum(1 for row in rewinds if row.get("reason") == "spike")
    stops = done >= policy.max_rollbacks
    skipped = [
        {"epoch": state.epoch + 1, "index": index, "step": step, "loss": loss} for index in batches
    ]
    row: dict[str, Any] = {
        "rewind": len(rewinds) + 1,
        "from_step": own_first,
        "step": own_first,
        "epoch": state.epoch,
        "position": state.position,
        "reason": "spike",
        "where": "memory",
        "why": why,
    }
    if stops:
        calls: dict[tuple[int, int], list[int]] = {}  # (epoch, step) -> its batches
        for r in member.state.skipped_batches:
            calls.setdefault((r["epoch"], r["step"]), []).append(r["index"])
        earlier = [f"epoch {e} {_batches(b)} (step {s})" for (e, s), b in calls.items()]
        member.stopped = (
            f"spiked at {where}: {why}, after {done} roll-back{'s' * (done != 1)} "
            f"(Spike(max_rollbacks={policy.max_rollbacks})); batches left out so far: "
            f"{', '.join(earlier) or 'none'}"
        )
        member.stopped_at = item.index  # its weights are those from before the call
        say(
            f"{member.label} stopped: the loss {member.stopped}. Its weights are those of its "
            f"step {own_first}; the other members train on"
        )
    else:
        row["skipped_batches"] = skipped
        row["steps"] = staged.count  # the steps it sits out
        member.state.skipped_batches.extend(dict(s) for s in skipped)
        member.sat_out += staged.count
        say(
            f"{member.label}: loss spike at {where}: {why}; rolled it back to its step "
            f"{own_first} and left those batches out for it (pop.skipped_batches() lists "
            f"them); the other members train on"
        )
    rewinds.append(row)
    member.events.rewound(row)
    return stops


def _batches(indices: Sequence[int]) -> str:
    """A call's batch indices (consecutive) as words: "batch 5", "batches 4-5"."""
    if len(indices) == 1:
        return f"batch {indices[0]}"
    return f"batches {indices[0]}-{indices[-1]}"


def spike_stops(members: Sequence[Any]) -> None:
    """Every member has stopped and one of them by its spikes: the run stops with a
    `SpikeError` naming each member's reason."""
    if any((m.stopped or "").startswith("spiked") for m in members):
        raise SpikeError(
            "every member of the population stopped: "
            + "; ".join(f"{m.label}: {m.stopped}" for m in members)
            + ". Look at the batches left out, lower the learning rates, or raise "
            "Spike(max_rollbacks=)"
        )
