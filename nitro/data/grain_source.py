"""Grain datasets as sources: `GrainSource` over a `grain.MapDataset`.

A `grain.MapDataset` is random-access, so Nitro reads it as an *index-addressable* source
(`begin_epoch`/`batch_at`): prefetch workers build its batches in parallel, and a run
stopped mid-epoch resumes at the exact batch from the checkpoint's epoch and position, which
is all the state a MapDataset's iterator has (Grain's own iterator state is its next index).

Epoch `e` reads the dataset at Grain's epoch indices `e * len(dataset) + i`, what Grain's
`repeat()` reads: a `shuffle` in the pipeline draws a new order and a `random_map` new random
draws every epoch, each a function of the pipeline's seed and the epoch alone.

- Unbatched (no `.batch(...)` in the pipeline; each element a dict of one sample's arrays):
  Nitro batches it, `batch_size` samples a batch, and with `shuffle=True` orders each
  epoch by a permutation of `(seed, epoch)`, the run's `seed=` unless given here, as
  `ArrayLoader` does.
- Batched (a `.batch(...)` in the pipeline): Nitro takes its batches as they are, in the
  pipeline's own order.

On a multi-process run (`jax.process_count() > 1`) each process reads its own shard: of an
unbatched dataset, its slice of every global batch of `batch_size` samples (as
`ArrayLoader(per_process=True)`); of a batched one, batches `p, p + P, p + 2P, ...`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from nitro.errors import SetupError

__all__ = ["GrainSource", "IndexedBatches", "is_batched", "shard_of"]


def shard_of(shard: tuple[int, int] | None) -> tuple[int, int]:
    """`(index, count)` of this process: `shard` when given, else `jax.process_index()` of
    `jax.process_count()`."""
    if shard is not None:
        index, count = shard
        if not (isinstance(count, int) and count >= 1 and isinstance(index, int)) or not (
            0 <= index < count
        ):
            raise SetupError(
                f"shard={shard!r}: give (process index, process count) with "
                f"0 <= index < count, or None for jax.process_index() of jax.process_count()"
            )
        return index, count
    import jax

    return jax.process_index(), jax.process_count()


@dataclasses.dataclass(frozen=True)
class Plan:
    """One epoch of an `IndexedBatches`: the epoch and its order (None: in order)."""

    epoch: int
    order: np.ndarray | None


class IndexedBatches:
    """Batches of `batch_size` items of a random-access collection of `num_items`,
    index-addressable: `begin_epoch(epoch)` draws the epoch's order from `(seed, epoch)`,
    `batch_at(index, plan)` reads one batch through `read(items, epoch)`, which subclasses
    give. An item is a sample (Nitro batches) or a whole batch (`batch_size=1`, taken as is).

    `shard=(index, count)`: this process's share (None: the JAX processes); `batch_size` is
    the global batch, of which each process reads `batch_size // count` items, in order: the
    shards of one epoch are disjoint and cover it."""

    what = "source"

    def __init__(
        self,
        num_items: int,
        batch_size: int,
        *,
        shuffle: bool,
        drop_last: bool,
        seed: int | None,
        shard: tuple[int, int] | None,
        name: str,
        items_are_batches: bool = False,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise SetupError(f"{name}: batch_size must be a positive int, got {batch_size!r}")
        if batch_size < 1:
            raise SetupError(f"{name}: batch_size must be a positive int, got {batch_size!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise SetupError(
                f"{name}: seed must be an int, or None to follow the run's seed=; got {seed!r}"
            )
        self.name = name
        self.num_items = int(num_items)
        self.items_are_batches = items_are_batches
        self.shuffle, self.drop_last, self.seed = bool(shuffle), bool(drop_last), seed
        self.process, self.processes = shard_of(shard)
        self.global_batch_size = int(batch_size)
        if items_are_batches:  # each process takes whole batches: p, p + P, ...
            self.global_batch_size = self.processes
        share, rest = divmod(self.global_batch_size, self.processes)
        if rest:
            raise SetupError(
                f"{name}: batch_size={batch_size} does not divide across {self.processes} "
                f"processes; the batch size is global: choose a multiple of {self.processes}"
            )
        self._share = share
        if len(self) == 0:
            raise SetupError(
                f"{name} has {self.num_items} {'batches' if items_are_batches else 'samples'}, "
                f"fewer than one batch of {self.global_batch_size} "
                f"{'across the processes' if items_are_batches else 'with drop_last=True'}"
            )
        if self.processes > 1 and not self.drop_last and self.num_items % self.global_batch_size:
            raise SetupError(
                f"{name} across {self.processes} processes needs full batches, but "
                f"{self.num_items} items leave a final batch of "
                f"{self.num_items % self.global_batch_size}: use drop_last=True"
            )

    def __len__(self) -> int:
        full, rest = divmod(self.num_items, self.global_batch_size)
        return full if (self.drop_last or rest == 0) else full + 1

    @property
    def batch_size(self) -> int | None:
        """Rows of this process's batch; None when the items are batches already."""
        return None if self.items_are_batches else self._share

    @property
    def num_samples(self) -> int | None:
        return None if self.items_are_batches else self.num_items

    @property
    def dropped(self) -> int:
        if self.items_are_batches or not self.drop_last:
            return 0
        return self.num_items % self.global_batch_size

    def with_seed(self, seed: int) -> IndexedBatches:
        """This source ordered by `seed` when it has no seed of its own (the run's `seed=`)."""
        if self.seed is not None:
            return self
        seeded = copy.copy(self)
        seeded.seed = seed
        return seeded

    def begin_epoch(self, epoch: int) -> Plan:
        if not self.shuffle:
            return Plan(epoch, None)
        seed = 0 if self.seed is None else int(self.seed) % 2**64
        return Plan(epoch, np.random.default_rng((seed, epoch)).permutation(self.num_items))

    def items_at(self, index: int, plan: Plan) -> np.ndarray:
        """The item numbers (within the epoch) of this process's batch `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range for {len(self)} batches")
        start = index * self.global_batch_size + self.process * self._share
        stop = min(start + self._share, self.num_items)
        rows = np.arange(start, stop)
        return rows if plan.order is None else plan.order[rows]

    def batch_at(self, index: int, plan: Plan | None = None) -> dict[str, np.ndarray]:
        plan = plan if plan is not None else Plan(0, None)
        return self.read(self.items_at(index, plan), plan.epoch, index)

    def read(self, items: np.ndarray, epoch: int, index: int) -> dict[str, np.ndarray]:
        raise NotImplementedError  # pragma: no cover - subclasses read

    def __iter__(self):
        plan = self.begin_epoch(0)
        return (self.batch_at(i, plan) for i in range(len(self)))


def is_batched(dataset: Any) -> bool:
    """Whether a `grain.MapDataset` pipeline batches: a `.batch(...)` among its transforms."""
    seen, todo = set(), [dataset]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "BatchMapDataset":
            return True
        todo.extend(getattr(node, "parents", ()) or ())
    return False


class GrainSource(IndexedBatches):
    """A `grain.MapDataset` as an index-addressable source (see the module docstring).

    Args:
      dataset: a `grain.MapDataset` whose elements are dicts of numpy arrays (or numbers):
        one sample each, or a batch each when the pipeline has a `.batch(...)`.
      batch_size: samples per (global) batch of an unbatched dataset; must be None for a
        batched one, whose batches are taken as they are.
      shuffle: order each epoch by a permutation of `(seed, epoch)`; the items are samples
        (unbatched) or whole batches (batched).
      drop_last: leave out the final partial batch (training needs it).
      seed: seeds the per-epoch order; None: the run's `seed=`.
      shard: `(process index, process count)`; None: the JAX processes.
      name: how errors name the source (Nitro passes the split: "the 'train' split").

    >>> import grain, numpy as np
    >>> rows = grain.MapDataset.source([{"x": np.full(3, i)} for i in range(10)])
    >>> source = GrainSource(rows, batch_size=4, shuffle=False)
    >>> len(source), source.batch_at(1, source.begin_epoch(0))["x"][:, 0].tolist()
    (2, [4, 5, 6, 7])
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = None,
        *,
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int | None = None,
        shard: tuple[int, int] | None = None,
        name: str = "a grain.MapDataset",
    ):
        self.dataset = dataset
        self.batched = is_batched(dataset)
        if self.batched and batch_size is not None:
            raise SetupError(
                f"{name} is batched already (a .batch(...) in its pipeline), so batch_size="
                f"{batch_size} has nothing to batch: drop batch_size=, or drop the .batch(...) "
                f"to have Nitro batch its samples"
            )
        if not self.batched and batch_size is None:
            raise SetupError(
                f"{name} yields single samples (no .batch(...) in its pipeline) and no batch "
                f"size is known: give the experiment a batch_size field, wrap it as "
                f"nitro.data.GrainSource(dataset, batch_size=...), or end the pipeline with "
                f".batch(batch_size, drop_remainder=True)"
            )
        super().__init__(
            len(dataset),
            1 if batch_size is None else batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            seed=seed,
            shard=shard,
            name=name,
            items_are_batches=self.batched,
        )

    def read(self, items: np.ndarray, epoch: int, index: int) -> dict[str, np.ndarray]:
        offset = epoch * self.num_items  # Grain's epoch: what repeat() reads
        elements = [self._element(offset + int(item), index) for item in items]
        if self.batched:
            (batch,) = elements
            return _checked_batch(batch, self.name, index)
        return _stack(elements, items, self.name, index)

    def _element(self, position: int, index: int) -> Mapping[str, Any]:
        try:
            element = self.dataset[position]
        except ValueError as error:  # grain's batch of samples that do not stack
            raise SetupError(
                f"{self.name} failed to build batch {index}: {error}. Every sample of a batch "
                f"needs the same fields with the same shapes: pad or crop samples to one shape "
                f"in the pipeline."
            ) from error
        if not isinstance(element, Mapping):
            kind = "batch" if self.batched else "sample"
            raise SetupError(
                f"{self.name} yields {type(element).__name__} elements; each {kind} must be a "
                f"dict of arrays by field name, e.g. {{'x': image, 'y': label}}: end the "
                f"pipeline with .map(lambda e: {{'x': ..., 'y': ...}})"
            )
        return element

    def __repr__(self) -> str:
        kind = "batches" if self.batched else f"batches of {self.global_batch_size}"
        return (
            f"GrainSource({self.num_items} {'batches' if self.batched else 'samples'}, "
            f"{len(self)} {kind}, shuffle={self.shuffle}, drop_last={self.drop_last})"
        )


