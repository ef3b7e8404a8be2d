"""Loading weights into a Flax NNX model in place (`load`), with the report of what came from
where (`LoadReport`), and saving a model's weights as a PyTorch `state_dict` (`save`).

>>> from flax import nnx
>>> import nitro.weights
>>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
>>> path = nitro.weights.save("linear.safetensors", model)
>>> sorted(nitro.weights.read(path))  # PyTorch's names and layout: weight is (out, in)
['bias', 'weight']
>>> other = nnx.Linear(3, 2, rngs=nnx.Rngs(1))
>>> print(nitro.weights.load(path, other))
loaded 2 leaves from linear.safetensors (1 converted: linear 1)
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from nitro.errors import WeightsError
from nitro.weights.layouts import (
    ALIGN,
    Binding,
    aligned_empty,
    model_layout,
    pytorch_name,
    to_torch,
)
from nitro.weights.weight_files import describe_source, read_views, write_safetensors

__all__ = ["KeyMap", "LoadReport", "LoadedLeaf", "load", "normal_name", "save"]

# regex pairs (pattern, replacement) applied in turn, or a function name -> name | None
KeyMap = Sequence[tuple[str, str]] | Callable[[str], str | None]
SHOWN = 8  # names listed in a message before "... and N more"


class LoadedLeaf(NamedTuple):
    """One leaf of the model filled from the source: the key it came from, the rule that
    converted it (`same` when it was taken as it is), and a cast (`float16 -> float32`)."""

    key: str
    rule: str
    cast: str | None = None


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What `load` did: every leaf of the model loaded (with its source key and rule), left
    at its initial value, and every key of the source that filled nothing."""

    source: str  # the file (or "a dict of N arrays")
    loaded: Mapping[str, LoadedLeaf]  # model leaf path -> where it came from
    left: tuple[str, ...]  # model leaves left at their initial values
    unused: tuple[str, ...]  # source keys that filled no leaf
    # source keys no weight takes: PyTorch's `num_batches_tracked`, a saved model's RNG state
    ignored: tuple[str, ...] = ()

    @property
    def converted(self) -> dict[str, str]:
        """Leaf path -> the rule that converted it from PyTorch's layout."""
        return {path: leaf.rule for path, leaf in self.loaded.items() if leaf.rule != "same"}

    @property
    def cast(self) -> dict[str, str]:
        """Leaf path -> the dtype cast its array took (`float16 -> float32`)."""
        return {path: leaf.cast for path, leaf in self.loaded.items() if leaf.cast}

    def __str__(self) -> str:
        name = Path(self.source).name if os.sep in self.source else self.source
        rules: dict[str, int] = {}
        for rule in self.converted.values():
            rules[rule] = rules.get(rule, 0) + 1
        line = f"loaded {len(self.loaded)} leaves from {name}"
        if rules:
            shown = ", ".join(f"{rule} {count}" for rule, count in sorted(rules.items()))
            line += f" ({len(self.converted)} converted: {shown})"
        if self.cast:
            casts = sorted(set(self.cast.values()))
            line += f"; {len(self.cast)} cast ({', '.join(casts)})"
        if self.left:
            line += f"; {len(self.left)} left at their initial values: {_listed(self.left)}"
        if self.unused:
            line += f"; {len(self.unused)} keys unused: {_listed(self.unused)}"
        return line


def _listed(names: Iterable[str]) -> str:
    names = list(names)
    more = f" ... and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def normal_name(name: str) -> str:
    """A source name as a dotted path: `layers[0]` and `layers/0` read as `layers.0`, and an
    NNX state's trailing `.value` is dropped."""
    name = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", name).replace("/", ".")
    return name.strip(".").removesuffix(".value")


def _mapped_names(keys: Iterable[str], key_map: KeyMap | None, where: str) -> dict[str, str]:
    """Source key -> the name it has after `key_map` (keys it maps to None left out)."""
    keys = list(keys)
    if key_map is None:
        return {key: normal_name(key) for key in keys}
    if callable(key_map):
        names = {}
        for key in keys:
            name = key_map(key)
            if name is not None and not isinstance(name, str):
                raise WeightsError(
                    f"key_map({key!r}) returned {name!r}: a key map function returns the "
                    f"model's name for a key (a str), or None to leave the key out"
                )
            if name is not None:
                names[key] = normal_name(name)
        return names
    pairs = _pairs(key_map)
    names = dict(zip(keys, keys, strict=True))
    for pattern, replacement in pairs:
        if not any(pattern.search(name) for name in names.values()):
            raise WeightsError(
                f"key_map pattern {pattern.pattern!r} matches no key of {where} (its keys: "
                f"{_listed(sorted(names.values()))}); fix the pattern, or list the keys with "
                f"nitro.weights.read(source).keys()"
            )
        names = {key: pattern.sub(replacement, name) for key, name in names.items()}
    return {key: normal_name(name) for key, name in names.items() if name}


