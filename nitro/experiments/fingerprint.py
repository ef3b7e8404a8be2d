"""Code fingerprints: what a compiled program's Python code depends on, as a digest.

A program's fingerprint walks the hooks it calls and, transitively, the user-defined
functions, methods and classes they reference, the closure cells and defaults they hold, and
the module-level constants they read. Library code (jax, flax, optax, numpy, nitro itself,
anything installed in site-packages or the standard library) is keyed by package version and
not walked, except for the values captured in library closures (so `optax.adam(1e-2)` and
`optax.adam(1e-3)` differ).

Each reached object contributes one *part* (a label such as ``helper mlp_block`` and the
digest of its own code or value), so two fingerprints can be diffed to say exactly what an
edit changed.
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import hashlib
import importlib.metadata
import inspect
import os
import sys
import sysconfig
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "CodeFingerprint",
    "Fingerprinter",
    "callable_token",
    "code_digest",
    "diff_parts",
    "is_function_like",
    "is_library_function",
    "is_library_module",
]

_ARRAY_HASH_LIMIT = 64 * 2**20  # bytes; larger arrays are keyed by shape, dtype and identity


@dataclasses.dataclass(frozen=True)
class CodeFingerprint:
    digest: str
    parts: Mapping[str, str]

    @classmethod
    def combine(cls, *fingerprints: CodeFingerprint) -> CodeFingerprint:
        parts: dict[str, str] = {}
        for fp in fingerprints:
            parts.update(fp.parts)
        return cls(_digest_parts(parts), parts)


def _digest_parts(parts: Mapping[str, str]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for label in sorted(parts):
        h.update(label.encode())
        h.update(b"=")
        h.update(parts[label].encode())
        h.update(b";")
    return h.hexdigest()


def _hash(*chunks: bytes | str) -> str:
    h = hashlib.blake2b(digest_size=12)
    for chunk in chunks:
        h.update(chunk.encode() if isinstance(chunk, str) else chunk)
        h.update(b"\x00")
    return h.hexdigest()


def diff_parts(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """Labels whose digest differs, appeared or disappeared, in a stable order."""
    changed = [k for k in new if old.get(k) != new[k]]
    removed = [k for k in old if k not in new]
    return sorted(changed) + sorted(f"{k} (no longer used)" for k in removed)


# ---------------------------------------------------------------------------------------------
# library detection

_STDLIB_DIRS = tuple(
    os.path.realpath(p)
    for p in {sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")}
    if p
)
_LIBRARY_TOPS_ALWAYS = {"nitro", "nitro_ipython", "builtins"}
_library_cache: dict[str, bool] = {}
_version_cache: dict[str, str] = {}


def _is_library_path(path: str) -> bool:
    path = os.path.realpath(path)
    return (
        f"{os.sep}site-packages{os.sep}" in path
        or f"{os.sep}dist-packages{os.sep}" in path
        or path.startswith(_STDLIB_DIRS)
    )


def is_library_module(module_name: str | None) -> bool:
    """True for code keyed by package version: installed packages, the stdlib and nitro.

    `__main__` (a script, a notebook, or code run in a namespace of that name) is user code.
    """
    if not module_name or module_name == "__main__":
        return False
    top = module_name.partition(".")[0]
    cached = _library_cache.get(top)
    if cached is not None:
        return cached
    if top in _LIBRARY_TOPS_ALWAYS or top in sys.stdlib_module_names:
        result = True
    else:
        path = getattr(sys.modules.get(top), "__file__", None)
        result = path is not None and _is_library_path(path)
    _library_cache[top] = result
    return result


def is_library_function(fn: types.FunctionType) -> bool:
    """Decided by where the code lives, so code run from a cell or `exec` counts as the user's."""
    module = getattr(fn, "__module__", None)
    top = (module or "").partition(".")[0]
    if top in _LIBRARY_TOPS_ALWAYS or top in sys.stdlib_module_names:
        return True
    filename = fn.__code__.co_filename
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    return _is_library_path(filename)


def library_version(module_name: str) -> str:
    top = module_name.partition(".")[0]
    version = _version_cache.get(top)
    if version is None:
        version = getattr(sys.modules.get(top), "__version__", None)
        if not isinstance(version, str):
            try:
                dists = importlib.metadata.packages_distributions().get(top, [top])
                version = importlib.metadata.version(dists[0])
            except Exception:
                version = "unknown"
        _version_cache[top] = version
    return version


