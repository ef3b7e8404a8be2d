"""Agent tools over the Model Context Protocol: a coding agent drives runs in a live session.

Fifteen tools (`nitro_setup`, `nitro_train`, `nitro_validate`, `nitro_evaluate`,
`nitro_predict`, `nitro_export`, `nitro_runs`, `nitro_status`, `nitro_logger`, `nitro_stop`,
`nitro_population`, `nitro_member`, `nitro_render`, `nitro_rewind`, `nitro_fork`) on the
official MCP SDK (`pip install 'nitro[agents]'`):

- from a shell, `python -m nitro.mcp` serves them over stdio;
- in a notebook, `%nitro mcp start` serves the live kernel's session over streamable HTTP on
  loopback, behind a random bearer token kept in an owner-only file (`HttpServer`,
  `write_token_file`).

Paths the tools take stay inside the session's root and the directories the user allowed.

Modules: `registry` (the runs the tools started), `lookup` (experiments by name, checked
overrides), `json_keywords` (run keywords from JSON), `convert` (JSON in and out), `paths` (where
tools may read and write), `describe` (what status says about a run or a population),
`members` (what only a population has: its members), `search_json` (`nitro_population`'s
`search` in JSON), `rewinds` (`nitro_rewind` and `nitro_fork`), `session` (what each tool does), `tools` (argument schemas and the
MCP server), `http` (the loopback server). Only `registry` loads without the SDK; the rest
load on first use.

>>> from nitro.mcp import ToolSession, HttpServer
>>> server = HttpServer(ToolSession(namespace=globals())).start()   # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "RUNS": "nitro.mcp.registry",
    "RunRegistry": "nitro.mcp.registry",
    "RunRecord": "nitro.mcp.registry",
    "ToolFailure": "nitro.mcp.lookup",
    "ToolSession": "nitro.mcp.session",
    "TOOLS": "nitro.mcp.tools",
    "build_server": "nitro.mcp.tools",
    "HttpServer": "nitro.mcp.http",
    "write_token_file": "nitro.mcp.http",
}

__all__ = [  # sorted(_EXPORTS)
    "HttpServer",
    "RUNS",
    "RunRecord",
    "RunRegistry",
    "TOOLS",
    "ToolFailure",
    "ToolSession",
    "build_server",
    "write_token_file",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nitro.mcp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from nitro.mcp.http import HttpServer, write_token_file
    from nitro.mcp.lookup import ToolFailure
    from nitro.mcp.registry import RUNS, RunRecord, RunRegistry
    from nitro.mcp.session import ToolSession
    from nitro.mcp.tools import TOOLS, build_server
