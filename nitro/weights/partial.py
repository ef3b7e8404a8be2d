"""`Partial`: weights from a file loaded into part of a run's model (`weights=nitro.Partial(
source, into="backbone")`), the rest as `build_model` initialized it.

At setup the model `build_model` returned gets the sub-tree `into` filled from `source` by
`nitro.weights.load` (PyTorch layouts converted, `key_map` applied); nothing compiles. The
handle's `weights_origin` and the binding report's `weights` section say which leaves came
from the file and which from `build_model`; a model `build_model` filled from a file itself
(`nitro.models.create(pretrained=...)`) is named there too (`origin_in_model`).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Mapping
from typing import Any

from flax import nnx

from nitro.errors import WeightsError, did_you_mean
from nitro.weights.layouts import dotted, model_layout
from nitro.weights.loading import KeyMap, LoadReport, load
from nitro.weights.weight_files import describe_source

__all__ = ["Partial", "PartialLoad", "note_origin", "origin_in_model"]

# where a module's weights came from, by module: kept beside the model, not on it, so that the
# text stays out of the model's graph (which keys the compile cache)
_ORIGINS: weakref.WeakKeyDictionary[nnx.Module, str] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class PartialLoad:
    """What a `Partial` loaded: the report, a sentence for `weights_origin`, and every leaf
    of the model by dotted path -> where it came from."""

    report: LoadReport
    origin: str
    leaves: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class Partial:
    """Weights for part of a run's model: `source` (a path `nitro.weights.read` reads, or a
    dict of arrays) loaded into the sub-module at the dotted path `into` ("backbone",
    "encoder.blocks"; None: the whole model) with `nitro.weights.load`'s `key_map` and
    `strict` (which here concern only the sub-module: the rest of the model always keeps
    its initial values).

    >>> import nitro
    >>> nitro.Partial("convnext.safetensors", into="backbone")
    Partial('convnext.safetensors', into='backbone')
    """

    source: str | os.PathLike | Mapping[str, Any]
    into: str | None = None
    key_map: KeyMap | None = None
    strict: bool = True

    def __post_init__(self):
        if self.into is not None and not isinstance(self.into, str):
            raise WeightsError(
                f"Partial(into={self.into!r}): into is the dotted path of a sub-module of the "
                f"model (e.g. 'backbone'), or None for the whole model"
            )
        if not isinstance(self.source, (str, os.PathLike, Mapping)):
            raise WeightsError(
                f"Partial(source=...) takes a path or a dict of arrays; got "
                f"{type(self.source).__name__}"
            )

    def __repr__(self) -> str:
        source = (
            repr(os.fspath(self.source))
            if not isinstance(self.source, Mapping)
            else (describe_source(self.source))
        )
        shown = [source] + [f"into={self.into!r}"] * (self.into is not None)
        if self.key_map is not None:
            shown.append(f"key_map={self.key_map!r}")
        if not self.strict:
            shown.append("strict=False")
        return f"Partial({', '.join(shown)})"

    def load_into(self, model: nnx.Module) -> PartialLoad:
        """Fill `model`'s sub-module `into` in place; the rest keeps its initial values."""
        target = self._sub_module(model)
        try:
            report = load(self.source, target, key_map=self.key_map, strict=self.strict)
        except WeightsError as error:
            raise WeightsError(f"weights={self!r}: {error}") from None
        prefix = f"{self.into}." if self.into else ""
        where = report.source
        leaves = dict.fromkeys(model_layout(model).leaves, "build_model")
        for path, leaf in report.loaded.items():
            leaves[prefix + path] = f"{where}: {leaf.key} ({leaf.rule})"
        part = f"{self.into} from {where}" if self.into else where
        converted = len(report.converted)
        origin = f"{part} ({len(report.loaded)} leaves, {converted} converted from PyTorch layout"
        origin += f", {len(report.cast)} cast)" if report.cast else ")"
        initial = sum(1 for v in leaves.values() if v == "build_model")
        if initial:
            origin += f"; {initial} leaves from build_model"
        return PartialLoad(report, origin, leaves)

    def _sub_module(self, model: nnx.Module) -> nnx.Module:
        if not self.into:
            return model
        node: Any = model
        walked: list[str] = []
        for part in self.into.split("."):
            children = {str(k): v for k, v in _children(node)}
            if part not in children:
                here = f"{type(model).__name__}.{dotted(walked)}" if walked else "the model"
                modules = sorted(k for k, v in children.items() if isinstance(v, nnx.Module))
                raise WeightsError(
                    f"weights={self!r}: {here} has no sub-module {part!r} (its sub-modules: "
                    f"{', '.join(modules) or 'none'}){did_you_mean(part, modules)}"
                )
            node = children[part]
            walked.append(part)
        if not isinstance(node, nnx.Module):
            raise WeightsError(
                f"weights={self!r}: {self.into!r} is a {type(node).__name__}, not a "
                f"flax.nnx.Module; into names the sub-module the weights fill"
            )
        return node


def note_origin(module: nnx.Module, origin: str) -> None:
    """Say where `module`'s weights came from (`nitro.models.create(pretrained=...)` does); a
    run whose `build_model` returns it, or a model holding it, names it in `weights_origin`."""
    _ORIGINS[module] = origin


def origin_in_model(model: nnx.Module) -> str:
    """The run's `weights_origin` when `build_model` made the weights: "build_model", and the
    file each module of it was filled from where `note_origin` recorded one."""
    found = []
    for path, node in nnx.iter_graph(model):
        hashable = isinstance(node, nnx.Module) and type(node).__hash__ is not None
        origin = _ORIGINS.get(node) if hashable else None  # (nnx.List, nnx.Dict are not)
        if origin is not None:
            found.append(f"{dotted(path) or type(node).__name__} {origin}")
    return "build_model: " + "; ".join(found) if found else "build_model"


def _children(node: Any):
    return nnx.iter_children(node)
