"""From an agent's JSON arguments to Nitro values: experiments by name, checked field overrides.

Every refusal is a `ToolFailure` that names the argument, says what was expected and how to fix
it; the agent reads the text.

>>> cls = find_experiment("nitro.examples.digits.Digits", {})
>>> build_experiment(cls, {"width": 64}).width
64
"""

from __future__ import annotations

import difflib
import importlib
import json
from collections.abc import Mapping
from typing import Any

from nitro.engine.run_keywords import RUN_KEYWORDS
from nitro.experiments.declaration import ExperimentError, field_specs, is_experiment
from nitro.experiments.presets import from_preset, replace

__all__ = ["ToolFailure", "build_experiment", "close_matches", "find_experiment"]


class ToolFailure(Exception):
    """A refusal the agent can act on; its text is the tool's error message."""


def close_matches(name: str, choices) -> str:
    """` (did you mean 'a', 'b'?)` for the choices close to `name`, or nothing."""
    close = difflib.get_close_matches(name, sorted(choices), n=3, cutoff=0.5)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def _experiments_in(namespace: Mapping[str, Any]) -> list[str]:
    return sorted(
        name
        for name, value in list(namespace.items())
        if not name.startswith("_") and isinstance(value, type) and is_experiment(value)
    )


def _attribute_path(value: Any, path: list[str]) -> Any:
    for part in path:
        value = getattr(value, part)
    return value


def _import_qualified(name: str) -> Any:
    """`pkg.module.Class` (or `pkg.module.Outer.Inner`): import the longest module prefix."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            missing = error.name or ""
            if module_name == missing or module_name.startswith(missing + "."):
                continue  # this prefix is not a module; try a shorter one
            raise
        try:
            return _attribute_path(module, parts[cut:])
        except AttributeError:
            wanted = ".".join(parts[cut:])
            known = _experiments_in(vars(module))
            listing = f"; its experiments: {', '.join(known)}" if known else ""
            raise ToolFailure(
                f"experiment: module {module_name!r} has no {wanted!r}"
                f"{close_matches(wanted, known)}{listing}"
            ) from None
    raise ToolFailure(f"experiment: no module found for {name!r}")


def find_experiment(name: str, namespace: Mapping[str, Any]) -> Any:
    """The experiment class (or instance, used as a base configuration) called `name`: a name
    in `namespace` (a notebook's variables), a dotted path from one (`my_module.Digits` after
    `import my_module`), or a module-qualified name (`nitro.examples.digits.Digits`)."""
    name = name.strip()
    head, _, rest = name.partition(".")
    if head in namespace:
        try:
            value = _attribute_path(namespace[head], rest.split(".") if rest else [])
        except AttributeError:
            raise ToolFailure(f"experiment: {head!r} has no attribute path {rest!r}") from None
    elif rest:
        try:
            value = _import_qualified(name)
        except ToolFailure:
            raise
        except Exception as error:  # the module itself failed to import
            raise ToolFailure(
                f"experiment: importing {name!r} failed: {type(error).__name__}: {error}"
            ) from None
    else:
        known = _experiments_in(namespace)
        where = (
            f"experiments in this session: {', '.join(known)}"
            if known
            else "this session defines none by name"
        )
        raise ToolFailure(
            f"experiment: no experiment named {name!r}{close_matches(name, known)}; {where}. "
            f"Use a module-qualified name such as 'nitro.examples.digits.Digits'."
        )
    if not is_experiment(value):
        raise ToolFailure(
            f"experiment: {name!r} is a {type(value).__name__}, not an experiment (a class "
            f"decorated with @nitro.experiment, or an instance of one)"
        )
    return value


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _convert(owner: str, name: str, tp: Any, value: Any) -> Any:
    """`value` (decoded JSON) as the field's type: lists become tuples where the type says so,
    ints become floats; a string for an int, or a float for an int, is refused."""
    from pydantic import PydanticSchemaGenerationError, TypeAdapter, ValidationError

    if isinstance(tp, str):
        return value  # an annotation that does not resolve; the experiment checks it
    try:
        adapter = TypeAdapter(tp)
    except (PydanticSchemaGenerationError, TypeError):
        if isinstance(tp, type) and not isinstance(value, tp):
            raise ToolFailure(
                f"overrides: field {name!r} of {owner} holds a {_type_name(tp)}, which cannot "
                f"be written as JSON; set it in the notebook instead"
            ) from None
        return value
    try:
        return adapter.validate_json(json.dumps(value), strict=True)
    except ValidationError as error:
        problem = error.errors()[0]["msg"]
        raise ToolFailure(
            f"overrides: field {name!r} of {owner} is {_type_name(tp)}; got {value!r} ({problem})"
        ) from None


def build_experiment(
    target: Any, overrides: Mapping[str, Any] | None, preset: str | None = None
) -> Any:
    """An instance of `target` (a class, or an instance to copy) with `overrides` applied,
    each checked against the field's name and type; a class is built from `preset`, when
    given (its values under the overrides)."""
    cls = target if isinstance(target, type) else type(target)
    owner = cls.__qualname__
    specs = {s.name: s for s in field_specs(cls)}
    values = {}
    for name, value in (overrides or {}).items():
        spec = specs.get(name)
        if spec is None:
            if name in RUN_KEYWORDS:
                raise ToolFailure(
                    f"overrides: {name!r} is a run keyword, not a field of {owner}; pass it as "
                    f"a run keyword instead (the {name} argument, or keywords)"
                )
            raise ToolFailure(
                f"overrides: {owner} has no field {name!r}{close_matches(name, specs)}; its fields: "
                f"{', '.join(specs)}"
            )
        values[name] = _convert(owner, name, spec.type, value)
    if preset is not None and not isinstance(target, type):
        raise ToolFailure(
            f"preset: a preset builds the experiment from its class, and the experiment named "
            f"is a {owner} instance; name the class ({owner}) with preset, or leave preset out"
        )
    if preset is not None:
        try:
            return from_preset(target, preset, **values)
        except ExperimentError as error:
            raise ToolFailure(f"preset: {error}") from None
    try:
        if isinstance(target, type):
            return target(**values)
        return replace(target, **values)
    except ExperimentError as error:
        raise ToolFailure(f"overrides: {error}") from None
    except TypeError as error:  # a required field without a value
        raise ToolFailure(
            f"overrides: {owner} could not be built ({error}); give every required field in "
            f"overrides"
        ) from None
