"""Export: a handle's eval-mode forward as a bundle that runs wherever JAX runs.

```
handle ──export_handle──► ExportSource ──write_bundle──► DIR/manifest.json
         (the only code        (pure forward,              DIR/program.jaxexport
          that reads a          weights by name,           DIR/weights.safetensors
          handle)               wire specs, provenance)
```

`write_bundle` lowers `export_preprocess` (when defined) then `forward` with `jax.export`, with
a symbolic batch axis, so one bundle serves every batch size, for CPU, CUDA, ROCm and TPU by
default. The weights are arguments of the program (not constants), written as safetensors;
Device fields are frozen into the program as constants. Nothing is pickled. `nitro.bundle`
loads the result without Nitro, Flax or Optax.

Optional experiment hooks shape the wire:

- `export_inputs(self)`: {name: one sample's shape and dtype}, e.g.
  `{"image": jax.ShapeDtypeStruct((28, 28), jnp.uint8)}`. Default: the fields `forward` (or
  `export_preprocess`) takes, with the dtypes and trailing shapes of the first split's batch.
- `export_preprocess(self, **wire)`: traced into the bundle; returns the fields `forward` takes.
- `export_outputs(self)`: {name: dtype or None} naming `forward`'s outputs (one entry per output
  array, the keys of a dict output) and optionally casting them.
- `postprocess(self, outputs, **inputs)`: run on the host after the program, in NumPy; its
  source, fingerprint and `self`'s values are recorded in the manifest, and the loader runs
  that text (only when trusted: `nitro.bundle.load(dir, trust_code=True)`).

`echo=` names wire inputs returned unchanged as outputs. Specs name their axes ("batch" first);
`axes=` names the others. `batch_sizes=` records the sizes a loader pads a call to (the program
keeps its symbolic batch: compiled for a size, it runs as a program exported for that size does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from nitro.programs.compile_cache import ProgramKind, record_compile
from nitro.runs.run_origin import PATCH, package_versions, provenance, run_config
from nitro.serving import bundle

__all__ = [
    "DEFAULT_PLATFORMS",
    "ExportError",
    "ExportSource",
    "check_axes",
    "check_batch_sizes",
    "export_handle",
    "write_bundle",
]

DEFAULT_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class ExportError(ValueError):
    """An experiment or handle cannot be exported as it is; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class ExportSource:
    """What a bundle is made of, independent of how the model was built or trained.

    `forward(weights, **inputs)` is pure and in eval mode: `weights` maps the names in
    `weights` to arrays, `inputs` the wire inputs (batch axis first) to arrays. `inputs` gives
    one sample's shape and dtype per wire input; `outputs` optionally names and types the
    outputs ({name: dtype or None}).
    """

    name: str
    forward: Callable[..., Any]
    weights: Mapping[str, np.ndarray]
    inputs: Mapping[str, jax.ShapeDtypeStruct]
    outputs: Mapping[str, Any] | None = None
    device_values: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    provenance: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    owner: str = ""
    files: Mapping[str, bytes] = dataclasses.field(default_factory=dict)  # more of the bundle's
    echo: tuple[str, ...] = ()  # wire inputs returned unchanged as outputs of the same name
    postprocess: bundle.Postprocess | None = None  # run on the host after the program
    batch_sizes: tuple[int, ...] = ()  # what a call is padded to (compiled when loaded)
    # {input or output name: a name or None per axis, "batch" first}, checked by check_axes
    axes: Mapping[str, tuple[str | None, ...]] = dataclasses.field(default_factory=dict)


def _dims(shape) -> list[int]:
    return [d if isinstance(d, int) else bundle.BATCH for d in shape]


def _output_names(outputs: Any, wanted: Mapping[str, Any] | None) -> dict[str, Any]:
    """forward's outputs as {wire name: array}, named by `export_outputs` or by default."""
    leaves = jax.tree_util.tree_flatten_with_path(outputs)[0]
    if isinstance(outputs, Mapping):
        names = [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in leaves]
    elif len(leaves) == 1:
        names = ["output"]
    else:
        names = [f"output_{i}" for i in range(len(leaves))]
    arrays = dict(zip(names, (leaf for _, leaf in leaves), strict=True))
    if wanted is None:
        return arrays
    wanted = dict(wanted)
    if isinstance(outputs, Mapping):
        if set(wanted) != set(arrays):
            raise ExportError(
                f"export_outputs() names {sorted(wanted)}, but forward returns a dict with "
                f"{sorted(arrays)}; name exactly forward's outputs (a dtype or None for each)"
            )
        order = list(wanted)
        chosen = {name: arrays[name] for name in order}
    else:
        if len(wanted) != len(arrays):
            raise ExportError(
                f"export_outputs() names {len(wanted)} output{'s' * (len(wanted) != 1)} but "
                f"forward returns {len(arrays)} array{'s' * (len(arrays) != 1)}; give one "
                f"name per array, in order"
            )
        chosen = dict(zip(wanted, arrays.values(), strict=True))
    return {
        name: value if wanted[name] is None else jnp.asarray(value).astype(wanted[name])
        for name, value in chosen.items()
    }


