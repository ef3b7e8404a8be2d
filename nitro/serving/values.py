"""Numbers given as Python values (JSON, gRPC contents, lists) against an input's dtype: what
NumPy's conversion would silently change (1.7 truncated to 1 for an integer input, 300 wrapped
for int8, 1e39 made infinite for float32) or refuse with a raw `OverflowError` (2**40 for
int32) is found first and named, so the bundle and the server refuse it in words.

>>> value_problem([1.0, 1.7], np.dtype("int32"), "int32")
'1.7 is not a whole number, and int32 takes integers only'
>>> value_problem([2**40], np.dtype("int32"), "int32")
'1099511627776 is out of the range of int32 (-2147483648 to 2147483647)'
>>> value_problem([[1, 2]], np.dtype("float32"), "float32") is None
True
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["value_problem"]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


def value_problem(data: Any, dtype: np.dtype, wire: str) -> str | None:
    """What in JSON or gRPC values (numbers, not binary data) does not fit `dtype` exactly,
    or None: NumPy would truncate 1.7 to 1 for an integer input, wrap 300 for INT8, or make
    1e39 infinite for FP32."""
    try:
        values = np.asarray(data)
    except (ValueError, TypeError, OverflowError):
        return None  # not a block of numbers: decoding names the problem
    if values.dtype.kind not in "iufO" or values.size == 0:
        return None
    if values.dtype.kind == "O":  # integers beyond int64: each is a Python number
        items = values.ravel().tolist()
        if not all(type(v) in (int, float) for v in items):
            return None
    else:
        items = None
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if items is not None:
            fraction = [v for v in items if isinstance(v, float) and not v.is_integer()]
            outside = [v for v in items if not info.min <= v <= info.max]
        else:
            floats = values.dtype.kind == "f"
            whole = np.isfinite(values) & (values == np.trunc(values)) if floats else True
            fraction = values[~whole].tolist() if floats else []
            outside = values[(values < info.min) | (values > info.max)].tolist()
        if fraction:
            return f"{_shown(fraction[0])} is not a whole number, and {wire} takes integers only"
        if outside:
            return f"{_shown(outside[0])} is out of the range of {wire} ({info.min} to {info.max})"
    elif dtype.kind == "f" and dtype.itemsize < 8:
        largest = float(np.finfo(dtype).max)
        if items is not None:  # Python numbers, some beyond what a float64 holds
            outside = [v for v in items if abs(v) > largest and v not in (math.inf, -math.inf)]
        else:
            numbers = values.astype(np.float64)
            outside = values[np.isfinite(numbers) & (np.abs(numbers) > largest)].tolist()
        if outside:
            return f"{_shown(outside[0])} is out of the range of {wire} (largest {largest:.8g})"
    return None
