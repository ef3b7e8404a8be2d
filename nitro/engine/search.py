"""Search inside one population: what a user declares (`nitro.search`).

- Spaces over fed values: `log_uniform(a, b)`, `uniform(a, b)`, `choice([...])` and
  `int_range(a, b)`, each a map from a number in [0, 1) to a value.
- Proposers fill a population's members: `Random(space, n=, seed=)` draws `n` points from
  `numpy.random.default_rng(seed)`, `Sobol(space, n=, seed=)` takes them from a scrambled Sobol
  sequence (`scipy.stats.qmc`). Each is a sequence of member settings, so
  `Population(e, search=Random(...))` and `Population(e, members=Random(...))` are one thing.
- Schedulers act while the population trains: `PBT` (population-based training: the worst
  members take the state of the best and perturb their fed values) and `Halving` (successive
  halving: the worst members stop and the population shrinks to the others, one compile per
  rung). What they do at their boundaries is `nitro.engine.population_search`.

A space's keys are what a population's members may vary (the run keywords fed to the step,
the Device fields): the population checks them against the experiment and names the key it
refuses.

>>> from nitro import search
>>> space = {"learning_rate": search.log_uniform(1e-4, 1e-1), "scale": search.choice([0.5, 1.0])}
>>> members = search.Random(space, n=3, seed=0)
>>> len(members), sorted(members[0])
(3, ['learning_rate', 'scale'])
>>> members.members == search.Random(space, n=3, seed=0).members   # from its seed
True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from nitro.errors import PopulationError

__all__ = [
    "PBT",
    "Choice",
    "Halving",
    "IntRange",
    "LogUniform",
    "Random",
    "Sobol",
    "Uniform",
    "choice",
    "int_range",
    "log_uniform",
    "uniform",
]


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class LogUniform:
    """Values between `low` and `high` whose logarithm is uniform (learning rates, decays)."""

    low: float
    high: float

    def __post_init__(self) -> None:
        low, high = _number("low", self.low), _number("high", self.high)
        if not 0 < low < high:
            raise ValueError(
                f"log_uniform({self.low!r}, {self.high!r}): give 0 < low < high "
                f"(log_uniform(1e-4, 1e-1), say)"
            )

    def at(self, u: float) -> float:
        return float(math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low))))


@dataclasses.dataclass(frozen=True)
class Uniform:
    """Values between `low` and `high`, uniformly."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not _number("low", self.low) < _number("high", self.high):
            raise ValueError(f"uniform({self.low!r}, {self.high!r}): give low < high")

    def at(self, u: float) -> float:
        return float(self.low + u * (self.high - self.low))


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of `values`, each as likely."""

    values: tuple[Any, ...]

    def __post_init__(self) -> None:
        if isinstance(self.values, (str, bytes)) or not len(self.values):
            raise ValueError(f"choice({self.values!r}): give a non-empty list of values")

    def at(self, u: float) -> Any:
        return self.values[min(int(u * len(self.values)), len(self.values) - 1)]


@dataclasses.dataclass(frozen=True)
class IntRange:
    """Integers from `low` to `high`, both included (seeds, counts)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        for name, value in (("low", self.low), ("high", self.high)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"int_range: {name} must be an int, got {value!r}")
        if self.low > self.high:
            raise ValueError(f"int_range({self.low}, {self.high}): give low <= high")

    def at(self, u: float) -> int:
        return min(self.low + int(u * (self.high - self.low + 1)), self.high)


Distribution = LogUniform | Uniform | Choice | IntRange


def log_uniform(low: float, high: float) -> LogUniform:
    """Between `low` and `high`, uniform in the logarithm: `log_uniform(1e-4, 1e-1)`."""
    return LogUniform(low, high)


def uniform(low: float, high: float) -> Uniform:
    """Between `low` and `high`, uniformly."""
    return Uniform(low, high)


