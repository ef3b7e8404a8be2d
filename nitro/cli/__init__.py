"""The `nitro` command (docs/command-line.md): `nitro train module:Class` and the other
experiment commands, `nitro runs` and `nitro serve`. Internal: `main` is the entry point.

Modules:

- `commands`: `train`, `validate`, `evaluate`, `predict` and `export`, each on a `nitro.Nitro`
  handle built from its options.
- `options`: the options of an experiment command, generated from the experiment's fields and
  `RUN_KEYWORDS` and read by jsonargparse from the command line and configuration files; the
  resolved configuration written back out (`--print-config`, a run's `config.yaml`).
- `run_table`: `nitro runs`, the runs on disk, and `nitro runs diff`, how two runs differ.
- `__main__`: `python -m nitro.cli`.

Importing this package loads no JAX: `nitro serve`, `nitro runs` and `--help` stay quick.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from nitro.cli.commands import COMMANDS

__all__ = []


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `nitro` command with `argv` (default: the process's arguments); the exit
    status."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        from nitro.cli.commands import run

        return run(argv[0], argv[1:])
    if argv and argv[0] == "runs":
        from nitro.cli.run_table import runs_command

        return runs_command(argv[1:])
    from nitro.serving import serve

    parser = argparse.ArgumentParser(prog="nitro", description="Nitro's command line.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():  # parsed by their own parsers: listed here for --help
        commands.add_parser(command.name, help=command.summary)
    commands.add_parser("runs", help="list the runs on disk; nitro runs diff A B compares two")
    serve_parser = commands.add_parser(
        "serve",
        help="serve exported bundles over the Open Inference Protocol (REST and gRPC)",
        description=serve.DESCRIPTION,
    )
    serve.add_arguments(serve_parser)
    args = parser.parse_args(argv)
    serve.run(args, serve_parser)
    return 0