# ---------------------------------------------------------------------------------------------
# the walker


def code_digest(code: types.CodeType | Callable) -> str:
    """A digest of what a function's code does, blind to line numbers and file names."""
    if not isinstance(code, types.CodeType):
        code = code.__code__
    return _code_token(code)


def _code_token(code: types.CodeType) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(code.co_code)
    h.update(
        repr(
            (
                code.co_argcount,
                code.co_posonlyargcount,
                code.co_kwonlyargcount,
                code.co_flags,
                code.co_names,
                code.co_varnames,
                code.co_freevars,
                code.co_cellvars,
            )
        ).encode()
    )
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            h.update(_code_token(const).encode())
        else:
            h.update(repr((type(const).__name__, const)).encode())
    return h.hexdigest()


def _code_names(code: types.CodeType) -> set[str]:
    """Every name the code and its nested code objects look up: globals and attributes."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


# the instructions that read a name from the function's globals (`self.scale` is a LOAD_ATTR,
# whose name `co_names` holds too, and never reads the global `scale`)
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> frozenset[str]:
    """The names the code and its nested code objects load as globals."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_LOADS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return frozenset(names)


def _qualname(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)


class Fingerprinter:
    """Walks code and values and collects labelled parts.

    `self_class` is the experiment class: attribute names a hook's code uses that are members
    of it (helper methods, class constants) are walked too, but its other hooks are not, so an
    edit of `build_data` never changes the fingerprint of `forward`.
    """

    def __init__(self, self_class: type | None = None):
        self.self_class = self_class
        self.parts: dict[str, str] = {}
        self.classes: list[type] = []  # user classes reached, in order
        self._memo: dict[int, str] = {}
        self._keepalive: list[Any] = []  # ids stay unique while the walk runs

    # public entry points ---------------------------------------------------------------------

    def hook(self, name: str, fn: Callable) -> str:
        return self._function(fn, label=f"hook {name}")

    def add_class(self, cls: type) -> str:
        """Walk a class (its methods, bases and class constants) as code a program runs."""
        return self._class(cls)

    def value(self, value: Any, label: str) -> str:
        token = self._value(value)
        self.parts[label] = token
        return token

    def fingerprint(self) -> CodeFingerprint:
        return CodeFingerprint(_digest_parts(self.parts), dict(self.parts))

    def structure(self, value: Any) -> str:
        """A content token for a static structure such as an NNX GraphDef.

        Classes inside it are keyed by their code (and add their parts), not their identity,
        so a model class redefined with identical code gives the same token.
        """
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return _hash(
                "struct",
                self._class(type(value)),  # its code: a Linen module inside a bridged model
                *(
                    f"{f.name}:{self.structure(getattr(value, f.name))}"
                    for f in dataclasses.fields(value)
                ),
            )
        if isinstance(value, type):
            return self._class(value)
        if isinstance(value, (tuple, list)):
            return _hash("struct-seq", *(self.structure(v) for v in value))
        if isinstance(value, Mapping):
            return _hash("struct-map", *(f"{k!r}:{self.structure(v)}" for k, v in value.items()))
        if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, functools.partial)):
            return self._value(value)
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return _hash("const", type(value).__name__, repr(value))
        if hasattr(value, "__dict__") and not _is_plain_data(value):
            return _hash(
                "struct-object",
                self._class(type(value)),
                *(f"{k}:{self.structure(v)}" for k, v in sorted(vars(value).items())),
            )
        return _hash("struct-value", type(value).__qualname__, repr(value))

    # functions and classes --------------------------------------------------------------------

    def _function(self, fn: Any, label: str | None = None) -> str:
        fn = inspect.unwrap(fn, stop=lambda f: not hasattr(f, "__wrapped__"))
        key = id(fn)
        if key in self._memo:
            if label is not None and label not in self.parts:
                self.parts[label] = self._memo[key]
            return self._memo[key]
        self._keepalive.append(fn)
        module = getattr(fn, "__module__", None)
        if not isinstance(fn, types.FunctionType):
            token = _hash("callable", str(module), _qualname(fn))
            self._memo[key] = token
            return token
        if is_library_function(fn):
            self._memo[key] = "pending"
            token = _hash(
                "library-function",
                str(module),
                _qualname(fn),
                self._library(str(module)),
                self._closure(fn),
            )
            self._memo[key] = token
            return token
        self._memo[key] = _hash("cycle", _qualname(fn))
        code = fn.__code__
        own = _hash(
            "function",
            _code_token(code),
            self._sequence(fn.__defaults__ or ()),
            self._mapping(fn.__kwdefaults__ or {}),
            self._closure(fn),
        )
        self._memo[key] = own
        self.parts[label or self._label_for_function(fn)] = own
        self._references(fn, code)
        return own

    def _label_for_function(self, fn: types.FunctionType) -> str:
        qualname = fn.__qualname__
        if "." in qualname.replace(".<locals>", ""):
            return f"method {qualname}"
        return f"helper {qualname}"

    def _references(self, fn: types.FunctionType, code: types.CodeType) -> None:
        names = _code_names(code)
        glb = fn.__globals__
        for name in sorted(_global_names(code)):
            if name in glb:
                value = glb[name]
                if isinstance(value, types.ModuleType) and not is_library_module(value.__name__):
                    # `helpers.block(...)`: walk the attributes of a user module that are used
                    for attr in sorted(names):
                        if attr in value.__dict__:
                            self._global(f"{value.__name__}.{attr}", value.__dict__[attr])
                else:
                    self._global(name, value)
        cls = self.self_class
        if cls is not None:
            fields = getattr(cls, "__dataclass_fields__", {})
            for name in sorted(names):
                if name in fields or name.startswith("__"):
                    continue
                try:
                    attr = inspect.getattr_static(cls, name)
                except AttributeError:
                    continue
                self._member(cls, name, attr)

    def _member(self, cls: type, name: str, attr: Any) -> None:
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if isinstance(attr, property):
            for accessor in (attr.fget, attr.fset):
                if accessor is not None:
                    self._function(accessor, label=f"method {cls.__qualname__}.{name}")
            return
        if isinstance(attr, types.FunctionType):
            self._function(attr, label=f"method {cls.__qualname__}.{name}")
            return
        self.parts[f"constant {cls.__qualname__}.{name}"] = self._value(attr)

    def _global(self, name: str, value: Any) -> None:
        token = self._value(value)
        if isinstance(value, types.ModuleType):
            return
        if isinstance(value, types.FunctionType):
            user_code = not is_library_function(value)
        else:
            user_code = isinstance(value, type) and not is_library_module(value.__module__)
        if user_code and getattr(value, "__name__", None) == name.rpartition(".")[2]:
            return  # the object's own part already covers it
        kind = "constant" if not callable(value) or _is_plain_data(value) else "global"
        self.parts[f"{kind} {name}"] = token

    def _class(self, cls: type) -> str:
        key = id(cls)
        if key in self._memo:
            return self._memo[key]
        module = cls.__module__
        if is_library_module(module):
            token = _hash("library-class", module, cls.__qualname__, self._library(module))
            self._memo[key] = token
            return token
        self._keepalive.append(cls)
        self.classes.append(cls)
        self._memo[key] = _hash("cycle-class", cls.__qualname__)
        bases = [self._class(b) for b in cls.__bases__]
        members = []
        for name, attr in sorted(cls.__dict__.items()):
            if name in _SKIPPED_CLASS_ATTRS:
                continue
            members.append(name)
            self._member(cls, name, attr)
        token = _hash("class", cls.__qualname__, *bases, *members)
        self._memo[key] = token
        self.parts[f"class {cls.__qualname__}"] = token
        return token

    def _library(self, module: str) -> str:
        top = module.partition(".")[0]
        version = library_version(top)
        self.parts[f"library {top}"] = version
        return version

    def _closure(self, fn: types.FunctionType) -> str:
        cells = fn.__closure__ or ()
        tokens = []
        for name, cell in zip(fn.__code__.co_freevars, cells, strict=True):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                tokens.append(f"{name}:<empty>")
                continue
            if name == "__class__":
                tokens.append(f"{name}:{_qualname(contents)}")
                continue
            tokens.append(f"{name}:{self._value(contents)}")
        return _hash("closure", *tokens)

    # values -------------------------------------------------------------------------------------

    def _sequence(self, values: Iterable[Any]) -> str:
        return _hash("seq", *(self._value(v) for v in values))

    def _mapping(self, mapping: Mapping[Any, Any]) -> str:
        items = sorted((repr(k), self._value(v)) for k, v in mapping.items())
        return _hash("map", *(f"{k}={v}" for k, v in items))

    def _value(self, value: Any) -> str:
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return _hash("const", type(value).__name__, repr(value))
        if isinstance(value, enum.Enum):
            return _hash("enum", self._class(type(value)), value.name)
        if isinstance(value, types.ModuleType):
            if is_library_module(value.__name__):
                return _hash("module", value.__name__, self._library(value.__name__))
            return _hash("user-module", value.__name__)
        if isinstance(value, type):
            return self._class(value)
        if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
            return self._function(value)
        if isinstance(value, types.MethodType):
            return _hash("method", self._function(value.__func__), self._value(value.__self__))
        if isinstance(value, functools.partial):
            return _hash(
                "partial",
                self._value(value.func),
                self._sequence(value.args),
                self._mapping(value.keywords),
            )
        if isinstance(value, (np.ndarray, np.generic)) or _is_jax_array(value):
            return _array_token(value)
        if isinstance(value, (tuple, list)):
            return _hash(type(value).__qualname__, self._class(type(value)), self._sequence(value))
        if isinstance(value, (set, frozenset)):
            return _hash("set", *sorted(self._value(v) for v in value))
        if isinstance(value, Mapping):
            return _hash("mapping", self._class(type(value)), self._mapping(value))
        if dataclasses.is_dataclass(value):
            return _hash(
                "dataclass",
                self._class(type(value)),
                self._mapping({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}),
            )
        if _stateless_library_object(value):
            # e.g. the descriptor Linen installs on every Module subclass: its class says all
            return _hash("stateless", self._class(type(value)))
        key = id(value)
        if key in self._memo:
            return self._memo[key]
        self._keepalive.append(value)
        # Anything else is keyed by identity: the same live object hits, a rebuilt one misses.
        token = _hash("object", self._class(type(value)), str(id(value)))
        self._memo[key] = token
        return token


