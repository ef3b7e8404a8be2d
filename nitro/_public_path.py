"""What a public import path is (`nitro.bundle`, `nitro.dispatch`, ...): a module of its own
that stands for a module inside a package, so that standard tools (pytest's
`--doctest-modules`, type checkers) see a file and its module agree.

Every name is read from the module it stands for, and set there: `nitro.dispatch.PROBE_SHARE =
0.1` changes what the engine reads. A leaf: imports nothing of nitro until it is given the
module.

>>> import nitro.bundle, nitro.serving.bundle
>>> nitro.bundle.load is nitro.serving.bundle.load
True
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, cast

__all__ = ["PublicPath", "stand_for"]


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class _Name:
    """One name of the module stood for, read, set and deleted there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, path: Any, owner: type | None = None) -> Any:
        return self if path is None else getattr(path.__wrapped__, self.name)

    def __set__(self, path: Any, value: Any) -> None:
        setattr(path.__wrapped__, self.name, value)

    def __delete__(self, path: Any) -> None:
        delattr(path.__wrapped__, self.name)


class PublicPath(types.ModuleType):
    """A module that stands for `__wrapped__`: its names are read from it and set in it."""

    __wrapped__: types.ModuleType

    def __getattr__(self, name: str) -> Any:
        if name == "__wrapped__":
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)  # a name the module gained since

    def __setattr__(self, name: str, value: Any) -> None:
        if _dunder(name):
            super().__setattr__(name, value)  # the import system's own
        else:
            setattr(self.__wrapped__, name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self.__wrapped__)) | set(self.__dict__))


def stand_for(name: str, target: str) -> None:
    """Make the module `name` (a public import path, while it is imported) stand for `target`."""
    module = importlib.import_module(target)
    names = {n: _Name() for n in vars(module) if not _dunder(n)}
    path = sys.modules[name]
    path.__class__ = type("PublicPath", (PublicPath,), {"__module__": __name__, **names})
    cast(PublicPath, path).__wrapped__ = module