def _checked_batch(batch: Mapping[str, Any], name: str, index: int) -> dict[str, np.ndarray]:
    arrays = {field: np.asarray(value) for field, value in batch.items()}
    lengths = {field: a.shape[0] if a.ndim else None for field, a in arrays.items()}
    if None in lengths.values() or len(set(lengths.values())) != 1:
        raise SetupError(
            f"{name}: batch {index} is ragged: its fields must share their first (batch) "
            f"axis; lengths: {lengths}"
        )
    return arrays


def _stack(
    elements: list[Mapping[str, Any]], items: np.ndarray, name: str, index: int
) -> dict[str, np.ndarray]:
    first = elements[0]
    out: dict[str, np.ndarray] = {}
    for field in first:
        values = []
        for item, element in zip(items, elements, strict=True):
            if field not in element or set(element) != set(first):
                raise SetupError(
                    f"{name}: sample {int(item)} has fields {sorted(element)}, but sample "
                    f"{int(items[0])} of the same batch has {sorted(first)}; every sample "
                    f"needs the same fields"
                )
            values.append(np.asarray(element[field]))
        shapes = {v.shape for v in values}
        if len(shapes) > 1:
            raise SetupError(
                f"{name}: field {field!r} is ragged in batch {index}: its samples have shapes "
                f"{sorted(shapes)}; every sample of a batch needs one shape: pad or crop them "
                f"in the pipeline"
            )
        out[field] = np.stack(values)
    return out
