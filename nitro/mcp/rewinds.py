"""What `nitro_rewind` and `nitro_fork` do: an agent goes back in a run as a person does, on the
public API (`n.snapshots`, `n.rewind(step)`, `n.fork(step, **changes)`; docs/time-travel.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nitro.mcp.convert import jsonable
from nitro.mcp.lookup import ToolFailure
from nitro.mcp.registry import RunRecord

__all__ = ["fork", "rewind", "snapshot_rows"]


def snapshot_rows(handle: Any) -> list[dict[str, Any]]:
    """The steps a run can go back to: step, epoch, position and where (memory or disk)."""
    table = handle.snapshots
    return [
        {"step": int(step), "epoch": int(row["epoch"]), "where": row["where"]}
        for step, row in table.iterrows()
    ]


def rewind(session: Any, run_id: str, step: int | None) -> dict[str, Any]:
    """Rewind run `run_id` to `step` (None: only list the steps it can go back to)."""
    found = session._handle(run_id, "rewind it")
    handle = found.handle
    if step is None:
        return {"run_id": found.run_id, "step": handle.step, "snapshots": snapshot_rows(handle)}
    if step not in {row["step"] for row in snapshot_rows(handle)}:
        raise ToolFailure(
            f"step: run {run_id} has no snapshot or checkpoint of step {step}; it can go back "
            f"to steps {', '.join(str(r['step']) for r in snapshot_rows(handle)) or 'none'} "
            f"(nitro_rewind without step lists them)"
        )
    from_step = handle.step
    handle.rewind(step)
    return {
        "run_id": found.run_id,
        "from_step": from_step,
        "step": handle.step,
        "epoch": handle.epoch,
        "note": f"rewound to step {handle.step}; nitro_train with this run_id trains on from "
        f"there, bit for bit as before; nitro_status history=true shows the branch it is on",
    }


def fork(
    session: Any,
    run_id: str,
    step: int | None,
    overrides: Mapping[str, Any] | None,
    keywords: Mapping[str, Any] | None,
    wait_seconds: float,
) -> dict[str, Any]:
    """A new run forked from run `run_id` at `step` with field `overrides` and run `keywords`
    (JSON forms, as nitro_train takes them); its run id, once built."""
    found = session._handle(run_id, "fork it", idle=step is None)
    parent = found.handle
    for name in overrides or {}:
        if name in (keywords or {}):
            raise ToolFailure(
                f"overrides.{name}: {name!r} is given both as a field and as a run keyword; "
                f"give it once"
            )
    checked = session._run_keywords(keywords, {})
    changes = {**dict(overrides or {}), **checked}

    def work(record: RunRecord) -> dict[str, Any]:
        handle = parent.fork(step, **changes)
        record.handle = handle
        return jsonable(
            {"forked_from": handle.forked_from, "step": handle.step, "epoch": handle.epoch}
        )

    record = session.registry.start(
        "fork",
        work,
        experiment=parent.cls.__qualname__,
        source=found.run_id,
        before=session.before_run,
    )
    answer = session._answer("fork", record, wait_seconds)
    if answer["status"] == "running":
        return answer
    return {
        **answer,
        "handle_run_id": record.handle.run_id,
        "note": "a new run from the snapshot, with its own run directory: nitro_train with "
        "this run_id trains it (beside its parent, if that trains too)",
    }
