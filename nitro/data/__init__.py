"""Data sources and the prefetcher.

`ArrayLoader` batches in-memory arrays; `GrainSource` reads a `grain.MapDataset`, `HFSource`
and `HFIterableSource` a Hugging Face dataset; any restartable iterable of dicts of numpy
arrays works as a source too. Every split is prefetched by default; wrap a source in `NoPrefetch`
to opt out.

- `loaders`: `ArrayLoader` over in-memory arrays, and the index-addressable protocol
- `grain_source`: `GrainSource` over a `grain.MapDataset`
- `hf_source`: `HFSource` and `HFIterableSource` over Hugging Face datasets
- `adopt`: splits from data libraries (a `grain.MapDataset`, a Hugging Face dataset) given as is
- `iter_state`: the iterator state of sources without random access, for exact resume
- `prefetch`: the prefetcher: worker threads build host batches, one stage transfers them
- `processes`: worker processes for sources whose batches cost Python time
- `datasets`: built-in data sets that need no download (`nitro.datasets`)
"""

from nitro.data.adopt import adopt
from nitro.data.grain_source import GrainSource, IndexedBatches
from nitro.data.hf_source import HFIterableSource, HFSource
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
    "GrainSource",
    "HFIterableSource",
    "HFSource",
    "IndexedBatches",
    "NoPrefetch",
    "PrefetchSettings",
    "Prefetcher",
    "StagedBatch",
    "adopt",
    "is_index_addressable",
    "is_one_shot",
    "pad_batch",
]
