"""The ten agent tools, driven by the MCP SDK's client over stdio and over streamable HTTP."""

from __future__ import annotations

import re

import anyio
import numpy as np
import pytest
from agent_client import call, http_session, poll, refusal, stdio_session

import nitro
from nitro.mcp import HttpServer, RunRegistry, ToolSession

TOOL_NAMES = {
    "nitro_setup",
    "nitro_train",
    "nitro_validate",
    "nitro_evaluate",
    "nitro_predict",
    "nitro_export",
    "nitro_runs",
    "nitro_status",
    "nitro_logger",
    "nitro_stop",
}


@pytest.fixture(scope="module")
def http_server():
    server = HttpServer(ToolSession(registry=RunRegistry())).start()
    yield server
    server.stop()


@pytest.fixture(params=["stdio", "http"])
def connect(request, http_server, tmp_path, monkeypatch):
    """A function opening a client session over the transport under test."""
    if request.param == "stdio":
        return lambda: stdio_session(tmp_path)
    monkeypatch.chdir(tmp_path)  # the in-process server's relative run directories
    return lambda: http_session(http_server.url, http_server.token)


def test_the_ten_tools_are_listed_with_their_input_schemas(connect):
    async def scenario():
        async with connect() as session:
            tools = (await session.list_tools()).tools
            return {t.name: t.input_schema for t in tools}, await call(session, "nitro_setup")

    schemas, setup = anyio.run(scenario)
    assert (setup["backend"], setup["device_count"], setup["n_devs"]) == ("cpu", 1, 1)
    assert set(schemas) == TOOL_NAMES
    train = schemas["nitro_train"]
    assert train["additionalProperties"] is False
    assert {"experiment", "overrides", "max_epochs", "seed", "resume", "keywords"} <= set(
        train["properties"]
    )
    max_epochs = train["properties"]["max_epochs"]["anyOf"][0]
    assert max_epochs == {"type": "integer", "minimum": 1}
    assert schemas["nitro_predict"]["required"] == ["run_id", "inputs"]
    assert schemas["nitro_status"]["required"] == ["run_id"]
    assert schemas["nitro_stop"]["properties"]["wait_seconds"]["default"] == 30.0


def test_a_run_trains_in_the_background_and_status_reports_its_metrics(connect):
    async def scenario():
        async with connect() as session:
            started = await call(
                session,
                "nitro_train",
                experiment="agent_toys.Quick",
                overrides={"width": 16},
                max_epochs=3,
                seed=1,
            )
            run_id = started["run_id"]
            done = await poll(session, run_id, lambda s: s["status"] != "running")
            history = await call(session, "nitro_status", run_id=run_id, history=True)
            validated = await call(session, "nitro_validate", run_id=run_id)
            tested = await call(session, "nitro_evaluate", run_id=run_id, split="test")
            x = np.linspace(-1, 1, 15).reshape(3, 5).tolist()
            predicted = await call(session, "nitro_predict", run_id=run_id, inputs={"x": x})
            listed = await call(session, "nitro_runs")
            return started, done, history, validated, tested, predicted, listed

    started, done, history, validated, tested, predicted, listed = anyio.run(scenario)
    assert re.fullmatch(r"[0-9a-f]{8}", started["run_id"]) and started["status"] == "running"
    assert started["experiment"] == "Quick"
    assert (done["status"], done["phase"], done["stop_reason"]) == ("done", "done", "completed")
    assert (done["epoch"], done["max_epochs"], done["step"]) == (3, 3, 12)
    assert set(done["metrics"]) >= {"loss", "val_loss", "val_acc"}
    assert 0 < done["loss"] < 5 and 0 <= done["metrics"]["val_acc"] <= 1
    assert done["result"] == {"epoch": 3, "step": 12, "stop_reason": "completed"}
    assert done["error"] is None
    assert [row["epoch"] for row in history["history"]] == [1, 2, 3]
    assert validated["result"]["val_loss"] == pytest.approx(done["metrics"]["val_loss"])
    assert set(tested["result"]) == {"test_loss", "test_acc"}
    assert predicted["rows"] == 3 and np.asarray(predicted["outputs"]).shape == (3, 2)
    kinds = {row["run_id"]: row["kind"] for row in listed["runs"]}
    assert kinds[started["run_id"]] == "train"
    assert kinds[validated["run_id"]] == "validate" and kinds[tested["run_id"]] == "evaluate"


def test_stop_ends_a_run_in_the_middle_of_an_epoch_with_stop_reason_requested(connect):
    async def scenario():
        async with connect() as session:
            started = await call(
                session,
                "nitro_train",
                experiment="agent_toys.Slow",
                overrides={"batches": 400, "delay": 0.02},
            )
            running = await call(session, "nitro_status", run_id=started["run_id"])
            await poll(session, started["run_id"], lambda s: s["step"] >= 3)
            stopped = await call(session, "nitro_stop", run_id=started["run_id"])
            again = await call(session, "nitro_stop", run_id=started["run_id"])
            return running, stopped, again

    running, stopped, again = anyio.run(scenario)
    assert running["status"] == "running"  # nitro_train answered before the run finished
    assert (stopped["status"], stopped["stop_reason"], stopped["running"]) == (
        "stopped",
        "requested",
        False,
    )
    assert stopped["epoch"] == 0 and 3 <= stopped["step"] < 400
    assert "is not running" in again["note"]


