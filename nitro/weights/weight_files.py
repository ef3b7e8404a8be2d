"""Weight files read as flat name -> numpy array: a safetensors file, a directory of
safetensors shards, an `.npz`, a Nitro run (its newest checkpoint) or one of its checkpoints,
and a plain orbax checkpoint; and safetensors written back.

>>> import numpy as np, nitro.weights
>>> np.savez("w.npz", **{"fc.weight": np.ones((2, 3), np.float32)})
>>> {k: v.shape for k, v in nitro.weights.read("w.npz").items()}
{'fc.weight': (2, 3)}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nitro.errors import SetupError, WeightsError

__all__ = ["describe_source", "read", "read_views", "write_safetensors"]

SHARD_INDEX = "model.safetensors.index.json"


def read(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of `source` by name, as the file names them (PyTorch's `state_dict` names
    for a PyTorch or Hugging Face file, the model's leaf paths for a Nitro run or an NNX
    state saved with orbax).

    `source` is a `.safetensors` file, a directory of safetensors shards (listed by
    `model.safetensors.index.json` where there is one, else every `*.safetensors` in it), an
    `.npz` file, a Nitro run directory, checkpoints directory or checkpoint (its parameters
    and batch statistics), a plain orbax checkpoint, or a dict of arrays (returned as numpy
    arrays). A missing or damaged file is a `WeightsError` naming it.
    """
    if isinstance(source, Mapping):
        return {str(k): np.asarray(v) for k, v in source.items()}
    if not isinstance(source, (str, os.PathLike)):
        raise WeightsError(
            f"weights are read from a path (a .safetensors or .npz file, a directory of "
            f"shards, a Nitro run, an orbax checkpoint) or a dict of arrays; got "
            f"{type(source).__name__}"
        )
    path = Path(source)
    if not path.exists():
        raise WeightsError(
            f"no weights at {str(path)!r}: the path does not exist (give a .safetensors or "
            f".npz file, a directory of shards, a Nitro run or an orbax checkpoint)"
        )
    if path.is_dir():
        return _read_directory(path)
    if path.suffix == ".npz":
        return _read_npz(path)
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    raise WeightsError(
        f"{str(path)!r} is not a weight file Nitro reads: give a .safetensors or .npz file "
        f"(a PyTorch .bin or .pt file: save its state_dict with safetensors.torch.save_file)"
    )


def read_views(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, np.ndarray]:
    """As `read`, but a safetensors file's (or shards') arrays are read-only views of the
    file's bytes, mapped into memory, not copies: a reader that converts them (`load`)
    touches each byte once, and several threads can read at once."""
    if isinstance(source, Mapping) or not isinstance(source, (str, os.PathLike)):
        return read(source)
    path = Path(source)
    if path.is_file() and path.suffix == ".safetensors":
        return _view_safetensors(path)
    if path.is_dir() and ((path / SHARD_INDEX).is_file() or any(path.glob("*.safetensors"))):
        return _read_directory(path, _view_safetensors)
    return read(source)


def describe_source(source: Any) -> str:
    """How a report and an origin name `source`: its path, or "a dict of N arrays"."""
    if isinstance(source, Mapping):
        return f"a dict of {len(source)} arrays"
    return str(Path(source).absolute())


