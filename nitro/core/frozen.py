"""Read-only containers for the records a run decides: `FrozenDict` and `freeze`.

A `RunSetup` holds mappings (splits, hook fields, resolved keywords) that nothing may write
once setup is done. `FrozenDict` is a mapping without mutators that prints, compares and
flattens (as a JAX pytree, with the keys a dict has) like the dict it was made from, so a
report, a log line or a tree of anchor weights reads the same frozen or not.

>>> from nitro.core.frozen import freeze
>>> settings = freeze({"ratios": {"head": 1.0}, "names": ["a", "b"]})
>>> settings
{'ratios': {'head': 1.0}, 'names': ('a', 'b')}
>>> settings["ratios"] == {"head": 1.0}
True
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import jax

__all__ = ["FrozenDict", "freeze"]

K = TypeVar("K")
V = TypeVar("V")


class FrozenDict(Mapping[K, V]):
    """A mapping that cannot be written: made from a mapping (copied) or key-value pairs."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[K, V] | Any = ()):
        object.__setattr__(self, "_items", dict(items))

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(self._items)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a FrozenDict cannot be changed (setting {name!r})")

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))


def freeze(value: Any) -> Any:
    """`value` with its dicts, lists and sets (at any depth) made read-only: `FrozenDict`,
    tuple, frozenset. Other values (arrays, functions, objects) are kept as they are."""
    if isinstance(value, FrozenDict):
        return value
    if type(value) in (dict, types.MappingProxyType):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    if type(value) in (list, tuple):  # not a NamedTuple (an optax transformation, say)
        return tuple(freeze(v) for v in value)
    if type(value) in (set, frozenset):
        return frozenset(value)
    return value


def _flatten(mapping: FrozenDict) -> tuple[list, tuple]:
    keys = sorted(mapping)  # as JAX orders a dict's keys
    return [(jax.tree_util.DictKey(k), mapping[k]) for k in keys], tuple(keys)


jax.tree_util.register_pytree_with_keys(
    FrozenDict,
    _flatten,
    lambda keys, values: FrozenDict(zip(keys, values, strict=True)),
    flatten_func=lambda mapping: (
        [mapping[k] for k in sorted(mapping)],
        tuple(sorted(mapping)),
    ),
)
