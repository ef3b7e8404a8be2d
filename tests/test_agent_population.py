"""Populations over the agent tools (nitro_population, nitro_member, and nitro_status,
nitro_runs and nitro_stop on a population), driven by the MCP SDK's client over stdio and
over streamable HTTP."""

from __future__ import annotations

import re

import anyio
import pytest
from agent_client import call, http_session, poll, refusal

from nitro.mcp import HttpServer, RunRegistry, ToolSession

DIGITS = "nitro.examples.digits.Digits"


def finished(status: dict) -> bool:
    return status["status"] != "running"


def test_a_population_trains_in_the_background_and_its_best_member_becomes_a_run(connect, tmp_path):
    async def scenario():
        async with connect() as session:
            started = await call(
                session,
                "nitro_population",
                experiment=DIGITS,
                overrides={"width": 32},
                axes={"learning_rate": [1e-3, 3e-2], "scale": [1.0, 0.5]},
                max_epochs=2,
            )
            done = await poll(session, started["run_id"], finished, timeout=300)
            history = await call(session, "nitro_status", run_id=started["run_id"], history=True)
            listed = await call(session, "nitro_runs")
            best = await call(session, "nitro_member", run_id=started["run_id"])
            validated = await call(session, "nitro_validate", run_id=best["run_id"])
            first = await call(session, "nitro_member", run_id=started["run_id"], member=0)
            more = await call(session, "nitro_train", run_id=first["run_id"], epochs=1)
            trained = await poll(session, more["run_id"], finished, timeout=300)
            exported = await call(
                session,
                "nitro_export",
                run_id=best["run_id"],
                dir=str(tmp_path / "best"),
                platforms=["cpu"],
            )
            return started, done, history, listed, best, validated, first, trained, exported

    started, done, history, listed, best, validated, first, trained, exported = anyio.run(scenario)
    assert re.fullmatch(r"[0-9a-f]{8}", started["run_id"])
    assert (started["kind"], started["population"], started["members"]) == ("population", True, 4)
    assert started["axes"] == {"learning_rate": [0.001, 0.03], "scale": [1.0, 0.5]}
    assert (done["status"], done["stop_reason"], done["epoch"], done["target_epoch"]) == (
        "done",
        "completed",
        2,
        2,
    )
    assert done["result"]["epoch"] == 2 and done["stopped"] == [] and done["error"] is None
    assert [m["settings"] for m in done["member_status"]] == [
        {"learning_rate": 0.001, "scale": 1.0},
        {"learning_rate": 0.001, "scale": 0.5},
        {"learning_rate": 0.03, "scale": 1.0},
        {"learning_rate": 0.03, "scale": 0.5},
    ]
    assert all(m["loss"] > 0 and "val_loss" in m["metrics"] for m in done["member_status"])

    rows = history["history"]  # one per member and epoch, with the member's settings
    assert [(r["member"], r["epoch"]) for r in rows] == [(m, e) for m in range(4) for e in (1, 2)]
    assert {"learning_rate", "scale", "loss", "val_loss", "val_acc"} <= set(rows[0])
    assert [r["learning_rate"] for r in rows if r["epoch"] == 2] == [0.001, 0.001, 0.03, 0.03]
    last = {r["member"]: r for r in rows if r["epoch"] == 2}

    row = next(r for r in listed["runs"] if r["run_id"] == started["run_id"])
    assert (row["kind"], row["population"], row["members"]) == ("population", True, 4)
    assert row["axes"] == started["axes"] and len(row["losses"]) == 4

    chosen = best["result"]
    best_loss = min(r["val_loss"] for r in last.values())
    assert chosen["chosen_by"] == {"metric": "val_loss", "value": pytest.approx(best_loss)}
    assert last[chosen["member"]]["val_loss"] == pytest.approx(best_loss)
    assert chosen["settings"] == done["member_status"][chosen["member"]]["settings"]
    assert done["best"]["member"] == chosen["member"]
    assert validated["result"]["val_loss"] == pytest.approx(best_loss, rel=1e-5)
    assert first["result"]["member"] == 0 and first["result"]["chosen_by"] is None
    assert (trained["status"], trained["epoch"], trained["source"]) == (
        "done",
        1,
        first["run_id"],
    )
    manifest = exported["result"]["manifest"]
    assert manifest["program"]["platforms"] == ["cpu"]
    assert "population" in manifest["provenance"]["weights_origin"]


