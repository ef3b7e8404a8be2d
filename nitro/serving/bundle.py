"""Load and run an exported bundle with nothing of Nitro, Flax or Optax.

A bundle is a directory written by `Nitro.export` (see docs/export.md):

```
DIR/
  manifest.json          inputs, outputs, frozen Device values, provenance, file checksums
  program.jaxexport      jax.export serialization of forward, with a symbolic batch axis
  weights.safetensors    the model's weights, passed to the program as arguments
```

This module imports only the standard library, NumPy, JAX and safetensors, so a serving process
loads a bundle without the training stack (`import nitro.bundle` runs no other nitro module
but two leaves, `nitro._version` and `nitro._public_path`).
One bundle serves every batch size; each new size compiles once in this process. A call checks
its inputs and its outputs against the manifest; a bundle's postprocess hook (Python recorded
in the manifest, run after the program) loads only with `trust_code=True`.

>>> import nitro                                   # the training process exports
>>> from nitro.examples.digits import Digits
>>> _ = nitro.Nitro(Digits(), progress=False).export("exports/digits")
>>> import nitro.bundle                            # the serving process loads
>>> model = nitro.bundle.load("exports/digits")
>>> [str(spec) for spec in model.inputs]
['x: float32[batch, 64]']
>>> import numpy as np
>>> model(x=np.zeros((300, 64), np.float32))["output"].shape
(300, 10)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax import export as jax_export

__all__ = [
    "BATCH",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "PROGRAM",
    "WEIGHTS",
    "Bundle",
    "BundleError",
    "OutputError",
    "Postprocess",
    "Program",
    "TensorSpec",
    "load",
    "read_weights",
    "value_problem",
    "weights_from_bytes",
]

FORMAT = "nitro-bundle"
FORMAT_VERSION = 2  # 2: echoed inputs, a postprocess hook (a bundle without them is written as 1)
MANIFEST = "manifest.json"
PROGRAM = "program.jaxexport"
WEIGHTS = "weights.safetensors"
BATCH = -1  # a symbolic (batch) dimension in a manifest shape, as in KServe V2 metadata


class BundleError(ValueError):
    """A bundle is damaged, or a call passed inputs the bundle does not take."""


class OutputError(RuntimeError):
    """A call's outputs are not what the manifest says (an output of another shape or dtype,
    or a postprocess hook that raised): the call returns nothing."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output on the wire: its name, NumPy dtype name, shape (BATCH = -1 for a
    variable axis) and axis names (`("batch", None)`: the first axis is the batch, the second
    unnamed; by default "batch" for each variable axis; `("batch", "height", "width")` shows as
    `[batch, height=8, width=8]`). `echo` names the input an output returns unchanged."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...] = ()
    echo: str | None = None

    def __post_init__(self):
        if not self.axes:
            named = tuple("batch" if d == BATCH else None for d in self.shape)
            object.__setattr__(self, "axes", named)

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> TensorSpec:
        return cls(
            str(entry["name"]),
            str(entry["dtype"]),
            tuple(int(d) for d in entry["shape"]),
            tuple(entry.get("axes") or ()),
            entry.get("echo"),
        )

    def to_json(self) -> dict[str, Any]:
        entry = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "axes": list(self.axes),
        }
        return entry if self.echo is None else {**entry, "echo": self.echo}

    def shape_text(self) -> str:
        return (
            "["
            + ", ".join(
                (axis or "?") if d == BATCH else str(d) if axis is None else f"{axis}={d}"
                for d, axis in zip(self.shape, self.axes, strict=True)
            )
            + "]"
        )

    def fits(self, shape: tuple[int, ...], rows: int | None) -> bool:
        """`shape` is this spec's, its batch axis `rows` long (any length when None)."""
        return len(shape) == len(self.shape) and all(
            have == want or (want == BATCH and (rows is None or axis != "batch" or have == rows))
            for want, have, axis in zip(self.shape, shape, self.axes, strict=True)
        )

    def __str__(self) -> str:
        return f"{self.name}: {self.dtype}{self.shape_text()}"


