"""Nitro: a notebook-first training framework for JAX, Flax NNX and Optax.

An experiment is a class plus hooks; `Nitro(e)` sets it up and compiles nothing; `train()`
runs the loop. Programs live in one module-level cache keyed on shapes, GraphConst values and
the code of the hooks, so sweeps, schedules, longer runs and rebuilt handles compile nothing,
and an edit recompiles only the programs it reaches.
"""

from . import data, datasets
from .compile_cache import (
    CacheStats,
    ProgramKind,
    cache_reset,
    cache_stats,
    explain_compiles,
    set_compilation_cache,
)
from .experiment import Device, ExperimentError, FieldKind, GraphConst, experiment, fields
from .handle import Nitro, SetupError
from .loop import DivergenceError
from .metrics import MetricError
from .routing import RoutingError
from .schedules import ScheduleError
from .trace_view import HostFieldError

__version__ = "0.1.0"

__all__ = [
    "CacheStats",
    "Device",
    "DivergenceError",
    "ExperimentError",
    "FieldKind",
    "GraphConst",
    "HostFieldError",
    "MetricError",
    "Nitro",
    "ProgramKind",
    "RoutingError",
    "ScheduleError",
    "SetupError",
    "cache_reset",
    "cache_stats",
    "data",
    "datasets",
    "experiment",
    "explain_compiles",
    "fields",
    "load_ipython_extension",
    "set_compilation_cache",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython) -> None:
    """`%load_ext nitro`: register the %nitro magics (see nitro_ipython)."""
    from nitro_ipython import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from nitro_ipython import unload_ipython_extension as unload

    unload(ipython)
