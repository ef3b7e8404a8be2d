"""Nitro: a notebook-first training framework for JAX, Flax NNX and Optax.

An experiment is a class plus hooks; `Nitro(e)` sets it up and compiles nothing; `train()`
runs the loop. Programs live in one module-level cache keyed on shapes, GraphConst values and
the code of the hooks, so sweeps, schedules, longer runs and rebuilt handles compile nothing,
and an edit recompiles only the programs it reaches.

Public names load on first use (PEP 562), so `import nitro.bundle` in a serving process
imports JAX and nothing of Flax or Optax.

Packages by layer, bottom-up (docs/architecture.md): `experiments`, `data`, `optim`, `core`,
`programs`, `runs`, `weights`, `models`, `loggers`, `engine`, `serving`, `handle`, `mcp`,
`examples`, `cli` (the `nitro` command). Modules: `errors` (every error raised on purpose), `_version`
(`__version__`), and the public import paths `bundle`, `serve`, `manual`, `staleness`, `events`,
`progress`, `runner`, `dispatch`, `datasets`, `search` and `gallery`, each standing for a module inside a package
(`_public_path`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nitro._version import __version__ as __version__  # the one version (a leaf module)

# public name -> the module that defines it
_EXPORTS = {
    "CacheStats": "nitro.programs.compile_cache",
    "ProgramKind": "nitro.programs.compile_cache",
    "cache_reset": "nitro.programs.compile_cache",
    "cache_stats": "nitro.programs.compile_cache",
    "explain_compiles": "nitro.programs.compile_cache",
    "set_compilation_cache": "nitro.programs.compile_cache",
    "Nitro": "nitro.handle",
    "Population": "nitro.handle",
    "PBT": "nitro.engine.search",
    "Halving": "nitro.engine.search",
    "LRFindResult": "nitro.handle.lr_find",
    "PopulationError": "nitro.errors",
    "Device": "nitro.experiments",
    "FieldKind": "nitro.experiments",
    "GraphConst": "nitro.experiments",
    "experiment": "nitro.experiments",
    "fields": "nitro.experiments",
    "presets": "nitro.experiments",
    "preset_of": "nitro.experiments",
    "CompilationCacheError": "nitro.errors",
    "ExperimentError": "nitro.errors",
    "SetupError": "nitro.errors",
    "DivergenceError": "nitro.errors",
    "MetricError": "nitro.errors",
    "RoutingError": "nitro.errors",
    "ScheduleError": "nitro.errors",
    "HostFieldError": "nitro.errors",
    "RunningError": "nitro.errors",
    "Checkpointer": "nitro.runs.checkpoints",
    "EMA": "nitro.optim.ema",
    "SAM": "nitro.optim.sam",
    "ASAM": "nitro.optim.sam",
    "Precision": "nitro.optim.precision",
    "EarlyStopping": "nitro.runs.early_stopping",
    "ReduceOnPlateau": "nitro.optim.plateau",
    "on_phase": "nitro.core.events",
    "saved_runs": "nitro.runs.run_dirs",
    "run_to_resume": "nitro.runs.resume",
    "Interrupted": "nitro.errors",
    "WeightsError": "nitro.errors",
    "average": "nitro.runs.initial_weights",
    "Partial": "nitro.weights.partial",
    "Hooks": "nitro.experiments.hooks",
    "hooks": "nitro.experiments.hooks",
    "OptimizerError": "nitro.errors",
    "SpikeError": "nitro.errors",
    "Snapshots": "nitro.engine.snapshots",
    "Spike": "nitro.engine.spikes",
}
_SUBMODULES = (
    "data",
    "datasets",
    "dispatch",
    "events",
    "gallery",
    "loggers",
    "models",
    "progress",
    "runner",
    "runs",
    "search",
    "staleness",
    "weights",
)

__all__ = [
    "ASAM",
    "EMA",
    "SAM",
    "CacheStats",
    "Checkpointer",
    "CompilationCacheError",
    "Device",
    "DivergenceError",
    "dispatch",
    "EarlyStopping",
    "ExperimentError",
    "FieldKind",
    "GraphConst",
    "Hooks",
    "HostFieldError",
    "Interrupted",
    "LRFindResult",
    "MetricError",
    "Nitro",
    "ReduceOnPlateau",
    "OptimizerError",
    "Partial",
    "PBT",
    "Halving",
    "Population",
    "PopulationError",
    "Precision",
    "ProgramKind",
    "RoutingError",
    "RunningError",
    "ScheduleError",
    "SetupError",
    "Snapshots",
    "Spike",
    "SpikeError",
    "average",
    "cache_reset",
    "cache_stats",
    "data",
    "datasets",
    "events",
    "experiment",
    "explain_compiles",
    "fields",
    "gallery",
    "hooks",
    "load_ipython_extension",
    "loggers",
    "models",
    "on_phase",
    "preset_of",
    "presets",
    "progress",
    "run_to_resume",
    "runner",
    "runs",
    "saved_runs",
    "search",
    "set_compilation_cache",
    "staleness",
    "unload_ipython_extension",
    "weights",
    "WeightsError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"nitro.{name}")
    else:
        raise AttributeError(f"module 'nitro' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from nitro import data, loggers, models, runs, weights
    from nitro.core import events, progress
    from nitro.core.events import on_phase
    from nitro.data import datasets
    from nitro.engine import dispatch, runner, search
    from nitro.engine.search import PBT, Halving
    from nitro.engine.snapshots import Snapshots
    from nitro.engine.spikes import Spike
    from nitro.errors import (
        CompilationCacheError,
        DivergenceError,
        ExperimentError,
        HostFieldError,
        Interrupted,
        MetricError,
        OptimizerError,
        PopulationError,
        RoutingError,
        RunningError,
        ScheduleError,
        SetupError,
        SpikeError,
        WeightsError,
    )
    from nitro.experiments.declaration import Device, FieldKind, GraphConst, experiment, fields
    from nitro.experiments.hooks import Hooks, hooks
    from nitro.experiments.presets import preset_of, presets
    from nitro.handle import gallery
    from nitro.handle.handle import Nitro
    from nitro.handle.lr_find import LRFindResult
    from nitro.handle.population import Population
    from nitro.optim.ema import EMA
    from nitro.optim.plateau import ReduceOnPlateau
    from nitro.optim.precision import Precision
    from nitro.optim.sam import ASAM, SAM
    from nitro.programs import staleness
    from nitro.programs.compile_cache import (
        CacheStats,
        ProgramKind,
        cache_reset,
        cache_stats,
        explain_compiles,
        set_compilation_cache,
    )
    from nitro.runs.checkpoints import Checkpointer
    from nitro.runs.early_stopping import EarlyStopping
    from nitro.runs.initial_weights import average
    from nitro.runs.resume import run_to_resume
    from nitro.runs.run_dirs import saved_runs
    from nitro.weights.partial import Partial


def load_ipython_extension(ipython) -> None:
    """`%load_ext nitro`: register the %nitro magics (see nitro_ipython)."""
    from nitro_ipython import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from nitro_ipython import unload_ipython_extension as unload

    unload(ipython)
