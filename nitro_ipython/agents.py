"""`%nitro mcp start|stop`: this kernel's runs, served to a coding agent over MCP.

The server (`nitro.mcp.HttpServer`) runs on a background thread on loopback, behind a random
bearer token. The token goes to a file only its owner reads (`token_path`: in Jupyter's runtime
directory, beside the kernel's connection file), never into a cell's output, which the notebook
saves. Its tools look experiments and handles up in the notebook's namespace, so the agent sees
the person's runs and the person sees the agent's (in `%nitro runs`). The agent's runs print no
progress into any cell (the agent reads it through its tools; `%nitro panel RUN_ID` shows it);
a warning they raise goes to the cell that ran `%nitro mcp start`. The token file goes when
serving stops, and when the kernel ends (shut down or restarted) while it serves.
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError

from . import worker

__all__ = ["agent_runs", "config_snippets", "serving", "start", "stop", "token_path"]

_SERVER: list[Any] = [None]


def serving():
    """The running server (an `HttpServer`), or None."""
    server = _SERVER[0]
    return server if server is not None and server.running else None


def agent_runs() -> dict[str, Any]:
    """Run id -> handle of the runs agent tools started in this process (empty when the
    agent extra is not installed)."""
    try:
        from nitro.mcp import RUNS
    except ImportError:  # pragma: no cover - the registry needs only the engine
        return {}
    return RUNS.handles()


def token_path(port: int) -> Path:
    """Where the token of the server on `port` is kept: Jupyter's runtime directory (where
    the kernels' connection files are), or ~/.nitro/ without Jupyter."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir

        directory = Path(jupyter_runtime_dir())
    except ImportError:  # pragma: no cover - a kernel has jupyter_core
        directory = Path.home() / ".nitro"
    return directory / f"nitro-mcp-{port}.token"


def config_snippets(url: str, token_file: str | os.PathLike) -> str:
    """How to point common agent clients at `url`, each reading the token from `token_file`."""

    def entry(variable: str) -> str:
        headers = {"Authorization": f"Bearer {variable}"}
        server = {"type": "http", "url": url, "headers": headers}
        return json.dumps({"mcpServers": {"nitro": server}})

    return "\n".join(
        [
            "Claude Code:",
            f'  claude mcp add --transport http nitro {url} --header "Authorization: Bearer '
            f'$(cat {token_file})"',
            "For the clients below, first, in the shell that starts them:",
            f'  export NITRO_MCP_TOKEN="$(cat {token_file})"',
            "Claude Code .mcp.json:",
            "  " + entry("${NITRO_MCP_TOKEN}"),
            "Cursor mcp.json:",
            "  " + entry("${env:NITRO_MCP_TOKEN}"),
            "Codex ~/.codex/config.toml:",
            f'  [mcp_servers.nitro]\n  url = "{url}"\n  bearer_token_env_var = "NITRO_MCP_TOKEN"',
        ]
    )


def start(
    shell: Any, port: int = 0, allow: list[str] | None = None, root: str | None = None
) -> str:
    """Serve the kernel's session on 127.0.0.1:`port` (0: any free port); returns the text to
    print: the URL, where the token is (never the token) and client configuration. Paths the
    tools take stay inside `root` (default: the kernel's working directory) or `allow`."""
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
        worker.quiet_thread()  # the agent reads progress through its tools
        if parent and set_thread_parent is not None:
            set_thread_parent(parent)  # a warning of the agent's run shows here

    if root is not None and not Path(root).is_dir():
        raise UsageError(f"--root {root}: no such directory")
    session = ToolSession(
        namespace=shell.user_ns, before_run=before_run, root=root, allow=allow or ()
    )
    server = HttpServer(session, port=port)
    try:
        server.start()
    except OSError as error:
        raise UsageError(str(error)) from None
    assert server.port is not None  # bound by start
    token_file = token_path(server.port)
    try:
        from nitro.mcp import write_token_file

        write_token_file(token_file, server.token)
    except OSError as error:
        server.stop()
        raise UsageError(f"cannot write the token to {token_file} ({error})") from None
    server.token_file = token_file  # removed when serving stops
    _SERVER[0] = server
    atexit.unregister(_remove_token)
    atexit.register(_remove_token)  # and when the kernel ends while it serves
    places = ", ".join(map(str, session.paths.places))
    return (
        f"nitro: serving this kernel's runs to coding agents at {server.url} (loopback only)\n"
        f"token: in {token_file} (readable by you only; a new one each start)\n"
        f"paths the agent may use: {places}\n\n"
        f"{config_snippets(server.url, token_file)}\n\n"
        f"Runs the agent starts show in `%nitro runs` (their progress: `%nitro panel RUN_ID`); "
        f"`%nitro mcp stop` stops serving."
    )


def _remove_token() -> None:
    """The kernel ends: the token of its server goes with it (a file that names no live
    server would only mislead a client)."""
    server = _SERVER[0]
    if server is not None and server.token_file is not None:
        Path(server.token_file).unlink(missing_ok=True)


def stop() -> str:
    server = _SERVER[0]
    _SERVER[0] = None
    if server is None or not server.running:
        return "nitro: not serving"
    server.stop()
    return f"nitro: stopped serving {server.url}; runs the agent started keep their state"
