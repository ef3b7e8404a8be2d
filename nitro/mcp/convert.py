"""JSON in, JSON out: prediction inputs as arrays, results as plain data.

Non-finite floats become `null` (JSON has no NaN), numpy values become Python numbers and
lists, anything else its `str`.

>>> import numpy as np
>>> jsonable({"loss": np.float32(0.5), "grad": float("nan"), "x": np.arange(3)})
{'loss': 0.5, 'grad': None, 'x': [0, 1, 2]}

Inputs take the dtype the model's batches have (`dtypes`); a value that does not fit it is
refused, naming the input:

>>> as_batch({"x": [[1, 2]]}, {"x": "float32"})["x"].dtype
dtype('float32')
>>> as_batch({"y": [0, 1.7]}, {"y": "int32"})
Traceback (most recent call last):
...
nitro.mcp.lookup.ToolFailure: inputs.y: the model takes int32, but 1.7 (at [1]) is not a whole number; ...
>>> as_batch({"x": [[1.0, 1e39]]}, {"x": "float32"})
Traceback (most recent call last):
...
nitro.mcp.lookup.ToolFailure: inputs.x: the model takes float32, but 1e+39 (at [0, 1]) is outside its range (largest 3.4028235e+38); give float32 values for x
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nitro.mcp.lookup import ToolFailure

__all__ = [
    "OUTPUT_FILES",
    "PREVIEW_ELEMENTS",
    "as_batch",
    "first_rows",
    "jsonable",
    "output_elements",
    "output_suffix",
    "save_outputs",
    "shapes",
]

# A prediction answers at most this many output values inline; a larger one is written to a
# file and answered as a preview (a client's message limit is about a megabyte).
PREVIEW_ELEMENTS = 10_000
OUTPUT_FILES = (".npy", ".npz", ".json")


def output_elements(outputs: Any) -> int:
    """How many values `outputs` (an array, or a dict of them) holds."""
    if isinstance(outputs, Mapping):
        return sum(output_elements(value) for value in outputs.values())
    return int(np.size(outputs))


def first_rows(outputs: Any, count: int) -> Any:
    """The first `count` rows of every output."""
    if isinstance(outputs, Mapping):
        return {k: first_rows(v, count) for k, v in outputs.items()}
    return np.asarray(outputs)[:count]


def output_suffix(outputs: Any) -> str:
    """The file type that holds `outputs`: .npy (an array), .npz (a dict of them), .json."""
    if not isinstance(outputs, Mapping):
        return ".npy"
    return ".json" if any(isinstance(v, Mapping) for v in outputs.values()) else ".npz"


def save_outputs(path: Path, outputs: Any) -> None:
    """All of `outputs` in `path`: .npy (one array), .npz (one array per output) or .json."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(jsonable(outputs)))
    elif path.suffix == ".npz":
        arrays = outputs if isinstance(outputs, Mapping) else {"output": outputs}
        if any(isinstance(v, Mapping) for v in arrays.values()):
            raise ToolFailure(f"out: nested outputs do not fit {path.name}; end it with .json")
        named: dict[str, Any] = {str(k): np.asarray(v) for k, v in arrays.items()}
        np.savez(path, **named)  # one array per output, by its name
    elif isinstance(outputs, Mapping):
        raise ToolFailure(
            f"out: the model has several outputs ({', '.join(map(str, outputs))}); .npy holds "
            f"one array: end it with .npz or .json"
        )
    else:
        np.save(path, np.asarray(outputs))


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


def shapes(outputs: Any) -> Any:
    """`{"shape": [...], "dtype": "float32"}` for an array, the same per entry of a dict."""
    if isinstance(outputs, Mapping):
        return {str(k): shapes(v) for k, v in outputs.items()}
    array = np.asarray(outputs)
    return {"shape": list(array.shape), "dtype": array.dtype.name}


def _first(mask: np.ndarray, array: np.ndarray) -> str:
    index = tuple(int(i) for i in np.argwhere(mask)[0])
    return f"{array[index].item()!r} (at {list(index)})"


def _as_dtype(name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`array` as `dtype`, refusing values it cannot hold exactly (1.7 for an int)."""
    fix = f"give {dtype.name} values for {name}"
    if array.dtype.kind not in "biuf":
        raise ToolFailure(f"inputs.{name}: the model takes {dtype.name}, got {array.dtype.name}")
    if dtype.kind in "iub":
        if array.dtype.kind == "f":
            bad = ~np.isfinite(array) | (array != np.round(array))
            if bad.any():
                raise ToolFailure(
                    f"inputs.{name}: the model takes {dtype.name}, but {_first(bad, array)} is "
                    f"not a whole number; {fix}"
                )
        if dtype.kind == "b":
            bad = (array != 0) & (array != 1)
            low, high = 0, 1
        else:
            info = np.iinfo(dtype)
            low, high = info.min, info.max
            bad = (array < low) | (array > high)
        if bad.any():
            raise ToolFailure(
                f"inputs.{name}: the model takes {dtype.name}, but {_first(bad, array)} is "
                f"outside {low}..{high}; {fix}"
            )
    elif dtype.kind == "f" and dtype.itemsize < array.dtype.itemsize:
        largest = float(_finfo(dtype).max)
        bad = np.isfinite(array) & (np.abs(array) > largest)  # the cast would make them inf
        if bad.any():
            raise ToolFailure(
                f"inputs.{name}: the model takes {dtype.name}, but {_first(bad, array)} is "
                f"outside its range (largest {largest:.8g}); {fix}"
            )
    return array.astype(dtype)


def _finfo(dtype: np.dtype) -> Any:
    try:
        return np.finfo(dtype)
    except ValueError:  # bfloat16 and the other ml_dtypes floats
        import ml_dtypes

        return ml_dtypes.finfo(dtype)


def as_batch(
    inputs: Mapping[str, Any], dtypes: Mapping[str, str] | None = None
) -> dict[str, np.ndarray]:
    """JSON arrays (batch axis first) -> numpy arrays of the dtype `dtypes` gives for each
    field (the model's batches'), else floats as float32 and integers as int32."""
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
        wanted = (dtypes or {}).get(name)
        if wanted is not None:
            array = _as_dtype(name, array, np.dtype(wanted))
        elif array.dtype.kind == "f":
            array = _as_dtype(name, array, np.dtype(np.float32))
        elif array.dtype.kind in "iu":
            array = array.astype(np.int32)
        batch[name] = array
    return batch
