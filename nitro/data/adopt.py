"""Splits from data libraries: a `grain.MapDataset` or a Hugging Face `datasets.Dataset` /
`IterableDataset` given as a split becomes a Nitro source (`GrainSource`, `HFSource`,
`HFIterableSource`). Neither library is imported here unless the split is one of its objects.

A `grain.IterDataset` or `grain.DataLoader` stays a plain restartable iterable (docs/data.md).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from nitro.data.grain_source import GrainSource, IndexedBatches, is_batched
from nitro.data.hf_source import HFIterableSource, HFSource
from nitro.errors import SetupError

__all__ = ["adopt"]


def _library(source: Any) -> str:
    return type(source).__module__.partition(".")[0]


def adopt(split: str, source: Any, batch_size: int | None) -> Any:
    """`source` as a Nitro source for split `split`. `batch_size` (the experiment's
    `batch_size` field, if any) batches a dataset of single samples. The training split is
    shuffled by the run's seed and drops its partial batch; the others keep their order and
    every sample. Anything else is returned as it is."""
    name = f"the '{split}' split"
    training = split == "train"
    if isinstance(source, (IndexedBatches, HFIterableSource)):
        if source.name.startswith("a "):  # built by hand: errors name the split
            source = copy.copy(source)
            source.name = name
        return source
    library = _library(source)
    if library == "grain":
        grain = sys.modules["grain"]
        if isinstance(source, grain.MapDataset):
            batched = is_batched(source)
            return GrainSource(
                source,
                None if batched else batch_size,
                shuffle=training and not batched,  # a batched pipeline keeps its own order
                drop_last=training,
                name=name,
            )
        return source
    if library == "datasets":
        datasets = sys.modules["datasets"]
        kinds = (datasets.Dataset, datasets.IterableDataset)
        if not isinstance(source, kinds):
            if isinstance(source, (datasets.DatasetDict, datasets.IterableDatasetDict)):
                raise SetupError(
                    f"{name} is a {type(source).__name__} of splits "
                    f"{sorted(source)}; give one split each: "
                    f"{{'train': ds['train'], ...}}"
                )
            return source
        if batch_size is None:
            raise SetupError(
                f"{name} is a datasets.{type(source).__name__} of single rows and no batch size "
                f"is known: give the experiment a batch_size field, or wrap it as "
                f"nitro.data.{'HFSource' if isinstance(source, datasets.Dataset) else 'HFIterableSource'}"
                f"(dataset, batch_size=...)"
            )
        kind = HFSource if isinstance(source, datasets.Dataset) else HFIterableSource
        return kind(source, batch_size, shuffle=training, drop_last=training, name=name)
    return source
