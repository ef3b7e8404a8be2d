"""`n.summary()`: the model as a table of its modules, like Keras's `model.summary()`.

One row per NNX module, parents before their children: its path in the model, its type, the
shape of what it returned for one batch, its parameter count and the bytes of its variables
(parameters and state such as batch statistics), each counting the module's submodules too;
then the totals. Rendered as HTML in a notebook (`_repr_html_`) and as text elsewhere.

Nothing is compiled and nothing runs on the device: the model is rebuilt from the shapes of
the handle's variables under `jax.eval_shape`, and `forward` is traced once on the shapes of
one batch (of a split, or the `batch=` given) with the model in eval mode. While it is traced,
the `__call__` of each module class in the model is wrapped to record what each module
returned (its first call: a module called twice shows its first output); a module `forward`
never calls shows no output shape. The wrapping is undone before `summary()` returns and is
seen by the summarizing thread only.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Iterator, Mapping
from html import escape
from typing import Any

import jax
import numpy as np
from flax import nnx

from nitro.core.run_setup import RunSetup
from nitro.errors import SetupError
from nitro.programs import tracing
from nitro.programs.compile_cache import short_dtype

__all__ = ["ModelSummary", "SummaryRow", "model_summary"]


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One module of the model. `params` and `bytes` count its submodules too."""

    path: str  # dotted path in the model ("" for the model itself)
    type: str  # the module's class name
    output: str | None  # what it returned for one batch ("f32[128,10]"); None: not called
    params: int  # parameter elements (nnx.Param)
    bytes: int  # bytes of all its variables: parameters and state
    depth: int  # 0 for the model itself