# safetensors' NumPy reader knows no bfloat16; JAX's ml_dtypes does.
_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": jax.numpy.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_weights(path: str) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as NumPy arrays (bfloat16 included)."""
    with open(path, "rb") as file:
        return weights_from_bytes(file.read(), path)


def weights_from_bytes(data: bytes, path: str) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file's contents (read from `path`, named in errors)."""
    from safetensors import SafetensorError, deserialize

    try:
        tensors = deserialize(data)
    except SafetensorError as error:
        raise BundleError(
            f"{path} is not a readable safetensors file ({error}); re-export the bundle"
        ) from None
    weights = {}
    for name, view in tensors:
        dtype = _SAFETENSORS_DTYPES.get(view["dtype"])
        if dtype is None:
            raise BundleError(f"{path}: tensor {name!r} has unsupported dtype {view['dtype']}")
        weights[name] = np.frombuffer(view["data"], dtype=dtype).reshape(view["shape"])
    return weights


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise BundleError(f"no bundle at {directory}: the directory does not exist")
    if not os.path.isfile(path):
        raise BundleError(
            f"no bundle at {directory}: {MANIFEST} is missing (write one with n.export(dir))"
        )
    try:
        with open(path, encoding="utf-8") as file:
            manifest = json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BundleError(f"{path} is not valid JSON ({error}); re-export the bundle") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f'{path} is not a Nitro bundle manifest (no "format": "{FORMAT}")')
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise BundleError(
            f"{path} is bundle format {version!r}; this nitro.bundle reads format "
            f"{FORMAT_VERSION} and older. Upgrade nitro where the bundle is loaded."
        )
    for key in ("name", "inputs", "outputs", "files"):
        if key not in manifest:
            raise BundleError(f"{path} has no {key!r} entry; re-export the bundle")
    if not isinstance(manifest["name"], str) or not manifest["name"]:
        raise BundleError(f"{path}: 'name' must be a non-empty string; re-export the bundle")
    for key in ("inputs", "outputs"):
        _check_specs(path, key, manifest[key])
    sizes = (manifest.get("program") or {}).get("batch_sizes")
    if sizes is not None and not (
        isinstance(sizes, list)
        and sizes
        and all(type(n) is int and n >= 1 for n in sizes)
        and sizes == sorted(set(sizes))
    ):
        raise BundleError(
            f"{path}: program['batch_sizes'] must be increasing batch sizes, not {sizes!r}; "
            f"re-export the bundle"
        )
    files = manifest["files"]
    if not isinstance(files, dict):
        raise BundleError(f"{path}: 'files' must be an object; re-export the bundle")
    for name in (PROGRAM, WEIGHTS):
        entry = files.get(name)
        if entry is None:
            raise BundleError(f"{path}: 'files' does not list {name}; re-export the bundle")
        where = f"{path}: files[{name!r}]"
        if not isinstance(entry, dict):
            raise BundleError(f"{where} must be an object; re-export the bundle")
        size, digest = entry.get("bytes"), entry.get("sha256")
        if type(size) is not int or size < 0:
            raise BundleError(
                f"{where}['bytes'] must be a byte count, not {size!r}; re-export the bundle"
            )
        if not isinstance(digest, str) or len(digest) != 64:
            raise BundleError(
                f"{where}['sha256'] must be 64 hex digits, not {digest!r}; re-export the bundle"
            )
    return manifest


