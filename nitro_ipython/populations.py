"""`%nitro` on a `nitro.Population`: train, stop (the run, or one member), wait, status.

A population is not a `nitro.Nitro` handle: `%nitro train pop` trains it as `pop.train()` does
(`--epochs N`, `--background`), `%nitro stop pop` stops the run after the current call and
`%nitro stop pop 3` prunes member 3 (`pop.stop(3)`): the magic waits until the loop has
stopped it, so `pop.stopped` names it when the cell ends. `%nitro train pop --resume [RUN_ID]`
continues the population's run on disk (after a kernel restart, say) in a new population of
the same keywords, stored under the same name. The magics find populations by
their names in the notebook; the status line gives the phase, epoch, step, how many members
still train and the best member by the monitored metric.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError

import nitro
from nitro.progress import ranked_members, settings_label

from . import worker

__all__ = [
    "best_member",
    "members_text",
    "named",
    "resumed",
    "status_lines",
    "stop",
    "stop_member",
    "table",
    "train",
    "wait",
]

# `%nitro train` options a population does not take, and why
_NOT_FOR_POPULATIONS = {
    "fresh": ("--fresh", "build a new nitro.Population to start over"),
    "no_live_edits": ("--no-live-edits", "a population takes no live edits"),
}


def members_text(training: int, total: int, running: bool) -> str:
    """`3 of 4 members training` while a run trains; after it, how many stopped."""
    if running:
        return f"{training} of {total} members training"
    stopped = total - training
    return f"{stopped} of {total} members stopped" if stopped else f"{total} members"


def named(user_ns: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The populations the notebook names (public names), one entry each."""
    seen: dict[int, tuple[str, Any]] = {}
    for key, value in list(user_ns.items()):
        if isinstance(value, nitro.Population) and not key.startswith("_"):
            seen.setdefault(id(value), (key, value))
    return list(seen.values())


def _ended(pop: Any) -> str:
    at = f"at epoch {pop.epoch}/{pop.target_epoch or pop.max_epochs}, step {pop.step}"
    said = {"done": "finished", "stopped": "stopped", "failed": "failed"}
    return f"{said[pop.phase]} {at}" if pop.phase in said else f"{pop.phase}, {at}"


def train(pop: Any, name: str, args, namespace: MutableMapping[str, Any] | None = None) -> Any:
    """`%nitro train POP [--epochs N] [--background] [--resume [RUN_ID]]`; a resumed
    population is stored as `name` in `namespace`."""
    for option, (flag, why) in _NOT_FOR_POPULATIONS.items():
        if getattr(args, option, False):
            raise UsageError(
                f"%nitro train {name} {flag}: {name} is a nitro.Population, and {why}; "
                f"train it with `%nitro train {name} [--epochs N] [--background] [--resume]`"
            )
    if getattr(args, "resume", False):
        pop = resumed(pop, name, args.resume)
        if namespace is not None and name.isidentifier():
            namespace[name] = pop
    if args.epochs is None and pop.epoch >= max(pop.target_epoch, pop.max_epochs):
        print(
            f"nitro: {name} already trained its {pop.epoch} epochs (max_epochs="
            f"{pop.max_epochs}); `%nitro train {name} --epochs N` trains N more"
        )
        return pop
    pop.train(epochs=args.epochs, background=args.background)
    if args.background and pop.running:
        worker.say(  # beside its panel's title while it lives, not under its record
            f"{name} ({len(pop)} members) is training in the background; `%nitro status` "
            f"shows how far it is, `%nitro stop {name}` stops it, `%nitro stop {name} I` stops "
            f"member I"
        )
        return None
    return pop


def resumed(pop: Any, name: str, resume: bool | str) -> Any:
    """A new population of `pop`'s experiment and keywords that continues a run on disk:
    `resume` True, this experiment's population of the same members (`resume="auto"`); a
    run id, that run beside `pop`'s directory; a path, that run. Refused, saying why, when
    there is none or it is not these members'."""
    if pop.running:
        raise UsageError(
            f"%nitro train {name} --resume: {name} is {pop.phase} in the background; `%nitro "
            f"stop {name}` stops it (then `%nitro train {name}` goes on from where it stopped)"
        )
    target: Any = True
    root = Path(pop.given_keywords.get("run_dir") or Path(pop.run_dir).parent)
    if isinstance(resume, str):
        target = resume if Path(resume).exists() else str(Path(pop.run_dir).parent / resume)
    keywords = {**pop.given_keywords, "resume": target}
    pop.close()  # the new population may write where it did; its next train() holds it again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            new = nitro.Population(pop.experiment, **keywords)
        except (nitro.PopulationError, nitro.SetupError) as error:
            raise UsageError(f"%nitro train {name} --resume: {error}") from None
    if not new.step:  # resume="auto" found no checkpoint: nothing to continue
        new.close()
        raise UsageError(
            f"%nitro train {name} --resume: no checkpoint of a {pop.cls.__name__} population "
            f"under {str(root.absolute())!r} to continue (a population saves one in its run "
            f"directory after its epochs, unless checkpointer=None); `%nitro train {name}` "
            f"trains {name} on from epoch {pop.epoch}, `--resume RUN_ID` names a run"
        )
    for warning in caught:  # what the resume said (a changed setting): the user's to read
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    print(
        f"nitro: {name} continues population {new.run_id} from its checkpoint at epoch "
        f"{new.epoch}, step {new.step} ({new.run_dir})"
    )
    return new


