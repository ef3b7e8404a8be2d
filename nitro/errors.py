"""Every error the engine raises on purpose, in one leaf module (it imports nothing of nitro),
`did_you_mean`, the hint their messages give for a misspelt name, and `Once`, for a warning
(or a configuration) given once per process.

Each error says what was wrong, where (the field, hook, keyword or split) and how to fix it.
"""

from __future__ import annotations

import difflib
import threading
import warnings
from collections.abc import Iterable

__all__ = [
    "CompilationCacheError",
    "DataWorkerError",
    "DivergenceError",
    "ExperimentError",
    "HostFieldError",
    "Interrupted",
    "MetricError",
    "Once",
    "OptimizerError",
    "PlacementError",
    "PopulationError",
    "RoutingError",
    "RunningError",
    "ScheduleError",
    "SetupError",
    "SpikeError",
    "WeightsError",
    "did_you_mean",
]


class ExperimentError(TypeError):
    """An experiment class or instance is declared or built incorrectly."""


class CompilationCacheError(OSError):
    """The persistent compilation cache directory cannot be created or written."""


class SetupError(ValueError):
    """The experiment, its data or its keywords cannot make a run."""


class WeightsError(SetupError):
    """Weights given to a run (`weights=`) do not fit its model; the message lists the leaves."""


class PopulationError(SetupError):
    """A population's axes would change the program its members share, or ask for what a
    population does not do yet; the message names the field."""


class DataWorkerError(RuntimeError):
    """A prefetch worker process failed to build a batch: the message names the split, the
    batch index and the original exception, which is chained (with the worker's traceback)."""


class DivergenceError(FloatingPointError):
    """Training produced a non-finite loss or gradient; the handle kept the last good weights."""


class SpikeError(DivergenceError):
    """A run's loss spiked more often than `nitro.Spike(max_rollbacks=)` lets it roll back;
    the message names the spike and the batches the roll-backs left out."""


class HostFieldError(AttributeError):
    """A traced hook read a Host field."""


class MetricError(ValueError):
    """A metrics hook returned something that cannot be reduced over a split."""


class RoutingError(TypeError):
    """A hook asks for batch fields a split does not yield, or declares them wrongly."""


class ScheduleError(ValueError):
    """A schedule key binds to nothing, or a schedule's values are unusable."""


class OptimizerError(TypeError):
    """The optimizer setting is not an optax transformation or factory."""


class PlacementError(ValueError):
    """The requested devices, or a batch, do not fit the visible devices."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or a notebook's interrupt) stopped `validate`, `evaluate` or `predict` cleanly:
    every batch was freed, nothing was recorded, and the handle is ready for the next call."""


class RunningError(RuntimeError):
    """The handle is busy (training in the background); the message says how to stop or wait."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """` Did you mean 'a', 'b'?` for the choices close to a misspelt `name`, or nothing.

    >>> did_you_mean("widht", ["width", "scale"])
    " Did you mean 'width'?"
    """
    close = difflib.get_close_matches(name, sorted(choices), n=3, cutoff=0.5)
    return f" Did you mean {', '.join(map(repr, close))}?" if close else ""


class Once:
    """Something done at most once per process, such as a warning; thread-safe.

    `claim()` is True the first time only; `reset()` lets it happen again (tests use it).

    >>> advice = Once()
    >>> advice.claim(), advice.claim()
    (True, False)
    >>> advice.reset()
    >>> advice.claim()
    True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def claim(self) -> bool:
        """True for the first caller; False once claimed."""
        with self._lock:
            first, self._done = not self._done, True
            return first

    def reset(self) -> None:
        with self._lock:
            self._done = False

    def warn(self, message: str, category: type[Warning] = RuntimeWarning, *, module: str) -> bool:
        """Issue the warning the first time only, attributed to Nitro (`module`) rather than
        to the user's line that happened to run; True when it was issued."""
        if not self.claim():
            return False
        warnings.warn_explicit(message, category, filename="nitro", lineno=0, module=module)
        return True
