"""`%nitro mcp` in a real kernel: an agent drives runs in the live session, and the person and
the agent see each other's runs."""

from __future__ import annotations

import ast
import json
import re
import stat
import time
from pathlib import Path

import anyio
import pytest
from agent_client import call, http_session, httpx2, poll, refusal
from notebook_kernel import (
    Kernel,
    kernel_fixture,  # noqa: F401 - provides the `kernel` fixture
)


def _serve(kernel, options: str = "") -> tuple[str, str, str]:
    """Start serving; the cell's msg_id, the URL it printed and the token from the file it
    named. The token is in no output of the kernel, which the notebook would save."""
    cell = kernel.run(f"%nitro mcp start {options}")
    url = re.search(r"at (http://127\.0\.0\.1:\d+/mcp) \(loopback only\)", cell.stdout).group(1)
    token_file = Path(re.search(r"token: in (\S+) \(readable by you only", cell.stdout).group(1))
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text()
    assert token == ast.literal_eval(kernel.eval("nitro_ipython.agents.serving().token"))
    assert token not in json.dumps([m["content"] for m in kernel.log])  # nothing to save
    assert f'--header "Authorization: Bearer $(cat {token_file})"' in cell.stdout  # Claude Code
    assert '"headers": {"Authorization": "Bearer ${NITRO_MCP_TOKEN}"}' in cell.stdout
    return cell.msg_id, url, token


def test_an_agent_trains_in_the_kernel_and_the_run_shows_in_nitro_runs(kernel):
    start_cell, url, token = _serve(kernel)
    kernel.run("from tiny_exp import Tiny")
    again = kernel.run("%nitro mcp start", check=False)
    assert f"already serving at {url}" in again.error

    async def agent():
        async with http_session(url, token) as session:
            started = await call(
                session, "nitro_train", experiment="Tiny", overrides={"batches": 6}, max_epochs=2
            )
            done = await poll(session, started["run_id"], lambda s: s["status"] != "running")
            return started["run_id"], done

    run_id, done = anyio.run(agent)
    assert (done["status"], done["epoch"], done["step"]) == ("done", 2, 12)
    assert 0 <= done["metrics"]["val_acc"] <= 1

    table = kernel.run("%nitro runs").data()[-1]
    assert re.search(rf"{run_id} +Tiny +done +2/2 +12", table)
    status = kernel.run(f"%nitro status {run_id}").stdout
    assert status.startswith(f"{run_id} (Tiny): done, epoch 2/2, step 12")
    printed = [
        m["content"]["text"]
        for m in kernel.log
        if m["msg_type"] == "stream" and m["parent_header"].get("msg_id") == start_cell
    ]
    assert len(printed) == 1 and "epoch" not in printed[0]  # the start message, no progress
    kernel.run("%nitro mcp stop")


def test_an_agents_run_gets_a_live_panel_when_the_person_shows_it(kernel):
    _, url, token = _serve(kernel)

    async def start():
        async with http_session(url, token) as session:
            started = await call(
                session,
                "nitro_train",
                experiment="tiny_exp.Tiny",
                overrides={"batches": 400, "delay": 0.02},
            )
            await poll(session, started["run_id"], lambda s: s["step"] >= 2)
            return started["run_id"]

    run_id = anyio.run(start)
    cell = kernel.run(f"%nitro panel {run_id}")
    assert any("nitro: live training panel" in text for text in cell.data())
    panel = f"nitro_ipython.live_panel(nitro_ipython.agents.agent_runs()[{run_id!r}])"
    first = float(kernel.eval(f"{panel}.progress.value"))
    deadline = time.monotonic() + 60
    while float(kernel.eval(f"{panel}.progress.value")) <= first:
        assert time.monotonic() < deadline, "the panel did not move"
        kernel.pump(0.2)
    assert "Tiny" in ast.literal_eval(kernel.eval(f"{panel}.title.value"))
    kernel.run(f"%nitro stop {run_id}")
    assert kernel.eval(f"{panel}.progress.bar_style") == "'warning'"  # stopped
    kernel.run("%nitro mcp stop")


