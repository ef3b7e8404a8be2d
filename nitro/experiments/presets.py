"""Presets: named partial configurations an experiment declares, and the instances built from
them.

An experiment declares its presets with a classmethod `presets(cls)` returning, by name, the
field values each preset sets (the other fields keep their defaults):

```python
@nitro.experiment
class Digits:
    width: GraphConst[int] = 256
    max_epochs: int = 30

    @classmethod
    def presets(cls):
        return {"small": {"width": 32, "max_epochs": 2}, "large": {"width": 1024}}
```

`Digits.from_preset("small", width=64)` builds a `Digits` from the preset, the keywords
winning over it; `nitro.presets(Digits)` lists the presets. Every key, a preset's or an
override's, is checked against the fields. The instance remembers its preset's name
(`nitro.preset_of(e)`), which every run of it records; `replace` keeps it across a copy with
other values.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from nitro.errors import ExperimentError, did_you_mean
from nitro.experiments.declaration import CLASS_METHODS, DRIVER_ONLY_NAMES, field_specs

__all__ = ["from_preset", "preset_of", "presets", "remember", "replace"]

# where an instance keeps the name of the preset it was built from (not a field: it is no
# part of the configuration's value, its equality or its repr)
_PRESET = "__nitro_preset__"


def _declared(cls: type) -> Mapping[str, Any]:
    """What `cls.presets()` returns, checked to be a mapping of names to mappings."""
    if "presets" in {spec.name for spec in field_specs(cls)}:
        return {}  # a field named `presets` is a value, not a declaration
    try:
        attribute = inspect.getattr_static(cls, "presets")
    except AttributeError:
        return {}
    if not isinstance(attribute, (classmethod, staticmethod)) and not inspect.isfunction(attribute):
        raise ExperimentError(
            f"{cls.__qualname__}.presets is a {type(attribute).__name__}; declare the presets with a "
            f"classmethod: @classmethod def presets(cls): return {{'small': {{'width': 32}}}}"
        )
    table = cls.presets()  # pyright: ignore[reportAttributeAccessIssue]  # found just above
    if not isinstance(table, Mapping) or not all(
        isinstance(name, str) and isinstance(values, Mapping) for name, values in table.items()
    ):
        raise ExperimentError(
            f"{cls.__qualname__}.presets() must return a dict of preset name -> field values, "
            f"e.g. {{'small': {{'width': 32}}}}; got {table!r}"
        )
    return table


def check_field_names(cls: type, names: Any, where: str) -> None:
    """Refuse a name in `names` that is no field of `cls`, naming `where` it was given, the
    close fields and, for a run keyword, how to set it."""
    fields = [spec.name for spec in field_specs(cls)]
    for name in names:
        if name in fields:
            continue
        from_keyword = ""
        if name in DRIVER_ONLY_NAMES:
            from_keyword = (
                f" `{name}` is a run keyword: a Host field named {name} supplies it (declare "
                f"one), or pass it to Nitro(..., {name}=...)."
            )
        raise ExperimentError(
            f"{where} sets {name!r}, which is not a field of {cls.__qualname__}."
            f"{did_you_mean(name, fields)}{from_keyword} Its fields: {', '.join(fields)}."
        )


def presets(experiment: Any) -> dict[str, dict[str, Any]]:
    """The presets an experiment (a class or an instance) declares: name -> the field values
    it sets, every key checked against the fields. Empty when it declares none.

    >>> import nitro
    >>> from nitro.examples.digits import Digits
    >>> nitro.presets(Digits)["small"]
    {'width': 32, 'batch_size': 64, 'max_epochs': 2}
    """
    cls = experiment if isinstance(experiment, type) else type(experiment)
    table = _declared(cls)
    for name, values in table.items():
        check_field_names(cls, values, f"{cls.__qualname__}.presets()[{name!r}]")
    return {name: dict(values) for name, values in table.items()}


def from_preset(cls: type, name: str | None, /, **overrides: Any) -> Any:
    """An instance of `cls` with preset `name`'s field values and `overrides` on top (the
    overrides win); it remembers the preset's name. `name=None`: no preset, `cls(**overrides)`.

    >>> import nitro
    >>> from nitro.examples.digits import Digits
    >>> e = Digits.from_preset("small", width=64)
    >>> e.width, e.max_epochs, nitro.preset_of(e)
    (64, 2, 'small')
    """
    check_field_names(cls, overrides, f"{cls.__qualname__}.from_preset({name!r}, ...)")
    values: Mapping[str, Any] = {}
    if name is not None:
        table = _declared(cls)
        if name not in table:
            known = list(table)
            listing = (
                f"Its presets: {', '.join(map(repr, known))}."
                if known
                else "It declares none (a classmethod presets(cls) returning "
                "{'small': {'width': 32}} declares them)."
            )
            raise ExperimentError(
                f"{cls.__qualname__} has no preset {name!r}.{did_you_mean(name, known)} {listing}"
            )
        values = table[name]
        check_field_names(cls, values, f"{cls.__qualname__}.presets()[{name!r}]")
    try:
        instance = cls(**{**values, **overrides})
    except ExperimentError as error:
        raise ExperimentError(f"preset {name!r} of {cls.__qualname__}: {error}") from None
    remember(instance, name)
    return instance


def preset_of(experiment: Any) -> str | None:
    """The name of the preset `experiment` (an instance) was built from, or None.

    >>> import nitro
    >>> from nitro.examples.digits import Digits
    >>> nitro.preset_of(Digits.from_preset("small")), nitro.preset_of(Digits())
    ('small', None)
    """
    return vars(experiment).get(_PRESET) if hasattr(experiment, "__dict__") else None


def replace(experiment: Any, /, **changes: Any) -> Any:
    """`dataclasses.replace(experiment, **changes)` that keeps the preset it was built from:
    the changes are overrides on top of it."""
    copy = dataclasses.replace(experiment, **changes)
    remember(copy, preset_of(experiment))
    return copy


def remember(instance: Any, name: str | None) -> Any:
    """`instance`, remembering that it was built from preset `name` (None: nothing to
    remember); for a copy of an instance as another class (a live edit's)."""
    if name is not None:
        object.__setattr__(instance, _PRESET, name)  # a frozen dataclass too
    return instance


CLASS_METHODS["from_preset"] = classmethod(from_preset)  # `Exp.from_preset(name, **overrides)`