def _check_specs(path: str, key: str, entries: Any) -> None:
    """Each of the manifest's `inputs` or `outputs` is {"name", "dtype", "shape"}."""
    if not isinstance(entries, list) or not entries:
        raise BundleError(f"{path}: {key!r} must be a non-empty list; re-export the bundle")
    names = set()
    for index, entry in enumerate(entries):
        where = f"{path}: {key}[{index}]"
        if not isinstance(entry, dict):
            raise BundleError(
                f"{where} must be an object with name, dtype and shape; re-export the bundle"
            )
        for field in ("name", "dtype", "shape"):
            if field not in entry:
                raise BundleError(f"{where} has no {field!r}; re-export the bundle")
        if not isinstance(entry["name"], str) or not entry["name"]:
            raise BundleError(
                f"{where}['name'] must be a non-empty string, not {entry['name']!r}; "
                f"re-export the bundle"
            )
        if entry["name"] in names:
            raise BundleError(
                f"{where}['name'] {entry['name']!r} is listed twice; re-export the bundle"
            )
        names.add(entry["name"])
        if not isinstance(entry["dtype"], str):
            raise BundleError(
                f"{where}['dtype'] must be a dtype name, not {entry['dtype']!r}; "
                f"re-export the bundle"
            )
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(
            type(d) is int and (d >= 0 or d == BATCH) for d in shape
        ):
            raise BundleError(
                f"{where}['shape'] must be a list of sizes (-1 for the batch axis), not "
                f"{shape!r}; re-export the bundle"
            )
        axes = entry.get("axes", [None] * len(shape))
        if (
            not isinstance(axes, list)
            or len(axes) != len(shape)
            or not all(a is None or (isinstance(a, str) and a) for a in axes)
        ):
            raise BundleError(
                f"{where}['axes'] must name each of the {len(shape)} axes (a name or null), "
                f"not {axes!r}; re-export the bundle"
            )