def test_a_member_pruned_while_the_population_trains_stops_and_the_others_train_on(connect):
    slow = {"batches": 20, "delay": 0.02}

    async def scenario():
        async with connect() as session:
            started = await call(
                session,
                "nitro_population",
                experiment="agent_toys.Slow",
                overrides=slow,
                axes={"learning_rate": [1e-2, 3e-2]},
                max_epochs=50,
                keywords={"steps_per_dispatch": 1},
            )
            run_id = started["run_id"]
            await poll(session, run_id, lambda s: s["step"] >= 3, timeout=300)
            pruned = await call(session, "nitro_stop", run_id=run_id, member=1)
            await poll(session, run_id, lambda s: s["epoch"] >= 2, timeout=300)
            stopped = await call(session, "nitro_stop", run_id=run_id)
            again = await call(session, "nitro_stop", run_id=run_id)
            history = await call(session, "nitro_status", run_id=run_id, history=True)
            return pruned, stopped, again, history

    pruned, stopped, again, history = anyio.run(scenario)
    assert pruned["status"] == "running" and "member 1 stops before" in pruned["note"]
    assert (stopped["status"], stopped["stop_reason"], stopped["running"]) == (
        "stopped",
        "requested",
        False,
    )
    assert 2 <= stopped["epoch"] < 50
    assert stopped["stopped"] == [1]
    assert stopped["member_status"][1]["stopped"] == "stopped by nitro_stop (member 1)"
    assert stopped["member_status"][0]["stopped"] is None
    assert "is not running" in again["note"]
    rows = history["history"]
    assert {r["member"] for r in rows} == {0, 1}
    assert all(r["stopped"] is None and r["loss"] > 0 for r in rows if r["member"] == 0)
    assert [r["stopped"] for r in rows if r["member"] == 1][
        -1
    ] == "stopped by nitro_stop (member 1)"


def test_a_member_stopped_while_the_population_sets_up_never_trains(connect, tmp_path):
    gate = tmp_path / "gate"

    async def scenario():
        async with connect() as session:
            started = await call(
                session,
                "nitro_population",
                experiment="agent_toys.Gated",
                overrides={"gate": str(gate)},
                axes={"learning_rate": [1e-2, 3e-2]},
                max_epochs=2,
                wait_seconds=0,
            )
            run_id = started["run_id"]
            queued = await call(session, "nitro_stop", run_id=run_id, member=1)
            refused = [
                await refusal(session, "nitro_stop", run_id=run_id, member=2),
                await refusal(session, "nitro_member", run_id=run_id, member=0),
            ]
            gate.touch()
            done = await poll(session, run_id, finished, timeout=300)
            history = await call(session, "nitro_status", run_id=run_id, history=True)
            return started, queued, refused, done, history

    started, queued, refused, done, history = anyio.run(scenario)
    assert "still setting up its members" in started["note"]
    assert queued["note"].startswith(
        f"population {started['run_id']} is still setting up its members; member 1 stops "
        f"before the first step"
    )
    out_of_range, member = refused
    assert "member: population" in out_of_range and "has 2 members (0 to 1); got 2" in out_of_range
    assert "is still setting up its members; take a member once nitro_status shows them" in member
    assert "single run" not in out_of_range + member
    assert (done["status"], done["epoch"], done["stopped"]) == ("done", 2, [1])
    assert done["member_status"][1]["stopped"] == "stopped by nitro_stop (member 1)"
    rows = history["history"]
    assert [r["epoch"] for r in rows if r["member"] == 0] == [1, 2]
    assert all(r["stopped"] for r in rows if r["member"] == 1)


