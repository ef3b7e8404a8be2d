"""Several processes: an experiment command as one process of a run across hosts.

`join` calls `jax.distributed.initialize()`, before anything touches a JAX backend, when this
process is one of several: when its options say so (`--coordinator`, `--num-processes`,
`--process-id`, `--local-device-ids`) or its environment does, as JAX's cluster detection
(`jax/_src/clusters`) reads it:

- SLURM: a task of `srun` (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_PROCID, SLURM_LOCALID and
  SLURM_NTASKS, above 1);
- Open MPI: a rank of `mpirun` (OMPI_MCA_orte_hnp_uri, and OMPI_COMM_WORLD_SIZE above 1);
- Kubernetes: a pod of an indexed Job or a JobSet (KUBERNETES_SERVICE_HOST and
  JOB_COMPLETION_INDEX; JAX asks the Kubernetes API for the rest);
- Cloud TPU on GKE: TPU_PROCESS_ADDRESSES or TPU_WORKER_HOSTNAMES naming several hosts (on a
  TPU VM the TPU runtime joins a slice's hosts by itself);
- JAX's own: JAX_COORDINATOR_ADDRESS.

JAX fills in from the environment what the options leave out. Any other process is a run of
its own: it joins nothing and waits for no one, and `--num-processes 1` makes it one whatever
the environment says.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

from nitro.cli.options import CommandError

__all__ = ["OPTIONS", "flags_in", "join", "launcher", "split"]

OPTIONS: tuple[dict[str, Any], ...] = tuple(
    {"flag": flag, "metavar": metavar, "default": argparse.SUPPRESS, "help": doc, **more}
    for flag, metavar, doc, more in [
        (
            "--coordinator",
            "HOST:PORT",
            "process 0's host and a free port, the same in every process of a run across "
            "hosts; else the launcher's (srun, mpirun, Kubernetes, Cloud TPU)",
            {},
        ),
        (
            "--num-processes",
            "N",
            "how many processes the run has; else the launcher's; 1: this process alone, "
            "whatever the environment says",
            {"type": int},
        ),
        (
            "--process-id",
            "I",
            "this process's index, 0 to N-1, else the launcher's; process 0 writes the run's "
            "files and prints its progress",
            {"type": int},
        ),
        (
            "--local-device-ids",
            "IDS",
            "the local devices this process uses, as 0,1; else all of them (one a process "
            "under srun and mpirun on GPUs)",
            {},
        ),
    ]
)

_SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def split(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the process options given, the other arguments)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for spec in OPTIONS:
        parser.add_argument(spec["flag"], type=spec.get("type", str), default=None)
    try:
        given, rest = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as error:
        raise CommandError(str(error)) from None
    return given, rest


def launcher(environ: Mapping[str, str] = os.environ) -> str | None:
    """What started this process as one of several, read from `environ` as JAX's cluster
    detection reads it; None for a process of its own.

    >>> launcher({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]",
    ...           "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"})
    "SLURM's srun (2 tasks)"
    >>> launcher({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}) is None  # a batch script, no srun
    True
    """

    def count(name: str) -> int:
        value = environ.get(name, "")
        return int(value) if value.isdigit() else 0

    if all(name in environ for name in _SLURM) and count("SLURM_NTASKS") > 1:
        return f"SLURM's srun ({count('SLURM_NTASKS')} tasks)"
    if "OMPI_MCA_orte_hnp_uri" in environ and count("OMPI_COMM_WORLD_SIZE") > 1:
        return f"Open MPI's mpirun ({count('OMPI_COMM_WORLD_SIZE')} ranks)"
    if "KUBERNETES_SERVICE_HOST" in environ and "JOB_COMPLETION_INDEX" in environ:
        return 'a Kubernetes indexed Job (JAX reads it with pip install "jax[k8s]")'
    hosts = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES") or ""
    if len(hosts.split(",")) > 1:
        return f"a Cloud TPU slice of {len(hosts.split(','))} hosts"
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return f"JAX_COORDINATOR_ADDRESS={environ['JAX_COORDINATOR_ADDRESS']}"
    return None


def join(
    given: argparse.Namespace, command: str, joins: bool, environ: Mapping[str, str] = os.environ
) -> None:
    """Join the run's other processes (`jax.distributed.initialize`) when this process is one
    of several; refused for a command that runs in one process (`joins` False)."""
    named = flags_in(vars(given))
    if given.num_processes == 1:
        return
    found = launcher(environ)
    if not named and found is None:
        return
    why = f"given {', '.join(named)}" if named else f"started by {found}"
    if not joins:
        raise CommandError(
            f"nitro {command} runs in one process, and this one is one of several ({why}): "
            f"run it once, outside the launcher, or with --num-processes 1"
        )
    coordinator, processes, index = given.coordinator, given.num_processes, given.process_id
    if coordinator is not None and not _host_port(coordinator):
        raise CommandError(
            f"--coordinator {coordinator}: expected HOST:PORT, process 0's host and a free "
            f"port (e.g. 10.0.0.1:1234)"
        )
    if processes is not None and processes < 1:
        raise CommandError(f"--num-processes {processes}: expected a positive count")
    if index is not None and not 0 <= index < (processes or index + 1):
        bound = f"0 to {processes - 1}" if processes else "0 or more"
        raise CommandError(f"--process-id {index}: expected {bound}")
    devices = None
    if given.local_device_ids is not None:
        try:
            devices = [int(i) for i in given.local_device_ids.split(",")]
        except ValueError:
            raise CommandError(
                f"--local-device-ids {given.local_device_ids}: expected device indices "
                f"separated by commas, e.g. 0,1"
            ) from None
    import jax

    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=processes,
            process_id=index,
            local_device_ids=devices,
        )
    except (ValueError, TypeError) as error:
        raise CommandError(
            f"this process is one of several ({why}) but cannot join the others: {error} "
            f"Give --coordinator HOST:PORT, --num-processes N and --process-id I, or start "
            f"the processes with a launcher JAX reads (srun, mpirun, an indexed Kubernetes "
            f"Job)"
        ) from None


def flags_in(values: Mapping[str, Any]) -> list[str]:
    """The process options `values` (the parsed options, by name) hold a value for."""
    return [spec["flag"] for spec in OPTIONS if values.get(_dest(spec)) is not None]


def _dest(spec: Mapping[str, Any]) -> str:
    return spec["flag"].lstrip("-").replace("-", "_")


def _host_port(address: str) -> bool:
    host, colon, port = address.rpartition(":")
    return bool(host) and bool(colon) and port.isdigit()