def write_safetensors(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write `arrays` to a safetensors file at `path` (its folder made if needed), as a
    PyTorch checkpoint (`format: pt`), through a temporary file so a crash leaves no half file."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    contiguous = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    save_file(contiguous, str(partial), metadata={"format": "pt"})
    os.replace(partial, path)
    return path


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error and OSErrors
        raise _unreadable(path, error) from error


# safetensors' dtype names (little-endian, as the format stores them)
_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
    "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}  # fmt: skip
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _view_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file as views of its mapped bytes. safetensors itself
    checks the header first (a truncated file is refused here, as `read` refuses it)."""
    import mmap

    import jax.numpy as jnp
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as checked:
            checked.keys()
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error and OSErrors
        raise _unreadable(path, error) from error
    with open(path, "rb") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if header else b""
    start = 8 + size
    arrays = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        kind = info["dtype"]
        dtype = np.dtype(_DTYPES.get(kind) or getattr(jnp, _ML_DTYPES[kind]))
        begin, end = info["data_offsets"]
        flat = np.frombuffer(mapped, dtype, (end - begin) // dtype.itemsize, start + begin)
        arrays[name] = flat.reshape(info["shape"])
    return arrays


def _unreadable(path: Path, error: Exception) -> WeightsError:
    return WeightsError(
        f"{str(path)!r} cannot be read as safetensors ({type(error).__name__}: {error}): "
        f"the file is truncated or not a safetensors file; download or write it again"
    )


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as found:
            return {name: found[name] for name in found.files}
    except Exception as error:  # noqa: BLE001 - zipfile, pickle and OS errors
        raise WeightsError(
            f"{str(path)!r} cannot be read as .npz ({type(error).__name__}: {error}): the file "
            f"is truncated or not written by numpy.savez; write it again"
        ) from error


def _read_directory(path: Path, reader: Any = None) -> dict[str, np.ndarray]:
    reader = reader or _read_safetensors
    index = path / SHARD_INDEX
    if index.is_file():
        return _read_shards(path, index, reader)
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return _merged(path, shards, reader)
    if _is_nitro_checkpoint(path):
        return _read_nitro(path)
    if _is_orbax(path):
        return _read_orbax(path)
    raise WeightsError(
        f"{str(path)!r} holds no weights Nitro reads: no *.safetensors shards, no Nitro "
        f"checkpoint, no orbax checkpoint. Give the file itself, or the directory that holds it"
    )


def _read_shards(path: Path, index: Path, reader: Any) -> dict[str, np.ndarray]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise WeightsError(
            f"{str(index)!r} is not a shard index (a JSON object with a 'weight_map' of "
            f"name -> shard file): {error}"
        ) from error
    files = sorted({path / str(name) for name in weight_map.values()})
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise WeightsError(
            f"{str(index)!r} lists shards that are not in {str(path)!r}: {', '.join(missing)}; "
            f"download the missing shards"
        )
    return _merged(path, files, reader)


def _merged(path: Path, shards: list[Path], reader: Any) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for shard in shards:
        for name, array in reader(shard).items():
            if name in arrays:
                raise WeightsError(
                    f"the shards of {str(path)!r} hold {name!r} twice (in {shard.name} and an "
                    f"earlier shard); keep one copy of each shard"
                )
            arrays[name] = array
    return arrays


def _is_nitro_checkpoint(path: Path) -> bool:
    """A Nitro run directory, its checkpoints directory, or one of its checkpoints."""
    if (path / "run.json").is_file() or (path / "checkpoints").is_dir():
        return True
    if (path / "state").is_dir():
        return True
    return any((p / "state").is_dir() and (p / "meta").is_dir() for p in path.iterdir())


def _read_nitro(path: Path) -> dict[str, np.ndarray]:
    from nitro.runs.checkpoint_reads import read_checkpoint, resolve_checkpoint
    from nitro.runs.checkpoint_trees import flatten
    from nitro.runs.run_dirs import KIND

    try:
        found = resolve_checkpoint(path)
        saved, record = read_checkpoint(*found)
    except SetupError as error:
        raise WeightsError(str(error)) from error
    if record.kind == KIND:
        raise WeightsError(
            f"{str(found.path)!r} is a population's checkpoint, which holds every "
            f"member's weights: read one member's, `<run_dir>/member-<i>`"
        )
    arrays: dict[str, np.ndarray] = {}
    for part in ("params", "model_state"):
        arrays.update({k: np.asarray(v) for k, v in flatten(saved.get(part) or {}).items()})
    return arrays


def _is_orbax(path: Path) -> bool:
    markers = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "checkpoint")
    return any((path / m).exists() for m in markers) or any(
        p.name.isdigit() and p.is_dir() for p in path.iterdir()
    )


def _read_orbax(path: Path) -> dict[str, np.ndarray]:
    """A checkpoint saved by orbax (`StandardCheckpointer`, `PyTreeCheckpointer`): every
    array read to the host. A `CheckpointManager`'s directory reads its newest step, which
    must hold one item."""
    import orbax.checkpoint as ocp

    from nitro.runs.checkpoint_trees import flatten

    path = path.absolute()  # orbax reads absolute paths only
    steps = sorted((p for p in path.iterdir() if p.name.isdigit() and p.is_dir()), key=_step)
    if steps and not (path / "_METADATA").exists():
        newest = steps[-1]
        items = [p for p in newest.iterdir() if p.is_dir() and not p.name.startswith("_")]
        if len(items) != 1:
            names = ", ".join(sorted(p.name for p in items)) or "none"
            raise WeightsError(
                f"{str(newest)!r} (the newest step of the orbax checkpoints in {str(path)!r}) "
                f"holds the items {names}: give the path of the one that holds the weights"
            )
        path = items[0]
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        item = checkpointer.metadata(path).item_metadata
        if item is None:
            raise ValueError("it records no tree of arrays")
        tree = item.tree
        restore_args = _map_leaves(tree, lambda _: ocp.RestoreArgs(restore_type=np.ndarray))
        saved = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many kinds
        raise WeightsError(
            f"{str(path)!r} cannot be read as an orbax checkpoint ({type(error).__name__}: "
            f"{error}); it is damaged or not a checkpoint of arrays"
        ) from error
    finally:
        checkpointer.close()
    return {k.removesuffix(".value"): np.asarray(v) for k, v in flatten(_as_dicts(saved)).items()}


def _step(path: Path) -> int:
    return int(path.name)


def _map_leaves(tree: Any, fn: Any) -> Any:
    if isinstance(tree, Mapping):
        return {k: _map_leaves(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_leaves(v, fn) for v in tree)
    return fn(tree)


def _as_dicts(tree: Any) -> Any:
    """Lists in a restored tree as dicts by index, so every leaf has a dotted name."""
    if isinstance(tree, Mapping):
        return {str(k): _as_dicts(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return {str(i): _as_dicts(v) for i, v in enumerate(tree)}
    return tree