def _pairs(key_map: Any) -> list[tuple[re.Pattern, str]]:
    if isinstance(key_map, Mapping):
        key_map = list(key_map.items())
    try:
        pairs = [(re.compile(p), str(r)) for p, r in key_map]
    except (TypeError, ValueError) as error:
        raise WeightsError(
            f"key_map takes regex pairs [(pattern, replacement), ...] applied to the source's "
            f"keys in turn, or a function key -> name | None; got {key_map!r} ({error})"
        ) from error
    return pairs


def _shape(shape: Sequence[int], dtype: Any) -> str:
    from nitro.programs.compile_cache import short_dtype

    return f"{short_dtype(str(np.dtype(dtype)))}[{','.join(map(str, shape))}]"


class _Planned(NamedTuple):
    binding: Binding
    keys: tuple[str, ...]  # the source keys its sources came from


def load(
    source: str | os.PathLike | Mapping[str, Any],
    model: nnx.Module,
    *,
    key_map: KeyMap | None = None,
    strict: bool = True,
) -> LoadReport:
    """Fill `model`'s leaves in place from `source` (a path `nitro.weights.read` reads, or a
    dict of arrays), converting PyTorch layouts to NNX ones by the type of the NNX module that
    holds each leaf (`nitro.weights.layouts`), and return the `LoadReport`.

    Names: the source's keys, after `key_map`, name the model's leaves, in PyTorch's
    spelling (`layers.0.weight` for `layers.0.kernel`, `features.0` for an `nnx.Sequential`'s
    `features.layers.0`) or NNX's own. `key_map` is regex pairs `[(pattern, replacement),
    ...]` applied to every key in turn (each pattern must match some key), or a function key
    -> name, or None to leave the key out.

    `strict=True` refuses a model leaf the source does not fill and a source key that fills
    no leaf (listing them); `strict=False` loads what fits and reports the rest. A shape or
    dtype that does not fit is refused either way, before any leaf is written: a failed load
    leaves the model as it was. Floating-point arrays are cast to the leaf's dtype (the report
    names each cast); integer arrays into floating-point leaves are refused.
    """
    where = describe_source(source)
    if not isinstance(model, nnx.Module):
        raise WeightsError(
            f"nitro.weights.load fills a flax.nnx.Module; got {type(model).__name__} "
            f"(a Linen module: load into the nnx module that bridges it)"
        )
    arrays = read_views(source)
    names = _mapped_names(arrays, key_map, repr(where))
    layout = model_layout(model)
    leaves, offered, ignored, aliases = (
        layout.leaves, layout.offered, layout.ignored, layout.aliases
    )  # fmt: skip
    known = {s for b in offered for s in b.sources} | ignored
    by_alias: dict[str, str | None] = {}
    for name in known:
        short = pytorch_name(name, aliases)
        if short != name:
            by_alias[short] = None if short in by_alias else name
    names = {k: n if n in known else by_alias.get(n) or n for k, n in names.items()}
    available: dict[str, str] = {}  # the binding's name -> source key
    for key, name in names.items():
        available.setdefault(name, key)
    plan: list[_Planned] = []
    filled: set[str] = set()
    for binding in offered:
        if filled.intersection(binding.targets):
            continue
        if all(s in available for s in binding.sources):
            plan.append(_Planned(binding, tuple(available[s] for s in binding.sources)))
            filled.update(binding.targets)
    used = {key for p in plan for key in p.keys}
    unused = tuple(k for k in arrays if k not in used and names.get(k) not in ignored)
    left = tuple(path for path in leaves if path not in filled)
    if not plan:
        raise WeightsError(
            f"no key of {where!r} names a leaf of this {type(model).__name__}: its keys look "
            f"like {_listed(sorted(names.values())[:4])}, the model's leaves like "
            f"{_listed(list(leaves)[:4])}. Map the names with key_map=[(pattern, replacement)]"
            f" (e.g. [(r'^model\\.', '')])"
        )
    if strict and (left or unused):
        raise WeightsError(_strict_message(where, left, unused))
    checked = [_checked(binding, keys, arrays, leaves, where) for binding, keys in plan]
    values = _converted_all(checked)
    loaded = {
        path: LoadedLeaf("+".join(c.keys), c.binding.rule, cast)
        for c in checked
        for path, cast in zip(c.binding.targets, c.casts, strict=True)
    }
    on_devices = [p for p in values if isinstance(leaves[p].get_value(), jax.Array)]
    shardings = [leaves[p].get_value().sharding for p in on_devices]
    # onto the leaves' devices in one batched transfer; on the host, without a copy
    placed = jax.device_put([values[p] for p in on_devices], shardings, may_alias=True)
    values.update(zip(on_devices, placed, strict=True))
    for path, value in values.items():
        leaves[path].set_value(value)
    order = {path: i for i, path in enumerate(leaves)}
    loaded = dict(sorted(loaded.items(), key=lambda item: order[item[0]]))
    dropped = tuple(k for k in arrays if names.get(k) in ignored)
    return LoadReport(where, loaded, left, unused, dropped)


