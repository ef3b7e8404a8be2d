"""Ports for the servers the tests start in subprocesses (JAX's distributed coordinator, KServe,
JupyterLab), chosen before the server binds them.

gRPC servers bind with SO_REUSEPORT, so two of them given the same port both start and split
its connections: two test processes (pytest-xdist workers) that each asked the OS for a free
port and got the same one would join each other's distributed runs. Each worker draws from a
range of its own, below Linux's ephemeral ports, so no two workers ever pick the same port;
within a worker the tests run one at a time.
"""

from __future__ import annotations

import os
import random
import socket

FIRST, WIDTH = 20_000, 1_000  # the main process's range; worker gwN's is the (N + 1)th after


def free_port() -> int:
    """A port no other test process picks, free on 127.0.0.1 now."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    start = FIRST + WIDTH * (index % 12)
    for port in random.sample(range(start, start + WIDTH), WIDTH):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}-{start + WIDTH - 1}")
