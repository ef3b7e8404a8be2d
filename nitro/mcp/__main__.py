"""`python -m nitro.mcp`: the agent tools over stdio, for clients that start their own server.

Experiments are named module-qualified (`nitro.examples.digits.Digits`); the working directory
is importable. Training output goes to stderr (stdout carries the protocol).
"""

from __future__ import annotations

import argparse

import anyio


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m nitro.mcp",
        description="Serve Nitro's agent tools over stdio (the Model Context Protocol).",
    )
    parser.parse_args(argv)

    from mcp.server.stdio import stdio_server

    from nitro.mcp.session import ToolSession
    from nitro.mcp.tools import build_server

    server = build_server(ToolSession())

    async def serve() -> None:
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())

    anyio.run(serve)


if __name__ == "__main__":
    main()
