"""PyTorch layouts and Flax NNX layouts: which names a PyTorch `state_dict` gives each leaf of
an NNX model, and how its arrays convert, decided by the type of the NNX module that holds
the leaf.

| NNX module | PyTorch names | NNX leaves | rule |
|---|---|---|---|
| `nnx.Linear` | `weight` (out, in), `bias` | `kernel` (in, out), `bias` | `linear`: transpose |
| `nnx.Conv` (1d, 2d, 3d, grouped, depthwise) | `weight` (O, I/groups, *k) | `kernel` (*k, I/groups, O) | `conv` |
| `nnx.ConvTranspose` | `weight` (I, O, *k) | `kernel` (*k, I, O), flipped | `conv_transpose` |
| `nnx.BatchNorm` | `weight`, `bias`, `running_mean`, `running_var` | `scale`, `bias`, `mean`, `var` | `batch_norm` |
| `nnx.LayerNorm`, `nnx.GroupNorm`, `nnx.RMSNorm` | `weight`, `bias` | `scale`, `bias` | `norm` |
| `nnx.Embed` | `weight` | `embedding` | `embedding` |
| `nnx.MultiHeadAttention` | `in_proj_weight` (fused), `q_proj.weight` ..., `qkv.weight`, `out_proj.weight`, `proj.weight` | `query`/`key`/`value`/`out` `kernel`s (in, heads, head_dim) | `attention` |

Every leaf also takes an array under its own NNX name and shape (rule `same`): a file saved
from an NNX model (a Nitro run, an orbax checkpoint) loads without conversion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from flax import nnx

__all__ = ["Binding", "ModelLayout", "dotted", "model_layout", "pytorch_name", "to_torch"]

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Binding:
    """Arrays named `sources` in a file fill the model's leaves `targets` by `rule`."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    rule: str
    # the source shapes the target shapes take (for a message naming both)
    source_shapes: Callable[[Sequence[Shape]], list[Shape]]
    to_nnx: Callable[[Sequence[np.ndarray], Sequence[Shape]], list[np.ndarray]]
    to_torch: Callable[[Sequence[np.ndarray]], list[np.ndarray]]


# ---------------------------------------------------------------------------------------------
# the rules, one array to one leaf


def _one(
    rule: str,
    shape: Callable[[Shape], Shape],
    to_nnx: Callable[[np.ndarray, Shape], np.ndarray],
    to_torch: Callable[[np.ndarray], np.ndarray],
) -> Callable[[str, str], Binding]:
    def bind(source: str, target: str) -> Binding:
        return Binding(
            (source,),
            (target,),
            rule,
            lambda shapes: [shape(tuple(shapes[0]))],
            lambda arrays, shapes: [to_nnx(arrays[0], tuple(shapes[0]))],
            lambda arrays: [to_torch(arrays[0])],
        )

    return bind