def test_the_agent_sees_and_stops_the_persons_runs_and_stop_ends_serving(kernel):
    _, url, token = _serve(kernel)
    kernel.run(
        """
        mine = tiny_exp.Tiny(batches=400, delay=0.02)
        %nitro train mine --background
        """
    )

    async def agent():
        async with http_session(url, token) as session:
            listed = await call(session, "nitro_runs")
            running = await poll(session, "mine_run", lambda s: s["step"] >= 2)
            stopped = await call(session, "nitro_stop", run_id="mine_run")
            wrong_split = await refusal(session, "nitro_evaluate", run_id="mine_run", split="x")
            return listed, running, stopped, wrong_split

    listed, running, stopped, wrong_split = anyio.run(agent)
    rows = {row["run_id"]: row for row in listed["runs"]}
    assert rows["mine_run"]["kind"] == "notebook" and rows["mine_run"]["started_by"] == "notebook"
    assert running["names"] == ["mine_run"]
    assert (stopped["status"], stopped["stop_reason"]) == ("stopped", "requested")
    assert "split: run mine_run has no split 'x'; its splits: train, val" in wrong_split
    assert ast.literal_eval(kernel.eval("(mine_run.stop_reason, mine_run.running)")) == (
        "requested",
        False,
    )

    assert kernel.run("%nitro mcp").stdout == f"nitro: serving at {url}\n"  # no token again
    assert kernel.run("%nitro mcp stop").stdout.startswith(f"nitro: stopped serving {url}")
    with pytest.raises(httpx2.ConnectError):
        httpx2.post(url, json={}, timeout=60)


def test_the_person_continuing_an_agents_run_gets_the_usual_panel(kernel):
    _, url, token = _serve(kernel)

    async def agent():
        async with http_session(url, token) as session:
            started = await call(
                session, "nitro_train", experiment="tiny_exp.Tiny", overrides={"batches": 4}
            )
            await poll(session, started["run_id"], lambda s: s["status"] != "running")
            return started["run_id"]

    run_id = anyio.run(agent)
    cell = kernel.run(
        f"agents_run = nitro_ipython.agents.agent_runs()[{run_id!r}]\n"
        f"%nitro train agents_run --epochs 1"
    )
    (record,) = cell.updates("text/html")  # the panel, replaced by its record at the end
    assert re.search(r"<b>done</b> &middot; epoch 2/2 &middot; step 8 &middot; loss", record)
    kernel.run("%nitro mcp stop")


def test_the_agent_reads_the_error_a_persons_run_failed_with(kernel):
    _, url, token = _serve(kernel)
    kernel.run(
        """
        class DroppedFeed(tiny_exp.SlowBatches):
            def __iter__(self):
                yield from list(super().__iter__())[:2]
                raise OSError("the sensor feed dropped")

        @nitro.experiment
        class Feed(tiny_exp.Tiny):
            def build_data(self):
                return {"train": DroppedFeed(4, 8, 0.0), "val": tiny_exp.SlowBatches(2, 8, 0.0)}

        feed = Feed()
        """
    )
    failed = kernel.run("%nitro train feed", check=False)
    assert "the sensor feed dropped" in failed.error

    async def agent():
        async with http_session(url, token) as session:
            return await call(session, "nitro_status", run_id="feed_run")

    status = anyio.run(agent)
    assert (status["status"], status["phase"], status["stop_reason"]) == (
        "failed",
        "failed",
        "error",
    )
    assert status["error"] == "OSError: the sensor feed dropped"
    kernel.run("%nitro mcp stop")


def test_the_agent_writes_only_inside_the_notebooks_directory_unless_the_person_allows_more(
    kernel, tmp_path
):
    shared = tmp_path / "shared"
    _, url, token = _serve(kernel, f"--allow {shared}")

    async def agent():
        async with http_session(url, token) as session:
            started = await call(
                session, "nitro_train", experiment="tiny_exp.Tiny", overrides={"batches": 2}
            )
            await poll(session, started["run_id"], lambda s: s["status"] != "running")
            outside = await refusal(
                session, "nitro_export", run_id=started["run_id"], dir="../elsewhere"
            )
            allowed = await call(
                session, "nitro_export", run_id=started["run_id"], dir=str(shared / "tiny")
            )
            return outside, allowed

    outside, allowed = anyio.run(agent)
    root = kernel.cwd.resolve()
    assert f"dir: '../elsewhere' is {root.parent / 'elsewhere'}, outside this session's root " in (
        outside
    )
    assert "`%nitro mcp start --allow DIR`" in outside
    assert not (root.parent / "elsewhere").exists()
    assert allowed["result"]["directory"] == str(shared.resolve() / "tiny")
    kernel.run("%nitro mcp stop")


def test_the_token_file_goes_when_the_kernel_that_served_it_shuts_down(tmp_path):
    kernel = Kernel(tmp_path)
    try:
        kernel.run("%load_ext nitro")
        started = kernel.run("%nitro mcp start").stdout
        token_file = Path(re.search(r"token: in (\S+) \(readable by you only", started).group(1))
        assert token_file.is_file()
    finally:
        kernel.client.stop_channels()
        kernel.manager.shutdown_kernel(now=False)  # as Jupyter shuts a kernel down
    assert not token_file.exists()