def test_a_member_pruned_between_trainings_by_steps_stays_as_it_was(connect):
    async def scenario():
        async with connect() as session:
            started = await call(
                session,
                "nitro_population",
                experiment=DIGITS,
                overrides={"width": 32},
                members=[{"seed": 0}, {"seed": 1}, {"seed": 2, "learning_rate": 3e-3}],
                steps=3,
            )
            run_id = started["run_id"]
            part = await poll(session, run_id, finished, timeout=300)
            refused = [
                await refusal(session, "nitro_stop", run_id=run_id, member=3),
                await refusal(session, "nitro_predict", run_id=run_id, inputs={"x": [[0.0]]}),
                await refusal(session, "nitro_population", run_id=run_id, epochs=1, axes={}),
                await refusal(session, "nitro_member", run_id=run_id, member=7),
                await refusal(session, "nitro_member", run_id=run_id),  # no epoch yet
            ]
            pruned = await call(session, "nitro_stop", run_id=run_id, member=2)
            more = await call(session, "nitro_population", run_id=run_id, epochs=1)
            done = await poll(session, more["run_id"], finished, timeout=300)
            history = await call(session, "nitro_status", run_id=run_id, history=True)
            single = await call(session, "nitro_member", run_id=run_id, member=2)
            not_population = await refusal(session, "nitro_member", run_id=single["run_id"])
            return started, part, refused, pruned, more, done, history, not_population

    started, part, refused, pruned, more, done, history, not_population = anyio.run(scenario)
    assert started["axes"] == {"seed": [0, 1, 2], "learning_rate": [0.003]}
    assert (part["status"], part["stop_reason"], part["epoch"], part["step"]) == (
        "done",
        "max_steps",
        0,
        3,
    )
    member, predict, mixed, index, no_metric = refused
    assert member == "nitro_stop: member: population " + started["run_id"] + (
        " has 3 members (0 to 2); got 3"
    )
    assert "nitro_predict: run_id: run " in predict and "is a population of 3 members" in predict
    assert "nitro_member" in predict  # the way to a single run
    assert "nitro_population: axes: run_id continues population" in mixed
    assert "nitro_member: member: population " in index and "got 7" in index
    assert "nitro_member: metric: no member of population" in no_metric
    assert "is stopped" in pruned["note"] and pruned["stopped"] == [2]
    assert more["run_id"] != started["run_id"]
    assert (done["status"], done["epoch"], done["step"], done["source"]) == (
        "done",
        1,
        9,
        started["run_id"],
    )
    rows = history["history"]
    assert [(r["member"], r["seed"]) for r in rows] == [(0, 0), (1, 1), (2, 2)]
    assert [r["stopped"] for r in rows] == [None, None, "stopped by nitro_stop (member 2)"]
    assert rows[2]["learning_rate"] == 0.003
    assert rows[2]["loss"] is not None  # its 3 steps before the pruning
    assert "is a single run, not a population" in not_population