def test_bad_arguments_are_tool_errors_naming_the_argument(connect):
    async def scenario():
        async with connect() as session:
            quick = "agent_toys.Quick"
            return [
                await refusal(session, "nitro_train", experiment=quick, overrides={"widht": 4}),
                await refusal(session, "nitro_train", experiment=quick, overrides={"width": "4"}),
                await refusal(
                    session,
                    "nitro_train",
                    experiment=quick,
                    overrides={"max_epochs": 2},
                    max_epochs=3,
                ),
                await refusal(session, "nitro_train", experiment=quick, max_epochs=0),
                await refusal(session, "nitro_train", experiment=quick, epochz=2),
                await refusal(session, "nitro_train", experiment=quick, keywords={"warmup": 5}),
                await refusal(session, "nitro_train", experiment="Quick"),
                await refusal(session, "nitro_status", run_id="nope"),
                await refusal(session, "nitro_setup", n_devs=64),
            ]

    (field, kind, both, bound, unknown, keyword, name, run, devices) = anyio.run(scenario)
    assert "overrides: Quick has no field 'widht' (did you mean 'width'?)" in field
    assert "field 'width' of Quick is int; got '4'" in kind
    assert "overrides.max_epochs: 'max_epochs' is given both as a field override" in both
    assert "argument 'max_epochs': Input should be greater than or equal to 1 (got 0)" in bound
    assert "unknown argument 'epochz'" in unknown
    assert "keywords.warmup: this version of nitro has no run keyword 'warmup'" in keyword
    assert "experiment: no experiment named 'Quick'" in name and "module-qualified" in name
    assert "run_id: no run 'nope'" in run
    assert "n_devs: 64 devices asked for" in devices


def test_predict_refuses_ragged_inputs_and_export_says_when_it_is_missing(connect):
    async def scenario():
        async with connect() as session:
            started = await call(session, "nitro_train", experiment="agent_toys.Quick")
            run_id = started["run_id"]
            await poll(session, run_id, lambda s: s["status"] != "running")
            ragged = await refusal(
                session, "nitro_predict", run_id=run_id, inputs={"x": [[1.0] * 5, [1.0]]}
            )
            missing = await refusal(
                session, "nitro_predict", run_id=run_id, inputs={"z": [[1.0] * 5]}
            )
            exported = await session.call_tool("nitro_export", {"run_id": run_id, "dir": "out"})
            return ragged, missing, exported

    ragged, missing, exported = anyio.run(scenario)
    assert "inputs.x: not a rectangular array" in ragged
    assert missing.startswith("nitro_predict: inputs:") and "'x'" in missing
    if not hasattr(nitro.Nitro, "export"):
        assert exported.is_error
        assert "not available in this version of nitro" in exported.content[0].text


def test_a_finished_run_continues_for_more_epochs_under_a_new_run_id(connect):
    async def scenario():
        async with connect() as session:
            first = await call(session, "nitro_train", experiment="agent_toys.Quick")
            await poll(session, first["run_id"], lambda s: s["status"] != "running")
            finished = await refusal(session, "nitro_train", run_id=first["run_id"])
            mixed = await refusal(
                session, "nitro_train", run_id=first["run_id"], experiment="agent_toys.Quick"
            )
            more = await call(session, "nitro_train", run_id=first["run_id"], epochs=1)
            done = await poll(session, more["run_id"], lambda s: s["status"] != "running")
            return first["run_id"], finished, mixed, more, done

    first, finished, mixed, more, done = anyio.run(scenario)
    assert "epochs: run " + first + " already trained its 2 epochs" in finished
    assert "experiment: run_id continues run" in mixed
    assert more["run_id"] != first and done["source"] == first
    assert (done["status"], done["epoch"], done["step"]) == ("done", 3, 12)


def test_a_new_handle_evaluates_with_the_weights_of_an_earlier_run(connect):
    async def scenario():
        async with connect() as session:
            first = await call(session, "nitro_train", experiment="agent_toys.Quick", seed=3)
            await poll(session, first["run_id"], lambda s: s["status"] != "running")
            trained = await call(session, "nitro_evaluate", run_id=first["run_id"])
            copied = await call(
                session,
                "nitro_evaluate",
                experiment="agent_toys.Quick",
                keywords={"weights": first["run_id"]},
            )
            fresh = await call(session, "nitro_evaluate", experiment="agent_toys.Quick")
            return trained, copied, fresh

    trained, copied, fresh = anyio.run(scenario)
    assert copied["result"] == pytest.approx(trained["result"])
    assert fresh["result"]["test_loss"] != pytest.approx(trained["result"]["test_loss"])
