"""`compile_options=`: XLA compiler options for the programs a handle compiles.

`Nitro(e, compile_options={"xla_cpu_enable_fast_math": False})` passes the options to every
program's `.compile(compiler_options=...)` (JAX's own argument); a dict keyed by program kind
(`{"train": {...}, "eval": {...}}`; kinds `train`, `eval`, `predict`, `metrics`) gives each kind
its own. The options key the compile cache and show in `explain_compiles()` reasons and the
binding report. An option XLA does not know is refused when the handle is built, before any
setup, by compiling a one-operation program with it.

>>> options = CompileOptions.of({"train": {"xla_cpu_enable_fast_math": False}})
>>> options.for_kind("train"), options.for_kind("eval")
({'xla_cpu_enable_fast_math': False}, {})
>>> CompileOptions.of({"xla_no_such_flag": 1})
Traceback (most recent call last):
ValueError: compile_options: XLA has no compile option 'xla_no_such_flag' ...
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Mapping
from typing import Any

__all__ = ["KINDS", "CompileOptions"]

# program kinds an option set may be given for (the slots of a handle's `ProgramSet`)
KINDS = ("train", "eval", "predict", "metrics")

_EXAMPLE = "compile_options={'xla_cpu_enable_fast_math': False}"


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """The options each program kind compiles with (kind -> sorted (name, value) pairs)."""

    by_kind: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

    @classmethod
    def of(cls, value: Any) -> CompileOptions:
        """Check `value` (a dict of option -> value, or of kind -> such a dict) and freeze it."""
        if isinstance(value, CompileOptions):
            return value
        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise ValueError(
                f"compile_options takes a dict of XLA option -> value ({_EXAMPLE}) or of "
                f"program kind -> such a dict (kinds: {', '.join(KINDS)}); got {value!r}"
            )
        nested = [k for k, v in value.items() if isinstance(v, Mapping)]
        if nested and len(nested) < len(value):
            raise ValueError(
                f"compile_options mixes program kinds ({', '.join(map(repr, nested))}) with "
                f"options: give either option -> value for every program, or kind -> options"
            )
        given = dict(value) if nested else dict.fromkeys(KINDS, value)
        for kind in given:
            if kind not in KINDS:
                raise ValueError(
                    f"compile_options[{kind!r}]: not a program kind; the kinds are "
                    f"{', '.join(KINDS)}"
                )
        frozen = []
        for kind in KINDS:
            options = given.get(kind) or {}
            for name, setting in options.items():
                _check(kind if nested else None, name, setting)
            _check_with_xla(tuple(sorted(options.items())))
            frozen.append((kind, tuple(sorted(options.items()))))
        return cls(tuple(pair for pair in frozen if pair[1]))

    def for_kind(self, kind: str) -> dict[str, Any]:
        """The options a program of `kind` compiles with ({} for none)."""
        return dict(dict(self.by_kind).get(kind, ()))

    def __bool__(self) -> bool:
        return bool(self.by_kind)

    def __repr__(self) -> str:
        kinds = {kind: dict(options) for kind, options in self.by_kind}
        if len({repr(o) for o in kinds.values()}) == 1 and len(kinds) == len(KINDS):
            return repr(next(iter(kinds.values())))
        return repr(kinds)


def _check(kind: str | None, name: Any, value: Any) -> None:
    where = f"compile_options[{kind!r}]" if kind else "compile_options"
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: option names are strings such as 'xla_...', got {name!r}")
    if not isinstance(value, (bool, int, float, str)):
        raise ValueError(
            f"{where}[{name!r}]: XLA options take a bool, int, float or string, got {value!r}"
        )


@functools.lru_cache(maxsize=64)
def _check_with_xla(options: tuple[tuple[str, Any], ...]) -> None:
    """Compile a one-operation program with `options`: XLA refuses an option it does not
    know or a value it cannot parse, and the refusal is raised naming the option."""
    if not options:
        return
    from nitro.programs.compile_cache import compile_with_options

    try:
        compile_with_options(dict(options))
    except Exception as error:  # XLA's INVALID_ARGUMENT, as a JaxRuntimeError
        text = str(error).strip()
        bad = next((name for name, _ in options if name in text), None)
        if bad is None:
            raise ValueError(f"compile_options {dict(options)}: XLA refused them: {text}") from None
        if "No such compile option" not in text:
            value = dict(options)[bad]
            raise ValueError(
                f"compile_options[{bad!r}]: XLA cannot take the value {value!r} ({text}); "
                f"give a value of the option's type"
            ) from None
        known = _known_options()
        close = difflib.get_close_matches(bad, known, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(
            f"compile_options: XLA has no compile option {bad!r} ({text}); {hint}"
            f"the options are XLA's DebugOptions flags, among them "
            f"{', '.join(known)}; e.g. {_EXAMPLE}"
        ) from None


def _known_options() -> list[str]:
    """The XLA options this jaxlib names (a part of DebugOptions' flags, which all work)."""
    import importlib

    try:  # jaxlib's binding of XLA's DebugOptions (a private module: absent, no names)
        debug_options = importlib.import_module("jaxlib._jax").DebugOptions
    except (ImportError, AttributeError):
        debug_options = object
    build = ("exec_time_optimization_effort", "memory_fitting_effort", "optimization_level")
    return sorted({n for n in dir(debug_options) if n.startswith("xla_")} | set(build))