def choice(values: Sequence[Any]) -> Choice:
    """One of `values`: `choice([0.5, 1.0, 2.0])`."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"choice({values!r}): give a list of values, choice([0.5, 1.0])")
    return Choice(tuple(values))


def int_range(low: int, high: int) -> IntRange:
    """An integer from `low` to `high`, both included: `int_range(0, 9)`."""
    return IntRange(low, high)


def _space(space: Any, who: str) -> dict[str, Distribution]:
    """`space` checked: names -> distributions (a list stands for `choice(list)`)."""
    if not isinstance(space, Mapping) or not space:
        raise PopulationError(
            f"{who}(space): give a dict of names to distributions, "
            f"{{'learning_rate': nitro.search.log_uniform(1e-4, 1e-1)}}; got {space!r}"
        )
    checked: dict[str, Distribution] = {}
    for key, value in space.items():
        if isinstance(value, list):
            value = choice(value)
        if not isinstance(value, (LogUniform, Uniform, Choice, IntRange)):
            raise PopulationError(
                f"{who} space[{key!r}] = {value!r} is not a distribution: give "
                f"nitro.search.log_uniform(a, b), uniform(a, b), choice([...]) or "
                f"int_range(a, b); a value every member shares is a keyword of Population "
                f"({key}={value!r})"
            )
        checked[str(key)] = value
    return checked


def _count(n: Any, who: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PopulationError(f"{who}(n={n!r}): give the number of members, a positive int")
    return n


class Proposal(Sequence[dict[str, Any]]):
    """Members drawn from a space: a sequence of their settings."""

    kind = ""

    def __init__(self, space: Mapping[str, Any], n: int, seed: int = 0):
        self.space = _space(space, self.kind)
        self.n = _count(n, self.kind)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise PopulationError(f"{self.kind}(seed={seed!r}): give an int")
        self.seed = seed
        units = self._units()
        self.members = [
            {key: dist.at(float(u)) for (key, dist), u in zip(self.space.items(), row, strict=True)}
            for row in units
        ]

    def _units(self) -> np.ndarray:
        """`[n, keys]` numbers in [0, 1)."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, index: Any) -> Any:
        return self.members[index]

    def __repr__(self) -> str:
        return f"{self.kind}({self.space!r}, n={self.n}, seed={self.seed})"


class Random(Proposal):
    """`n` members, each key drawn independently from its distribution, reproducible from
    `seed` (`numpy.random.default_rng(seed)`)."""

    kind = "Random"

    def _units(self) -> np.ndarray:
        return np.random.default_rng(self.seed).random((self.n, len(self.space)))


class Sobol(Proposal):
    """`n` members from a scrambled Sobol sequence over the space (`scipy.stats.qmc.Sobol`):
    they cover it more evenly than random draws; `n` a power of two keeps its balance."""

    kind = "Sobol"

    def _units(self) -> np.ndarray:
        try:
            from scipy.stats import qmc
        except ImportError:  # pragma: no cover - scipy comes with nitro[search]
            raise PopulationError(
                "nitro.search.Sobol needs scipy: pip install 'nitro[search]'"
            ) from None
        import warnings

        with warnings.catch_warnings():  # n not a power of two: said in the docstring
            warnings.simplefilter("ignore", UserWarning)
            sobol = qmc.Sobol(
                d=len(self.space), scramble=True, rng=np.random.default_rng(self.seed)
            )
            return sobol.random(self.n)


# ---------------------------------------------------------------------------------------------
# schedulers


def _unit(unit: Any, who: str) -> str:
    if unit not in ("epochs", "steps"):
        raise PopulationError(f"{who}(unit={unit!r}): give 'epochs' or 'steps'")
    return unit


def _mode(mode: Any, who: str) -> None:
    if mode not in (None, "min", "max"):
        raise PopulationError(f"{who}(mode={mode!r}): give 'min', 'max' or None (by the name)")


Perturb = Mapping[str, "tuple[float, ...] | Callable[[Any, np.random.Generator], Any]"]


