"""Data sources and the prefetcher.

`ArrayLoader` batches in-memory arrays; any restartable iterable of dicts of numpy arrays
works as a source too. Every split is prefetched by default; wrap a source in `NoPrefetch`
to opt out.
"""

from nitro.data.loaders import (
    ArrayLoader,
    FromFactory,
    NoPrefetch,
    is_index_addressable,
    is_one_shot,
)
from nitro.data.prefetch import Prefetcher, PrefetchSettings, StagedBatch, pad_batch

__all__ = [
    "ArrayLoader",
    "FromFactory",
    "NoPrefetch",
    "PrefetchSettings",
    "Prefetcher",
    "StagedBatch",
    "is_index_addressable",
    "is_one_shot",
    "pad_batch",
]