def _program_outputs(manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The manifest's entries for what the program returns: its outputs but the echoed inputs,
    or with a postprocess hook, the hook's `program_outputs`."""
    hook = manifest.get("postprocess")
    if hook is not None:
        return hook["program_outputs"]
    return [entry for entry in manifest["outputs"] if "echo" not in entry]


def _check_signature(directory: str, manifest: Mapping[str, Any], exported) -> None:
    """The manifest's inputs and outputs are those of the program, name by name."""
    path = os.path.join(directory, MANIFEST)
    program = os.path.join(directory, PROGRAM)
    try:
        (_, inputs), _ = jax.tree.unflatten(exported.in_tree, exported.in_avals)
        outputs = jax.tree.unflatten(exported.out_tree, exported.out_avals)
        if not (isinstance(inputs, dict) and isinstance(outputs, dict)):
            raise TypeError
    except (TypeError, ValueError):
        raise BundleError(
            f"{program} does not take (weights, inputs) and return outputs by name; it was not "
            f"written by n.export. Re-export the bundle"
        ) from None
    entries = {"inputs": manifest["inputs"], "outputs": _program_outputs(manifest)}
    for key, avals, verb in (("inputs", inputs, "takes"), ("outputs", outputs, "returns")):
        listed = [entry["name"] for entry in entries[key]]
        if sorted(listed) != sorted(avals):
            raise BundleError(
                f"{path}: {key!r} names {listed}, but {program} {verb} {sorted(avals)}; "
                f"re-export the bundle"
            )
        for index, entry in enumerate(entries[key]):
            aval = avals[entry["name"]]
            dims = [d if isinstance(d, int) else BATCH for d in aval.shape]
            spec = TensorSpec(entry["name"], np.dtype(aval.dtype).name, tuple(dims))
            where = f"{path}: {key}[{index}] ({entry['name']!r})"
            if entry["dtype"] != spec.dtype:
                raise BundleError(
                    f"{where} has dtype {entry['dtype']!r}, but {program} {verb} {spec}; "
                    f"re-export the bundle"
                )
            if entry["shape"] != dims:
                raise BundleError(
                    f"{where} has shape {entry['shape']}, but {program} {verb} {spec} "
                    f"(-1 is the batch axis); re-export the bundle"
                )
    wire = {entry["name"]: entry for entry in manifest["inputs"]}
    for index, entry in enumerate(manifest["outputs"]):
        source = wire.get(entry["echo"]) if "echo" in entry else None
        if "echo" in entry and (
            source is None or (source["dtype"], source["shape"]) != (entry["dtype"], entry["shape"])
        ):
            raise BundleError(
                f"{path}: outputs[{index}] ({entry['name']!r}) echoes input "
                f"{entry['echo']!r}, which the bundle does not take with that dtype and shape; "
                f"re-export the bundle"
            )


def _check_file(directory: str, name: str, manifest: Mapping[str, Any]) -> str:
    path = os.path.join(directory, name)
    expected = manifest["files"][name]
    if not os.path.isfile(path):
        raise BundleError(f"{path} is missing; the manifest expects it ({expected['bytes']} bytes)")
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        raise BundleError(
            f"{path} has {size} bytes but the manifest expects {expected['bytes']} "
            f"(truncated, or written by another export); re-export the bundle"
        )
    if _file_digest(path) != expected["sha256"]:
        raise BundleError(
            f"{path} does not match the sha256 in the manifest (changed after the export, or "
            f"an export was still writing it); re-export the bundle"
        )
    return path


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


def value_problem(data: Any, dtype: np.dtype, wire: str) -> str | None:
    """What in Python values (a list, JSON or gRPC contents; not binary data) does not fit
    `dtype` exactly, or None: NumPy would truncate 1.7 to 1 for an integer input, wrap 300
    for int8, make 1e39 infinite for float32, or raise a raw OverflowError for 2**40.

    >>> value_problem([1.0, 1.7], np.dtype("int32"), "int32")
    '1.7 is not a whole number, and int32 takes integers only'
    >>> value_problem([2**40], np.dtype("int32"), "int32")
    '1099511627776 is out of the range of int32 (-2147483648 to 2147483647)'
    >>> value_problem([[1, 2]], np.dtype("float32"), "float32") is None
    True
    """
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


@dataclasses.dataclass(frozen=True)
class Postprocess:
    """A bundle's host hook, `postprocess(self, outputs, **inputs)`, from its recorded source.

    It runs on the host after the program: `outputs` are the program's outputs and `inputs`
    the wire inputs, as NumPy arrays, and it returns {output name: array}; `self` holds the
    experiment's GraphConst and Device values recorded at export (`fields`). The source runs
    with `np` (NumPy) in scope; it imports what else it uses.
    """

    source: str
    fields: Mapping[str, Any]
    function: Any = dataclasses.field(repr=False, default=None)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @classmethod
    def compile(cls, source: str, fields: Mapping[str, Any], where: str) -> Postprocess:
        """The hook defined by `source` (ValueError naming `where` if it defines none)."""
        namespace: dict[str, Any] = {"np": np, "__name__": "nitro_bundle_postprocess"}
        try:
            exec(compile(source, f"<postprocess of {where}>", "exec"), namespace)  # noqa: S102
        except Exception as error:  # noqa: BLE001 - any failure: the source does not define it
            raise ValueError(
                f"the postprocess source of {where} does not run on its own "
                f"({type(error).__name__}: {error}); it must be a plain `def postprocess(self, "
                f"outputs, **inputs)` that imports what it uses (np is NumPy)"
            ) from None
        function = namespace.get("postprocess")
        if not callable(function):
            raise ValueError(f"the postprocess source of {where} defines no function `postprocess`")
        return cls(source, dict(fields), function)

    def __call__(
        self, name: str, outputs: dict[str, np.ndarray], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, Any]:
        """The hook's outputs; OutputError names the hook when it raises or returns no dict."""
        import types

        try:
            result = self.function(types.SimpleNamespace(**self.fields), dict(outputs), **inputs)
        except Exception as error:
            raise OutputError(
                f"{name}'s postprocess hook raised {type(error).__name__}: {error}; the call "
                f"returns no outputs"
            ) from error
        if not isinstance(result, Mapping) or not all(isinstance(k, str) for k in result):
            raise OutputError(
                f"{name}'s postprocess hook returned {type(result).__name__}; it must return a "
                f"dict {{output name: array}}"
            )
        return dict(result)


def _postprocess(
    directory: str, manifest: Mapping[str, Any], trust_code: bool
) -> Postprocess | None:
    """The manifest's postprocess hook, compiled when `trust_code`; refused otherwise."""
    entry = manifest.get("postprocess")
    if entry is None:
        return None
    path = os.path.join(directory, MANIFEST)
    if not (
        isinstance(entry, dict)
        and isinstance(entry.get("source"), str)
        and isinstance(entry.get("sha256"), str)
        and isinstance(entry.get("fields"), dict)
    ):
        raise BundleError(
            f"{path}: 'postprocess' must hold its source, sha256 and fields; re-export the bundle"
        )
    _check_specs(path, "postprocess.program_outputs", entry.get("program_outputs"))
    digest = hashlib.sha256(entry["source"].encode()).hexdigest()
    if digest != entry["sha256"]:
        raise BundleError(
            f"{path}: the postprocess source does not match its sha256 (edited after the "
            f"export); re-export the bundle"
        )
    if not trust_code:
        raise BundleError(
            f"{directory} holds a postprocess hook (manifest.json's 'postprocess', sha256 "
            f"{digest[:16]}...) that runs the Python source recorded in the bundle on this "
            f"host. Read it there; if you trust where the bundle came from, load it with "
            f"nitro.bundle.load(dir, trust_code=True), or serve it with nitro serve --trust-code"
        )
    try:
        return Postprocess.compile(entry["source"], entry["fields"], manifest["name"])
    except ValueError as error:
        raise BundleError(f"{path}: {error}; re-export the bundle") from None


@dataclasses.dataclass(frozen=True)
class Program:
    """A bundle's deserialized program and its compiled call, shared by the bundles whose
    program file has the same sha256 and whose inputs are the same (`key`)."""

    key: str
    exported: Any  # jax.export.Exported
    call: Any  # jax.jit of exported.call: compiles once per batch width


def _program_key(manifest: Mapping[str, Any]) -> str:
    """The program file's sha256 and the input signature: bundles with one key run one program."""
    signature = hashlib.sha256(json.dumps(manifest["inputs"], sort_keys=True).encode())
    return f"{manifest['files'][PROGRAM]['sha256']}:{signature.hexdigest()[:16]}"


class Bundle:
    """A loaded bundle: call it with its inputs by name; it returns its outputs by name.

    `inputs` and `outputs` are `TensorSpec`s (BATCH, -1, marks the batch axis); `manifest` is
    the parsed manifest.json, with the frozen Device values and the provenance of the export;
    `program` the (shareable) compiled program, `weights` the tensors as NumPy arrays.
    """

    def __init__(
        self,
        directory: str,
        manifest: dict[str, Any],
        program: Program,
        weights,
        postprocess: Postprocess | None = None,
    ):
        self.directory = directory
        self.manifest = manifest
        self.name: str = manifest["name"]
        self.inputs = tuple(TensorSpec.from_json(e) for e in manifest["inputs"])
        self.outputs = tuple(TensorSpec.from_json(e) for e in manifest["outputs"])
        self.program_outputs = tuple(TensorSpec.from_json(e) for e in _program_outputs(manifest))
        self.program = program
        self.postprocess = postprocess  # run on the host after the program
        sizes = manifest.get("program", {}).get("batch_sizes")
        self.batch_sizes: tuple[int, ...] = tuple(sizes or ())  # what a call is padded to
        self.weights: dict[str, np.ndarray] = weights  # on the host; placed on the first call
        self._placed = None

    @property
    def weights_bytes(self) -> int:
        """The bytes of the weights' tensors (what they take in memory, on host or device)."""
        return sum(int(t.nbytes) for t in self.weights.values())

    def __call__(
        self, inputs: Mapping[str, Any] | None = None, /, **named: Any
    ) -> dict[str, np.ndarray]:
        """Run the program: `bundle(x=xs)` or `bundle({"x": xs})` -> {"output": array}."""
        given = {**(inputs or {}), **named}
        arrays = self.check_inputs(given)
        if self._placed is None:
            self._placed = jax.device_put(self.weights)
        return self.run(self._placed, arrays)

    def run(self, weights: Mapping[str, Any], arrays: Mapping[str, np.ndarray]):
        """The program on checked `arrays` with `weights` (this bundle's, or another weight
        set of its program, on the host or the device) -> {output name: array}."""
        rows = next(iter(arrays.values())).shape[0]  # every input has the batch axis first
        width = self.width(rows)
        if width == rows and (not self.batch_sizes or rows <= self.batch_sizes[-1]):
            results = self.program.call(weights, arrays)
            outputs = {spec.name: np.asarray(results[spec.name]) for spec in self.program_outputs}
        else:  # padded (repeating the last row) to a batch size, in calls of at most the largest
            step = min(width, self.batch_sizes[-1])
            padded = {
                k: np.concatenate([v, np.repeat(v[-1:], width - rows, 0)])
                for k, v in arrays.items()
            }
            parts = [
                self.program.call(weights, {k: v[first : first + step] for k, v in padded.items()})
                for first in range(0, width, step)
            ]
            outputs = {
                spec.name: np.concatenate([np.asarray(p[spec.name]) for p in parts])[:rows]
                for spec in self.program_outputs
            }
        if self.postprocess is not None:
            outputs = self.postprocess(self.name, outputs, arrays)
        for spec in self.outputs:
            if spec.echo is not None:  # the wire input, unchanged
                outputs[spec.name] = np.asarray(arrays[spec.echo])
        return self.check_outputs(outputs, rows)

    def width(self, rows: int, max_batch: int | None = None) -> int:
        """The rows a call of `rows` runs with: the smallest of `batch_sizes` that holds them
        (beyond the largest, a multiple of it, run in calls of the largest); without batch
        sizes, `rows`, or with `max_batch` the next power of two up to it (`nitro serve`)."""
        if self.batch_sizes:
            fit = next((size for size in self.batch_sizes if size >= rows), None)
            largest = self.batch_sizes[-1]
            return fit if fit is not None else -(-rows // largest) * largest
        return rows if max_batch is None else min(1 << (rows - 1).bit_length(), max_batch)

    def check_outputs(self, outputs: Mapping[str, Any], rows: int) -> dict[str, np.ndarray]:
        """`outputs` in the manifest's order, after checking each one's dtype and shape against
        it (the batch axis `rows` long); OutputError names an output that differs."""
        extra = sorted(set(outputs) - {s.name for s in self.outputs})
        if extra:
            raise OutputError(
                f"{self.name} returned {', '.join(map(repr, extra))}, which its manifest does "
                f"not list (it lists {', '.join(map(str, self.outputs))}); re-export the bundle"
            )
        checked = {}
        for spec in self.outputs:
            if spec.name not in outputs:
                raise OutputError(
                    f"{self.name} returned no output {spec.name!r} ({spec}); re-export the bundle"
                )
            value = np.asarray(outputs[spec.name])
            if value.dtype != np.dtype(spec.dtype) or not spec.fits(tuple(value.shape), rows):
                raise OutputError(
                    f"{self.name}'s output {spec.name!r} is {value.dtype.name}"
                    f"{list(value.shape)} for {rows} row{'s' * (rows != 1)}, but its manifest "
                    f"says {spec}; the bundle's program or hook does not return what it was "
                    f"exported with"
                )
            checked[spec.name] = value
        return checked

    def check_inputs(self, given: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The inputs as arrays, after checking names, dtypes and shapes (BundleError names
        the input and what was expected)."""
        unknown = sorted(set(given) - {s.name for s in self.inputs})
        if unknown:
            raise BundleError(
                f"{self.name} has no input {', '.join(map(repr, unknown))}; it takes "
                f"{', '.join(map(str, self.inputs))}"
            )
        arrays = {}
        batch = None
        for spec in self.inputs:
            if spec.name not in given:
                raise BundleError(
                    f"{self.name} needs input {spec.name!r} ({spec}); it takes "
                    f"{', '.join(map(str, self.inputs))}"
                )
            value = given[spec.name]
            if not hasattr(value, "dtype"):  # a list or a number: converted by the input's dtype
                problem = value_problem(value, np.dtype(spec.dtype), spec.dtype)
                if problem is not None:
                    raise BundleError(
                        f"input {spec.name!r} must be {spec.dtype}{spec.shape_text()}: "
                        f"{problem}; give values that fit, or an array of that dtype"
                    )
                try:
                    value = np.asarray(value, dtype=spec.dtype)
                except (TypeError, ValueError, OverflowError) as error:
                    raise BundleError(
                        f"input {spec.name!r} must be {spec.dtype}{spec.shape_text()}: {error}"
                    ) from None
            shape = tuple(value.shape)
            got = f"got {np.dtype(value.dtype).name}{list(shape)}"
            if np.dtype(value.dtype) != np.dtype(spec.dtype):
                raise BundleError(
                    f"input {spec.name!r} must be {spec.dtype}{spec.shape_text()}; {got}. "
                    f"Convert it, e.g. x.astype('{spec.dtype}')"
                )
            if not spec.fits(shape, None):
                fix = ""
                if shape == spec.shape[1:] and spec.shape[:1] == (BATCH,):
                    fix = f". For a single example, add the batch axis: {spec.name}[None]"
                raise BundleError(
                    f"input {spec.name!r} must have shape {spec.shape_text()}; {got}{fix}"
                )
            for want, have in zip(spec.shape, shape, strict=True):
                if want == BATCH and have < 1:
                    raise BundleError(f"input {spec.name!r} has no rows; give at least one")
                if want == BATCH:
                    if batch is not None and have != batch[1]:
                        raise BundleError(
                            f"inputs {batch[0]!r} and {spec.name!r} must share the batch size; "
                            f"they have {batch[1]} and {have} rows"
                        )
                    batch = (spec.name, have)
            arrays[spec.name] = np.asarray(value)
        return arrays

    def __repr__(self) -> str:
        ins = ", ".join(map(str, self.inputs))
        outs = ", ".join(map(str, self.outputs))
        return f"<nitro bundle {self.name!r} ({ins}) -> ({outs}) from {self.directory}>"


def load(
    directory: str | os.PathLike,
    *,
    programs: dict[str, Program] | None = None,
    trust_code: bool = False,
) -> Bundle:
    """Load the bundle in `directory`, checking every file against the manifest.

    A bundle with a postprocess hook runs Python source recorded in it: it loads only with
    `trust_code=True` (BundleError otherwise, naming the flag), the choice to run it.

    A missing or damaged file, a manifest from a newer format, or one that does not match the
    program (its keys, or an input's or output's name, dtype or shape) raises `BundleError`
    naming the file, the key and what was expected. With `programs` (a dict the caller keeps),
    bundles of one program (the program file's sha256 and the inputs) share its
    deserialization and compiled calls.
    """
    directory = os.fspath(directory)
    manifest = _read_manifest(directory)
    postprocess = _postprocess(directory, manifest, trust_code)
    program_path = _check_file(directory, PROGRAM, manifest)
    weights_path = _check_file(directory, WEIGHTS, manifest)
    key = _program_key(manifest)
    program = (programs or {}).get(key)
    if program is None:
        with open(program_path, "rb") as file:
            blob = file.read()
        try:
            exported = jax_export.deserialize(bytearray(blob))
        except Exception as error:  # noqa: BLE001 - any failure means an unreadable program
            raise BundleError(
                f"{program_path} cannot be deserialized by jax {jax.__version__} ({error}); "
                f"re-export with a jax version close to this one"
            ) from None
        program = Program(key, exported, jax.jit(exported.call))
    exported = program.exported
    _check_signature(directory, manifest, exported)
    weights = read_weights(weights_path)
    (expected, _), _ = jax.tree.unflatten(exported.in_tree, exported.in_avals)
    if set(weights) != set(expected):
        missing = sorted(set(expected) - set(weights))[:3]
        extra = sorted(set(weights) - set(expected))[:3]
        raise BundleError(
            f"{weights_path} does not hold the tensors {program_path} takes (missing: "
            f"{missing or 'none'}, unexpected: {extra or 'none'}); re-export the bundle"
        )
    for name, aval in expected.items():
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(aval.shape) or tensor.dtype != aval.dtype:
            raise BundleError(
                f"{weights_path}: tensor {name!r} is {tensor.dtype}{list(tensor.shape)}, but the "
                f"program expects {aval.dtype}{list(aval.shape)}; re-export the bundle"
            )
    if programs is not None:
        programs.setdefault(key, program)
    return Bundle(directory, manifest, program, weights, postprocess)