def _strict_message(where: str, left: tuple[str, ...], unused: tuple[str, ...]) -> str:
    parts = []
    if left:
        parts.append(
            f"{len(left)} leaves of the model have no weights in {where!r} and would stay at "
            f"their initial values: {_listed(left)}"
        )
    if unused:
        parts.append(f"{len(unused)} keys of {where!r} fill no leaf: {_listed(unused)}")
    return (
        "; ".join(parts)
        + ". Map the names with key_map=[(pattern, replacement), ...] (or a function), or "
        "pass strict=False to load what fits (the report lists the rest)"
    )


class _Checked(NamedTuple):
    """A binding whose source arrays fit its leaves: their shapes, and each leaf's cast."""

    binding: Binding
    keys: tuple[str, ...]
    sources: list[np.ndarray]
    shapes: list[tuple[int, ...]]
    dtypes: list[np.dtype]
    casts: list[str | None]  # "float16 -> float32", or None


def _checked(
    binding: Binding,
    keys: tuple[str, ...],
    arrays: Mapping[str, np.ndarray],
    leaves: Mapping[str, nnx.Variable],
    where: str,
) -> _Checked:
    """The binding's arrays checked against its leaves, refused when a shape or dtype does
    not fit (before any leaf is written)."""
    targets = [leaves[t].get_value() for t in binding.targets]
    shapes = [tuple(np.shape(t)) for t in targets]
    expected = binding.source_shapes(shapes)
    sources = [arrays[k] for k in keys]
    for key, array, shape in zip(keys, sources, expected, strict=True):
        if tuple(array.shape) != tuple(shape):
            model = ", ".join(
                f"{t!r} {_shape(s, x.dtype)}"
                for t, s, x in zip(binding.targets, shapes, targets, strict=True)
            )
            layout = "" if binding.rule == "same" else f" in PyTorch layout ({binding.rule})"
            raise WeightsError(
                f"shape mismatch: {key!r} of {where!r} is {_shape(array.shape, array.dtype)}, "
                f"but the model's {model} takes {_shape(shape, array.dtype)}{layout}. Build "
                f"the model with the source's sizes, or leave the key out with key_map"
            )
    dtypes = [np.dtype(t.dtype) for t in targets]
    given = sources[0].dtype
    casts = [
        _cast(given, dtype, "+".join(keys), path, where)
        for path, dtype in zip(binding.targets, dtypes, strict=True)
    ]
    return _Checked(binding, keys, sources, shapes, dtypes, casts)


def _cast(given: np.dtype, dtype: np.dtype, key: str, path: str, where: str) -> str | None:
    """The cast an array of dtype `given` takes into a leaf of `dtype` (floating point to
    floating point, integer to integer), or None; refused otherwise."""
    if given == dtype:
        return None
    ints = np.issubdtype(given, np.integer) and np.issubdtype(dtype, np.integer)
    if not (ints or (_floating(given) and _floating(dtype))):
        raise WeightsError(
            f"dtype mismatch: {key!r} of {where!r} is {given}, but the model's {path!r} "
            f"is {dtype}, which does not take it (a cast would change what the values mean). "
            f"Write the file with {dtype} weights, or leave the key out with key_map"
        )
    return f"{given} -> {dtype}"


PARALLEL_BYTES = 1 << 24  # above this, arrays convert on several threads (numpy frees the GIL)


def _converted_all(checked: list[_Checked]) -> dict[str, np.ndarray]:
    """Leaf path -> its array in NNX's layout and the leaf's dtype, contiguous, and always a
    copy: the model never shares memory with the caller's arrays or a mapped file."""

    def convert(c: _Checked) -> list[tuple[str, np.ndarray]]:
        found = []
        converted = c.binding.to_nnx(c.sources, c.shapes)
        for path, value, dtype in zip(c.binding.targets, converted, c.dtypes, strict=True):
            fresh = not any(np.may_share_memory(value, x) for x in c.sources)
            aligned = value.flags.c_contiguous and value.ctypes.data % ALIGN == 0
            if value.dtype != dtype or not (fresh and aligned):
                value, given = aligned_empty(value.shape, dtype), value
                np.copyto(value, given, casting="unsafe")  # a cast `_checked` allowed
            found.append((path, value))
        return found

    size = sum(x.nbytes for c in checked for x in c.sources)
    # half the cores at most: on a machine of few cores, busy with other work, threads that
    # hand the GIL back and forth between many small copies are slower than one
    workers = min(8, (os.cpu_count() or 1) // 2)
    if size < PARALLEL_BYTES or workers <= 1:
        return dict(pair for c in checked for pair in convert(c))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="nitro-weights") as pool:
        return dict(pair for pairs in pool.map(convert, checked) for pair in pairs)


def _floating(dtype: np.dtype) -> bool:
    import jax.numpy as jnp

    return bool(jnp.issubdtype(dtype, jnp.floating))


def save(path: str | os.PathLike, model: nnx.Module) -> Path:
    """Write `model`'s weights to a safetensors file at `path` in PyTorch layout and names
    (`to_torch`); `load` reads them back bitwise. Returns the path."""
    if not isinstance(model, nnx.Module):
        raise WeightsError(f"nitro.weights.save writes a flax.nnx.Module; got {type(model)!r}")
    return write_safetensors(path, to_torch(model))
