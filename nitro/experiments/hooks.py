"""Hooks as values (`hooks=`): hook functions built in a notebook cell that override the
experiment's methods of those names for one handle.

`nitro.hooks(loss=fn)` is one *set*; `|` combines sets (`nitro.hooks(loss=fn) |
nitro.hooks(metrics=g)`), and `Nitro(e, hooks=...)` takes a set, a combination or a plain dict
(one set). Each function takes `self` first, as the method it replaces. The handle runs an
instance of the experiment's class with the functions as its methods (the same name, fields and
owner), so they are frozen, fingerprinted and keyed as methods are.

A set is *traced* (its hooks run inside a compiled program: `forward`, `loss`, `train_step`, and
`metrics`/`train_metrics` where they run on the device) or *host* (`finalize_metrics`, and
`metrics`/`train_metrics` where they run on the host); a set mixing the two is refused, so
rebuilding a host set in a cell never touches a program, and a traced set's functions are
checked for captured arrays: a jax array a traced hook reads from its closure or its globals
is refused, naming it (the compiled program would hold it as a constant outside its inputs;
make it a Device field).

>>> import nitro
>>> both = nitro.hooks(loss=lambda self, outputs, *, y: 0.0) | nitro.hooks(finalize_metrics=print)
>>> sorted(both)
['finalize_metrics', 'loss']
"""

from __future__ import annotations

import difflib
import functools
import inspect
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["HOOK_NAMES", "Hooks", "hooks", "with_hooks"]

# the hooks a set may give (the experiment's methods of these names)
HOOK_NAMES = ("forward", "loss", "metrics", "train_metrics", "finalize_metrics", "train_step")
_ALWAYS_TRACED = ("forward", "loss", "train_step")
_RESIDENT = ("metrics", "train_metrics")  # traced where they run on the device


class Hooks(Mapping[str, Callable]):
    """Hook name -> function, as one or more sets (`parts`); `|` combines sets."""

    def __init__(self, parts: tuple[tuple[tuple[str, Callable], ...], ...]):
        self.parts = parts
        self._functions = {name: fn for part in parts for name, fn in part}

    @classmethod
    def of(cls, value: Any) -> Hooks:
        """`value` as a Hooks: a Hooks, or a dict of hook name -> function (one set)."""
        if isinstance(value, Hooks):
            return value
        if not isinstance(value, Mapping) or not value:
            raise ValueError(
                f"hooks= takes a dict of hook name -> function or nitro.hooks(...); got "
                f"{type(value).__name__}. E.g. hooks=nitro.hooks(loss=my_loss)"
            )
        for name, fn in value.items():
            _check(name, fn)
        return cls((tuple(sorted(value.items())),))

    def __or__(self, other: Any) -> Hooks:
        other = Hooks.of(other)
        both = sorted(set(self) & set(other))
        if both:
            raise ValueError(
                f"hooks: {', '.join(both)} given in two sets; give each hook in one set"
            )
        return Hooks(self.parts + other.parts)

    def __getitem__(self, name: str) -> Callable:
        return self._functions[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._functions)

    def __len__(self) -> int:
        return len(self._functions)

    def __hash__(self) -> int:
        return hash(self.parts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Hooks) and self.parts == other.parts

    def __repr__(self) -> str:
        sets = " | ".join(
            "hooks(" + ", ".join(f"{n}={_name(fn)}" for n, fn in part) + ")" for part in self.parts
        )
        return sets

    def experiment(self, instance: Any) -> Any:
        """`instance` as an instance of its class with these hooks as its methods (the same
        field values)."""
        import dataclasses

        from nitro.experiments.presets import preset_of, remember

        cls = with_hooks(type(instance), self)
        values = {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance) if f.init}
        return remember(cls(**values), preset_of(instance))

    def check(self, residency: Mapping[str, str]) -> None:
        """Refuse a set mixing traced and host hooks (by where `residency` runs the metrics
        hooks), and a traced hook reading a jax array from its closure or globals."""
        for part in self.parts:
            traced = [n for n, _ in part if _traced(n, residency)]
            host = [n for n, _ in part if not _traced(n, residency)]
            if traced and host:
                given = ", ".join(n for n, _ in part)
                raise ValueError(
                    f"hooks: the set ({given}) mixes traced hooks ({', '.join(traced)}: they "
                    f"run inside compiled programs) with host hooks ({', '.join(host)}: "
                    f"they run in Python on the host). Give them as two sets, "
                    f"nitro.hooks({', '.join(f'{n}=...' for n in traced)}) | "
                    f"nitro.hooks({', '.join(f'{n}=...' for n in host)}), so editing the host "
                    f"set never compiles"
                )
            for name, fn in part:
                if traced:
                    _refuse_captured_arrays(name, fn)


