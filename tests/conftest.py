import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# A shell without job control starts a background command with SIGINT ignored, and Python then
# installs no KeyboardInterrupt handler; the Ctrl-C tests (and the processes they start, which
# inherit an ignored signal) need the one an interactive Ctrl-C reaches.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import nitro  # noqa: E402


@pytest.fixture
def fresh_cache():
    """An empty compile cache, so a test can assert exact counts."""
    nitro.cache_reset()
    yield
    nitro.cache_reset()


@pytest.fixture(autouse=True)
def _runs_in_a_temporary_directory(tmp_path, monkeypatch):
    """Runs write their directories (runs/<Experiment>/<run id>) under the working directory:
    keep each test's in its own temporary directory."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def http_server():
    """The agent tools served over HTTP in this process, for a module's tests."""
    from nitro.mcp import HttpServer, RunRegistry, ToolSession

    server = HttpServer(ToolSession(registry=RunRegistry())).start()
    yield server
    server.stop()


@pytest.fixture(params=["stdio", "http"])
def connect(request, http_server, tmp_path, monkeypatch):
    """A function opening an MCP client session (tests/agent_client.py) over the transport
    under test: a `python -m nitro.mcp` subprocess, or `http_server`."""
    from agent_client import http_session, stdio_session

    if request.param == "stdio":
        return lambda: stdio_session(tmp_path)
    monkeypatch.chdir(tmp_path)  # the in-process server's relative run directories
    return lambda: http_session(http_server.url, http_server.token)