ALIGN = 64  # XLA's CPU client takes a host array aligned to this without copying it


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """`np.empty`, its data aligned to `ALIGN` bytes (numpy aligns to 16)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(size + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + size].view(dtype).reshape(shape)


def transposed(x: np.ndarray) -> np.ndarray:
    """`x.T` of a 2-D array, contiguous, copied a band of rows at a time: each band's rows
    become columns whose pieces are one cache line long (numpy's copy of `x.T` in one go
    writes one element per cache line, missing the cache at every element)."""
    rows, cols = x.shape
    band = max(16, 64 // x.itemsize)
    out = aligned_empty((cols, rows), x.dtype)
    if rows * cols < 1 << 16:
        out[...] = x.T
        return out
    for i in range(0, rows, band):
        out[:, i : i + band] = x[i : i + band].T
    return out


def _conv_to_nnx(x: np.ndarray) -> np.ndarray:
    """(O, I, *k) -> (*k, I, O): (O, I*k) transposed, then I moved behind k (a copy of
    contiguous runs of O)."""
    flat = transposed(x.reshape(x.shape[0], -1)).reshape(*x.shape[1:], x.shape[0])
    return np.moveaxis(flat, 0, -2)


def _conv_back(rank: int) -> tuple[int, ...]:
    """(*k, I, O) -> (O, I, *k)."""
    return (rank - 1, rank - 2, *range(rank - 2))


def _flip_spatial(x: np.ndarray) -> np.ndarray:
    return x[(slice(None, None, -1),) * (x.ndim - 2)]


def _transpose_kernel(x: np.ndarray, shape: Shape) -> np.ndarray:
    """PyTorch's ConvTranspose weight (I, O, *k) -> NNX's kernel (*k, I, O), spatially flipped
    (PyTorch's transposed convolution is the gradient of a convolution; `lax.conv_transpose`
    without `transpose_kernel` applies the kernel as given)."""
    return _flip_spatial(x.transpose(*range(2, x.ndim), 0, 1))


def _transpose_kernel_back(x: np.ndarray) -> np.ndarray:
    return _flip_spatial(x).transpose(x.ndim - 2, x.ndim - 1, *range(x.ndim - 2))


SAME = _one("same", lambda s: s, lambda x, s: x, lambda x: x)
LINEAR = _one("linear", lambda s: s[::-1], lambda x, s: transposed(x), lambda x: x.T)
CONV = _one(
    "conv",
    lambda s: tuple(s[i] for i in _conv_back(len(s))),
    lambda x, s: _conv_to_nnx(x),
    lambda x: x.transpose(_conv_back(x.ndim)),
)
CONV_TRANSPOSE = _one(
    "conv_transpose",
    lambda s: (s[-2], s[-1], *s[:-2]),
    _transpose_kernel,
    _transpose_kernel_back,
)
# with transpose_kernel=True the NNX kernel is (*k, O, I) and applied as a convolution's
CONV_TRANSPOSED_KERNEL = _one(
    "conv_transpose",
    lambda s: (s[-1], s[-2], *s[:-2]),
    lambda x, s: x.transpose(*range(2, x.ndim), 1, 0),
    lambda x: x.transpose(x.ndim - 1, x.ndim - 2, *range(x.ndim - 2)),
)


def _bound(rule: str) -> Callable[[str, str], Binding]:
    return _one(rule, lambda s: s, lambda x, s: x, lambda x: x)


NORM = _bound("norm")
BATCH_NORM = _bound("batch_norm")
EMBEDDING = _bound("embedding")

# attention: a projection's PyTorch weight (heads * head_dim, in) against NNX's (in, heads,
# head_dim), its bias (heads * head_dim) against (heads, head_dim); the output projection's
# weight (out, heads * head_dim) against (heads, head_dim, out)
PROJECTION = _one(
    "attention",
    lambda s: (int(np.prod(s[1:])), s[0]),
    lambda x, s: transposed(x).reshape(s),
    lambda x: x.reshape(x.shape[0], -1).T,
)
PROJECTION_BIAS = _one(
    "attention", lambda s: (int(np.prod(s)),), lambda x, s: x.reshape(s), lambda x: x.reshape(-1)
)
OUT_PROJECTION = _one(
    "attention",
    lambda s: (s[-1], int(np.prod(s[:-1]))),
    lambda x, s: transposed(x).reshape(s),
    lambda x: x.reshape(-1, x.shape[-1]).T,
)


def _fused(source: str, targets: tuple[str, ...], bias: bool) -> Binding:
    """One fused array (PyTorch's `in_proj_weight`, timm's `qkv.weight`) for the query, key
    and value projections, stacked along PyTorch's output axis."""

    def sizes(shapes: Sequence[Shape]) -> list[int]:
        return [int(np.prod(s)) if bias else int(np.prod(s[1:])) for s in shapes]

    def source_shapes(shapes: Sequence[Shape]) -> list[Shape]:
        total = sum(sizes(shapes))
        return [(total,) if bias else (total, shapes[0][0])]

    def to_nnx(arrays: Sequence[np.ndarray], shapes: Sequence[Shape]) -> list[np.ndarray]:
        parts = np.split(arrays[0], np.cumsum(sizes(shapes))[:-1], axis=0)
        if bias:
            return [p.reshape(s) for p, s in zip(parts, shapes, strict=True)]
        return [transposed(p).reshape(s) for p, s in zip(parts, shapes, strict=True)]

    def back(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        if bias:
            return [np.concatenate([a.reshape(-1) for a in arrays])]
        return [np.concatenate([a.reshape(a.shape[0], -1).T for a in arrays], axis=0)]

    return Binding((source,), targets, "attention", source_shapes, to_nnx, back)


# ---------------------------------------------------------------------------------------------
# the model's leaves and their bindings


def dotted(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


def _attention(prefix: str, leaves: dict[str, nnx.Variable]) -> list[Binding]:
    names = ("query", "key", "value")
    kernels = tuple(f"{prefix}{n}.kernel" for n in names)
    biases = tuple(f"{prefix}{n}.bias" for n in names)
    found: list[Binding] = []
    if all(k in leaves for k in kernels):
        found += [_fused(f"{prefix}in_proj_weight", kernels, bias=False)]
        found += [_fused(f"{prefix}qkv.weight", kernels, bias=False)]
    if all(b in leaves for b in biases):
        found += [_fused(f"{prefix}in_proj_bias", biases, bias=True)]
        found += [_fused(f"{prefix}qkv.bias", biases, bias=True)]
    for name, short in zip(names, "qkv", strict=True):
        kernel, bias = f"{prefix}{name}.kernel", f"{prefix}{name}.bias"
        found += [PROJECTION(f"{prefix}{short}_proj_weight", kernel)]
        found += [PROJECTION(f"{prefix}{short}_proj.weight", kernel)]
        if bias in leaves:
            found += [PROJECTION_BIAS(f"{prefix}{short}_proj.bias", bias)]
    for out in ("out_proj", "proj"):
        found += [OUT_PROJECTION(f"{prefix}{out}.weight", f"{prefix}out.kernel")]
        if f"{prefix}out.bias" in leaves:
            found += [_bound("attention")(f"{prefix}{out}.bias", f"{prefix}out.bias")]
    return found


def _module_bindings(
    module: nnx.Module, prefix: str, leaves: dict[str, nnx.Variable]
) -> list[Binding]:
    """The PyTorch bindings of one module's leaves, by the module's type (none for a type
    without a rule: its leaves take their own NNX names)."""

    def pairs(rule, *names: tuple[str, str]) -> list[Binding]:
        return [
            (SAME if t == n else rule)(prefix + t, prefix + n)
            for t, n in names
            if prefix + n in leaves
        ]

    bias = pairs(SAME, ("bias", "bias"))
    if isinstance(module, nnx.Linear):
        return pairs(LINEAR, ("weight", "kernel")) + bias
    if isinstance(module, nnx.Conv):
        return pairs(CONV, ("weight", "kernel")) + bias
    if isinstance(module, nnx.ConvTranspose):
        rule = CONV_TRANSPOSED_KERNEL if module.transpose_kernel else CONV_TRANSPOSE
        return pairs(rule, ("weight", "kernel")) + bias
    if isinstance(module, nnx.BatchNorm):
        named = (("weight", "scale"), ("bias", "bias"), ("running_mean", "mean"))
        return pairs(BATCH_NORM, *named, ("running_var", "var"))
    if isinstance(module, (nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm)):
        return pairs(NORM, ("weight", "scale"), ("bias", "bias"))
    if isinstance(module, nnx.Embed):
        return pairs(EMBEDDING, ("weight", "embedding"))
    if isinstance(module, nnx.MultiHeadAttention):
        return _attention(prefix, leaves)
    return []


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """What one walk over a model finds: its leaves, the bindings they take, and the PyTorch
    names that need no leaf or differ from NNX's paths."""

    leaves: dict[str, nnx.Variable]  # dotted path -> variable (RNG state left out)
    offered: list[Binding]  # PyTorch names first, then each leaf's own NNX name
    written: list[Binding]  # the binding `to_torch` writes for each leaf
    ignored: set[str]  # names no weight takes: BatchNorm's `num_batches_tracked`, RNG state
    counters: set[str]  # BatchNorm's `num_batches_tracked`, which `to_torch` writes as PyTorch
    # (`<path>.layers.`, `<path>.`) for each `nnx.Sequential`: PyTorch's `nn.Sequential`
    # names its layers `0`, `1`, ... where NNX's names them `layers.0`
    aliases: list[tuple[str, str]]


def model_layout(model: nnx.Module) -> ModelLayout:
    """The model's leaves and their bindings, from one walk over its graph."""
    nodes = list(nnx.iter_graph(model))
    variables = [(dotted(path), node) for path, node in nodes if isinstance(node, nnx.Variable)]
    leaves = {path: node for path, node in variables if not isinstance(node, nnx.RngState)}
    offered: list[Binding] = []
    written: list[Binding] = []
    # RNG state (a Dropout's key and count) is no weight: a file that holds it (a Nitro run,
    # an orbax checkpoint of `nnx.state(model)`) loads without it
    rng_state = {path for path, node in variables if isinstance(node, nnx.RngState)}
    counters: set[str] = set()
    aliases: list[tuple[str, str]] = []
    for path, module in nodes:
        if not isinstance(module, nnx.Module):
            continue
        prefix = f"{dotted(path)}." if path else ""
        found = _module_bindings(module, prefix, leaves)
        offered += found
        attention = isinstance(module, nnx.MultiHeadAttention)
        written += _attention_written(found) if attention else found
        if isinstance(module, nnx.BatchNorm):
            counters.add(f"{prefix}num_batches_tracked")
        if isinstance(module, nnx.Sequential):
            aliases.append((f"{prefix}layers.", prefix))
    same = [SAME(name, name) for name in leaves]
    filled = {t for b in written for t in b.targets}
    written += [b for b in same if b.targets[0] not in filled]
    return ModelLayout(leaves, offered + same, written, rng_state | counters, counters, aliases)


def _attention_written(found: list[Binding]) -> list[Binding]:
    """What `to_torch` writes of an attention: PyTorch's `nn.MultiheadAttention` names
    (`in_proj_weight`, `in_proj_bias`, `out_proj.weight`, `out_proj.bias`)."""
    wanted = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
    return [b for b in found if b.sources[0].endswith(wanted)]


def to_torch(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's weights in PyTorch layout and names (a `state_dict` of numpy arrays):
    Linear and Conv kernels transposed, BatchNorm's statistics as `running_mean` and
    `running_var` (with `num_batches_tracked`, as PyTorch saves it), attention fused as
    `nn.MultiheadAttention`'s `in_proj_weight`, an `nnx.Sequential`'s layers numbered as
    `nn.Sequential` numbers them (`features.0`). RNG state (a Dropout's key and count) is no
    weight and is left out, as a PyTorch `state_dict` has none. `nitro.weights.load` reads it
    back exactly."""
    layout = model_layout(model)
    arrays: dict[str, np.ndarray] = {}
    for binding in layout.written:
        values = [np.asarray(layout.leaves[t].get_value()) for t in binding.targets]
        for name, array in zip(binding.sources, binding.to_torch(values), strict=True):
            arrays[pytorch_name(name, layout.aliases)] = array
    for name in layout.counters:
        arrays[pytorch_name(name, layout.aliases)] = np.zeros((), np.int64)
    return arrays


def pytorch_name(name: str, aliases: list[tuple[str, str]]) -> str:
    """`name` with each `nnx.Sequential`'s `layers.` dropped, as PyTorch's `nn.Sequential`
    names its layers (the innermost first)."""
    for long, short in sorted(aliases, key=lambda pair: -len(pair[0])):
        if name.startswith(long):
            name = short + name[len(long) :]
    return name
