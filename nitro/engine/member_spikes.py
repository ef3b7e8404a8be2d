"""`spike=` in a population: every member's watch over its own losses, and what a member's
roll-back records.

A population's members train as one program, so a member's roll-back is its own. Under
`spike=` the train step does not donate its variables, and the loop holds each call's input
until the call is read back; when member i's loss spikes in a call (`MembersWatch`: a run's
rule, for every member at once), its slice goes back to that input by a select along the
member axis (`take_members`), while the others keep theirs. The member sits the call out:
its batches are left out for it alone (`skipped_batches` in its record), and from then on it
is fed the values of its own step, the population's less the steps it sat out
(`Member.sat_out`), so it trains as a run whose data never yielded those batches. Past
`max_rollbacks`, the member stops with the weights from before the call, as a diverged member
stops, and the others train on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nitro.engine.spikes import Spike
from nitro.errors import SpikeError

__all__ = ["MembersWatch", "roll_back_member", "spike_stops"]


class MembersWatch:
    """Every member's recent finite losses and the spike test of a call's, for all members at
    once (numpy over the member and step axes): `SpikeWatch`'s rule, member by member. A
    member's window is its last `window` finite losses since the population started or
    resumed, `recent[member]` oldest first, NaN where it has fewer."""

    def __init__(self, policy: Spike, count: int):
        self.policy = policy
        self.recent = np.full((count, policy.window), np.nan)
        self.full = False  # every member's window holds `window` losses

    def take(self, other: MembersWatch, rows: Sequence[int]) -> None:
        """The windows of `other`'s members `rows` (a population shrunk to them)."""
        self.recent = other.recent[list(rows)].copy()
        self.full = not np.isnan(self.recent).any()

    def _calm(self, losses: np.ndarray) -> bool:
        """The common call, in a few array operations: every member trained every step, all
        finite, its windows full, and no step over its window's mean. Then the losses join
        the windows."""
        window, steps = self.policy.window, losses.shape[1]
        joined = np.concatenate([np.zeros((len(losses), 1)), self.recent, losses], axis=1)
        sums = np.cumsum(joined, axis=1)
        mean = (sums[:, window : window + steps] - sums[:, :steps]) / window
        if (losses - mean > self.policy.rtol * np.abs(mean)).any():
            return False
        self.recent = joined[:, -window:]
        return True

    def first_spikes(
        self, losses: np.ndarray, codes: np.ndarray, limits: np.ndarray
    ) -> dict[int, tuple[int, str]]:
        """Member (row) -> the offset of its first spiking step in the call and why it
        spikes, for the members whose loss spiked; the others' losses join their windows.
        `losses`, `codes`: the call's `[members, steps]`; `limits`: the steps each member
        trained (a stopped member's fewer)."""
        policy, window = self.policy, self.policy.window
        steps = losses.shape[1]
        if (
            self.full
            and limits.min() >= steps
            and not codes.any()
            and np.isfinite(losses).all()
            and self._calm(losses)
        ):
            return {}
        trained = np.arange(steps) < limits[:, None]
        with np.errstate(invalid="ignore", over="ignore"):
            broken = trained & ((codes != 0) | ~np.isfinite(losses))
            joined = np.concatenate([self.recent, np.where(trained, losses, np.nan)], axis=1)
            seen = ~np.isnan(joined)
            sums = np.cumsum(np.where(seen, joined, 0.0), axis=1)
            counts = np.cumsum(seen, axis=1)
            zero = np.zeros((len(losses), 1))
            sums, counts = np.hstack([zero, sums]), np.hstack([zero, counts])
            # step k's window: the `window` values before it, recent ones and the call's
            total = sums[:, window : window + steps] - sums[:, :steps]
            number = counts[:, window : window + steps] - counts[:, :steps]
            mean = total / np.maximum(number, 1)
            high = trained & (number >= window) & (losses - mean > policy.rtol * np.abs(mean))
        spiked = broken | high
        found: dict[int, tuple[int, str]] = {}
        for row in np.flatnonzero(spiked.any(axis=1)):
            offset = int(np.argmax(spiked[row]))
            loss = float(losses[row, offset])
            if broken[row, offset]:
                kind = "a non-finite loss" if not np.isfinite(loss) else "a non-finite step"
                found[int(row)] = (offset, f"{kind} ({loss})")
            else:
                found[int(row)] = (
                    offset,
                    f"loss {loss:.6g} over the mean {mean[row, offset]:.6g} of the "
                    f"{int(number[row, offset])} steps before it by more than "
                    f"rtol={policy.rtol:g} times it",
                )
        calm = np.ones(len(losses), bool)
        calm[list(found)] = False  # a spiking member's window stays as before the call
        whole = calm & (limits >= steps)  # NaN only in front: its last values are its window
        self.recent[whole] = joined[whole, -window:]
        for row in np.flatnonzero(calm & ~whole):  # stopped within the call: its values
            kept = joined[row][seen[row]][-window:]
            self.recent[row] = np.nan
            if len(kept):
                self.recent[row, window - len(kept) :] = kept
        self.full = self.full or not np.isnan(self.recent).any()
        return found


def roll_back_member(
    member: Any,
    policy: Spike,
    state: Any,
    item: Any,
    found: tuple[int, str],
    loss: float,
    say: Callable[[str], None],
) -> bool:
    """Member `member`'s loss spiked in the call `item` (`found`: the offset of the step and
    why, `loss` its loss): the call is rolled back for it alone, recorded in its rewinds and
    skipped batches (and its logger runs hear of it). Returns True when that was past
    `max_rollbacks`, and the member stops there (with its weights from before the call),
    False when it trains on."""
    own_first = item.index - member.sat_out  # the member's own steps before the call
    offset, why = found
    staged = item.staged
    step = own_first + offset + 1
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
