"""Hugging Face `datasets` as sources.

- `HFSource` over a `datasets.Dataset` (random access): index-addressable like
  `ArrayLoader`. Each batch is one indexed read of the Arrow table in numpy format
  (`dataset.with_format("numpy")[rows]`), so its columns arrive as the batch's fields by name;
  each epoch's order is a permutation of `(seed, epoch)`, the run's `seed=` unless given; a
  run stopped mid-epoch resumes at the exact batch.
- `HFIterableSource` over a `datasets.IterableDataset` (a stream): each epoch is a fresh
  pass with `set_epoch(epoch)`, shuffled in a buffer by the seed (Hugging Face shuffles epoch
  `e` with `seed + e`), batched by `IterableDataset.iter(batch_size=...)`; a resume mid-epoch
  replays the epoch's pass up to the stopping batch, which is the same pass again.

On a multi-process run each process reads its share: its slice of every global batch
(`HFSource`), or its node's part of the stream (`datasets.distributed.split_dataset_by_node`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np

from nitro.data.grain_source import IndexedBatches, shard_of
from nitro.errors import SetupError

__all__ = ["HFIterableSource", "HFSource"]


class HFSource(IndexedBatches):
    """A `datasets.Dataset` as an index-addressable source of `batch_size` rows a batch.

    Args:
      dataset: a `datasets.Dataset`; its columns become the batch's fields.
      batch_size: rows per (global) batch.
      shuffle, drop_last, seed, shard, name: as `nitro.data.GrainSource`.

    >>> import datasets, numpy as np
    >>> table = datasets.Dataset.from_dict({"x": np.arange(10.0), "y": np.arange(10) % 2})
    >>> source = HFSource(table, batch_size=4, shuffle=False)
    >>> len(source), source.batch_at(1, source.begin_epoch(0))["x"].tolist()
    (2, [4.0, 5.0, 6.0, 7.0])
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int | None = None,
        shard: tuple[int, int] | None = None,
        name: str = "a datasets.Dataset",
    ):
        self.dataset = dataset
        self.table = dataset.with_format("numpy")
        super().__init__(
            len(dataset),
            batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            seed=seed,
            shard=shard,
            name=name,
        )

    def read(self, items: np.ndarray, epoch: int, index: int) -> dict[str, np.ndarray]:
        return dict(self.table[items])

    def __repr__(self) -> str:
        return (
            f"HFSource({self.num_items} rows, {len(self)} batches of {self.global_batch_size}, "
            f"shuffle={self.shuffle}, drop_last={self.drop_last}; columns "
            f"{', '.join(self.dataset.column_names)})"
        )


class HFIterableSource:
    """A `datasets.IterableDataset` as a source: one pass of the stream an epoch.

    Args:
      dataset: a `datasets.IterableDataset`; its columns become the batch's fields.
      batch_size: rows per (global) batch.
      shuffle: shuffle in a buffer of `buffer_size` rows by the seed, anew each epoch.
      drop_last: leave out the final partial batch (training needs it).
      seed: None: the run's `seed=`.
      shard: `(process index, process count)`; None: the JAX processes.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        buffer_size: int = 1000,
        drop_last: bool = True,
        seed: int | None = None,
        shard: tuple[int, int] | None = None,
        name: str = "a datasets.IterableDataset",
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise SetupError(f"{name}: batch_size must be a positive int, got {batch_size!r}")
        self.dataset, self.name = dataset, name
        self.shuffle, self.buffer_size, self.drop_last, self.seed = (
            shuffle,
            buffer_size,
            drop_last,
            seed,
        )
        self.process, self.processes = shard_of(shard)
        self.global_batch_size = batch_size
        self.batch_size, rest = divmod(batch_size, self.processes)
        if rest:
            raise SetupError(
                f"{name}: batch_size={batch_size} does not divide across {self.processes} "
                f"processes; the batch size is global: choose a multiple of {self.processes}"
            )

    def with_seed(self, seed: int) -> HFIterableSource:
        if self.seed is not None:
            return self
        seeded = copy.copy(self)
        seeded.seed = seed
        return seeded

    @property
    def exact_state(self) -> bool:
        """Whether a pass's state resumes it exactly: Hugging Face's state leaves out the rows
        in a shuffle buffer, so only a pass without one (or with one of a single row) saves it."""
        return not self.shuffle or self.buffer_size <= 1

    def iter_epoch(self, epoch: int) -> _Pass:
        """The batches of epoch `epoch`: the same ones each time it is asked for; an
        iterator with Grain's `get_state`/`set_state` (None when the pass has no exact state)."""
        return _Pass(self._stream(epoch), self.batch_size, self.drop_last, self.exact_state)

    def _stream(self, epoch: int) -> Any:
        stream = self.dataset
        if self.processes > 1:
            from datasets.distributed import split_dataset_by_node

            stream = split_dataset_by_node(stream, rank=self.process, world_size=self.processes)
        if self.shuffle:
            seed = 0 if self.seed is None else int(self.seed) % 2**32
            stream = stream.shuffle(seed=seed, buffer_size=self.buffer_size)
        stream = stream.with_format("numpy")  # a copy: set_epoch leaves the caller's alone
        stream.set_epoch(epoch)
        return stream

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self.iter_epoch(0)

    def __repr__(self) -> str:
        return (
            f"HFIterableSource(batches of {self.global_batch_size}, shuffle={self.shuffle}, "
            f"buffer_size={self.buffer_size}, drop_last={self.drop_last})"
        )


class _Pass:
    """One pass of a `datasets.IterableDataset` in batches, with its state (`state_dict`)."""

    def __init__(self, stream: Any, batch_size: int, drop_last: bool, exact: bool):
        self.stream, self.exact = stream, exact
        self._batches: Iterator[Any] | None = None
        self._args = (batch_size, drop_last)

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batches = self._batches
        if batches is None:
            batch_size, drop_last = self._args
            batches = self._batches = self.stream.iter(
                batch_size=batch_size, drop_last_batch=drop_last
            )
        return dict(next(batches))

    def get_state(self) -> dict[str, Any] | None:
        return self.stream.state_dict() if self.exact else None

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue after the batch `state` was read at; before the first batch only."""
        self.stream.load_state_dict(state)
