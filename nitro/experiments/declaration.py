"""Experiments: a dataclass plus hooks, with each field marked GraphConst, Device or Host.

```python
@nitro.experiment
class Digits:
    width: GraphConst[int] = 128      # bakes into the compiled program
    scale: Device[float] = 1.0        # a traced input: changing it never recompiles
    batch_size: int = 128             # Host: read by the driver, never by the tracer
```
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import enum
import functools
import html
import inspect
import itertools
import linecache
import re
import sys
import textwrap
import types
import typing
from typing import Annotated, Any

from nitro.errors import ExperimentError
from nitro.experiments.field_types import check_field_value
from nitro.experiments.fingerprint import is_function_like

__all__ = [
    "Device",
    "FieldKind",
    "FieldSpec",
    "GraphConst",
    "ExperimentError",
    "experiment",
    "fields",
    "field_specs",
    "is_experiment",
    "REQUIRED_HOOKS",
    "DRIVER_ONLY_NAMES",
]


class FieldKind(enum.StrEnum):
    GRAPHCONST = "graphconst"
    DEVICE = "device"
    HOST = "host"

    def __str__(self) -> str:
        return self.value


if typing.TYPE_CHECKING:
    # What a type checker sees: `GraphConst[int]` is an `int`, as the Annotated type that
    # `GraphConst[int]` makes at run time.
    _T = typing.TypeVar("_T")
    GraphConst: typing.TypeAlias = Annotated[_T, FieldKind.GRAPHCONST]
    Device: typing.TypeAlias = Annotated[_T, FieldKind.DEVICE]
else:

    class GraphConst:
        """`GraphConst[T]`: a value baked into every compiled program that reads it.

        It keys the compile cache: changing it recompiles exactly the programs that read it.
        """

        def __class_getitem__(cls, tp):
            return Annotated[tp, FieldKind.GRAPHCONST]

    class Device:
        """`Device[T]`: a numeric value passed to compiled programs as a traced input.

        Changing it (sweeps, schedules, `Nitro.set_device`) never recompiles.
        """

        def __class_getitem__(cls, tp):
            return Annotated[tp, FieldKind.DEVICE]


REQUIRED_HOOKS = ("build_data", "build_model", "forward", "loss")

# Names the driver reads; baking one into a program would recompile per seed, per run length...
DRIVER_ONLY_NAMES = frozenset(
    {
        "seed",
        "max_epochs",
        "max_steps",
        "val_every_steps",
        "eval_splits",
        "run_dir",
        "n_devs",
        "logger",
        "checkpointer",
        "early_stop",
        "resume",
        "schedules",
        "learning_rate",
        "optimizer",
        "check_divergence",
        "freeze_batch_stats",
        "prefetch_workers",
        "device_batches",
        "host_batches",
        "ordered",
        "prefetch",
        "progress",
        "steps_per_dispatch",
        "accum",
        "ema",
        "sam",
    }
)


_NO_DEFAULT = dataclasses.MISSING

# Methods every experiment class gets (unless it defines its own), registered by the modules
# built on this one when they load (`nitro.experiments` loads them): "from_preset".
CLASS_METHODS: dict[str, Any] = {}


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    name: str
    type: Any
    default: Any
    kind: FieldKind
    doc: str

    @property
    def has_default(self) -> bool:
        return self.default is not _NO_DEFAULT


def _kind_of(annotation: Any) -> tuple[FieldKind, Any]:
    """Split an annotation into (kind, underlying type)."""
    if typing.get_origin(annotation) is Annotated:
        base, *extras = typing.get_args(annotation)
        for extra in extras:
            if isinstance(extra, FieldKind):
                return extra, base
        return FieldKind.HOST, annotation
    if isinstance(annotation, str):
        text = annotation.replace(" ", "")
        for prefix, kind in (("GraphConst[", FieldKind.GRAPHCONST), ("Device[", FieldKind.DEVICE)):
            for qualified in (prefix, "nitro." + prefix):
                if text.startswith(qualified) and text.endswith("]"):
                    return kind, text[len(qualified) : -1]
    return FieldKind.HOST, annotation


def _resolved_annotations(cls) -> dict[str, Any]:
    raw = {}
    for klass in reversed(cls.__mro__):
        raw.update(klass.__dict__.get("__annotations__", {}))
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:  # unresolvable forward references: fall back to the raw strings
        hints = {}
    return {name: hints.get(name, ann) for name, ann in raw.items()}


def _class_node(klass: type) -> ast.ClassDef | None:
    """The class statement that defined `klass`, from its module's source or, for a class
    defined in a notebook cell (whose module `__main__` has no file), from the cell's source,
    which IPython keeps in `linecache`."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)), None)
    except (OSError, TypeError, SyntaxError, IndentationError):
        pass
    # The class's own methods name the file and the lines its body spans. (Methods that
    # dataclasses generated or wrapped name other files, which hold no such class.)
    prefix = f"{klass.__qualname__}."
    lines_by_file: dict[str, set[int]] = {}
    for value in vars(klass).values():
        function = getattr(value, "__func__", getattr(value, "fget", value))
        code = getattr(function, "__code__", None)
        if code is not None and getattr(function, "__qualname__", "").startswith(prefix):
            lines_by_file.setdefault(code.co_filename, set()).add(code.co_firstlineno)
    for filename, firstlines in lines_by_file.items():
        try:
            tree = ast.parse("".join(linecache.getlines(filename)))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == klass.__name__:
                starts = {
                    min([n.lineno, *(d.lineno for d in n.decorator_list)])
                    for n in node.body
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                }
                if firstlines <= starts:
                    return node
    return None


