"""`%nitro mcp start|stop`: this kernel's runs, served to a coding agent over MCP.

The server (`nitro.mcp.HttpServer`) runs on a background thread on loopback, behind a random
bearer token printed once. Its tools look experiments and handles up in the notebook's
namespace, so the agent sees the person's runs and the person sees the agent's (in `%nitro
runs`). Output of the agent's runs goes to the cell that ran `%nitro mcp start`.
"""

from __future__ import annotations

import json
from typing import Any

from IPython.core.error import UsageError

__all__ = ["agent_runs", "config_snippets", "serving", "start", "stop"]

_SERVER: list[Any] = [None]


def serving():
    """The running server (an `HttpServer`), or None."""
    server = _SERVER[0]
    return server if server is not None and server.running else None


def agent_runs() -> dict[str, Any]:
    """Run id -> handle of the runs agent tools started in this process (empty when the
    agent extra is not installed)."""
    try:
        from nitro.mcp.registry import RUNS
    except ImportError:  # pragma: no cover - the registry needs only the engine
        return {}
    return RUNS.handles()


def config_snippets(url: str, token: str) -> str:
    """How to point common agent clients at `url` with `token`."""
    header = f"Authorization: Bearer {token}"
    entry = {"type": "http", "url": url, "headers": {"Authorization": f"Bearer {token}"}}
    return "\n".join(
        [
            "Claude Code:",
            f'  claude mcp add --transport http nitro {url} --header "{header}"',
            "Claude Code .mcp.json, Cursor mcp.json (mcpServers); VS Code .vscode/mcp.json "
            "(servers):",
            "  " + json.dumps({"mcpServers": {"nitro": entry}}),
            f"Codex ~/.codex/config.toml, with NITRO_MCP_TOKEN={token} in Codex's environment:",
            f'  [mcp_servers.nitro]\n  url = "{url}"\n  bearer_token_env_var = "NITRO_MCP_TOKEN"',
        ]
    )


def start(shell: Any, port: int = 0) -> str:
    """Serve the kernel's session on 127.0.0.1:`port` (0: any free port); returns the text to
    print: the URL, the token (shown only here) and client configuration."""
    try:
        from nitro.mcp import HttpServer, ToolSession
    except ImportError as error:
        raise UsageError(
            f"%nitro mcp needs the MCP SDK ({error}); install it with pip install 'nitro[agents]'"
        ) from None
    running = serving()
    if running is not None:
        raise UsageError(
            f"already serving at {running.url}; `%nitro mcp stop` first to start again "
            f"(with a new token)"
        )
    get_parent = getattr(shell, "get_parent", None)
    parent = get_parent() if get_parent is not None else None
    set_thread_parent = getattr(shell, "set_thread_parent", None)

    def before_run() -> None:
        if parent and set_thread_parent is not None:
            set_thread_parent(parent)

    session = ToolSession(namespace=shell.user_ns, before_run=before_run)
    try:
        server = HttpServer(session, port=port).start()
    except OSError as error:
        raise UsageError(str(error)) from None
    _SERVER[0] = server
    return (
        f"nitro: serving this kernel's runs to coding agents at {server.url} (loopback only)\n"
        f"token (shown once): {server.token}\n\n"
        f"{config_snippets(server.url, server.token)}\n\n"
        f"Runs the agent starts print here and show in `%nitro runs`; `%nitro mcp stop` stops "
        f"serving."
    )


def stop() -> str:
    server = _SERVER[0]
    _SERVER[0] = None
    if server is None or not server.running:
        return "nitro: not serving"
    server.stop()
    return f"nitro: stopped serving {server.url}; runs the agent started keep their state"
