"""The stripped view of an experiment that traced hooks receive as `self`.

GraphConst fields are plain values (each read is recorded, so a program is keyed only on the
GraphConst fields it actually read), Device fields are the traced arrays passed to the
program, and Host fields raise `HostFieldError`: the tracer never walks a dataset kept on the
experiment. Methods and properties of the experiment class work as usual, bound to the view.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Mapping
from typing import Any

from nitro.errors import HostFieldError
from nitro.experiments.declaration import FieldKind, field_specs

__all__ = ["HostFieldError", "TraceView"]


_SLOTS = ("_nitro_cls", "_nitro_graphconst", "_nitro_device", "_nitro_host", "_nitro_reads")


class TraceView:
    __slots__ = _SLOTS

    def __init__(
        self,
        cls: type,
        graphconst: Mapping[str, Any],
        device: Mapping[str, Any],
        reads: set[str] | None = None,
    ):
        host = frozenset(s.name for s in field_specs(cls) if s.kind is FieldKind.HOST)
        object.__setattr__(self, "_nitro_cls", cls)
        object.__setattr__(self, "_nitro_graphconst", dict(graphconst))
        object.__setattr__(self, "_nitro_device", dict(device))
        object.__setattr__(self, "_nitro_host", host)
        object.__setattr__(self, "_nitro_reads", reads if reads is not None else set())

    def __getattr__(self, name: str) -> Any:
        graphconst = self._nitro_graphconst
        if name in graphconst:
            self._nitro_reads.add(name)
            return graphconst[name]
        if name in self._nitro_device:
            return self._nitro_device[name]
        cls = self._nitro_cls
        if name in self._nitro_host:
            raise HostFieldError(
                f"`self.{name}` is a Host field of {cls.__qualname__}: traced hooks "
                f"(forward, loss, device metrics) cannot read it, because the tracer never sees "
                f"Host values. Mark it `GraphConst[...]` if it shapes the program (changing it "
                f"recompiles) or `Device[...]` if it is a number or array that may change "
                f"without recompiling."
            )
        try:
            attr = inspect.getattr_static(cls, name)
        except AttributeError:
            raise AttributeError(
                f"{cls.__qualname__} has no attribute {name!r} (inside a traced hook)"
            ) from None
        if isinstance(attr, staticmethod):
            return attr.__func__
        if isinstance(attr, classmethod):
            return types.MethodType(attr.__func__, cls)
        if isinstance(attr, property):
            return attr.__get__(self, cls)
        if isinstance(attr, types.FunctionType):
            return types.MethodType(attr, self)
        if hasattr(attr, "__get__") and not isinstance(attr, type):
            return attr.__get__(self, cls)
        return attr

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"traced hooks cannot assign `self.{name}`: the experiment is read-only inside a "
            f"compiled program. Return the value from the hook instead."
        )

    def __repr__(self) -> str:
        return f"<traced view of {self._nitro_cls.__qualname__}>"

    @property
    def graphconst_reads(self) -> frozenset[str]:
        return frozenset(self._nitro_reads)
