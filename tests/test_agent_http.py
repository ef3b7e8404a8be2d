"""The HTTP server answers only this machine, and only with the token."""

from __future__ import annotations

import stat

import anyio
import pytest
from agent_client import call, http_session, httpx2
from mcp import MCPError

from nitro.mcp import HttpServer, RunRegistry, ToolSession, build_server
from nitro.mcp.http import LoopbackBearerGuard, is_loopback

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "test", "version": "0"},
    },
}
ACCEPT = {"Accept": "application/json, text/event-stream"}


@pytest.fixture(scope="module")
def server():
    server = HttpServer(ToolSession(registry=RunRegistry())).start()
    yield server
    server.stop()


def _post(url: str, headers: dict[str, str]) -> httpx2.Response:
    return httpx2.post(url, json=INITIALIZE, headers={**ACCEPT, **headers}, timeout=120)


def test_a_request_without_the_token_or_with_a_wrong_one_is_refused(server):
    missing = _post(server.url, {})
    wrong = _post(server.url, {"Authorization": "Bearer not-the-token"})
    basic = _post(server.url, {"Authorization": f"Basic {server.token}"})
    right = _post(server.url, {"Authorization": f"Bearer {server.token}"})

    for refused in (missing, wrong, basic):
        assert refused.status_code == 401
        assert refused.headers["WWW-Authenticate"] == "Bearer"
        assert "missing or wrong bearer token" in refused.json()["error"]
    assert right.status_code == 200


def test_the_sdk_client_connects_with_the_token_and_fails_without_it(server):
    async def connect(token):
        async with http_session(server.url, token) as session:
            return await call(session, "nitro_runs")

    assert anyio.run(connect, server.token)["runs"] == []
    for token in (None, "not-the-token"):
        with pytest.raises(ExceptionGroup) as refused:
            anyio.run(connect, token)
        assert refused.group_contains(MCPError)


def test_a_request_from_another_machine_is_refused_even_with_the_token():
    app = build_server(ToolSession(registry=RunRegistry())).streamable_http_app()

    async def request(client: tuple[str, int], token: str | None):
        transport = httpx2.ASGITransport(app=LoopbackBearerGuard(app, "secret"), client=client)
        headers = {**ACCEPT, "Authorization": f"Bearer {token}"} if token else ACCEPT
        async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            return await http.post("/mcp", json=INITIALIZE, headers=headers)

    remote = anyio.run(request, ("192.0.2.7", 50000), "secret")
    assert remote.status_code == 403
    assert "only answers this machine; 192.0.2.7 is not loopback" in remote.json()["error"]
    assert anyio.run(request, ("127.0.0.1", 50000), None).status_code == 401


def test_loopback_addresses_are_told_apart_from_others():
    assert all(map(is_loopback, ["127.0.0.1", "127.8.9.1", "::1", "::ffff:127.0.0.1"]))
    assert not any(map(is_loopback, ["10.0.0.1", "192.0.2.7", "::ffff:10.0.0.1", "", "host"]))


def test_the_server_binds_loopback_and_refuses_a_port_in_use(server):
    assert server.url == f"http://127.0.0.1:{server.port}/mcp"
    with pytest.raises(OSError, match=rf"cannot serve on 127.0.0.1:{server.port} .*another port"):
        HttpServer(ToolSession(registry=RunRegistry()), port=server.port).start()


def test_the_host_header_may_name_loopback_with_or_without_the_port(server):
    def post(host: str) -> httpx2.Response:
        return _post(server.url, {"Authorization": f"Bearer {server.token}", "Host": host})

    for host in ("127.0.0.1", f"127.0.0.1:{server.port}", f"localhost:{server.port}", "[::1]"):
        assert post(host).status_code == 200, host
    for host in ("attacker.example", f"attacker.example:{server.port}", "127.0.0.1:1"):
        refused = post(host)
        assert (refused.status_code, refused.text) == (421, "Invalid Host header"), host


def test_a_server_on_port_80_answers_clients_that_send_the_host_without_the_port():
    try:
        server = HttpServer(ToolSession(registry=RunRegistry()), port=80).start()
    except OSError as error:  # not root, or the port is taken
        pytest.skip(f"cannot serve on port 80 here: {error}")

    async def connect():
        async with http_session(server.url, server.token) as session:  # sends Host: 127.0.0.1
            return await call(session, "nitro_runs")

    try:
        assert server.url == "http://127.0.0.1:80/mcp"
        assert anyio.run(connect)["runs"] == []
    finally:
        server.stop()


def test_the_token_file_is_readable_by_its_owner_only_and_goes_when_serving_stops(tmp_path):
    path = tmp_path / "runtime" / "nitro-mcp.token"
    path.parent.mkdir()
    path.write_text("an old token")
    path.chmod(0o644)
    server = HttpServer(ToolSession(registry=RunRegistry()), token_file=path).start()

    async def connect(token):
        async with http_session(server.url, token) as session:
            return await call(session, "nitro_runs")

    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = path.read_text()
        assert token == server.token and anyio.run(connect, token)["runs"] == []
    finally:
        server.stop()
    assert not path.exists()