_SKIPPED_CLASS_ATTRS = frozenset(
    {
        "__module__",
        "__qualname__",
        "__doc__",
        "__dict__",
        "__weakref__",
        "__annotations__",
        "__dataclass_fields__",
        "__dataclass_params__",
        "__match_args__",
        "__nitro_fields__",
        "__firstlineno__",
        "__static_attributes__",
        "__abstractmethods__",
        "_abc_impl",
        "__slots__",
        "__orig_bases__",
        "__parameters__",
    }
)


def is_function_like(value: Any) -> bool:
    """True for the callables `callable_token` keys without their `==` and `hash`: functions
    and lambdas, builtin functions, `functools.partial` objects, bound methods, and library
    function objects such as `jnp.tanh` or `jax.nn.relu` (a copy of which is a new object)."""
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        return True
    if isinstance(value, types.BuiltinFunctionType):  # `abs`, not `[].append`
        return value.__self__ is None or isinstance(value.__self__, types.ModuleType)
    return (
        callable(value)
        and not isinstance(value, type)
        and hasattr(value, "__wrapped__")
        and is_library_module(type(value).__module__)
    )


def callable_token(value: Callable) -> str:
    """A token for a callable given as a value (a GraphConst function).

    Functions are keyed as hooks are: by their code, defaults and closure values, and the code
    and constants they reference, so two lambdas written alike give the same token and another
    closure value another token. Partials and bound methods add their arguments and `self`.
    Library function objects (`jnp.tanh`) are keyed by identity: the same object each time.

    >>> callable_token(lambda x: x * 2) == callable_token(lambda x: x * 2)
    True
    """
    fingerprinter = Fingerprinter()
    fingerprinter.value(value, "value")
    return fingerprinter.fingerprint().digest


def _stateless_library_object(value: Any) -> bool:
    """An instance of a library class that holds no attributes of its own."""
    cls = type(value)
    if not is_library_module(cls.__module__) or getattr(value, "__dict__", None) != {}:
        return False
    return not any(getattr(c, "__slots__", ()) for c in cls.__mro__)


def _is_plain_data(value: Any) -> bool:
    return isinstance(value, (np.ndarray, np.generic)) or _is_jax_array(value)


def _is_jax_array(value: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(value, jax.Array)


def _array_token(value: Any) -> str:
    try:
        array = np.asarray(value)
    except Exception:  # deleted or non-addressable arrays
        return _hash("array-id", str(id(value)))
    if array.nbytes > _ARRAY_HASH_LIMIT:
        return _hash("big-array", str(array.shape), str(array.dtype), str(id(value)))
    return _hash("array", str(array.shape), str(array.dtype), np.ascontiguousarray(array).tobytes())
