"""The MCP SDK's own client, connected to Nitro's agent tools over stdio or streamable HTTP.

`stdio_session(cwd, *options)` starts `python -m nitro.mcp` as a subprocess (this checkout and tests/
importable, so experiments are named `agent_toys.Quick`); `http_session(url, token)` connects
to a running `HttpServer`. The helpers call a tool and return its JSON answer or its error.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

pytest.importorskip("mcp")

import httpx2  # noqa: E402 - the SDK's HTTP client (tests import it from here)
from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


@asynccontextmanager
async def stdio_session(cwd: Path, *options: str):
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "nitro.mcp", *options],
        env={"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]), "JAX_PLATFORMS": "cpu"},
        cwd=cwd,
    )
    with open(cwd / "server.log", "w") as errlog:  # the server's stderr: training output
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session


@asynccontextmanager
async def http_session(url: str, token: str | None):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http:
        async with streamable_http_client(url, http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session


async def call(session: ClientSession, tool: str, **arguments) -> dict:
    """The tool's JSON answer; fails the test with the tool's error text."""
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, result.content[0].text
    return result.structured_content


async def refusal(session: ClientSession, tool: str, **arguments) -> str:
    """The tool's error text; fails the test when the call succeeds."""
    result = await session.call_tool(tool, arguments)
    assert result.is_error, f"{tool}({arguments}) succeeded: {result.structured_content}"
    return result.content[0].text


async def poll(session: ClientSession, run_id: str, until, timeout: float = 120) -> dict:
    """nitro_status of `run_id` until `until(status)` holds."""
    deadline = time.monotonic() + timeout
    while True:
        status = await call(session, "nitro_status", run_id=run_id)
        if until(status):
            return status
        assert time.monotonic() < deadline, f"status stayed {status}"
        await anyio.sleep(0.1)