def _serialize_weights(weights: Mapping[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save

    return save({name: np.asarray(value, order="C") for name, value in weights.items()})


# Files a bundle directory may hold: the bundle's own, and the temporaries an export before
# atomic bundles could leave behind (removed by the next export).
_BUNDLE_FILES = (bundle.MANIFEST, bundle.PROGRAM, bundle.WEIGHTS, PATCH)
_OLD_TEMPORARY = re.compile(
    r"^\.(manifest\.json|program\.jaxexport|weights\.safetensors)\.\d+\.tmp$"
)


def _prepare_directory(directory: str) -> None:
    """Refuse a target that is not a bundle directory, before anything is traced or written."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ExportError(f"cannot export to {directory}: it is a file; choose a directory")
    if not os.path.isdir(directory):
        return
    entries = [e for e in os.listdir(directory) if not _OLD_TEMPORARY.match(e)]
    if entries and bundle.MANIFEST not in entries:
        raise ExportError(
            f"{directory} is not empty and holds no bundle; export to a new or empty "
            f"directory, or to an earlier export's directory to replace it"
        )
    other = sorted(e for e in entries if e not in _BUNDLE_FILES)
    if other:
        raise ExportError(
            f"{directory} holds files that are not part of its bundle ({', '.join(other[:5])}); "
            f"a re-export replaces the whole directory, so move them elsewhere first"
        )


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "xb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _sync_directory(path: str) -> None:
    if os.name == "posix":  # a directory's entries are durable once it is synced (POSIX)
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _publish(directory: str, files: Mapping[str, bytes], manifest: dict[str, Any]) -> None:
    """Write the bundle whole into a sibling directory, then swap it in with two renames, so
    `directory` holds the previous bundle or the new one, never a mix, and a failure (a full
    disk) leaves the previous bundle as it was and no temporary behind.

    `manifest["files"]` gets each file's size and checksum; the manifest is written last.
    """
    for name, data in files.items():
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    files = {**files, bundle.MANIFEST: json.dumps(manifest, indent=2).encode() + b"\n"}
    target = os.path.realpath(directory)  # a symlink goes on pointing at the bundle
    parent, base = os.path.split(target)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    staging = os.path.join(parent, f".{base}.export-{tag}")
    retired = os.path.join(parent, f".{base}.previous-{tag}")
    moved = False
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(staging)
        if os.path.isdir(target):
            shutil.copymode(target, staging)
        for name, data in files.items():  # the manifest last
            _write_synced(os.path.join(staging, name), data)
        _sync_directory(staging)
        if os.path.isdir(target):
            os.rename(target, retired)
            moved = True
        os.rename(staging, target)
        moved = False
    except BaseException as error:  # a full disk, or Ctrl-C while writing: undo, then say why
        if moved:  # the new bundle did not go in: put the previous one back
            os.rename(retired, target)
        shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(error, OSError):
            raise
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            size = sum(map(len, files.values()))
            fix = f"Free space on that disk (the bundle takes {size:,} bytes) or export elsewhere"
        elif error.errno == errno.EBUSY:
            fix = "It is a mount point, which cannot be replaced: export to a directory inside it"
        else:
            fix = "Check that its parent directory is writable, or export elsewhere"
        kept = (
            "the previous bundle there is unchanged"
            if moved or os.path.isdir(target)
            else "nothing was written there"
        )
        raise ExportError(
            f"cannot write the bundle to {directory} ({error.strerror or error}); {kept}. {fix}."
        ) from error
    with contextlib.suppress(OSError):  # the new bundle is in place: make the swap durable
        _sync_directory(parent)
    shutil.rmtree(retired, ignore_errors=True)


def _check_platforms(platforms: Any) -> tuple[str, ...]:
    valid = ", ".join(map(repr, DEFAULT_PLATFORMS))
    example = "e.g. platforms=('cpu',) or platforms=('cpu', 'cuda')"
    if isinstance(platforms, str) or not isinstance(platforms, (tuple, list)):
        raise ExportError(
            f"platforms must be a tuple of platform names, {example}; got {platforms!r}"
        )
    if not platforms:
        raise ExportError(
            f"platforms=() names no platform to lower for; name at least one of {valid}, "
            f"{example}, or leave it out for all four"
        )
    unknown = [p for p in platforms if p not in DEFAULT_PLATFORMS]
    if unknown:
        gpu = " ('cuda' for NVIDIA GPUs, 'rocm' for AMD)" if "gpu" in unknown else ""
        raise ExportError(
            f"platforms names {', '.join(map(repr, unknown))}, which jax.export cannot lower "
            f"for; the valid platforms are {valid}{gpu} ({example})"
        )
    if len(set(platforms)) != len(platforms):
        raise ExportError(f"platforms names a platform twice: {tuple(platforms)!r}; name each once")
    return tuple(platforms)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        return np.asarray(value).tolist()
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _callbacks(jaxpr: Any) -> list[Any]:
    """The host-callback equations of a jaxpr, its sub-programs' (a scan's body, a cond's
    branches, a nested jit) included."""
    found = []
    for eqn in jaxpr.eqns:
        if "callback" in eqn.primitive.name:
            found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found.extend(_callbacks(inner))
    return found


def _refuse_host_callbacks(
    program: Any, weight_specs: Any, inputs: Mapping[str, Any], error: Exception
) -> None:
    """After a failed export: when forward holds a host callback, which no bundle can hold
    (it calls Python in this process), say so and how to take it out, instead of JAX's error
    about lowering it."""
    concrete = {
        name: jax.ShapeDtypeStruct((2, *spec.shape), spec.dtype) for name, spec in inputs.items()
    }
    try:
        found = _callbacks(jax.make_jaxpr(program)(weight_specs, concrete).jaxpr)
    except Exception:  # noqa: BLE001 - forward does not trace: the export's error says why
        return
    if not found:
        return
    try:
        from jax._src import source_info_util  # where each one is: the best line of user code

        where = f" at {source_info_util.summarize(found[0].source_info)}"
    except Exception:  # noqa: BLE001 - a private helper of JAX's: the place is a nicety
        where = ""
    names = sorted({eqn.primitive.name for eqn in found})
    raise ExportError(
        f"forward holds {len(found)} host callback{'s' * (len(found) != 1)} "
        f"({', '.join(names)}{where}): jax.pure_callback, jax.debug.callback, jax.debug.print "
        f"or a library's runtime check calls Python in this process, which a bundle cannot "
        f"hold. Take it out of forward for export (or behind a Device field you set off "
        f"before exporting). Diffrax's default error checks are such callbacks: set "
        f"EQX_ON_ERROR=nan in the environment before equinox is imported, or give "
        f"diffeqsolve(..., throw=False). JAX's error: {type(error).__name__}: {error}"
    ) from error


def _probe_postprocess(
    name: str,
    hook: bundle.Postprocess,
    wire: Mapping[str, bundle.TensorSpec],
    program_outputs: list[bundle.TensorSpec],
) -> list[bundle.TensorSpec]:
    """The hook's outputs, from calls on zeros of 1 and 2 rows: an axis whose length differs
    between the two is variable (-1), named "batch" when it is the first and as long as the
    rows. Each output must have the batch axis first (the server pads and slices by rows)."""
    seen: list[dict[str, np.ndarray]] = []

    def zeros(spec: bundle.TensorSpec, rows: int) -> np.ndarray:
        return np.zeros([rows if d == bundle.BATCH else d for d in spec.shape], spec.dtype)

    for rows in (1, 2):
        outputs = {spec.name: zeros(spec, rows) for spec in program_outputs}
        inputs = {spec.name: zeros(spec, rows) for spec in wire.values()}
        try:
            result = hook(name, outputs, inputs)
        except bundle.OutputError as error:
            raise ExportError(
                f"{error} when export called it on zeros of {rows} row{'s' * (rows != 1)} "
                f"(outputs {', '.join(map(str, program_outputs))}); make it work for any batch"
            ) from error.__cause__
        seen.append({k: np.asarray(v) for k, v in result.items()})
    if not seen[0] or list(seen[0]) != list(seen[1]):
        raise ExportError(
            f"postprocess returned {sorted(seen[0])} for 1 row and {sorted(seen[1])} for 2; "
            f"return the same non-empty dict {{output name: array}} for every batch"
        )
    specs = []
    for key, one in seen[0].items():
        two = seen[1][key]
        if one.ndim != two.ndim or one.dtype != two.dtype or one.ndim == 0:
            raise ExportError(
                f"postprocess output {key!r} is {one.dtype}{list(one.shape)} for 1 row and "
                f"{two.dtype}{list(two.shape)} for 2; each output must have the batch axis "
                f"first and one dtype and rank for every batch"
            )
        if (one.shape[0], two.shape[0]) != (1, 2):
            raise ExportError(
                f"postprocess output {key!r} has {one.shape[0]} and {two.shape[0]} rows for "
                f"batches of 1 and 2; put the batch axis first, one row per input row"
            )
        shape = tuple(
            a if a == b else bundle.BATCH for a, b in zip(one.shape, two.shape, strict=True)
        )
        axes = ("batch",) + (None,) * (one.ndim - 1)
        specs.append(bundle.TensorSpec(key, one.dtype.name, shape, axes))
    return specs


def check_batch_sizes(sizes: Any) -> tuple[int, ...]:
    """`batch_sizes=`: increasing batch sizes, e.g. (1, 8, 32)."""
    example = "e.g. batch_sizes=(1, 8, 32)"
    if sizes is None:
        return ()
    if isinstance(sizes, (str, int)) or not isinstance(sizes, (tuple, list)) or not sizes:
        raise ExportError(
            f"batch_sizes must be a non-empty tuple of sizes, {example}; got {sizes!r}"
        )
    if not all(type(n) is int and n >= 1 for n in sizes) or list(sizes) != sorted(set(sizes)):
        raise ExportError(
            f"batch_sizes must be whole numbers of rows of at least 1, increasing, each once "
            f"({example}); got {tuple(sizes)!r}"
        )
    return tuple(sizes)


def _check_echo(echo: Any, wire: Mapping[str, Any], outputs: list[str]) -> tuple[str, ...]:
    """`echo=`: names of wire inputs, none of them also an output of forward."""
    if isinstance(echo, str) or not isinstance(echo, (tuple, list)):
        raise ExportError(f"echo must be a tuple of input names, e.g. echo=('id',); got {echo!r}")
    for name in echo:
        if name not in wire:
            raise ExportError(
                f"echo names {name!r}, which is not an input of the bundle (it takes "
                f"{', '.join(map(str, wire.values()))}); declare it in export_inputs(self), "
                f"e.g. {{{name!r}: jax.ShapeDtypeStruct((), jnp.int32)}}"
            )
        if name in outputs:
            raise ExportError(
                f"echo names {name!r}, but the bundle already returns an output {name!r}; "
                f"rename one of them (export_outputs(self) names forward's outputs)"
            )
    if len(set(echo)) != len(echo):
        raise ExportError(f"echo names an input twice: {tuple(echo)!r}; name each once")
    return tuple(echo)


_AXES_EXAMPLE = "e.g. axes={'x': ('batch', 'height', 'width')}"


def check_axes(axes: Any) -> dict[str, tuple[str | None, ...]]:
    """`axes=`: {input or output name: a name (or None) per axis, "batch" first}, checked for
    its form before anything is traced (its fit to the shapes is checked by the export)."""
    if axes is None:
        return {}
    if not isinstance(axes, Mapping):
        raise ExportError(
            f"axes must be a dict {{input or output name: a name per axis}}, {_AXES_EXAMPLE}; "
            f"got {axes!r}"
        )
    checked = {}
    for key, names in axes.items():
        if not isinstance(key, str) or not key:
            raise ExportError(f"axes keys are input or output names, {_AXES_EXAMPLE}; got {key!r}")
        if isinstance(names, str) or not isinstance(names, (tuple, list)):
            raise ExportError(
                f"axes[{key!r}] must be a tuple with a name (or None) for each axis, 'batch' "
                f"first, {_AXES_EXAMPLE}; got {names!r}"
            )
        if not all(n is None or (isinstance(n, str) and n) for n in names):
            raise ExportError(
                f"axes[{key!r}] = {tuple(names)!r}: each axis name must be a non-empty string "
                f"or None (unnamed), {_AXES_EXAMPLE}"
            )
        named = [n for n in names if n is not None]
        if len(set(named)) != len(named):
            raise ExportError(
                f"axes[{key!r}] = {tuple(names)!r} names an axis twice; give each axis its own name"
            )
        checked[key] = tuple(names)
    return checked


def _name_axes(
    specs: list[bundle.TensorSpec], axes: Mapping[str, tuple[str | None, ...]]
) -> tuple[list[bundle.TensorSpec], list[str]]:
    """`specs` with the axes `axes` names for them, and what does not fit: a count of names
    other than the rank, or "batch" named anywhere but the batch axis."""
    named, problems = [], []
    for spec in specs:
        names = axes.get(spec.name)
        if names is None:
            named.append(spec)
            continue
        example = tuple(a if a == "batch" else f"axis{i}" for i, a in enumerate(spec.axes))
        fix = (
            f"give one name (or None) per axis, 'batch' for the batch axis: e.g. "
            f"axes={{{spec.name!r}: {example!r}}}"
        )
        if len(names) != len(spec.shape):
            problems.append(
                f"axes[{spec.name!r}] names {len(names)} ax{'es' if len(names) != 1 else 'is'} "
                f"{tuple(names)!r}, but {spec} has {len(spec.shape)}; {fix}"
            )
        elif any(
            (old == "batch") != (new == "batch") for old, new in zip(spec.axes, names, strict=True)
        ):
            problems.append(
                f"axes[{spec.name!r}] = {tuple(names)!r} does not name the batch axis of {spec} "
                f"'batch' (and only it: the server pads and slices by it); {fix}"
            )
        else:
            spec = dataclasses.replace(spec, axes=tuple(names))
        named.append(spec)
    return named, problems


def write_bundle(
    source: ExportSource,
    directory: str | os.PathLike,
    *,
    platforms: tuple[str, ...] = DEFAULT_PLATFORMS,
    accept: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Lower `source` with a symbolic batch axis and write the bundle; returns the manifest.
    `accept`, if given, sees the manifest before anything is written and may refuse it by
    raising.

    Re-exporting to the same directory writes the new bundle beside it and swaps it in whole:
    the directory holds the previous bundle or the new one, never a mix, and an export that
    fails (a full disk) leaves the previous bundle as it was. `platforms` names the platforms
    to lower for, a non-empty subset of DEFAULT_PLATFORMS.
    """
    directory = os.fspath(directory)
    platforms = _check_platforms(platforms)
    if not _NAME.match(source.name):
        raise ExportError(
            f"bundle name {source.name!r} must start with a letter or digit and hold only "
            f"letters, digits, '.', '_' and '-' (it becomes part of the serving URL)"
        )
    _prepare_directory(directory)
    (batch,) = jax_export.symbolic_shape("batch")
    weight_specs = {
        name: jax.ShapeDtypeStruct(np.shape(value), np.asarray(value).dtype)
        for name, value in source.weights.items()
    }
    input_specs = {
        name: jax.ShapeDtypeStruct((batch, *spec.shape), spec.dtype)
        for name, spec in source.inputs.items()
    }
    order: list[str] = []

    def program(weights, inputs):
        named = _output_names(source.forward(weights, **inputs), source.outputs)
        order[:] = named
        return named

    start = time.perf_counter()
    fix = (
        "A bundle serves every batch size, so forward must not depend on the batch size as a "
        "Python int (write x.reshape(x.shape[0], -1), not a fixed batch width)."
    )
    try:
        # no source locations in the program: its digest names the computation alone, so
        # bundles of one architecture share one program whatever called export
        limit = jax.config.values["jax_traceback_in_locations_limit"]
        jax.config.update("jax_traceback_in_locations_limit", 0)
        try:
            exported = jax_export.export(jax.jit(program), platforms=platforms)(
                weight_specs, input_specs
            )
        finally:
            jax.config.update("jax_traceback_in_locations_limit", limit)
    except Exception as error:
        _refuse_host_callbacks(program, weight_specs, source.inputs, error)
        kind = type(error).__name__
        if "Dimension" in kind or "symbolic" in str(error).lower():
            raise ExportError(
                f"forward does not trace with a symbolic batch size ({kind}: {error}). {fix}"
            ) from error
        raise
    # A fixed batch width can pass the symbolic trace and fail only when the program is
    # compiled for another size: trace two concrete sizes too (no compile).
    for rows in sorted({1, 2, *source.batch_sizes}):
        concrete = {
            name: jax.ShapeDtypeStruct((rows, *spec.shape), spec.dtype)
            for name, spec in source.inputs.items()
        }
        try:
            jax.eval_shape(program, weight_specs, concrete)
        except Exception as error:
            raise ExportError(
                f"forward does not trace for a batch of {rows} ({type(error).__name__}: "
                f"{error}). {fix}"
            ) from error
    blob = exported.serialize()
    seconds = time.perf_counter() - start

    outputs = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    wire = {
        n: bundle.TensorSpec(n, np.dtype(s.dtype).name, (bundle.BATCH, *s.shape))
        for n, s in source.inputs.items()
    }
    program_outputs = [
        bundle.TensorSpec(n, np.dtype(outputs[n].dtype).name, tuple(_dims(outputs[n].shape)))
        for n in order
    ]
    client = program_outputs
    if source.postprocess is not None:
        client = _probe_postprocess(source.name, source.postprocess, wire, program_outputs)
    unpadded = [str(spec) for spec in program_outputs if spec.axes[:1] != ("batch",)]
    if source.batch_sizes and unpadded:
        raise ExportError(
            f"batch_sizes pads a call to a batch size and slices the outputs back, but forward's "
            f"output {unpadded[0]} has no batch axis first; return one row per input row, or "
            f"leave batch_sizes out"
        )
    names = [spec.name for spec in client]
    echo = _check_echo(source.echo, wire, names)
    axes = check_axes(source.axes)
    named_wire, wrong = _name_axes(list(wire.values()), axes)
    wire = {spec.name: spec for spec in named_wire}
    client, wrong_outputs = _name_axes(client, axes)
    wrong += wrong_outputs
    unknown = sorted(set(axes) - set(wire) - set(names))
    if unknown:
        wrong.append(
            f"axes names {', '.join(map(repr, unknown))}, which the bundle neither takes nor "
            f"returns (inputs {', '.join(map(str, wire.values()))}; outputs "
            f"{', '.join(map(str, client))}); name those"
        )
    echoed = [dataclasses.replace(wire[n], echo=n) for n in echo]
    manifest = {
        "format": bundle.FORMAT,
        "format_version": bundle.FORMAT_VERSION if echoed or source.postprocess is not None else 1,
        "name": source.name,
        "inputs": [spec.to_json() for spec in wire.values()],
        "outputs": [spec.to_json() for spec in (*client, *echoed)],
        "device_values": {k: _jsonable(v) for k, v in source.device_values.items()},
        "program": {
            "platforms": list(exported.platforms),
            "calling_convention_version": exported.calling_convention_version,
            "batch_symbol": "batch",
            **({"batch_sizes": list(source.batch_sizes)} if source.batch_sizes else {}),
        },
        "weights": {
            "tensors": len(source.weights),
            "elements": int(sum(np.size(v) for v in source.weights.values())),
        },
        "provenance": {k: _jsonable(v) for k, v in source.provenance.items()},
        "files": {},
    }
    if source.postprocess is not None:  # what runs after the program, exactly
        manifest["postprocess"] = {
            "source": source.postprocess.source,
            "sha256": source.postprocess.sha256,
            "fields": dict(source.postprocess.fields),
            "program_outputs": [spec.to_json() for spec in program_outputs],
        }
    files = {
        bundle.PROGRAM: bytes(blob),
        bundle.WEIGHTS: _serialize_weights(source.weights),
        **source.files,
    }
    if accept is not None:  # before the axes' errors: a publish names the contract it breaks
        accept(manifest)
    if wrong:
        raise ExportError(wrong[0])
    _publish(directory, files, manifest)
    record_compile(
        ProgramKind.EXPORT.value,
        source.owner or source.name,
        seconds,
        f"exported outside the program cache (jax.export for {', '.join(exported.platforms)}, "
        f"symbolic batch) to {directory}",
    )
    return manifest


# ---------------------------------------------------------------------------------------------
# From a handle. Everything that reads a handle's internals is in export_handle.


def export_handle(
    handle: Any,
    directory: str | os.PathLike,
    name: str | None = None,
    *,
    platforms: tuple[str, ...] = DEFAULT_PLATFORMS,
    variables: Any = None,
    dtype: str | None = None,
    accept: Callable[[dict[str, Any]], None] | None = None,
    echo: tuple[str, ...] = (),
    batch_sizes: tuple[int, ...] | None = None,
    axes: Mapping[str, tuple[str | None, ...]] | None = None,
) -> dict[str, Any]:
    """Export a handle's current weights (or `variables`: e.g. the moving average) and its
    eval-mode forward; returns the manifest.

    `dtype` is the bundle's: "float32" (the default, whatever the run's precision),
    "bfloat16" or "float16" (the floating weights stored in it, halving the bundle, and the
    forward computed in it; the wire's inputs and outputs keep their dtypes), or "compute"
    (the run's `precision=`).

    >>> import nitro
    >>> from nitro.examples.digits import Digits
    >>> n = nitro.Nitro(Digits(), progress=False)
    >>> export_handle(n, "exports/digits")["inputs"]
    [{'name': 'x', 'dtype': 'float32', 'shape': [-1, 64], 'axes': ['batch', None]}]
    """
    from flax import nnx

    from nitro.experiments.declaration import FieldKind, field_specs, has_method
    from nitro.experiments.equinox import hook_model
    from nitro.experiments.routing import hook_fields
    from nitro.experiments.trace_view import TraceView
    from nitro.programs.tracing import EVAL_SEED

    sizes = check_batch_sizes(batch_sizes)  # before anything is traced
    named_axes = check_axes(axes)
    setup, state = handle.setup, handle.state
    variables = variables if variables is not None else state.variables
    precision = _bundle_precision(dtype, setup)
    model_setup = setup.model
    cls, experiment = handle.cls, handle.experiment
    preprocess = has_method(cls, "export_preprocess")
    forward_fields = setup.experiment.hook_fields["forward"]
    forward_hook = setup.experiment.hooks["forward"]
    takes = hook_fields(cls, "export_preprocess", ()) if preprocess else forward_fields
    echo_only = {
        e
        for e in (echo if isinstance(echo, (tuple, list)) else ())
        if not takes.takes_all and e not in (*takes.required, *takes.optional)
    }

    # Weights: parameters then other model state, as host arrays named by their model path.
    # The caller holds the handle (no step runs meanwhile).
    trees = [
        jax.tree.unflatten(model_setup.params_def, variables.params),
        jax.tree.unflatten(model_setup.model_state_def, variables.model_state),
    ]
    device = {k: np.asarray(v) for k, v in handle.runtime.feed.current_device().items()}
    names, weights, key_impls = [], {}, {}
    for tree in trees:
        group = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            key = jax.tree_util.keystr(path, simple=True, separator=".")
            key = key.removesuffix(".value")
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                key_impls[key] = jax.random.key_impl(leaf)
                leaf = jax.random.key_data(leaf)
            weights[key] = np.array(leaf)  # a host copy: training may go on
            if precision.mixed and jnp.issubdtype(leaf.dtype, jnp.floating):
                weights[key] = weights[key].astype(precision.policy.compute_dtype)
            group.append(key)
        names.append(group)
    if len(weights) != sum(map(len, names)):
        raise ExportError(f"{cls.__qualname__}'s model has two state entries with one path")

    def forward(weights: Mapping[str, jax.Array], **inputs: jax.Array):
        def leaves(group):
            return [
                jax.random.wrap_key_data(weights[k], impl=key_impls[k])
                if k in key_impls
                else weights[k]
                for k in group
            ]

        params = jax.tree.unflatten(model_setup.params_def, leaves(names[0]))
        rest = jax.tree.unflatten(model_setup.model_state_def, leaves(names[1]))
        frozen = {k: jnp.asarray(v) for k, v in device.items()}
        view = TraceView(cls, setup.experiment.graphconst, precision.cast_compute(frozen))
        model = nnx.merge(model_setup.graphdef_eval, params, rest, copy=True)
        inputs = {k: v for k, v in inputs.items() if k not in echo_only}  # returned as sent
        fields = view.export_preprocess(**inputs) if preprocess else inputs
        if not isinstance(fields, Mapping):
            raise ExportError(
                f"export_preprocess must return a dict of the fields forward takes "
                f"({forward_fields.describe()}); it returned {type(fields).__name__}"
            )
        missing = [f for f in forward_fields.required if f not in fields]
        if missing:
            where = "export_preprocess returns" if preprocess else "export_inputs() declares"
            raise ExportError(
                f"forward needs {', '.join(map(repr, missing))}, but {where} "
                f"{sorted(fields)}; name the fields forward takes ({forward_fields.describe()})"
            )
        chosen = (
            fields
            if forward_fields.takes_all
            else {
                f: fields[f]
                for f in forward_fields.required + forward_fields.optional
                if f in fields
            }
        )
        chosen = precision.cast_compute(chosen)  # the bundle's dtype (dtype=)
        if forward_fields.takes_rngs:  # one fixed key: an export is deterministic
            chosen = {**chosen, "rngs": nnx.Rngs(EVAL_SEED)}
        return precision.cast_output(forward_hook(view, hook_model(model), **chosen))

    # The wire: export_inputs, else the first split's batch for the fields the wire takes.
    if has_method(cls, "export_inputs"):
        declared = experiment.export_inputs()
        if not isinstance(declared, Mapping) or not declared:
            raise ExportError(
                "export_inputs() must return a non-empty dict {name: one sample's shape and "
                "dtype}, e.g. {'x': jax.ShapeDtypeStruct((64,), jnp.float32)}"
            )
        inputs = {}
        for key, spec in declared.items():
            if not (hasattr(spec, "shape") and hasattr(spec, "dtype")):
                raise ExportError(
                    f"export_inputs()[{key!r}] is a {type(spec).__name__}; give one sample's "
                    f"shape and dtype, e.g. jax.ShapeDtypeStruct((64,), jnp.float32)"
                )
            inputs[str(key)] = jax.ShapeDtypeStruct(tuple(spec.shape), spec.dtype)
    else:
        wire = takes
        split = next((s for s in ("train", *handle.splits) if s in handle.splits), None)
        if split is None:
            raise ExportError(
                f"this handle has no data to take the input shapes from (built with data={{}}); "
                f"define export_inputs(self) on {cls.__qualname__}, returning e.g. "
                f"{{'{(wire.required or ('x',))[0]}': jax.ShapeDtypeStruct((64,), jnp.float32)}} "
                f"(one sample's shape)"
            )
        first = _first_batch(handle.splits[split], split)
        chosen = wire.resolve(tuple(first), split)
        inputs = {
            k: jax.ShapeDtypeStruct(np.shape(first[k])[1:], np.asarray(first[k]).dtype)
            for k in chosen
        }
    outputs = experiment.export_outputs() if has_method(cls, "export_outputs") else None
    if outputs is not None and (not isinstance(outputs, Mapping) or not outputs):
        raise ExportError(
            "export_outputs() must return a non-empty dict {name: dtype or None}, e.g. "
            "{'logits': None} or {'probabilities': 'float16'}"
        )

    graphconst = {
        s.name: getattr(experiment, s.name)
        for s in field_specs(cls)
        if s.kind is FieldKind.GRAPHCONST
    }
    hook = None
    if has_method(cls, "postprocess"):
        hook = _host_hook(cls, {**graphconst, **device})
    origin, patch = provenance(cls)
    source = ExportSource(
        name=name or cls.__name__.lower(),
        forward=forward,
        weights=weights,
        inputs=inputs,
        outputs=outputs,
        device_values=device,
        provenance={
            **_provenance(handle, graphconst),
            "git": origin["git"],
            "dtype": precision.compute,
        },
        owner=handle.owner,
        files={PATCH: patch} if patch is not None else {},
        echo=tuple(echo) if isinstance(echo, (tuple, list)) else echo,
        postprocess=hook,
        batch_sizes=sizes,
        axes=named_axes,
    )
    return write_bundle(source, directory, platforms=platforms, accept=accept)


def _host_hook(cls: type, fields: Mapping[str, Any]) -> bundle.Postprocess:
    """`cls.postprocess` as recorded source, compiled on its own as a loader will."""
    import inspect
    import textwrap

    function = inspect.getattr_static(cls, "postprocess")
    where = f"{cls.__qualname__}.postprocess"
    if not inspect.isfunction(function):
        raise ExportError(
            f"{where} must be a plain method `def postprocess(self, outputs, **inputs)`, not a "
            f"{type(function).__name__}"
        )
    try:
        text = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError) as error:
        raise ExportError(
            f"cannot read the source of {where} ({error}), which the bundle records; define "
            f"it in a file or a notebook cell"
        ) from None
    recorded = json.loads(json.dumps({k: _jsonable(v) for k, v in fields.items()}))
    try:
        return bundle.Postprocess.compile(text, recorded, where)
    except ValueError as error:
        raise ExportError(str(error)) from None


