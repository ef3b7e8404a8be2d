"""`python -m nitro.mcp`: the agent tools over stdio, for clients that start their own server.

Experiments are named module-qualified (`nitro.examples.digits.Digits`); the root (`--root`,
default the working directory) is the working directory and importable. Paths the tools take
stay inside the root or an `--allow`ed directory.

The protocol owns stdout, so before anything else runs the server keeps it on a duplicate of
file descriptor 1 and points fd 1 (and `sys.stdout`) at stderr for the rest of the process:
whatever a hook prints, through Python or a C library, lands in stderr with the training
output and never in the protocol stream.
"""

from __future__ import annotations

import argparse
import os
import sys
from io import TextIOWrapper
from typing import BinaryIO

import anyio


def keep_stdout_for_protocol() -> BinaryIO:
    """The original stdout as a binary file for the protocol alone; fd 1 and `sys.stdout`
    write to stderr from now on."""
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = TextIOWrapper(
        os.fdopen(1, "wb", closefd=False), encoding="utf-8", errors="replace", line_buffering=True
    )
    return protocol


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m nitro.mcp",
        description="Serve Nitro's agent tools over stdio (the Model Context Protocol).",
    )
    parser.add_argument(
        "--root",
        help="the directory the tools work in and whose paths they may use (default: the "
        "working directory); it becomes the working directory and is importable",
    )
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="DIR",
        help="another directory the tools may read and write (repeatable)",
    )
    args = parser.parse_args(argv)
    protocol = keep_stdout_for_protocol()
    if args.root is not None:
        root = os.path.abspath(args.root)
        if not os.path.isdir(root):
            parser.error(f"--root {args.root}: no such directory")
        os.chdir(root)
        sys.path.insert(0, root)

    from mcp.server.stdio import stdio_server

    from nitro.mcp.session import ToolSession
    from nitro.mcp.tools import build_server

    server = build_server(ToolSession(allow=args.allow))
    stdout = anyio.wrap_file(TextIOWrapper(protocol, encoding="utf-8"))

    async def serve() -> None:
        async with stdio_server(stdout=stdout) as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())

    anyio.run(serve)


if __name__ == "__main__":
    main()