def stop(pop: Any, name: str) -> None:
    """`%nitro stop POP`: stop the run after the current call; wait until it stopped."""
    if not pop.running:
        print(f"nitro: {name} is not running ({_ended(pop)}); nothing to stop")
        return
    began = time.monotonic()
    pop.stop()
    pop.wait()
    if pop.stop_reason == "requested":
        print(
            f"nitro: stopped {name} at epoch {pop.epoch}, step {pop.step} (in "
            f"{time.monotonic() - began:.1f} s); `%nitro train {name}` resumes it"
        )
    else:  # it ended before the stop took effect
        print(f"nitro: {name} is not running ({_ended(pop)}); nothing to stop")


def _member_index(pop: Any, name: str, member: str) -> int:
    last = len(pop) - 1
    try:
        index = int(member)
    except ValueError:
        index = None
    if index is None or not 0 <= index <= last:
        raise UsageError(
            f"%nitro stop {name} {member}: {name} has {len(pop)} members, numbered 0 to "
            f"{last}; name one of them (`%nitro stop {name} {last}`), or none to stop the run"
        )
    return index


def stop_member(pop: Any, name: str, member: str, timeout: float = 600.0) -> None:
    """`%nitro stop POP I`: prune member I (`pop.stop(I)`); a running population stops it at
    its next call, and the magic waits for that, so `pop.stopped` names it afterwards."""
    index = _member_index(pop, name, member)
    label = f"member {index} ({settings_label(pop.members[index])})"
    if index in pop.stopped:
        print(f"nitro: {label} of {name} already stopped: {pop.stopped[index]}")
        return
    why = f"stopped by %nitro stop {name} {index}"
    pop.stop(index, why)
    deadline = time.monotonic() + timeout
    while index not in pop.stopped and time.monotonic() < deadline:
        if not pop.running:  # the run ended before its next call: stop it now
            pop.stop(index, why)
            break
        time.sleep(0.02)
    if index not in pop.stopped:
        print(
            f"nitro: {label} of {name} stops at the population's next call (it asked at step "
            f"{pop.step}); `%nitro status {name}` lists it once it has"
        )
        return
    training = len(pop) - len(pop.stopped)
    print(  # the step it stopped at, as its record has it: the run has gone on since
        f"nitro: stopped {label} of {name} at step {pop.stopped_at[index]}; {training} of "
        f"{len(pop)} members train on"
        + ("" if pop.running else f" when `%nitro train {name}` trains it again")
    )


def wait(pop: Any, name: str) -> None:
    pop.wait()
    for line in status_lines(pop, name):
        print(line)


def best_member(pop: Any) -> tuple[str, float, int] | None:
    """(metric, value, member) of the best member still training, by the monitored metric of
    each one's latest row; None before any row."""
    stopped = pop.stopped
    history = pop.history()
    if history.empty:
        return None
    latest = history.groupby(level="member").tail(1).reset_index()
    rows = [r for r in latest.to_dict("records") if int(r["member"]) not in stopped]
    metric, order = ranked_members(rows)
    value = order[0].get(metric) if order else None
    if isinstance(value, float) and math.isfinite(value):
        return metric, value, int(order[0]["member"])
    return None


def table(user_ns: Mapping[str, Any]):
    """`%nitro runs`' populations: one row per population the notebook names, or None."""
    import pandas as pd

    rows = []
    for name, pop in named(user_ns):
        found = best_member(pop)
        rows.append(
            {
                "population": name,
                "experiment": pop.cls.__name__,
                "phase": pop.phase,
                "epoch": f"{pop.epoch}/{pop.target_epoch or pop.max_epochs}",
                "step": pop.step,
                "members": members_text(len(pop) - len(pop.stopped), len(pop), pop.running),
                "best": (
                    f"{found[0]} {found[1]:.4g} (member {found[2]}: "
                    f"{settings_label(pop.members[found[2]])})"
                    if found is not None
                    else "-"
                ),
                "running": pop.running,
            }
        )
    return pd.DataFrame(rows).set_index("population") if rows else None


def status_lines(pop: Any, name: str) -> list[str]:
    """`pop (Tiny population of 4): training, epoch 1/3, step 25, 3 of 4 members training,
    best val_loss 0.5123 (member 2: learning_rate=0.01)`, then a line per stopped member."""
    stopped = pop.stopped
    target = pop.target_epoch or pop.max_epochs
    text = (
        f"{name} ({pop.cls.__name__} population of {len(pop)}): {pop.phase}, epoch "
        f"{pop.epoch}/{target}, step {pop.step}, "
        + members_text(len(pop) - len(stopped), len(pop), pop.running)
    )
    found = best_member(pop)
    if found is not None:
        metric, value, best = found
        text += f", best {metric} {value:.4g} (member {best}: {settings_label(pop.members[best])})"
    if not pop.running and pop.stop_reason:
        text += f" (stop reason: {pop.stop_reason})"
    lines = [text]
    for index, why in stopped.items():
        lines.append(f"  member {index} ({settings_label(pop.members[index])}): {why}")
    return lines
