"""Weights from elsewhere: PyTorch, timm and Hugging Face checkpoints (safetensors files and
shards), `.npz` files, other Nitro runs and orbax checkpoints, read and loaded into Flax NNX
models with PyTorch layouts converted by rule (docs/weights.md). The weights a run starts
from (`weights=` a handle, a run, `nitro.average`) are `nitro.runs.initial_weights`; a file
loaded into part of a run's model is `weights=nitro.Partial(...)`.

- `weight_files`: reading weight files as flat name -> array (`read`), writing safetensors
- `layouts`: PyTorch's names and layouts against NNX's, by the type of the NNX module that
  holds each leaf: the conversion rules, and `to_torch`
- `loading`: `load` into a model in place, its `LoadReport`; `save` in PyTorch layout
- `partial`: `Partial`, a file loaded into part of a run's model (`weights=nitro.Partial(...)`)
"""

from nitro.weights.layouts import to_torch
from nitro.weights.loading import KeyMap, LoadedLeaf, LoadReport, load, save
from nitro.weights.partial import Partial
from nitro.weights.weight_files import read

__all__ = [
    "KeyMap",
    "LoadReport",
    "LoadedLeaf",
    "Partial",
    "load",
    "read",
    "save",
    "to_torch",
]