def _bundle_precision(dtype: Any, setup: Any):
    """The bundle's dtype as a precision policy: float32 weights and compute by default."""
    from nitro.errors import SetupError
    from nitro.optim.precision import COMPUTE_DTYPES, FLOAT32, Precision

    if dtype is None:
        return FLOAT32
    if isinstance(dtype, str) and dtype == "compute":
        return Precision((setup.precision or FLOAT32).compute)
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        name = repr(dtype)
    if name not in COMPUTE_DTYPES:
        raise ExportError(
            f"export dtype={dtype!r}: the bundle's dtype must be 'float32' (the default), "
            f"'bfloat16', 'float16', or 'compute' (the run's precision=, here "
            f"{(setup.precision or FLOAT32).compute!r})"
        )
    try:
        return Precision(name)
    except SetupError as error:  # not reached: the names are checked above
        raise ExportError(str(error)) from None


def _first_batch(source: Any, split: str) -> Mapping[str, Any]:
    from nitro.data import NoPrefetch, is_index_addressable

    source = source.source if isinstance(source, NoPrefetch) else source
    if is_index_addressable(source):
        return source.batch_at(0, source.begin_epoch(0))
    iterator = iter(source)
    try:
        return next(iterator)
    except StopIteration:
        raise ExportError(
            f"the '{split}' split yields no batch to take input shapes from"
        ) from None
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:  # release what the iterator started (generators, workers)
            close()


def _provenance(handle: Any, graphconst: Mapping[str, Any]) -> dict[str, Any]:
    """Where the bundle comes from: the experiment, its preset and resolved configuration,
    the weights' run and step, the packages' versions (the git state is added beside it)."""
    return {
        "experiment": handle.owner,
        "preset": handle.setup.experiment.preset,
        "graphconst": dict(graphconst),
        "config": run_config(handle.setup),
        "seed": handle.seed,
        "step": handle.step,
        "epoch": handle.epoch,
        "weights_origin": getattr(handle, "weights_origin", None),
        "run_id": getattr(handle, "run_id", None),
        "checkpoint": getattr(handle, "weights_checkpoint", None),
        "versions": package_versions(),
        "exported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
