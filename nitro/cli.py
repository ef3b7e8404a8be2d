"""The `nitro` command: `nitro serve DIR [DIR ...]` serves exported bundles (docs/export.md)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    from nitro.serving import serve

    parser = argparse.ArgumentParser(prog="nitro", description="Nitro's command line.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_parser = commands.add_parser(
        "serve",
        help="serve exported bundles over the Open Inference Protocol (REST and gRPC)",
        description=serve.DESCRIPTION,
    )
    serve.add_arguments(serve_parser)
    args = parser.parse_args(argv)
    serve.run(args, serve_parser)