def test_what_a_population_cannot_vary_or_take_is_refused_naming_the_argument(connect):
    async def scenario():
        async with connect() as session:
            lr = {"learning_rate": [1e-3, 1e-2]}
            return [
                await refusal(
                    session, "nitro_population", experiment=DIGITS, axes={"width": [32, 64]}
                ),
                await refusal(
                    session, "nitro_population", experiment=DIGITS, members=[{"batch_size": 32}]
                ),
                await refusal(
                    session, "nitro_population", experiment=DIGITS, axes={"accum": [1, 2]}
                ),
                await refusal(
                    session, "nitro_population", experiment=DIGITS, axes={"learning_rate": [-1.0]}
                ),
                await refusal(
                    session, "nitro_population", experiment=DIGITS, axes=lr, members=[{"seed": 1}]
                ),
                await refusal(session, "nitro_population", experiment=DIGITS),
                await refusal(
                    session,
                    "nitro_population",
                    experiment=DIGITS,
                    axes=lr,
                    keywords={"learning_rate": 0.1},
                ),
                await refusal(session, "nitro_population", experiment=DIGITS, axes={"lr": [1, 2]}),
                await refusal(
                    session, "nitro_population", experiment=DIGITS, axes=lr, epochs=1, steps=2
                ),
                await refusal(
                    session,
                    "nitro_population",
                    experiment=DIGITS,
                    axes=lr,
                    keywords={"run_dir": "/elsewhere/pop"},
                ),
            ]

    graphconst, host, program, value, both, neither, twice, unknown, by, outside = anyio.run(
        scenario
    )
    assert graphconst.startswith(
        "nitro_population: axes.width: width cannot vary across a population: it is a "
        "GraphConst field of Digits, which bakes into the program"
    )
    assert "Build one population per value of width" in graphconst
    assert host.startswith("nitro_population: members[0].batch_size: batch_size cannot vary")
    assert "it is a Host field of Digits" in host
    assert program.startswith("nitro_population: axes.accum: accum cannot vary")
    assert value.startswith(
        "nitro_population: axes.learning_rate: member 0 (learning_rate=-1): learning_rate must be"
    )
    assert both.startswith("nitro_population: members: Population() takes members= or list-valued")
    assert neither.startswith("nitro_population: axes: give what varies across the members")
    assert twice.startswith("nitro_population: axes.learning_rate: 'learning_rate' varies")
    assert unknown.startswith("nitro_population: axes.lr: lr is neither a run keyword nor a field")
    assert by.startswith("nitro_population: steps: give epochs")
    # a population's run directory stays inside the root, as a run's
    assert outside.startswith("nitro_population: keywords.run_dir: '/elsewhere/pop' is ")
    assert "outside this session's root" in outside


def test_a_notebooks_population_is_listed_read_and_taken_from_by_its_variable_name():
    import nitro
    from nitro.examples.digits import Digits

    pop = nitro.Population(Digits(width=32, max_epochs=1), seed=[0, 1], progress=False).train()
    server = HttpServer(ToolSession(registry=RunRegistry(), namespace={"pop": pop})).start()

    async def scenario():
        async with http_session(server.url, server.token) as session:
            listed = await call(session, "nitro_runs")
            status = await call(session, "nitro_status", run_id="pop", history=True)
            taken = await call(session, "nitro_member", run_id="pop", member=1)
            validated = await call(session, "nitro_validate", run_id=taken["run_id"])
            return listed, status, taken, validated

    try:
        listed, status, taken, validated = anyio.run(scenario)
    finally:
        server.stop()
    (row,) = listed["runs"]
    assert (row["run_id"], row["kind"], row["started_by"], row["population"]) == (
        "pop",
        "notebook",
        "notebook",
        True,
    )
    assert (row["members"], row["axes"], row["status"]) == (2, {"seed": [0, 1]}, "done")
    assert status["names"] == ["pop"] and status["target_epoch"] == 1
    assert [(r["member"], r["seed"]) for r in status["history"]] == [(0, 0), (1, 1)]
    assert taken["result"]["member"] == 1
    val_loss = status["member_status"][1]["metrics"]["val_loss"]
    assert validated["result"]["val_loss"] == pytest.approx(val_loss, rel=1e-5)


