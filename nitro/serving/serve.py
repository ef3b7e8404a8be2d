"""`nitro serve DIR [DIR ...]` (also `python -m nitro.serve`): serve exported bundles over the
Open Inference Protocol (KServe V2), REST and gRPC, with KServe's model server.

    nitro serve exports/digits exports/mnist --port 8080 --grpc-port 8081

Binds 127.0.0.1 unless `--host` says otherwise. Needs the serve extra:
`pip install 'nitro[serve]'`. See docs/export.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["DESCRIPTION", "add_arguments", "main"]

DESCRIPTION = (
    "Serve exported bundles over the Open Inference Protocol (KServe V2), REST and gRPC, with "
    "KServe's model server. Binds 127.0.0.1 unless --host says otherwise."
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("directories", nargs="+", metavar="DIR", help="bundle directories")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to listen on (default: 127.0.0.1; 0.0.0.0 for every interface)",
    )
    parser.add_argument("--port", type=int, default=8080, help="REST port (default: 8080)")
    parser.add_argument("--grpc-port", type=int, default=8081, help="gRPC port (default: 8081)")
    parser.add_argument("--no-grpc", action="store_true", help="serve REST only")
    parser.add_argument(
        "--max-request-mb",
        type=float,
        default=16.0,
        help="refuse request bodies and gRPC messages over this size (default: 16)",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=1024,
        help="most rows one request, or one batch of requests, may carry (default: 1024)",
    )
    parser.add_argument(
        "--batching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="join concurrent requests for one model into one call (default: on)",
    )
    parser.add_argument(
        "--batch-delay",
        type=float,
        default=0.0,
        metavar="MS",
        help="how long a batch of several requests that is not full waits for more, in "
        "milliseconds (default: 0: requests that arrived during the previous call go at once)",
    )
    parser.add_argument(
        "--device-memory",
        metavar="BYTES",
        help="most bytes of weights held on the device (2GB, 500MB, or a fraction of its "
        "memory such as 0.5); others move in on demand, least recently used out first "
        "(default: no limit)",
    )
    parser.add_argument(
        "--host-memory",
        metavar="BYTES",
        help="most bytes of weights held in host memory (as --device-memory); others are read "
        "again from their bundle's weights file on demand (default: no limit)",
    )
    parser.add_argument(
        "--watch",
        action="store_true",
        help="reload a bundle when it is exported again to its directory",
    )
    parser.add_argument(
        "--trust-code",
        action="store_true",
        help="serve bundles with a postprocess hook, which runs the Python source recorded in "
        "the bundle (its manifest's 'postprocess'); without it such a bundle is refused",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="log level of the server (default: info)",
    )
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m nitro.serve") -> None:
    parser = add_arguments(argparse.ArgumentParser(prog=prog, description=DESCRIPTION))
    run(parser.parse_args(argv), parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from nitro.serving.bundle import BundleError

    try:
        from nitro.serving.server import serve
    except ImportError as error:
        parser.exit(2, f"{parser.prog}: {error}\n")
    try:
        serve(
            args.directories,
            host=args.host,
            port=args.port,
            grpc_port=None if args.no_grpc else args.grpc_port,
            max_request_bytes=int(args.max_request_mb * (1 << 20)),
            max_batch=args.max_batch,
            batching=args.batching,
            batch_delay_ms=args.batch_delay,
            device_memory_budget=args.device_memory,
            host_memory_budget=args.host_memory,
            watch=args.watch,
            log_level=args.log_level,
            trust_code=args.trust_code,
        )
    except (BundleError, ValueError) as error:
        parser.exit(2, f"{parser.prog}: {error}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
