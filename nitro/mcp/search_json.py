"""`nitro_population`'s `search` argument: a population's search in JSON, as the engine's.

| JSON | Python |
|---|---|
| `{"random": {"space": {...}, "n": 8, "seed": 0}}` (or `"sobol"`) | `nitro.search.Random(space, n=8, seed=0)` |
| a space entry `{"log_uniform": [1e-4, 1e-1]}`, `{"uniform": [a, b]}`, `{"choice": [...]}`, `{"int_range": [a, b]}` | `nitro.search.log_uniform(1e-4, 1e-1)`, ... |
| `{"pbt": {"every": 2, "quantile": 0.25, "factors": [0.8, 1.2], "seed": 0}}` | `nitro.PBT(every=2, ...)` |
| `{"halving": {"rungs": [1, 2], "keep": 0.5}}` | `nitro.Halving(rungs=[1, 2], keep=0.5)` |
| a list of one of each kind | `search=[Random(...), Halving(...)]` |

>>> search_from_json({"random": {"space": {"learning_rate": {"log_uniform": [1e-4, 1e-1]}}, "n": 2}})
Random({'learning_rate': LogUniform(low=0.0001, high=0.1)}, n=2, seed=0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nitro.errors import PopulationError
from nitro.mcp.lookup import ToolFailure

__all__ = ["search_from_json"]

_DISTRIBUTIONS = ("log_uniform", "uniform", "choice", "int_range")


def search_from_json(value: Any, where: str = "search") -> Any:
    """The engine's search for the JSON `value` (a dict of one kind, or a list of them);
    a `ToolFailure` naming the part of the argument that is wrong."""
    if isinstance(value, list):
        return [search_from_json(part, f"{where}[{i}]") for i, part in enumerate(value)]
    kinds = ("random", "sobol", "pbt", "halving")
    if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in kinds:
        raise ToolFailure(
            f'{where}: give one of {{"random": {{...}}}}, {{"sobol": {{...}}}}, '
            f'{{"pbt": {{...}}}}, {{"halving": {{...}}}}, or a list of a proposal and a '
            f"scheduler; got {value!r}"
        )
    ((kind, settings),) = value.items()
    if not isinstance(settings, Mapping):
        raise ToolFailure(f"{where}.{kind}: give its settings as an object; got {settings!r}")
    from nitro import search
    from nitro.engine.search import PBT, Halving

    try:
        if kind in ("random", "sobol"):
            space = settings.get("space")
            if not isinstance(space, Mapping) or not space:
                raise ToolFailure(
                    f'{where}.{kind}.space: give each name\'s distribution, e.g. {{"learning_rate": '
                    f'{{"log_uniform": [0.0001, 0.1]}}}}; got {space!r}'
                )
            drawn = {
                name: _distribution(f"{where}.{kind}.space.{name}", d) for name, d in space.items()
            }
            rest = {k: v for k, v in settings.items() if k != "space"}
            make = search.Random if kind == "random" else search.Sobol
            return make(drawn, **rest)
        options = dict(settings)
        if "factors" in options and isinstance(options["factors"], list):
            options["factors"] = tuple(options["factors"])
        return PBT(**options) if kind == "pbt" else Halving(**options)
    except (PopulationError, TypeError, ValueError) as error:
        raise ToolFailure(f"{where}.{kind}: {error}") from None


def _distribution(where: str, value: Any) -> Any:
    from nitro import search

    if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in _DISTRIBUTIONS:
        raise ToolFailure(
            f"{where}: give one of {', '.join(_DISTRIBUTIONS)} with its arguments, e.g. "
            f'{{"log_uniform": [0.0001, 0.1]}} or {{"choice": [0, 1]}}; got {value!r}'
        )
    ((name, arguments),) = value.items()
    if not isinstance(arguments, list):
        raise ToolFailure(f"{where}.{name}: give its arguments as a list; got {arguments!r}")
    if name == "choice":
        return search.choice(arguments)
    return getattr(search, name)(*arguments)
