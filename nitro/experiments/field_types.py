"""Field values against their declared types: a wrong value fails where it is given.

`Toy(width="abc")` would otherwise fail deep inside Flax or numpy, far from the field. GraphConst
values are checked against their annotation; Device values must be numbers (or numeric arrays)
whose kind fits the annotation. Host fields are not checked.

>>> import nitro
>>> @nitro.experiment
... class Toy:
...     width: nitro.GraphConst[int] = 128
>>> Toy(width="abc")
Traceback (most recent call last):
...
nitro.errors.ExperimentError: Toy.width is GraphConst[int] but got 'abc' (str); pass an int, \
e.g. Toy(width=128)

Rules for GraphConst: a class is checked with `isinstance`, with the numeric tower of PEP 484
(an int is no bool, a float may be an int; numpy integer and floating scalars count as int and
float); `X | None` allows None; `Literal[...]` its values; a generic container (`tuple[int, ...]`)
its origin (`tuple`). What cannot be checked (a string annotation that does not resolve, a
TypeVar, `Any`) is accepted.
"""

from __future__ import annotations

import builtins
import reprlib
import sys
import types
import typing
from typing import Any, Literal

from nitro.errors import ExperimentError

__all__ = ["buffer_set_type", "check_field_value", "fits_type"]

_UNKNOWN = None  # "cannot tell": the value is accepted

# scalar annotation -> numpy dtype kinds a Device value of that annotation may hold
_DEVICE_KINDS = {bool: "b", int: "iu", float: "iuf", complex: "iufc"}
_NUMERIC_KINDS = "biuf"

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def check_field_value(owner: str, spec: Any, value: Any, *, call: str, namespace=None) -> None:
    """Raise `ExperimentError` when `value` does not fit the GraphConst or Device field `spec`.

    `owner` is the experiment's name, `call` how the value was given (`"Toy"` or
    `"set_device"`, for the example in the message), `namespace` the globals that resolve a
    string annotation.
    """
    kind = spec.kind.value
    if kind not in ("graphconst", "device"):
        return
    declared = _resolve(spec.type, namespace)
    expected = _expected(kind, declared, value)
    if expected is None:
        return
    marker = "GraphConst" if kind == "graphconst" else "Device"
    message = (
        f"{owner}.{spec.name} is {marker}[{_type_name(spec.type)}] but got {_REPR.repr(value)} "
        f"({type(value).__name__}); pass {expected}"
    )
    default = spec.default
    if spec.has_default and not callable(default) and _expected(kind, declared, default) is None:
        message += f", e.g. {call}({spec.name}={_REPR.repr(default)})"
    raise ExperimentError(message)


def fits_type(tp: Any, value: Any, namespace=None) -> bool | None:
    """Whether `value` fits the annotation `tp` by GraphConst's rules: True or False, or None
    when it cannot be told (the command line reads text by it).

    >>> fits_type(tuple[int, ...], (1, 2)), fits_type(int, "8"), fits_type("Model", 1)
    (True, False, None)
    """
    return _matches(_resolve(tp, namespace), value)


def _expected(kind: str, declared: Any, value: Any) -> str | None:
    """None when `value` fits (or fit cannot be told); else what a value should be."""
    if kind == "device":
        return _device_expected(declared, value)
    return None if _matches(declared, value) in (True, _UNKNOWN) else _describe(declared)


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    if typing.get_origin(tp) is None and hasattr(tp, "__name__"):
        return tp.__name__.rpartition(".")[2]  # jax.Array's name is "jaxlib._jax.Array"
    return str(tp).replace("typing.", "")


def _resolve(tp: Any, namespace) -> Any:
    """A string annotation evaluated in the defining module's globals; itself if it fails."""
    if not isinstance(tp, str):
        return tp
    scope = {"__builtins__": builtins, **(namespace or {})}
    try:
        return eval(tp, scope)  # noqa: S307 - the annotation of the user's own class
    except Exception:  # noqa: BLE001 - an unresolvable annotation is not checked
        return tp


# ---------------------------------------------------------------------------------------------
# GraphConst: the annotation itself


