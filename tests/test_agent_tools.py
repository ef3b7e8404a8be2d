"""The fifteen agent tools, driven by the MCP SDK's client over stdio and over streamable HTTP."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anyio
import numpy as np
import pytest
from agent_client import call, http_session, poll, refusal, stdio_session

import nitro
import nitro.bundle
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
    "nitro_population",
    "nitro_member",
    "nitro_render",
    "nitro_rewind",
    "nitro_fork",
}


def test_the_fifteen_tools_are_listed_with_their_input_schemas(connect):
    async def scenario():
        async with connect() as session:
            tools = (await session.list_tools()).tools
            return {t.name: t.input_schema for t in tools}, await call(session, "nitro_setup")

    schemas, setup = anyio.run(scenario)
    assert (setup["backend"], setup["device_count"], setup["n_devs"]) == ("cpu", 1, 1)
    assert set(schemas) == TOOL_NAMES
    train = schemas["nitro_train"]
    assert train["additionalProperties"] is False
    assert {"experiment", "overrides", "preset", "max_epochs", "seed", "resume", "keywords"} <= set(
        train["properties"]
    )
    max_epochs = train["properties"]["max_epochs"]["anyOf"][0]
    assert max_epochs == {"type": "integer", "minimum": 1}
    resume = train["properties"]["resume"]["anyOf"]
    assert {"type": "boolean"} in resume and {"type": "string"} in resume
    pair = next(t for t in resume if t.get("type") == "array")["prefixItems"]
    assert pair[1]["enum"] == ["best", "latest"]
    assert {"weights", "keywords"} <= set(schemas["nitro_evaluate"]["properties"])
    assert schemas["nitro_export"]["required"] == ["dir"]
    assert {"run_id", "experiment", "weights", "name", "platforms", "echo", "batch_sizes"} | {
        "axes"
    } <= set(schemas["nitro_export"]["properties"])
    assert schemas["nitro_predict"]["required"] == ["run_id", "inputs"]
    assert schemas["nitro_status"]["required"] == ["run_id"]
    assert schemas["nitro_stop"]["properties"]["wait_seconds"]["default"] == 30.0
    assert "member" in schemas["nitro_stop"]["properties"]
    population = schemas["nitro_population"]
    assert population["additionalProperties"] is False
    assert {"experiment", "overrides", "axes", "members", "keywords", "epochs", "steps"} <= set(
        population["properties"]
    )
    assert schemas["nitro_member"]["required"] == ["run_id"]
    assert {"member", "metric", "mode", "keywords"} <= set(schemas["nitro_member"]["properties"])
    assert schemas["nitro_rewind"]["required"] == ["run_id"]
    assert {"step", "overrides", "keywords"} <= set(schemas["nitro_fork"]["properties"])


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
            history = await call(
                session, "nitro_status", run_id=done["handle_run_id"], history=True
            )
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
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", done["handle_run_id"])
    run_dir = Path(done["run_dir"])
    assert run_dir.name == done["handle_run_id"] and run_dir.parent.name == "Quick"
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == done["handle_run_id"]
    assert history["run_id"] == started["run_id"]  # found by the handle's run id too
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
                await refusal(session, "nitro_train", experiment="agent_toys.Quik"),
                await refusal(session, "nitro_status", run_id="nope"),
                await refusal(session, "nitro_setup", n_devs=64),
                await refusal(
                    session,
                    "nitro_train",
                    experiment=quick,
                    keywords={"early_stop": {"patience": 0}},
                ),
                await refusal(
                    session, "nitro_train", experiment=quick, keywords={"checkpointer": {"kk": 1}}
                ),
                await refusal(
                    session, "nitro_train", experiment=quick, keywords={"logger": "wandb"}
                ),
                await refusal(session, "nitro_train", experiment=quick, weights="nope"),
                await refusal(session, "nitro_train", experiment=quick, resume=["runs", "worst"]),
            ]

    (field, kind, both, bound, unknown, keyword, name, module, run, devices, *objects) = anyio.run(
        scenario
    )
    early_stop, checkpointer, logger, weights, resume = objects
    assert "keywords.early_stop: EarlyStopping(patience=0): patience counts epochs" in early_stop
    assert (
        "keywords.checkpointer: Checkpointer has no field 'kk' (did you mean 'k'?)" in checkpointer
    )
    assert "keywords.logger: no logger named 'wandb'; loggers: jsonl, csv, tensorboard" in logger
    assert "weights: no run 'nope' (nitro_runs lists them) and no run directory or checkpoint" in (
        weights
    )
    assert "argument 'resume.1': Input should be 'best' or 'latest' (got 'worst')" in resume
    assert "; resume: continue from a checkpoint: 'auto'" in resume  # one clause, with the forms
    assert "overrides: Quick has no field 'widht' (did you mean 'width'?)" in field
    assert "field 'width' of Quick is int; got '4'" in kind
    assert "overrides.max_epochs: 'max_epochs' is given both as a field override" in both
    assert "argument 'max_epochs': Input should be greater than or equal to 1 (got 0)" in bound
    assert "unknown argument 'epochz'" in unknown
    assert "keywords.warmup: this version of nitro has no run keyword 'warmup'" in keyword
    assert "experiment: no experiment named 'Quick'" in name and "module-qualified" in name
    assert "module 'agent_toys' has no 'Quik' (did you mean 'Quick'?); its experiments:" in module
    assert "run_id: no run 'nope'" in run
    assert "n_devs: 64 devices asked for" in devices


def test_a_null_run_keyword_is_refused_naming_the_argument_and_the_default(connect):
    async def scenario():
        async with connect() as session:
            quick = "agent_toys.Quick"
            return (
                await refusal(session, "nitro_train", experiment=quick, keywords={"accum": None}),
                await refusal(
                    session, "nitro_population", experiment=quick, axes={"seed": [0, None]}
                ),
            )

    keyword, axis = anyio.run(scenario)
    assert "keywords.accum: accum=None is not a setting (accum: micro-batches per" in keyword
    assert "Leave it out for the default (the framework's: accum=1)" in keyword
    assert "axes.seed: member 1 (seed=None): seed=None is not a setting (seed: seeds" in axis


def test_predict_refuses_ragged_inputs_and_names_a_missing_field(connect):
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
            return ragged, missing

    ragged, missing = anyio.run(scenario)
    assert "inputs.x: not a rectangular array" in ragged
    assert missing.startswith("nitro_predict: inputs:") and "'x'" in missing


def test_export_writes_bundles_that_predict_what_the_run_predicts(connect, tmp_path):
    x = np.linspace(-2, 2, 20).reshape(4, 5).astype(np.float32)

    async def scenario():
        async with connect() as session:
            started = await call(session, "nitro_train", experiment="agent_toys.Quick", seed=4)
            done = await poll(session, started["run_id"], lambda s: s["status"] != "running")
            predicted = await call(
                session, "nitro_predict", run_id=started["run_id"], inputs={"x": x.tolist()}
            )
            from_run = await call(
                session,
                "nitro_export",
                run_id=started["run_id"],
                dir=str(tmp_path / "from_run"),
                name="quick-agent",
            )
            from_checkpoint = await call(
                session,
                "nitro_export",
                experiment="agent_toys.Quick",
                weights=done["run_dir"],
                dir=str(tmp_path / "from_checkpoint"),
                platforms=["cpu"],
            )
            neither = await refusal(session, "nitro_export", dir=str(tmp_path / "x"))
            platform = await refusal(
                session, "nitro_export", run_id=started["run_id"], dir="x", platforms=["gpu"]
            )
            return done, predicted, from_run, from_checkpoint, neither, platform

    done, predicted, from_run, from_checkpoint, neither, platform = anyio.run(scenario)
    expected = np.asarray(predicted["outputs"], dtype=np.float32)
    for answer, name in ((from_run, "quick-agent"), (from_checkpoint, "quick")):
        assert answer["status"] == "done"
        bundle = nitro.bundle.load(answer["result"]["directory"])
        assert bundle.manifest == answer["result"]["manifest"]
        assert bundle.manifest["name"] == name
        np.testing.assert_allclose(bundle(x=x)["output"], expected, rtol=1e-5, atol=1e-6)
    run_provenance = from_run["result"]["manifest"]["provenance"]
    assert (run_provenance["run_id"], run_provenance["step"]) == (done["handle_run_id"], 8)
    checkpoint = from_checkpoint["result"]["manifest"]["provenance"]["checkpoint"]
    assert (checkpoint["run_id"], checkpoint["step"]) == (done["handle_run_id"], 8)
    assert from_checkpoint["result"]["manifest"]["program"]["platforms"] == ["cpu"]
    assert "nitro_export: run_id: give the run to export (run_id), or an experiment" in neither
    assert "argument 'platforms.0': Input should be 'cpu', 'cuda', 'rocm' or 'tpu'" in platform


def test_export_takes_echo_batch_sizes_and_axes_with_the_checks_of_n_export(connect, tmp_path):
    async def scenario():
        async with connect() as session:
            started = await call(session, "nitro_train", experiment="agent_toys.Tagged", seed=1)
            await poll(session, started["run_id"], lambda s: s["status"] != "running")
            run_id = started["run_id"]
            shaped = await call(
                session,
                "nitro_export",
                run_id=run_id,
                dir=str(tmp_path / "tagged"),
                platforms=["cpu"],
                echo=["id"],
                batch_sizes=[2, 8],
                axes={"x": ["batch", "feature"], "output": ["batch", "class"]},
            )
            refused = [
                await refusal(session, "nitro_export", run_id=run_id, dir="x", **wrong)
                for wrong in (
                    {"batch_sizes": [8, 2]},
                    {"axes": {"x": ["batch", ""]}},
                    {"axes": {"x": ["batch", "height", "width"]}},
                    {"echo": ["key"]},
                )
            ]
            return shaped, refused

    shaped, (sizes, form, rank, echo) = anyio.run(scenario)
    manifest = shaped["result"]["manifest"]
    assert manifest["program"]["batch_sizes"] == [2, 8]
    assert [(e["name"], e["axes"], e.get("echo")) for e in manifest["outputs"]] == [
        ("output", ["batch", "class"], None),
        ("id", ["batch"], "id"),
    ]
    model = nitro.bundle.load(shaped["result"]["directory"])
    assert [str(s) for s in model.inputs] == ["x: float32[batch, feature=5]", "id: int32[batch]"]
    ids = np.array([3, 1, 4], np.int32)
    np.testing.assert_array_equal(model(x=np.zeros((3, 5), np.float32), id=ids)["id"], ids)
    assert sizes.startswith("nitro_export: batch_sizes must be whole numbers of rows of at least")
    assert "got (8, 2)" in sizes
    assert form.startswith(
        "nitro_export: axes['x'] = ('batch', ''): each axis name must be a non-empty string"
    )
    assert (
        "ExportError: axes['x'] names 3 axes ('batch', 'height', 'width'), but x: "
        "float32[batch, 5] has 2; give one name (or None) per axis"
    ) in rank
    assert "ExportError: echo names 'key', which is not an input of the bundle" in echo


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


def test_a_new_handle_evaluates_with_the_weights_of_a_run_or_of_its_checkpoint(connect):
    async def scenario():
        async with connect() as session:
            first = await call(session, "nitro_train", experiment="agent_toys.Quick", seed=3)
            done = await poll(session, first["run_id"], lambda s: s["status"] != "running")
            trained = await call(session, "nitro_evaluate", run_id=first["run_id"])
            copied = await call(
                session,
                "nitro_evaluate",
                experiment="agent_toys.Quick",
                keywords={"weights": first["run_id"]},
            )
            from_dir = await call(
                session, "nitro_evaluate", experiment="agent_toys.Quick", weights=done["run_dir"]
            )
            validated = await call(
                session,
                "nitro_validate",
                experiment="agent_toys.Quick",
                weights=[done["run_dir"], "latest"],
            )
            fresh = await call(session, "nitro_evaluate", experiment="agent_toys.Quick")
            return done, trained, copied, from_dir, validated, fresh

    done, trained, copied, from_dir, validated, fresh = anyio.run(scenario)
    assert copied["result"] == pytest.approx(trained["result"])
    assert from_dir["result"] == pytest.approx(trained["result"])
    assert validated["result"]["val_loss"] == pytest.approx(done["metrics"]["val_loss"])
    assert fresh["result"]["test_loss"] != pytest.approx(trained["result"]["test_loss"])


def test_a_stopped_run_resumes_from_its_checkpoint_with_resume_auto(connect):
    slow = {"batches": 100, "delay": 0.05}  # epochs of 5 s: the stop lands in epoch 2

    async def scenario():
        async with connect() as session:
            first = await call(
                session, "nitro_train", experiment="agent_toys.Slow", overrides=slow, max_epochs=3
            )
            await poll(session, first["run_id"], lambda s: s["epoch"] >= 1)
            stopped = await call(session, "nitro_stop", run_id=first["run_id"])
            again = await call(
                session,
                "nitro_train",
                experiment="agent_toys.Slow",
                overrides=slow,
                max_epochs=3,
                resume="auto",
            )
            done = await poll(session, again["run_id"], lambda s: s["status"] != "running")
            history = await call(session, "nitro_status", run_id=again["run_id"], history=True)
            return stopped, done, history

    stopped, done, history = anyio.run(scenario)
    assert (stopped["stop_reason"], stopped["epoch"]) == ("requested", 1)
    assert 100 <= stopped["step"] < 200  # stopped in epoch 2
    resumed_from = done["weights_checkpoint"]
    # a stop saves the step it stops on, mid-epoch too: the resume continues from there
    assert (resumed_from["epoch"], resumed_from["step"]) == (1, stopped["step"])
    assert resumed_from["run_id"] == stopped["handle_run_id"]
    assert (done["handle_run_id"], done["run_dir"]) == (
        stopped["handle_run_id"],
        stopped["run_dir"],
    )  # the resumed run keeps its id and directory
    assert (done["status"], done["stop_reason"], done["epoch"], done["step"]) == (
        "done",
        "completed",
        3,
        300,
    )
    rows = history["history"]
    assert [row["epoch"] for row in rows] == [1, 2, 3] and [row["step"] for row in rows] == [
        100,
        200,
        300,
    ]
    assert rows[0]["val_loss"] == stopped["metrics"]["val_loss"]  # epoch 1 as it was saved


def test_early_stopping_and_loggers_given_as_json_show_in_status_and_logger(connect):
    async def scenario():
        async with connect() as session:
            started = await call(
                session,
                "nitro_train",
                experiment="agent_toys.Quick",
                max_epochs=6,
                keywords={
                    "early_stop": {"metric": "val_loss", "patience": 1, "min_delta": 10.0},
                    "logger": ["jsonl", "csv"],
                    "checkpointer": False,
                },
            )
            done = await poll(session, started["run_id"], lambda s: s["status"] != "running")
            logger = await call(session, "nitro_logger", run_id=started["run_id"])
            silent = await call(
                session, "nitro_evaluate", experiment="agent_toys.Quick", keywords={"logger": None}
            )
            none = await call(session, "nitro_logger", run_id=silent["run_id"])
            return done, logger, none

    done, logger, none = anyio.run(scenario)
    assert none["logger"] is None and "logs nothing (logger=None)" in none["note"]
    assert (done["status"], done["stop_reason"], done["epoch"]) == ("done", "early_stop", 2)
    assert done["logger"] == ["JSONLinesLogger", "CSVLogger"]
    run_dir = Path(done["run_dir"])
    assert logger["logger"] == "LoggerGroup" and logger["run_dir"] == done["run_dir"]
    assert logger["info"]["loggers"] == [
        {"type": "JSONLinesLogger", "path": str(run_dir / "metrics.jsonl")},
        {"type": "CSVLogger", "path": str(run_dir / "metrics.csv")},
    ]
    assert logger["run_url"] == (run_dir / "metrics.jsonl").as_uri()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["type"] == "finish" and lines[-1]["status"] == "early_stop"
    assert (run_dir / "metrics.csv").is_file() and not (run_dir / "checkpoints").exists()


def test_paths_outside_the_root_are_refused_naming_the_argument_and_the_root(connect, tmp_path):
    root = tmp_path.resolve()
    outside = root.parent / f"{root.name}-outside"
    outside.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)  # inside, leading outside
    quick = "agent_toys.Quick"

    async def scenario():
        async with connect() as session:
            return [
                await refusal(session, "nitro_export", run_id="nope", dir="../../etc/passwd"),
                await refusal(
                    session, "nitro_export", experiment=quick, weights="runs", dir="link/bundle"
                ),
                await refusal(session, "nitro_train", experiment=quick, run_dir=str(outside)),
                await refusal(
                    session, "nitro_train", experiment=quick, keywords={"run_dir": "../run"}
                ),
                await refusal(session, "nitro_train", experiment=quick, weights=str(outside)),
                await refusal(
                    session, "nitro_evaluate", experiment=quick, weights=["link", "best"]
                ),
                await refusal(session, "nitro_train", experiment=quick, resume="link"),
            ]

    export, symlink, run_dir, keyword, weights, pair, resume = anyio.run(scenario)
    escaped = (root / "../../etc/passwd").resolve()
    assert export.startswith(
        f"nitro_export: dir: '../../etc/passwd' is {escaped}, outside this session's root {root}"
    )
    assert (
        "`%nitro mcp start --allow DIR`" in export and "`python -m nitro.mcp --allow DIR`" in export
    )
    assert f"dir: 'link/bundle' is {outside / 'bundle'}, outside this session's root" in symlink
    assert f"nitro_train: run_dir: '{outside}' is {outside}, outside" in run_dir
    assert f"keywords.run_dir: '../run' is {root.parent / 'run'}, outside" in keyword
    assert f"nitro_train: weights: '{outside}' is {outside}, outside" in weights
    assert f"nitro_evaluate: weights: 'link' is {outside}, outside" in pair
    assert f"nitro_train: resume: 'link' is {outside}, outside" in resume
    assert not escaped.parent.exists() and list(outside.iterdir()) == []  # nothing written


def test_directories_the_user_allows_take_runs_and_bundles(tmp_path):
    root, allowed = tmp_path / "project", tmp_path / "shared"
    root.mkdir()

    async def scenario(session, tag: str):
        started = await call(
            session, "nitro_train", experiment="agent_toys.Quick", run_dir=str(allowed / tag)
        )
        done = await poll(session, started["run_id"], lambda s: s["status"] != "running")
        assert done["status"] == "done", done["error"]
        exported = await call(
            session, "nitro_export", run_id=started["run_id"], dir=str(allowed / f"{tag}-bundle")
        )
        here = await call(session, "nitro_export", run_id=started["run_id"], dir=f"{tag}-bundle")
        return exported, here

    async def over_stdio():  # started from tmp_path: --root makes project the working directory
        async with stdio_session(tmp_path, "--root", str(root), "--allow", str(allowed)) as session:
            return await scenario(session, "stdio")

    exported, here = anyio.run(over_stdio)
    assert nitro.bundle.load(exported["result"]["directory"]).manifest["name"] == "quick"
    assert exported["result"]["directory"] == str(allowed.resolve() / "stdio-bundle")
    assert here["result"]["directory"] == str(root.resolve() / "stdio-bundle")
    assert (allowed / "stdio" / "run.json").is_file()

    server = HttpServer(ToolSession(registry=RunRegistry(), root=root, allow=[allowed])).start()

    async def in_process():  # the working directory (tmp_path) is outside this root
        async with http_session(server.url, server.token) as session:
            default = await refusal(session, "nitro_train", experiment="agent_toys.Quick")
            return default, await scenario(session, "http")

    try:
        default, (exported, here) = anyio.run(in_process)
    finally:
        server.stop()
    assert f"run_dir: 'runs (the default)' is {tmp_path.resolve() / 'runs'}, outside" in default
    assert "or give run_dir inside the root" in default
    assert exported["result"]["directory"] == str(allowed.resolve() / "http-bundle")
    assert here["result"]["directory"] == str(root.resolve() / "http-bundle")  # not the cwd


def test_what_a_hook_prints_goes_to_stderr_and_never_into_the_protocol(tmp_path, caplog):
    async def scenario():
        async with stdio_session(tmp_path) as session:
            started = await call(session, "nitro_train", experiment="agent_toys.Chatty")
            done = await poll(session, started["run_id"], lambda s: s["status"] != "running")
            return done, await call(session, "nitro_runs")

    with caplog.at_level("DEBUG"):
        done, listed = anyio.run(scenario)
    assert done["status"] == "done" and len(listed["runs"]) == 1
    log = (tmp_path / "server.log").read_text()  # the server's stderr
    assert "chatty: building the data" in log and "chatty: tracing forward" in log
    assert "chatty: written to fd 1" in log  # a C-level write to stdout's descriptor
    assert not [r for r in caplog.records if "Failed to parse JSONRPC" in r.getMessage()]


def test_predict_converts_json_numbers_to_the_models_dtypes_and_refuses_what_does_not_fit(connect):
    async def scenario():
        async with connect() as session:
            runs = {}
            for name in ("Quick", "Tokens"):
                started = await call(session, "nitro_train", experiment=f"agent_toys.{name}")
                await poll(session, started["run_id"], lambda s: s["status"] != "running")
                runs[name] = started["run_id"]
            floats = await call(
                session, "nitro_predict", run_id=runs["Quick"], inputs={"x": [[1.0, 2, 3, 4, 5]]}
            )
            ints = await call(
                session, "nitro_predict", run_id=runs["Quick"], inputs={"x": [[1, 2, 3, 4, 5]]}
            )
            tokens = await call(
                session, "nitro_predict", run_id=runs["Tokens"], inputs={"x": [[1, 2, 3, 4, 5.0]]}
            )
            fraction = await refusal(
                session, "nitro_predict", run_id=runs["Tokens"], inputs={"x": [[1, 2, 1.7, 4, 5]]}
            )
            huge = await refusal(
                session, "nitro_predict", run_id=runs["Tokens"], inputs={"x": [[1, 2, 3, 4, 2**40]]}
            )
            beyond = await refusal(
                session, "nitro_predict", run_id=runs["Quick"], inputs={"x": [[1, 2, 3, 4, 1e39]]}
            )
            return floats, ints, tokens, fraction, huge, beyond

    floats, ints, tokens, fraction, huge, beyond = anyio.run(scenario)
    assert ints["outputs"] == floats["outputs"]  # integers ran as the model's float32
    assert ints["shapes"] == {"shape": [1, 2], "dtype": "float32"}
    assert np.asarray(tokens["outputs"]).shape == (1, 2)
    assert fraction.startswith(
        "nitro_predict: inputs.x: the model takes int32, but 1.7 (at [0, 2]) is not a whole number"
    )
    assert f"inputs.x: the model takes int32, but {2**40} (at [0, 4]) is outside" in huge
    assert beyond.startswith(  # not turned into inf: refused as the server refuses it
        "nitro_predict: inputs.x: the model takes float32, but 1e+39 (at [0, 4]) is outside its "
        "range (largest 3.4028235e+38); give float32 values for x"
    )


def test_a_large_prediction_answers_a_preview_and_writes_every_row_to_a_file(connect, tmp_path):
    x = np.random.default_rng(0).integers(-3, 4, size=(20_000, 5))

    async def scenario():
        async with connect() as session:
            started = await call(session, "nitro_train", experiment="agent_toys.Quick")
            run_id = started["run_id"]
            await poll(session, run_id, lambda s: s["status"] != "running")
            large = await call(session, "nitro_predict", run_id=run_id, inputs={"x": x.tolist()})
            first = await call(
                session, "nitro_predict", run_id=run_id, inputs={"x": x[:3].tolist()}
            )
            as_json = await call(
                session,
                "nitro_predict",
                run_id=run_id,
                inputs={"x": x[:5].tolist()},
                out="answers/five.json",
            )
            outside = await refusal(
                session,
                "nitro_predict",
                run_id=run_id,
                inputs={"x": x[:1].tolist()},
                out="../a.npy",
            )
            return large, first, as_json, outside

    large, first, as_json, outside = anyio.run(scenario)
    assert large["rows"] == 20_000 and large["shapes"] == {"shape": [20_000, 2], "dtype": "float32"}
    shown = large["preview_rows"]
    assert 1 <= shown < 20_000 and len(large["outputs"]) == shown
    path = Path(large["file"])
    assert path.parent == tmp_path.resolve() / "predictions" and path.suffix == ".npy"
    saved = np.load(path)
    assert saved.shape == (20_000, 2) and saved.dtype == np.float32
    np.testing.assert_allclose(saved[:shown], large["outputs"], rtol=1e-6)
    np.testing.assert_allclose(saved[:3], first["outputs"], rtol=1e-6)
    assert "file" not in first  # a small answer comes inline
    assert as_json["file"] == str(tmp_path.resolve() / "answers" / "five.json")
    assert np.asarray(json.loads(Path(as_json["file"]).read_text())).shape == (5, 2)
    assert (
        "nitro_predict: out: '../a.npy' is" in outside and "outside this session's root" in outside
    )


def test_a_second_run_into_the_same_run_dir_is_refused_naming_the_writer(connect):
    slow = {"batches": 20, "delay": 0.05}
    train = {
        "experiment": "agent_toys.Slow",
        "overrides": slow,
        "max_epochs": 2,
        "keywords": {"run_dir": "shared"},
    }

    async def scenario():
        async with connect() as session:
            first = await call(session, "nitro_train", **train)
            await poll(session, first["run_id"], lambda s: s["step"] > 0)
            second = await call(session, "nitro_train", **train)
            refused = await poll(session, second["run_id"], lambda s: s["status"] != "running")
            done = await poll(session, first["run_id"], lambda s: s["status"] != "running")
            return refused, done

    refused, done = anyio.run(scenario)
    assert refused["status"] == "failed" and "has a writer already" in refused["error"]
    assert "shared" in refused["error"]
    assert (done["status"], done["epoch"]) == ("done", 2)
    lines = (Path(done["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    kinds = [json.loads(line)["type"] for line in lines]
    assert kinds.count("params") == 1  # one run's lines only


def test_nitro_train_builds_a_preset_of_the_class_and_the_run_records_it(http_server, tmp_path):
    async def scenario():
        async with http_session(http_server.url, http_server.token) as session:
            started = await call(
                session,
                "nitro_train",
                experiment="nitro.examples.digits.Digits",
                preset="small",
                overrides={"width": 8},
                max_epochs=1,
            )
            done = await poll(session, started["run_id"], lambda s: s["status"] != "running")
            unknown = await refusal(
                session, "nitro_train", experiment="nitro.examples.digits.Digits", preset="tiny"
            )
            return done, unknown

    done, unknown = anyio.run(scenario)
    assert (done["status"], done["preset"], done["step"]) == ("done", "small", 19)
    info = json.loads((Path(done["run_dir"]) / "run.json").read_text())
    assert (info["preset"], info["config"]["fields"]["width"]) == ("small", 8)
    assert info["config"]["fields"]["batch_size"] == 64  # the preset's, under the overrides
    assert unknown == (
        "nitro_train: preset: Digits has no preset 'tiny'. Its presets: 'small', 'large'."
    )


def test_an_agent_rewinds_a_run_and_forks_it_as_a_person_does(http_server):
    async def scenario():
        async with http_session(http_server.url, http_server.token) as session:
            keywords = {"snapshots": {"every": 1, "keep": 50}, "steps_per_dispatch": 1}
            started = await call(
                session,
                "nitro_train",
                experiment="agent_toys.Quick",
                max_epochs=2,
                keywords=keywords,
            )
            run_id = started["run_id"]
            done = await poll(session, run_id, lambda s: s["status"] != "running")
            listed = await call(session, "nitro_rewind", run_id=run_id)
            rewound = await call(session, "nitro_rewind", run_id=run_id, step=3)
            missing = await refusal(session, "nitro_rewind", run_id=run_id, step=999)
            forked = await call(
                session, "nitro_fork", run_id=run_id, step=3, overrides={"scale": 2.0}
            )
            refused = await refusal(
                session, "nitro_fork", run_id=run_id, step=3, keywords={"accum": 2}
            )
            again = await call(session, "nitro_train", run_id=run_id)
            trained = await poll(session, again["run_id"], lambda s: s["status"] != "running")
            return done, listed, rewound, missing, forked, refused, trained

    done, listed, rewound, missing, forked, refused, trained = anyio.run(scenario)
    assert {row["step"] for row in listed["snapshots"]} >= {0, 3, 7}
    assert (rewound["from_step"], rewound["step"], rewound["epoch"]) == (8, 3, 0)
    assert "has no snapshot or checkpoint of step 999" in missing
    assert forked["status"] == "done" and forked["result"]["step"] == 3
    assert forked["result"]["forked_from"]["run_id"] == done["handle_run_id"]
    assert "fork(accum=...) changes the program" in refused
    assert trained["step"] == 8 and trained["metrics"]["val_loss"] == done["metrics"]["val_loss"]


def test_render_answers_images_as_the_protocols_image_content(connect):
    import base64

    async def scenario():
        async with connect() as session:
            started = await call(session, "nitro_train", experiment="agent_toys.Quick")
            run_id = started["run_id"]
            await poll(session, run_id, lambda s: s["status"] != "running")
            samples = await session.call_tool(
                "nitro_render", {"run_id": run_id, "samples": 4, "split": "val"}
            )
            matrix = await session.call_tool(
                "nitro_render", {"run_id": run_id, "view": "confusion"}
            )
            wrong = await refusal(session, "nitro_render", run_id=run_id, split="tset")
            return samples, matrix, wrong

    samples, matrix, wrong = anyio.run(scenario)
    for result in (samples, matrix):
        assert not result.is_error
        images = [c for c in result.content if c.type == "image"]
        assert len(images) == 1 and images[0].mime_type == "image/png"
        assert base64.b64decode(images[0].data).startswith(b"\x89PNG")
    rows = samples.structured_content["rows"][0]
    assert [row["index"] for row in rows] == [0, 1, 2, 3]
    assert {"y", "prediction", "loss"} <= set(rows[0])
    confusion = matrix.structured_content
    assert sum(map(sum, confusion["matrix"][0])) == sum(
        r["support"] for r in confusion["per_class"][0]
    )
    assert "split: run" in wrong and "no split 'tset'" in wrong