def test_the_tools_for_runs_validate_train_on_and_read_the_files_of_a_population():
    import nitro
    from nitro.examples.digits import Digits

    pop = nitro.Population(Digits(width=32, max_epochs=1), seed=[0, 1], progress=False).train()
    pop.stop(1)  # pruned: its epoch and step stay where it stopped
    server = HttpServer(ToolSession(registry=RunRegistry(), namespace={"pop": pop})).start()

    async def scenario():
        async with http_session(server.url, server.token) as session:
            validated = await call(session, "nitro_validate", run_id="pop")
            evaluated = await call(session, "nitro_evaluate", run_id="pop", split="val")
            files = await call(session, "nitro_logger", run_id="pop")
            more = await call(session, "nitro_train", run_id="pop", epochs=1)
            done = await poll(session, more["run_id"], finished, timeout=300)
            stopped = await call(session, "nitro_stop", run_id=more["run_id"])
            status = await call(session, "nitro_status", run_id="pop")
            finished_run = await refusal(session, "nitro_train", run_id="pop")
            return validated, evaluated, files, more, done, stopped, status, finished_run

    try:
        validated, evaluated, files, more, done, stopped, status, finished_run = anyio.run(scenario)
    finally:
        server.stop()
    rows = validated["result"]  # one row per member, with its settings
    assert [(r["member"], r["seed"]) for r in rows] == [(0, 0), (1, 1)]
    expected = pop.history().xs(1, level="epoch")["val_loss"].tolist()
    assert [r["val_loss"] for r in rows] == pytest.approx(expected, rel=1e-5)
    assert [r["val_loss"] for r in evaluated["result"]] == pytest.approx(expected, rel=1e-5)

    assert (files["run_dir"], files["handle_run_id"]) == (pop.run_dir, pop.run_id)
    assert [m["dir"] for m in files["members"]] == [f"{pop.run_dir}/member-{i}" for i in (0, 1)]
    assert all("metrics.jsonl" in m["files"] for m in files["members"])

    assert (more["kind"], more["population"], more["members"]) == ("population", True, 2)
    assert (done["status"], done["epoch"], done["source"]) == ("done", 2, "pop")
    assert done["result"]["stopped"] == [1]
    assert "is not running" in stopped["note"] and stopped["note"].startswith("population")
    assert (status["run_dir"], status["handle_run_id"]) == (pop.run_dir, pop.run_id)
    trained, pruned = status["member_status"]
    assert (trained["epoch"], trained["step"]) == (2, pop.step)
    assert (pruned["epoch"], pruned["step"]) == (1, pop.stopped_at[1])
    assert pruned["step"] < trained["step"]
    assert "nitro_train: epochs: population pop already trained its 2 epochs" in finished_run


def test_an_agent_starts_a_searched_population_and_bad_search_settings_are_refused(connect):
    space = {"learning_rate": {"log_uniform": [1e-3, 1e-1]}}
    search = [{"random": {"space": space, "n": 4, "seed": 3}}, {"halving": {"rungs": [1]}}]

    async def scenario():
        async with connect() as session:
            started = await call(
                session,
                "nitro_population",
                experiment=DIGITS,
                overrides={"width": 16, "batch_size": 128},
                search=search,
                max_epochs=2,
            )
            done = await poll(session, started["run_id"], finished, timeout=300)
            refused = [
                await refusal(
                    session,
                    "nitro_population",
                    experiment=DIGITS,
                    search={"random": {"space": {"width": {"choice": [16, 32]}}, "n": 2}},
                ),
                await refusal(
                    session, "nitro_population", experiment=DIGITS, search={"pbt": {"every": 0}}
                ),
                await refusal(
                    session,
                    "nitro_population",
                    experiment=DIGITS,
                    search={"random": {"space": {"learning_rate": {"normal": [0, 1]}}, "n": 2}},
                ),
            ]
            return started, done, refused

    started, done, (graphconst, every, distribution) = anyio.run(scenario)
    assert started["members"] == 4 and done["status"] == "done"
    assert len(done["stopped"]) == 2  # the halving rung stopped half of them
    assert graphconst.startswith(
        "nitro_population: search: Random space key 'width': width cannot vary"
    )
    assert every.startswith("nitro_population: search.pbt: PBT(every=0): give a whole number")
    assert distribution.startswith(
        "nitro_population: search.random.space.learning_rate: give one of log_uniform, uniform"
    )