def hooks(**functions: Callable) -> Hooks:
    """One set of hook functions for `Nitro(e, hooks=...)`, each taking `self` first;
    combine sets with `|`.

    >>> import nitro
    >>> nitro.hooks(finalize_metrics=lambda self, values: values)
    hooks(finalize_metrics=<lambda>)
    """
    return Hooks.of(functions)


def _check(name: Any, fn: Any) -> None:
    if name not in HOOK_NAMES:
        close = difflib.get_close_matches(str(name), HOOK_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"hooks: {name!r} is not a hook{hint}; hooks= gives {', '.join(HOOK_NAMES)}"
        )
    if not isinstance(fn, (types.FunctionType, functools.partial)) and not callable(fn):
        raise ValueError(f"hooks: {name} must be a function taking self first; got {fn!r}")
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: taken as it is
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not parameters or parameters[0].kind not in (*positional, inspect.Parameter.VAR_POSITIONAL):
        raise ValueError(
            f"hooks: {name} must take self first, as the method it replaces: "
            f"def {name}(self, ...); got {_name(fn)}{inspect.signature(fn)}"
        )


def _traced(name: str, residency: Mapping[str, str]) -> bool:
    return name in _ALWAYS_TRACED or (name in _RESIDENT and residency.get(name) == "device")


def _refuse_captured_arrays(name: str, fn: Callable) -> None:
    import jax

    fn = inspect.unwrap(fn)
    if isinstance(fn, functools.partial):
        values = {f"argument {i}": v for i, v in enumerate(fn.args)} | dict(fn.keywords)
        fn = fn.func
    else:
        values = {}
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=True)
        for var, cell in cells:
            try:
                values[var] = cell.cell_contents
            except ValueError:  # an empty cell
                continue
        glb = getattr(fn, "__globals__", {})
        values.update({n: glb[n] for n in code.co_names if n in glb})
    for var, value in values.items():
        arrays = [x for x in jax.tree.leaves(value) if isinstance(x, jax.Array)]
        if arrays and not isinstance(value, types.ModuleType):
            shape = f"{arrays[0].dtype}{list(arrays[0].shape)}"
            raise ValueError(
                f"hooks: {name} captures {var!r}, a jax array ({shape}): a traced hook's "
                f"captured array becomes a constant of the compiled program, outside its "
                f"inputs and the run's record (a large one is keyed by identity, a tracer "
                f"leaks). Make it a Device field of the experiment (`{var}: Device[...]`, "
                f"read as self.{var}) or pass it through the batch"
            )


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


@functools.cache
def with_hooks(cls: type, given: Hooks) -> type:
    """`cls` with the `given` hooks as its methods, under its own name and module (so the
    owner, the run's directory and the compile cache's explanations are the class's). The
    same class and hooks give the same class."""
    return types.new_class(
        cls.__name__,
        (cls,),
        exec_body=lambda ns: ns.update(
            dict(given),
            __module__=cls.__module__,
            __qualname__=cls.__qualname__,
            __doc__=cls.__doc__,
            __nitro_hooks__=(cls, given),
        ),
    )
