"""The safe reload: applying an edit of a module's file to the live module.

Nitro reloads a module the way `%autoreload` does (`importlib.reload` into an emptied
namespace, so a name the file no longer defines is gone), and the names the notebook imported
from it (`from m import Tiny`) follow the edit. A file that does not compile is never loaded,
and a reload that raises puts back the namespace of the module's last good load: either way
the module is exactly as it was. `code_tokens` fingerprints what a module defines, so two
loads diff into "changed Tiny.loss, scale".

When to reload (a file saved, no run training, autoreload loaded or not) is `code_watcher.py`'s.
"""

from __future__ import annotations

import dis
import importlib
import types
from typing import Any

from nitro.staleness import code_digest

__all__ = ["changed_names", "code_tokens", "reload_module", "syntax_error"]

_SIMPLE = (int, float, complex, str, bytes, bool, type(None), tuple, frozenset)

# What a module keeps across a reload into an emptied namespace (the import system's own names)
_MODULE_ATTRIBUTES = frozenset(
    {"__name__", "__loader__", "__spec__", "__file__", "__package__", "__path__", "__cached__"}
)


def _member_token(member: Any, filename: str) -> str | None:
    """A token for a function written in `filename` or a simple constant; None otherwise
    (functions generated elsewhere, such as a dataclass's __init__, follow from the fields)."""
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    if isinstance(member, property):
        member = member.fget
    if isinstance(member, types.FunctionType):
        if member.__code__.co_filename != filename:
            return None
        return code_digest(member.__code__) + repr(member.__defaults__)[:200]
    if isinstance(member, _SIMPLE):
        return repr(member)[:400]
    return None


def code_tokens(module: types.ModuleType) -> dict[str, str]:
    """Name -> token of every function, method and public constant the module defines, so
    two loads can be diffed into "changed Tiny.loss, scale"."""
    filename = getattr(module, "__file__", None) or ""
    tokens = {}
    for name, value in vars(module).items():
        if isinstance(value, type) and value.__module__ == module.__name__:
            for attr, member in vars(value).items():
                if attr.startswith("_") and not isinstance(member, types.FunctionType):
                    continue
                token = _member_token(member, filename)
                if token is not None:
                    tokens[f"{value.__qualname__}.{attr}"] = token
        elif isinstance(value, types.FunctionType) or not name.startswith("_"):
            token = _member_token(value, filename)
            if token is not None:
                tokens[name] = token
    return tokens


def changed_names(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """What differs between two `code_tokens` of a module (removed names marked so)."""
    names = [k for k in new if old.get(k) != new[k]]
    names += [f"{k} (removed)" for k in old if k not in new]
    return names


def syntax_error(data: bytes, path: str) -> SyntaxError | None:
    """The error that keeps the file's new code from compiling, or None."""
    try:
        compile(data, path, "exec")
    except SyntaxError as error:
        return error
    return None


def reload_module(
    module: types.ModuleType, good: dict[str, Any], user_ns: dict[str, Any], live: bool = False
) -> BaseException | None:
    """Reload `module` and rebind the names `user_ns` imported from it; when the reload
    raises, restore `good` (its namespace after its last good load) and return the error.
    `live`: code of the module runs on other threads (a run trains): reload over the
    namespace, then drop the names the new code does not bind, so no global goes missing."""
    old = dict(vars(module))
    namespace = vars(module)
    if not live:
        namespace.clear()  # a class renamed or deleted in the file is gone from the module too
        namespace.update({k: v for k, v in old.items() if k in _MODULE_ATTRIBUTES})
    try:
        importlib.reload(module)
    except Exception as error:  # noqa: BLE001 - shown to the user, module restored
        _restore(module, good)
        return error
    if live:
        bound = _bound_names(module)
        if bound is not None:
            for name in [k for k in namespace if k not in bound and k not in _MODULE_ATTRIBUTES]:
                if not (name.startswith("__") and name.endswith("__")):
                    del namespace[name]
    _rebind(module, old, user_ns)
    return None


def _bound_names(module: types.ModuleType) -> set[str] | None:
    """The names the module's top-level code binds (None when it cannot tell: a `from m
    import *`, or no source)."""
    spec = getattr(module, "__spec__", None)
    loader = getattr(spec, "loader", None)
    get_code = getattr(loader, "get_code", None)
    try:
        code = get_code(module.__name__) if get_code is not None else None
    except Exception:  # noqa: BLE001 - keep every name rather than guess
        return None
    if code is None:
        return None
    bound = set()
    for instruction in dis.get_instructions(code):
        if instruction.opname == "IMPORT_STAR":
            return None
        if instruction.opname in ("STORE_NAME", "STORE_GLOBAL"):
            bound.add(instruction.argval)
    return bound


def _rebind(module: types.ModuleType, old: dict[str, Any], user_ns: dict[str, Any]) -> None:
    """Names the notebook imported from the module (`from m import Tiny`) follow the edit."""
    defined = {
        id(value): key
        for key, value in old.items()
        if isinstance(value, (type, types.FunctionType))
        and getattr(value, "__module__", None) == module.__name__
    }
    for name, value in list(user_ns.items()):
        key = defined.get(id(value))
        if key is not None and key in vars(module):
            user_ns[name] = vars(module)[key]


def _restore(module: types.ModuleType, namespace: dict[str, Any]) -> None:
    """Put back `namespace` (over the module's, then dropping the names it lacks: no global
    is missing meanwhile)."""
    current = vars(module)
    current.update(namespace)
    for name in [k for k in current if k not in namespace]:
        del current[name]