@dataclasses.dataclass(frozen=True)
class PBT:
    """Population-based training: every `every` epochs (or steps, `unit="steps"`), the
    members in the worst `quantile` by `metric` take the variables (weights, optimizer state,
    moving average, loss scale) of members drawn from the best `quantile`, and their fed
    values perturbed: each name of `perturb` multiplied by one of `factors`, drawn at random,
    or given to a rule of its own, `perturb={"learning_rate": (0.5, 2.0), "scale": lambda
    value, rng: ...}`. `perturb=None`: the fed values the members differ in (the population's
    axes), else the learning rate. Draws are reproducible from `seed`.

    `metric`: by default `val_loss` (the epoch's row) with `unit="epochs"`, and the mean
    training loss since the previous boundary (`"loss"`) with `unit="steps"`.
    """

    every: float = 1
    unit: str = "epochs"
    quantile: float = 0.25
    perturb: Perturb | Sequence[str] | None = None
    factors: tuple[float, ...] = (0.8, 1.2)
    metric: str | None = None
    mode: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        every = self.every
        if isinstance(every, bool) or not isinstance(every, (int, float)) or not every >= 1:
            raise PopulationError(
                f"PBT(every={every!r}): give a whole number of epochs (or steps, unit='steps'), "
                f"at least 1; every=float('inf') never exploits"
            )
        if math.isfinite(every) and every != int(every):
            raise PopulationError(f"PBT(every={every!r}): give a whole number")
        _unit(self.unit, "PBT")
        _mode(self.mode, "PBT")
        if not 0 < self.quantile <= 0.5:
            raise PopulationError(
                f"PBT(quantile={self.quantile!r}): give a share in (0, 0.5], the worst "
                f"quantile copying the best (0.25: the worst quarter takes the best quarter's)"
            )
        factors = tuple(self.factors)
        if not factors or not all(_number("factors", f) > 0 for f in factors):
            raise PopulationError(f"PBT(factors={self.factors!r}): give positive numbers")
        object.__setattr__(self, "factors", factors)
        if isinstance(self.perturb, str):
            raise PopulationError(
                f"PBT(perturb={self.perturb!r}): give a list of names, or a dict of names to "
                f"factors or rules"
            )
        for name, rule in self.rules().items():
            if not callable(rule) and not (
                isinstance(rule, (tuple, list)) and rule and all(_number(name, f) > 0 for f in rule)
            ):
                raise PopulationError(
                    f"PBT(perturb={{{name!r}: {rule!r}}}): give factors, (0.8, 1.2), or a rule "
                    f"(value, rng) -> new value"
                )

    def rules(self) -> dict[str, Any]:
        """Name -> factors or a rule, as given (empty: the default names)."""
        if self.perturb is None:
            return {}
        if isinstance(self.perturb, Mapping):
            return dict(self.perturb)
        return {str(name): self.factors for name in self.perturb}

    @property
    def interval(self) -> int | None:
        """Epochs (or steps) between two boundaries; None: never."""
        return int(self.every) if math.isfinite(self.every) else None


@dataclasses.dataclass(frozen=True)
class Halving:
    """Successive halving: at each rung (epochs trained, or steps with `unit="steps"`), the
    members still training are ranked by `metric` and the best `keep` share of them (at least
    one) train on; the others stop, and the population shrinks to the kept ones: their
    variables are gathered along the member axis and the program compiles once for the
    smaller count, so the stopped members cost nothing from then on.

    >>> Halving(rungs=[1, 2, 3]).sizes(16)      # 16 -> 8 -> 4 -> 2
    [16, 8, 4, 2]
    """

    rungs: Sequence[int] = (1,)
    keep: float = 0.5
    unit: str = "epochs"
    metric: str | None = None
    mode: str | None = None

    def __post_init__(self) -> None:
        rungs = tuple(self.rungs) if isinstance(self.rungs, (list, tuple)) else None
        if (
            not rungs
            or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in rungs)
            or list(rungs) != sorted(set(rungs))
        ):
            raise PopulationError(
                f"Halving(rungs={self.rungs!r}): give increasing positive ints, the epochs (or "
                f"steps, unit='steps') at which the population halves: rungs=[1, 2, 3]"
            )
        object.__setattr__(self, "rungs", rungs)
        if not 0 < self.keep < 1:
            raise PopulationError(
                f"Halving(keep={self.keep!r}): give the share kept at each rung, in (0, 1)"
            )
        _unit(self.unit, "Halving")
        _mode(self.mode, "Halving")

    def kept(self, count: int) -> int:
        """How many of `count` members train on after a rung."""
        return max(1, math.ceil(count * self.keep - 1e-9))

    def sizes(self, count: int) -> list[int]:
        """The population's sizes: at the start and after each rung."""
        sizes = [count]
        for _ in self.rungs:
            sizes.append(self.kept(sizes[-1]))
        return sizes


Scheduler = PBT | Halving


def split_search(search: Any) -> tuple[Proposal | None, Scheduler | None]:
    """`Population(search=)`: members drawn from a space (`Random`, `Sobol`), a scheduler
    (`PBT`, `Halving`), or one of each (`[Random(...), Halving(...)]`: Hyperband's bracket)."""
    parts = list(search) if isinstance(search, (list, tuple)) else [search]
    proposals = [p for p in parts if isinstance(p, Proposal)]
    schedulers = [p for p in parts if isinstance(p, (PBT, Halving))]
    others = [p for p in parts if p is not None and p not in proposals and p not in schedulers]
    if others or len(proposals) > 1 or len(schedulers) > 1:
        raise PopulationError(
            f"search={search!r}: give nitro.search.Random(...) or Sobol(...) (the members), "
            f"nitro.PBT(...) or nitro.Halving(...) (what happens while they train), or one of "
            f"each in a list: search=[nitro.search.Random(space, n=16), nitro.Halving(rungs=[1, 2, 3])]"
        )
    return (proposals[0] if proposals else None), (schedulers[0] if schedulers else None)