def _field_docs(cls) -> dict[str, str]:
    """Attribute docstrings: a string literal on the line after a field, as Sphinx reads them."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        node = _class_node(klass)
        body = node.body if node is not None else []
        for node, following in itertools.pairwise([*body, None]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _check_hashable_by_content(owner: str, name: str, value: Any) -> None:
    if is_function_like(value) and not isinstance(value, types.MethodType):
        return  # the compile cache keys functions by their code and closure, as hooks
    fix = (
        f"GraphConst values key the compile cache, so they must hash by content. "
        f"Use an immutable value (a tuple instead of a list, a frozen dataclass), or mark "
        f"`{name}` as Device (numeric, traced) or leave it unmarked (Host)."
    )
    try:
        h = hash(value)
    except TypeError:
        raise ExperimentError(
            f"{owner}.{name} is GraphConst but its value {value!r} of type "
            f"{type(value).__name__} is not hashable. {fix}"
        ) from None
    try:
        twin = copy.deepcopy(value)
        same = hash(twin) == h and bool(twin == value)
    except Exception:
        same = False
    if not same:
        raise ExperimentError(
            f"{owner}.{name} is GraphConst but its value of type {type(value).__name__} hashes "
            f"by identity, not content (a copy of it hashes differently). {fix}"
        )


_Class = typing.TypeVar("_Class")


@typing.overload
def experiment(cls: type[_Class], /) -> type[_Class]: ...
@typing.overload
def experiment(
    cls: None = None, /, **dataclass_options: Any
) -> typing.Callable[[type[_Class]], type[_Class]]: ...


# a type checker then knows the keyword-only __init__ that dataclass() writes
@typing.dataclass_transform(kw_only_default=True, eq_default=True)
def experiment(cls=None, /, **dataclass_options):
    """Declare an experiment: a keyword-only dataclass whose fields are GraphConst, Device or Host.

    Four hooks are required (`build_data`, `build_model`, `forward`, `loss`); every other
    behaviour has a default. `nitro.fields(cls)` lists the fields with their kinds and docs.

    >>> import nitro
    >>> from nitro import GraphConst, Device
    >>> @nitro.experiment
    ... class Tiny:
    ...     width: GraphConst[int] = 8
    ...     scale: Device[float] = 1.0
    ...     batch_size: int = 4
    >>> Tiny(width=16).width
    16
    """

    def wrap(cls):
        if not isinstance(cls, type):
            raise ExperimentError("@nitro.experiment decorates a class")
        user_post_init = getattr(cls, "__post_init__", None)
        # an inherited nitro check wraps the user's own __post_init__ (or nothing)
        user_post_init = getattr(user_post_init, "__nitro_user_post_init__", user_post_init)

        def __post_init__(self, *init_vars):
            if user_post_init is not None:
                user_post_init(self, *init_vars)
            check_values(self)

        # Installed before dataclass() runs, so the generated __init__ calls it.
        __post_init__.__nitro_user_post_init__ = user_post_init
        cls.__post_init__ = __post_init__
        options = {"kw_only": True, "eq": True, "repr": True, **dataclass_options}
        datacls = dataclasses.dataclass(cls, **options)
        annotations = _resolved_annotations(datacls)
        docs = _field_docs(datacls)
        specs = []
        for f in dataclasses.fields(datacls):
            kind, base = _kind_of(annotations.get(f.name, f.type))
            if f.default is not _NO_DEFAULT:
                default = f.default
            elif f.default_factory is not _NO_DEFAULT:
                default = f.default_factory
            else:
                default = _NO_DEFAULT
            doc = f.metadata.get("doc") or docs.get(f.name, "")
            if kind is FieldKind.GRAPHCONST and f.name in DRIVER_ONLY_NAMES:
                raise ExperimentError(
                    f"{datacls.__qualname__}.{f.name} is marked GraphConst, but `{f.name}` is "
                    f"read by the driver: baking it would recompile for every value. "
                    f"Leave it unmarked (Host)."
                )
            specs.append(FieldSpec(f.name, base, default, kind, doc))
        datacls.__nitro_fields__ = tuple(specs)
        for name, method in CLASS_METHODS.items():
            if name not in vars(datacls):
                setattr(datacls, name, method)
        _bump_edit_generation()
        return datacls

    if cls is None:
        return wrap
    return wrap(cls)


def check_values(instance: Any) -> None:
    """Refuse GraphConst and Device values of the wrong type, and GraphConst values that do not
    hash by content, naming the field, the expected type and the value."""
    cls = type(instance)
    for spec in cls.__nitro_fields__:
        if spec.kind is FieldKind.HOST:
            continue
        value = getattr(instance, spec.name)
        if spec.kind is FieldKind.GRAPHCONST:
            _check_hashable_by_content(cls.__qualname__, spec.name, value)
        check_field_type(cls, spec, value, call=cls.__name__)


def check_field_type(cls: type, spec: FieldSpec, value: Any, *, call: str) -> None:
    """Refuse a GraphConst or Device value that does not fit the field's declared type; `call`
    is how the value was given ("Toy", "set_device"), for the example in the message."""
    module = sys.modules.get(cls.__module__)
    namespace = vars(module) if module is not None else None
    check_field_value(cls.__qualname__, spec, value, call=call, namespace=namespace)


def has_method(cls: type, name: str) -> bool:
    """True when `cls` defines (or inherits) a method `name`: a hook or an accessor."""
    try:
        attr = inspect.getattr_static(cls, name)
    except AttributeError:
        return False
    return isinstance(attr, (staticmethod, classmethod)) or inspect.isfunction(attr)


def is_experiment(obj: Any) -> bool:
    cls = obj if isinstance(obj, type) else type(obj)
    return hasattr(cls, "__nitro_fields__")


def field_specs(obj: Any) -> tuple[FieldSpec, ...]:
    cls = obj if isinstance(obj, type) else type(obj)
    specs = getattr(cls, "__nitro_fields__", None)
    if specs is None:
        raise ExperimentError(
            f"{getattr(cls, '__qualname__', cls)!s} is not an experiment: decorate the class "
            f"with @nitro.experiment"
        )
    return specs


def fields(obj: Any):
    """A table of the experiment's fields: name, type, default, kind and doc.

    Accepts the class or an instance (then `value` shows the instance's values). A
    DataFrame; a notebook shows its docs left-aligned, with their `code` set as code.
    """
    import pandas as pd

    rows = []
    for spec in field_specs(obj):
        row = {
            "name": spec.name,
            "type": _type_name(spec.type),
            "default": "(required)" if not spec.has_default else spec.default,
            "kind": spec.kind.value,
            "doc": spec.doc,
        }
        if not isinstance(obj, type):
            row["value"] = getattr(obj, spec.name)
        rows.append(row)
    columns = ["name", "type", "default", "kind", "doc"] + (
        [] if isinstance(obj, type) else ["value"]
    )
    table = pd.DataFrame(rows, columns=pd.Index(columns), dtype=object).set_index("name")
    return _field_table()(table)


@functools.cache
def _field_table() -> type:
    """The DataFrame class of `fields()`: its HTML reads as text (pandas builds it on first
    use; frames derived from it are plain DataFrames)."""
    import pandas as pd

    class FieldTable(pd.DataFrame):
        @property
        def _constructor(self):
            return pd.DataFrame

        def _repr_html_(self) -> str:
            def text(value: Any) -> str:
                return html.escape(str(value))

            def doc(value: Any) -> str:
                code = re.sub(r"`([^`]+)`", r"<code>\1</code>", text(value))
                return f"<div style='text-align:left'>{code}</div>"

            formatters = {name: doc if name == "doc" else text for name in self.columns}
            table = pd.DataFrame(self).to_html(formatters=formatters, escape=False)
            return table.replace("<th>doc</th>", "<th style='text-align:left'>doc</th>", 1)

    return FieldTable


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


# A counter bumped whenever code that handles may depend on is (re)defined; handles use it
# to decide when to re-check their code fingerprints for staleness.
_EDIT_GENERATION = [0]


def _bump_edit_generation() -> None:
    _EDIT_GENERATION[0] += 1


def edit_generation() -> int:
    return _EDIT_GENERATION[0]