def _matches(tp: Any, value: Any) -> bool | None:
    if tp is Any or tp is object or isinstance(tp, (str, typing.TypeVar, typing.ForwardRef)):
        return _UNKNOWN
    if tp is None or tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _matches(typing.get_args(tp)[0], value)
    if origin is typing.Union or origin is types.UnionType:
        verdicts = [_matches(arg, value) for arg in typing.get_args(tp)]
        if True in verdicts:
            return True
        return _UNKNOWN if _UNKNOWN in verdicts else False
    if origin is Literal:
        return any(type(value) is type(v) and value == v for v in typing.get_args(tp))
    if origin is not None:
        tp = origin  # tuple[int, ...] -> tuple, Callable[[int], int] -> Callable
    if not isinstance(tp, type):
        return _UNKNOWN
    return _is_instance(value, tp)


def _is_instance(value: Any, tp: type) -> bool | None:
    np = sys.modules.get("numpy")  # a numpy scalar exists only once numpy is imported
    if tp is bool:
        return isinstance(value, bool) or (np is not None and isinstance(value, np.bool_))
    if tp in (int, float, complex):
        if isinstance(value, bool) or (np is not None and isinstance(value, np.bool_)):
            return False
        allowed = {int: (int,), float: (int, float), complex: (int, float, complex)}[tp]
        if isinstance(value, allowed):
            return True
        if np is not None:
            numpy_kinds = {int: np.integer, float: (np.integer, np.floating), complex: np.number}
            return isinstance(value, numpy_kinds[tp])
        return False
    try:
        return isinstance(value, tp)
    except TypeError:  # a protocol or generic alias isinstance cannot check
        return _UNKNOWN


def _describe(tp: Any) -> str:
    """What a value of `tp` is, for a message: "an int", "a tuple or None", "one of 'a', 'b'"."""
    if tp is None or tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _describe(typing.get_args(tp)[0])
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_describe(arg) for arg in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if origin is not None:
        tp = origin
    name = getattr(tp, "__name__", None) or str(tp)
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


# ---------------------------------------------------------------------------------------------
# Device: a number or numeric array whose kind fits the annotation


def _device_expected(tp: Any, value: Any) -> str | None:
    container = buffer_set_type(tp)
    if container is not None:  # a buffer set: a dict or tuple of numbers or numeric arrays
        parts = _parts(value) if isinstance(value, container) else None
        if parts and all(_numeric_kind(part) is not None for part in parts):
            return None
        return f"a {container.__name__} of numbers or numeric arrays (a buffer set)"
    scalar = _scalar_annotation(tp)
    kinds = _DEVICE_KINDS.get(scalar, _NUMERIC_KINDS)
    expected = _describe(scalar) if scalar is not None else "a number or a numeric array"
    kind = _numeric_kind(value)
    return None if kind is not None and kind in kinds else expected


def buffer_set_type(tp: Any) -> type | None:
    """`dict` or `tuple` for a Device field that holds a buffer set (`Device[dict]`,
    `Device[dict[str, jax.Array]]`, `Device[tuple]`, ...); None for one array."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return buffer_set_type(typing.get_args(tp)[0])
    container = origin or tp
    return container if container in (dict, tuple) else None


def _parts(value: Any) -> list[Any]:
    """A buffer set's parts, nested dicts and tuples walked."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in _parts(v)]
    if isinstance(value, tuple):
        return [p for v in value for p in _parts(v)]
    return [value]


def _scalar_annotation(tp: Any) -> type | None:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _scalar_annotation(typing.get_args(tp)[0])
    return tp if tp in _DEVICE_KINDS else None


def _numeric_kind(value: Any) -> str | None:
    """The numpy dtype kind of a number, numeric array or nested sequence of numbers."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    if isinstance(value, bool):
        return "b"
    if isinstance(value, int):
        return "i"
    if isinstance(value, float):
        return "f"
    if isinstance(value, complex):
        return "c"
    dtype = getattr(value, "dtype", None)
    if dtype is None and not isinstance(value, (list, tuple)):
        return None
    import numpy as np

    try:
        dtype = np.dtype(dtype) if dtype is not None else np.asarray(value).dtype
    except (TypeError, ValueError):
        return None
    if dtype.kind == "V":  # bfloat16 and the other ml_dtypes floats
        jnp = sys.modules.get("jax.numpy")
        if jnp is not None and jnp.issubdtype(dtype, jnp.floating):
            return "f"
    return dtype.kind if dtype.kind in "biufc" else None
