"""Serving the tools over streamable HTTP, on loopback only, behind a bearer token.

```
client --HTTP--> uvicorn (127.0.0.1, its own thread)
                   -> LoopbackBearerGuard: 403 unless the peer is loopback,
                                           401 unless "Authorization: Bearer <token>"
                   -> the SDK's streamable HTTP app (also checks Host and Origin headers:
                      loopback names, with the port and without)
                   -> tools, each on a worker thread
```

The token can be written to a file only its owner reads (`token_file`, mode 0600), so a
notebook shows where the token is and never the token itself.

>>> server = HttpServer(ToolSession()).start()      # doctest: +SKIP
>>> server.url, len(server.token)                   # doctest: +SKIP
('http://127.0.0.1:40123/mcp', 43)
>>> server.stop()                                   # doctest: +SKIP
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from nitro.mcp.session import ToolSession
from nitro.mcp.tools import build_server

__all__ = [
    "HOST",
    "HttpServer",
    "LoopbackBearerGuard",
    "is_loopback",
    "transport_security",
    "write_token_file",
]

HOST = "127.0.0.1"
PATH = "/mcp"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback addresses."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def transport_security(port: int) -> Any:
    """The SDK's DNS-rebinding check for a loopback server on `port`: the loopback names as
    `Host` (`127.0.0.1:8765`, and bare `127.0.0.1`, which clients send for port 80) and as
    `Origin`; any other host name is answered 421."""
    from mcp.server.transport_security import TransportSecuritySettings

    hosts = [f"{name}:{port}" for name in LOOPBACK_NAMES] + list(LOOPBACK_NAMES)
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=hosts,
        allowed_origins=[f"http://{host}" for host in hosts],
    )


def write_token_file(path: str | os.PathLike, token: str) -> Path:
    """Write `token` to `path` readable by its owner only (mode 0600, also when the file
    existed), creating the parent directory (mode 0700) when missing."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return path


class LoopbackBearerGuard:
    """ASGI middleware: refuses HTTP requests from other machines (403) and requests without
    the token (401) before they reach the MCP app."""

    def __init__(self, app: Any, token: str):
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope):
        from starlette.datastructures import Headers
        from starlette.responses import JSONResponse

        client = scope.get("client") or ("",)
        if not is_loopback(client[0]):
            return JSONResponse(
                {"error": f"this server only answers this machine; {client[0]} is not loopback"},
                status_code=403,
            )
        scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), self._token
        ):
            return JSONResponse(
                {
                    "error": "missing or wrong bearer token; send 'Authorization: Bearer <token>' "
                    "with the token from the file `%nitro mcp start` names"
                },
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return None


class HttpServer:
    """The tools of `session` over streamable HTTP at `url`, served by a background thread.

    `port=0` picks a free port. The token is random unless given; with `token_file` it is
    written there (mode 0600) when serving starts and removed when it stops.
    """

    def __init__(
        self,
        session: ToolSession,
        port: int = 0,
        token: str | None = None,
        token_file: str | os.PathLike | None = None,
    ):
        self.session = session
        self.token = token or secrets.token_urlsafe(32)
        self.token_file = Path(token_file) if token_file is not None else None
        self._requested_port = port
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}{PATH}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 30.0) -> HttpServer:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, self._requested_port))
        except OSError as error:
            sock.close()
            raise OSError(
                f"cannot serve on {HOST}:{self._requested_port} ({error.strerror}); choose "
                f"another port, or 0 for any free one"
            ) from None
        self.port = port = sock.getsockname()[1]
        app = build_server(self.session).streamable_http_app(
            streamable_http_path=PATH, host=HOST, transport_security=transport_security(port)
        )
        config = uvicorn.Config(
            LoopbackBearerGuard(app, self.token),
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [sock]}, name="nitro-mcp-http"
        )
        self._thread.daemon = True
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the MCP server on {HOST}:{self.port} did not start")
            time.sleep(0.01)
        if self.token_file is not None:
            try:
                write_token_file(self.token_file, self.token)
            except OSError:
                self.stop()
                raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (runs keep training; they live in the session's registry)."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            deadline = time.monotonic() + timeout
            while self._thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            if self._thread.is_alive():
                assert self._uvicorn is not None  # started with the thread
                self._uvicorn.force_exit = True
        self._thread = None
        if self.token_file is not None:
            self.token_file.unlink(missing_ok=True)
