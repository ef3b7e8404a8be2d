"""JSON in, JSON out: prediction inputs as arrays, results as plain data.

Non-finite floats become `null` (JSON has no NaN), numpy values become Python numbers and
lists, anything else its `str`.

>>> import numpy as np
>>> jsonable({"loss": np.float32(0.5), "grad": float("nan"), "x": np.arange(3)})
{'loss': 0.5, 'grad': None, 'x': [0, 1, 2]}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from nitro.mcp.lookup import ToolFailure

__all__ = ["as_batch", "jsonable"]


def jsonable(value: Any) -> Any:
    """`value` as JSON-ready data."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "__array__"):
        return jsonable(np.asarray(value).tolist())
    return str(value)


def as_batch(inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """JSON arrays (batch axis first) -> numpy arrays: floats as float32, integers as int32."""
    if not inputs:
        raise ToolFailure(
            'inputs: give at least one batch field, e.g. {"x": [[0.1, 0.2], [0.3, 0.4]]}'
        )
    batch = {}
    for name, value in inputs.items():
        try:
            array = np.asarray(value)
        except ValueError as error:  # ragged nesting
            raise ToolFailure(
                f"inputs.{name}: not a rectangular array ({error}); every row needs the same shape"
            ) from None
        if array.dtype == object or array.dtype.kind in "US":
            raise ToolFailure(
                f"inputs.{name}: expected numbers in nested lists (batch axis first), got "
                f"{type(value).__name__} holding {array.dtype.name} values"
            )
        if array.ndim == 0:
            raise ToolFailure(
                f"inputs.{name}: expected an array with the batch axis first, got the scalar "
                f"{value!r}; wrap one sample in a list: [{value!r}]"
            )
        if array.dtype.kind == "f":
            array = array.astype(np.float32)
        elif array.dtype.kind in "iu":
            array = array.astype(np.int32)
        batch[name] = array
    return batch