@dataclasses.dataclass(frozen=True)
class ModelSummary:
    """The table `Nitro.summary()` returns: `rows`, the totals, and where the output shapes
    came from (`batch`: field -> shape text, None when no batch was known)."""

    model: str  # the model's class name
    rows: tuple[SummaryRow, ...]
    params: int  # total parameter elements
    param_bytes: int
    state_bytes: int  # model state besides parameters (batch statistics, RNG state)
    batch: Mapping[str, str] | None  # field -> "f32[128,64]"; None: no output shapes
    source: str | None  # "the 'train' split's batch", "batch="
    forward_output: str | None  # what forward returned

    @property
    def bytes(self) -> int:
        return self.param_bytes + self.state_bytes

    def to_frame(self):
        """The rows as a pandas DataFrame (path, type, output, params, bytes, depth)."""
        import pandas as pd

        return pd.DataFrame([dataclasses.asdict(row) for row in self.rows])

    def _header(self) -> str:
        if self.batch is None:
            return (
                "no output shapes: the handle has no split to take a batch from; pass "
                "summary(batch={...})"
            )
        fields = ", ".join(f"{k} {v}" for k, v in self.batch.items()) or "no fields"
        return f"output shapes for one batch ({self.source}: {fields})"

    def _totals(self) -> list[tuple[str, str]]:
        rows = [
            ("parameters", f"{self.params:,} ({human_bytes(self.param_bytes)})"),
            ("model state", human_bytes(self.state_bytes)),
            ("total", human_bytes(self.bytes)),
        ]
        if self.forward_output is not None:
            rows.insert(0, ("forward returns", self.forward_output))
        return rows

    def _cells(self) -> Iterator[tuple[str, str, str, str, str]]:
        for row in self.rows:
            name = ("  " * row.depth + row.path.rsplit(".", 1)[-1]) if row.path else "(model)"
            yield (
                name,
                row.type,
                row.output if row.output is not None else "-",
                f"{row.params:,}",
                human_bytes(row.bytes),
            )

    def __str__(self) -> str:
        header = ("module", "type", "output", "params", "bytes")
        cells = [header, *self._cells()]
        widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
        right = (False, False, False, True, True)

        def line(row) -> str:
            parts = [
                c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)
            ]
            return "  ".join(parts).rstrip()

        rule = "-" * len(line(header))
        lines = [f"{self.model}: {self._header()}", rule, line(header), rule]
        lines += [line(c) for c in cells[1:]]
        lines.append(rule)
        lines += [f"{k}: {v}" for k, v in self._totals()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        head = "".join(
            f"<th style='text-align:{a}'>{h}</th>"
            for h, a in zip(
                ("module", "type", "output", "params", "bytes"),
                ("left", "left", "left", "right", "right"),
                strict=True,
            )
        )
        body = "".join(
            "<tr>"
            + f"<td style='text-align:left;white-space:pre'>{escape(c[0])}</td>"
            + "".join(f"<td style='text-align:left'><code>{escape(x)}</code></td>" for x in c[1:3])
            + "".join(f"<td style='text-align:right'>{escape(x)}</td>" for x in c[3:])
            + "</tr>"
            for c in self._cells()
        )
        foot = "".join(
            f"<tr><th style='text-align:left'>{escape(k)}</th>"
            f"<td colspan='4' style='text-align:left'>{escape(v)}</td></tr>"
            for k, v in self._totals()
        )
        caption = f"{escape(self.model)}: {escape(self._header())}"
        return (
            f"<table><caption>{caption}</caption><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody><tfoot>{foot}</tfoot></table>"
        )


def human_bytes(n: int) -> str:
    """`n` bytes in B, KiB, MiB or GiB.

    >>> human_bytes(512), human_bytes(2048), human_bytes(3 * 2**20)
    ('512 B', '2.0 KiB', '3.0 MiB')
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def shape_text(tree: Any) -> str:
    """Array shapes as text: `f32[128,10]`; dicts, lists and tuples of them as such.

    >>> shape_text({"a": jax.ShapeDtypeStruct((2, 3), "float32"), "b": ()})
    "{'a': f32[2,3], 'b': ()}"
    """
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return f"{short_dtype(str(tree.dtype))}[{','.join(map(str, tree.shape))}]"
    if isinstance(tree, Mapping):
        return "{" + ", ".join(f"{k!r}: {shape_text(v)}" for k, v in tree.items()) + "}"
    if isinstance(tree, list | tuple):
        inner = ", ".join(shape_text(v) for v in tree)
        return f"[{inner}]" if isinstance(tree, list) else f"({inner}{',' * (len(tree) == 1)})"
    leaves = jax.tree.leaves(tree)
    if leaves and not (len(leaves) == 1 and leaves[0] is tree):
        return f"{type(tree).__name__}({', '.join(shape_text(v) for v in leaves)})"
    return type(tree).__name__


def _abstract(value: Any, where: str) -> jax.ShapeDtypeStruct:
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        try:
            value = np.asarray(value)
        except (TypeError, ValueError) as error:
            raise SetupError(f"summary: {where} cannot be read as an array ({error})") from None
    if np.dtype(value.dtype).kind not in "biufc":
        raise SetupError(
            f"summary: {where} holds {value.dtype} values; forward takes arrays of numbers "
            f"(give an array, or its jax.ShapeDtypeStruct)"
        )
    return jax.ShapeDtypeStruct(tuple(value.shape), value.dtype)


def _batch_of(setup: RunSetup, batch: Any, split: str | None):
    """The abstract batch forward gets, its description, and where it came from."""
    forward = setup.experiment.hook_fields["forward"]
    if batch is not None:
        if split is not None:
            raise SetupError("summary: pass batch= or split=, not both")
        if not isinstance(batch, Mapping):
            raise SetupError(
                f"summary: batch= takes a dict of batch fields (forward takes: "
                f"{forward.describe()}); got {type(batch).__name__}. For example: "
                f"n.summary(batch={{'{(forward.required or ('x',))[0]}': xs}})"
            )
        missing = [f for f in forward.required if f not in batch]
        if missing:
            raise SetupError(
                f"summary: batch= lacks {', '.join(map(repr, missing))}, which forward needs "
                f"(forward takes: {forward.describe()}); add "
                f"{'it' if len(missing) == 1 else 'them'} to the dict"
            )
        names = forward.resolve(batch.keys(), "batch=")
        inputs = {name: _abstract(batch[name], f"batch[{name!r}]") for name in names}
        return inputs, "batch="
    splits = setup.splits
    if split is None:
        split = next((s for s in ("train", "val", "test", *splits) if s in splits), None)
        if split is None:
            return None, None
    elif split not in splits:
        raise SetupError(
            f"summary: split={split!r} is not a split of this handle; its splits are "
            f"{sorted(splits) or 'none (build_data returned none)'}"
        )
    chosen = splits[split]
    inputs = {
        name: jax.ShapeDtypeStruct(tuple(shape), dtype)
        for name in chosen.hook_fields.get("forward", ())
        if name in chosen.batch_spec
        for shape, dtype in (chosen.batch_spec[name],)
    }
    return inputs, f"the {split!r} split's batch"


def _nbytes(leaf: Any) -> int:
    return int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.itemsize


def _path(parts: tuple) -> str:
    return ".".join(map(str, parts))


def _sort_key(parts: tuple) -> tuple:
    return tuple((isinstance(p, int), p if isinstance(p, int) else str(p)) for p in parts)


class _Recorder:
    """What each module returned, by the module's id, while forward is traced."""

    def __init__(self, ids: Mapping[int, str]):
        self.ids = ids
        self.outputs: dict[str, str] = {}
        self.active: set[int] = set()


_LOCAL = threading.local()  # `.recorder` on the thread that summarizes
_PATCH_LOCK = threading.Lock()  # one summary wraps the classes at a time


def _recording(original):
    @functools.wraps(original)
    def call(module, *args, **kwargs):
        recorder: _Recorder | None = getattr(_LOCAL, "recorder", None)
        key = id(module)
        if recorder is None or key in recorder.active or key not in recorder.ids:
            return original(module, *args, **kwargs)  # another thread, or a super() call
        recorder.active.add(key)
        try:
            out = original(module, *args, **kwargs)
        finally:
            recorder.active.discard(key)
        recorder.outputs.setdefault(recorder.ids[key], shape_text(out))
        return out

    return call


def _call_classes(modules) -> list[type]:
    """The classes in the modules' MROs that define `__call__` themselves."""
    seen: dict[type, None] = {}
    for module in modules:
        for cls in type(module).__mro__:
            if "__call__" in vars(cls) and issubclass(cls, nnx.Module):
                seen.setdefault(cls, None)
    return list(seen)


def model_summary(
    setup: RunSetup,
    params: list[Any],
    model_state: list[Any],
    device: Mapping[str, Any],
    *,
    batch: Any = None,
    split: str | None = None,
    depth: int | None = None,
) -> ModelSummary:
    """The summary of the model whose variables are `params` and `model_state` (leaf lists,
    arrays or shapes), with `forward` traced on one batch of `split` (default: "train", else
    the first split) or on `batch=` (a dict of arrays or `jax.ShapeDtypeStruct`s)."""
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise SetupError(
            f"summary: depth= takes a whole number >= 0 (0: the model alone) or None (every "
            f"module); got {depth!r}"
        )
    inputs, source = _batch_of(setup, batch, split)
    model = setup.model
    abstract_params = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in params]
    abstract_rest = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in model_state]
    walked: list[tuple[tuple, str, int, int]] = []
    totals: list[int] = []
    recorder_box: list[_Recorder] = []

    def trace(param_leaves, rest_leaves, device_values, batch_values):
        tree_params = jax.tree.unflatten(model.params_def, param_leaves)
        tree_rest = jax.tree.unflatten(model.model_state_def, rest_leaves)
        module = nnx.merge(model.graphdef_eval, tree_params, tree_rest, copy=True)
        modules = list(nnx.iter_modules(module))
        for parts, sub in modules:
            param_state = jax.tree.leaves(nnx.state(sub, nnx.Param))
            everything = jax.tree.leaves(nnx.state(sub))
            walked.append(
                (
                    parts,
                    type(sub).__name__,
                    sum(int(np.prod(x.shape, dtype=np.int64)) for x in param_state),
                    sum(_nbytes(x) for x in everything),
                )
            )
        totals.extend(
            (
                sum(_nbytes(x) for x in param_leaves),
                sum(_nbytes(x) for x in rest_leaves),
            )
        )
        if batch_values is None:
            return None
        recorder = _Recorder({id(sub): _path(parts) for parts, sub in modules})
        recorder_box.append(recorder)
        view = tracing.view(setup, device_values, set())
        classes = _call_classes(sub for _, sub in modules)
        with _PATCH_LOCK:
            originals = {cls: vars(cls)["__call__"] for cls in classes}
            _LOCAL.recorder = recorder
            try:
                for cls, original in originals.items():
                    cls.__call__ = _recording(original)  # pyright: ignore[reportAttributeAccessIssue]
                return tracing.call(setup, "forward", view, module, **batch_values)
            finally:
                for cls, original in originals.items():
                    cls.__call__ = original  # pyright: ignore[reportAttributeAccessIssue]
                _LOCAL.recorder = None

    try:
        out = jax.eval_shape(trace, abstract_params, abstract_rest, dict(device), inputs)
    except SetupError:
        raise
    except Exception as error:
        shapes = ", ".join(f"{k}: {shape_text(v)}" for k, v in (inputs or {}).items())
        error.add_note(
            f"nitro: raised by forward while summary() traced it on {source} ({shapes}); "
            f"forward fails the same way at the first compile. Fix forward, or pass "
            f"summary(batch={{...}}) with the shapes it takes."
        )
        raise
    outputs = recorder_box[0].outputs if recorder_box else {}
    rows = tuple(
        SummaryRow(
            path=_path(parts),
            type=kind,
            output=outputs.get(_path(parts)),
            params=count,
            bytes=size,
            depth=len(parts),
        )
        for parts, kind, count, size in sorted(walked, key=lambda w: _sort_key(w[0]))
        if depth is None or len(parts) <= depth
    )
    root = next(w for w in walked if w[0] == ())
    return ModelSummary(
        model=root[1],
        rows=rows,
        params=root[2],
        param_bytes=totals[0],
        state_bytes=totals[1],
        batch=None if inputs is None else {k: shape_text(v) for k, v in inputs.items()},
        source=source,
        forward_output=None if inputs is None else shape_text(out),
    )
