"""Metrics: values a hook returns per batch, reduced over a split by their mode.

A metrics hook returns a dict. Each value is

- a bare scalar or array: the mean over real samples (weighted by each batch's real count);
- `(value, count)`: summed, and divided once at the end by the summed counts;
- `(value, "sum" | "max" | "min" | "concat")`: summed, maxed, mined, or joined along the
  batch axis (for AUROC and the like, reduced in `finalize_metrics`);
- a metric object of a library made for JAX (`clu.metrics`: `Accuracy.from_model_output(...)`,
  `Average`, `Std`, or any object with `merge` and `compute`, a pytree of arrays): merged over
  the batches as the library defines, and computed once at the end.

A mode applies leaf by leaf to a nested dict, and a nested dict may mix modes. The set of keys,
the modes and the shapes are fixed by the first batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from nitro.errors import MetricError

__all__ = ["MODES", "MetricError", "MetricAccumulator", "flatten_metrics", "split_modes"]

MODES = ("sum", "max", "min", "concat")


def _is_mode_pair(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2


def split_modes(values: Any, hook: str) -> tuple[list[tuple[str, str]], list[tuple[Any, Any]]]:
    """Normalize a hook's return into parallel lists: (path, mode) and (value, count).

    Runs on host values or, for device residency, on tracers at trace time (the modes are
    static; only the values and counts leave the program).
    """
    if not isinstance(values, Mapping):
        raise MetricError(
            f"`{hook}` must return a dict of metric name -> value, got {type(values).__name__}"
        )
    specs: list[tuple[str, str]] = []
    leaves: list[tuple[Any, Any]] = []

    def visit(path: str, value: Any, inherited: tuple[str, Any] | None) -> None:
        if _is_metric_object(value):
            if inherited is not None:
                raise MetricError(
                    f"metric {path!r} of `{hook}` is a library metric ({type(value).__name__}), "
                    f"which merges over batches itself: return it without a mode"
                )
            specs.append((path, "merge"))
            leaves.append((value, None))
            return
        if _is_mode_pair(value) and inherited is None:
            inner, mode = value
            if mode is None:
                raise MetricError(
                    f"metric {path!r} of `{hook}` has no mode: write (value, 'sum'), "
                    f"(value, 'max'), (value, 'min'), (value, 'concat') or (value, count)"
                )
            if isinstance(mode, str):
                if mode not in MODES:
                    raise MetricError(
                        f"metric {path!r} of `{hook}` has unknown mode {mode!r}; modes are "
                        f"{', '.join(MODES)}, or give a count: (value, count)"
                    )
                visit(path, inner, (mode, None))
            else:
                visit(path, inner, ("count", mode))
            return
        if _is_mode_pair(value):
            raise MetricError(
                f"metric {path!r} of `{hook}` carries a mode twice; give the mode once, at the "
                f"level it applies to"
            )
        if isinstance(value, Mapping):
            for key, inner in value.items():
                visit(f"{path}/{key}", inner, inherited)
            return
        if isinstance(value, (str, bytes)) or value is None or isinstance(value, (list, tuple)):
            raise MetricError(
                f"metric {path!r} of `{hook}` is {type(value).__name__}; a metric value is a "
                f"number or array, or (value, mode) with a mode in {', '.join(MODES)}, or "
                f"(value, count)"
            )
        if inherited is None:
            specs.append((path, "mean"))
            leaves.append((value, None))
        else:
            specs.append((path, inherited[0]))
            leaves.append((value, inherited[1]))

    for key, value in values.items():
        visit(str(key), value, None)
    return specs, leaves


def _is_metric_object(value: Any) -> bool:
    """A library's metric (clu.metrics): a dataclass pytree that merges and computes."""
    return (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and callable(getattr(value, "merge", None))
        and callable(getattr(value, "compute", None))
    )


class MetricAccumulator:
    """Reduces per-batch metric values over a split."""

    def __init__(self, hook: str):
        self.hook = hook
        self.specs: list[tuple[str, str]] | None = None
        self.totals: list[Any] = []
        self.counts: list[Any] = []

    def add(self, specs: list[tuple[str, str]], leaves: list[tuple[Any, Any]], n_real: int):
        if self.specs is None:
            self.specs = list(specs)
            self.totals = [None] * len(specs)
            self.counts = [0.0] * len(specs)
        elif specs != self.specs:
            self._raise_changed(specs)
        for i, ((path, mode), (value, count)) in enumerate(zip(specs, leaves, strict=True)):
            previous = self.totals[i]
            if mode == "merge":  # a library's metric object: its own merge
                import jax

                value = jax.device_get(value)
                self.totals[i] = value if previous is None else previous.merge(value)
                continue
            value = np.asarray(value)
            if previous is not None and mode != "concat" and np.shape(previous) != value.shape:
                raise MetricError(
                    f"metric {path!r} of `{self.hook}` changed shape between batches: "
                    f"{np.shape(previous)} -> {value.shape}; keep it the same on every batch"
                )
            if mode == "mean":
                weighted = value.astype(np.float64) * n_real
                self.totals[i] = weighted if previous is None else previous + weighted
                self.counts[i] += n_real
            elif mode == "count":
                value = value.astype(np.float64)
                self.totals[i] = value if previous is None else previous + value
                self.counts[i] += np.asarray(count, dtype=np.float64)
            elif mode == "sum":
                self.totals[i] = value if previous is None else previous + value
            elif mode == "max":
                self.totals[i] = value if previous is None else np.maximum(previous, value)
            elif mode == "min":
                self.totals[i] = value if previous is None else np.minimum(previous, value)
            else:  # concat along the batch axis
                if value.ndim == 0:
                    raise MetricError(
                        f"metric {path!r} of `{self.hook}` uses mode 'concat' but is a scalar; "
                        f"concat joins per-sample arrays along the batch axis"
                    )
                if previous is not None and previous[0].shape[1:] != value.shape[1:]:
                    raise MetricError(
                        f"metric {path!r} of `{self.hook}` changed shape between batches: "
                        f"{previous[0].shape} -> {value.shape} (concat joins along axis 0; the "
                        f"other axes must match)"
                    )
                self.totals[i] = [value] if previous is None else previous + [value]

    def _raise_changed(self, specs) -> None:
        old, new = dict(self.specs or ()), dict(specs)
        if set(old) != set(new):
            raise MetricError(
                f"`{self.hook}` returned keys {sorted(new)} but the first batch returned "
                f"{sorted(old)}; the key set is fixed by the first batch"
            )
        for path in old:
            if old[path] != new[path]:
                raise MetricError(
                    f"metric {path!r} of `{self.hook}` changed mode between batches: "
                    f"{old[path]!r} -> {new[path]!r}; use the same mode on every batch"
                )

    @property
    def empty(self) -> bool:
        return self.specs is None

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for (path, mode), total, count in zip(
            self.specs or [], self.totals, self.counts, strict=True
        ):
            if mode == "merge":
                value = np.asarray(total.compute())
            elif mode in ("mean", "count"):
                value = total / count
            elif mode == "concat":
                value = np.concatenate(total, axis=0)
            else:
                value = total
            out[path] = _scalarize(value)
        return out


def _scalarize(value: Any) -> Any:
    array = np.asarray(value)
    if array.ndim:
        return array
    if array.dtype.kind == "f":
        return float(array)
    if array.dtype.kind in "iub":
        return int(array)
    return array.item()


def flatten_metrics(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Join nested dicts into "a/b" keys (finalize_metrics may return nested dicts)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, prefix=f"{name}/"))
        else:
            flat[name] = _scalarize(value) if np.ndim(value) == 0 else value
    return flat
