"""Data sources: `ArrayLoader` over in-memory arrays, and the index-addressable protocol.

A source is any restartable iterable of dicts of numpy arrays (batch axis first). A source
that also has `begin_epoch(epoch) -> plan` and `batch_at(index, plan) -> batch` is
*index-addressable*: several prefetch workers can build its batches in parallel, and a run
stopped mid-epoch resumes at the exact batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

__all__ = ["ArrayLoader", "FromFactory", "NoPrefetch", "is_index_addressable", "is_one_shot"]


class ArrayLoader:
    """Batches over a dict of equally long numpy arrays.

    Args:
      arrays: field name -> array; every array has the same length on axis 0.
      batch_size: samples per batch.
      shuffle: draw a new permutation every epoch (deterministic in `seed` and the epoch).
      drop_last: drop the final partial batch. Training needs it; evaluation splits keep the
        partial batch, which the framework pads to the compiled width and slices back.
      seed: seeds the per-epoch permutations. None (the default): the run's `seed=` when a
        `Nitro` handle trains on it (`with_seed`), 0 when iterated on its own. An explicit
        seed wins over the run's.
      per_process: in a multi-process run (`jax.distributed`), `batch_size` is the global
        batch and each process yields its share: the `jax.process_index()`-th of
        `jax.process_count()` equal slices of every global batch. Every process holds the
        same arrays and seed, so they agree on the permutation. `batch_size` then reads the
        local share; `global_batch_size` the whole.

    >>> import numpy as np
    >>> loader = ArrayLoader({"x": np.zeros((10, 3)), "y": np.arange(10)}, batch_size=4)
    >>> len(loader), loader.batch_at(0)["x"].shape
    (2, (4, 3))
    >>> loader.with_seed(7).seed, loader.seed, ArrayLoader(loader.arrays, 4, seed=1).with_seed(7).seed
    (7, None, 1)
    """

    def __init__(
        self,
        arrays: Mapping[str, Any],
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int | None = None,
        per_process: bool = False,
    ):
        if not arrays:
            raise ValueError("ArrayLoader needs at least one array")
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"ArrayLoader batch_size must be a positive int, got {batch_size!r}")
        self.arrays = {name: np.asarray(value) for name, value in arrays.items()}
        lengths = {name: a.shape[0] if a.ndim else None for name, a in self.arrays.items()}
        if len(set(lengths.values())) != 1 or None in lengths.values():
            raise ValueError(
                f"ArrayLoader arrays must share their first (batch) axis; lengths: {lengths}"
            )
        num_samples = next(iter(lengths.values()))
        assert num_samples is not None  # checked above: every array has a batch axis
        self.num_samples = num_samples
        self.global_batch_size = int(batch_size)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise ValueError(
                f"ArrayLoader seed must be an int, or None to follow the run's seed=; got {seed!r}"
            )
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self._epochs_iterated = 0
        if len(self) == 0:
            raise ValueError(
                f"ArrayLoader has {self.num_samples} samples, fewer than one batch of "
                f"{batch_size} with drop_last=True"
            )
        self.process, self.processes = _process_share() if per_process else (0, 1)
        self.batch_size, rest = divmod(self.global_batch_size, self.processes)
        if rest:
            raise ValueError(
                f"ArrayLoader batch_size={batch_size} does not divide across "
                f"{self.processes} processes; with per_process=True the batch size is global: "
                f"choose a multiple of {self.processes}"
            )
        if self.processes > 1 and not drop_last and self.num_samples % self.global_batch_size:
            raise ValueError(
                f"ArrayLoader with per_process=True across {self.processes} processes needs "
                f"full batches, but {self.num_samples} samples leave a final batch of "
                f"{self.num_samples % self.global_batch_size}. Use drop_last=True or a sample "
                f"count that is a multiple of {self.global_batch_size}."
            )

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch_size)
        return full if (self.drop_last or rest == 0) else full + 1

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self.arrays)

    @property
    def dropped(self) -> int:
        """Samples left out of every epoch by drop_last."""
        return self.num_samples % self.global_batch_size if self.drop_last else 0

    def with_seed(self, seed: int) -> ArrayLoader:
        """This loader shuffling by `seed` when it has no seed of its own: a copy sharing the
        arrays (what `Nitro` trains on, given the run's `seed=`); else itself."""
        if self.seed is not None:
            return self
        seeded = copy.copy(self)
        seeded.seed = seed
        return seeded

    def holding_out(self, fraction: float) -> tuple[ArrayLoader, ArrayLoader]:
        """(train, held out): the last `fraction` of the samples as an evaluation loader (in
        order, the last batch kept), the rest as this loader was; split before any
        shuffling, as Keras's `validation_split=` does (`Nitro(..., validation_split=)`).

        >>> import numpy as np
        >>> train, val = ArrayLoader({"x": np.arange(10)}, 2).holding_out(0.2)
        >>> train.num_samples, val.arrays["x"].tolist()
        (8, [8, 9])
        """
        at = int(self.num_samples * (1.0 - fraction))
        kept = {name: a[:at] for name, a in self.arrays.items()}
        held = {name: a[at:] for name, a in self.arrays.items()}
        size = self.global_batch_size
        train = ArrayLoader(
            kept,
            size,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            seed=self.seed,
            per_process=self.processes > 1,
        )
        return train, ArrayLoader(
            held, min(size, len(held[next(iter(held))])), shuffle=False, drop_last=False
        )

    def begin_epoch(self, epoch: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        seed = 0 if self.seed is None else int(self.seed) % 2**64  # numpy takes no negatives
        return np.random.default_rng((seed, epoch)).permutation(self.num_samples)

    def batch_at(self, index: int, plan: np.ndarray | None = None) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range for {len(self)} batches")
        start = index * self.global_batch_size
        stop = min(start + self.global_batch_size, self.num_samples)
        if self.processes > 1:  # this process's slice of the global batch
            start += self.process * self.batch_size
            stop = start + self.batch_size
        if plan is None:
            return {name: a[start:stop] for name, a in self.arrays.items()}
        rows = plan[start:stop]
        return {name: a[rows] for name, a in self.arrays.items()}

    def block_at(
        self, index: int, count: int, plan: np.ndarray | None = None
    ) -> dict[str, np.ndarray] | None:
        """Batches `index` to `index + count - 1` stacked, `[count, batch, ...]`, gathered
        in one indexed copy per array (what fused steps take); None when one of them is not
        a whole batch of this process, which `batch_at` then gives one by one."""
        size = self.global_batch_size
        if self.processes > 1 or index < 0 or (index + count) * size > self.num_samples:
            return None
        start, stop = index * size, (index + count) * size
        if plan is None:
            return {
                name: a[start:stop].reshape(count, size, *a.shape[1:]).copy()
                for name, a in self.arrays.items()
            }
        rows = plan[start:stop]  # np.take: the same rows, about twice as fast as a[rows]
        return {
            name: np.take(a, rows, axis=0).reshape(count, size, *a.shape[1:])
            for name, a in self.arrays.items()
        }

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        plan = self.begin_epoch(self._epochs_iterated)
        self._epochs_iterated += 1
        for index in range(len(self)):
            yield self.batch_at(index, plan)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {v.dtype}{list(v.shape[1:])}" for k, v in self.arrays.items())
        share = (
            f" (process {self.process} of {self.processes} yields {self.batch_size})"
            if self.processes > 1
            else ""
        )
        return (
            f"ArrayLoader({self.num_samples} samples, {len(self)} batches of "
            f"{self.global_batch_size}{share}, shuffle={self.shuffle}, "
            f"drop_last={self.drop_last}; {shapes})"
        )


class NoPrefetch:
    """Opt out of prefetching: the loop builds and transfers each batch itself, inline."""

    def __init__(self, source: Any):
        self.source = source

    def __iter__(self):
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        return f"NoPrefetch({self.source!r})"


class FromFactory:
    """A source from a function that returns a fresh iterator of batches each time it is
    called: every epoch calls it again. `Nitro` wraps a callable given as a split in it.

    >>> def batches():
    ...     for i in range(3):
    ...         yield {"x": np.full((2, 1), i)}
    >>> source = FromFactory(batches)
    >>> [int(b["x"][0, 0]) for b in source], [int(b["x"][0, 0]) for b in source]
    ([0, 1, 2], [0, 1, 2])
    """

    def __init__(self, factory: Callable[[], Any], length: int | None = None):
        if not callable(factory):
            raise TypeError(f"FromFactory takes a callable; got {type(factory).__name__}")
        self.factory = factory
        self.length = length

    def __iter__(self) -> Iterator[Any]:
        return iter(self.factory())

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("this source does not know its length")
        return self.length

    def __repr__(self) -> str:
        name = getattr(self.factory, "__qualname__", type(self.factory).__name__)
        return f"FromFactory({name})"


def is_one_shot(source: Any) -> bool:
    """True for an iterator (a generator object, `iter(list)`, an open file): it can be
    iterated once, so it cannot feed more than one epoch."""
    return isinstance(source, Iterator)


def _process_share() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


def is_index_addressable(source: Any) -> bool:
    """True when `source` has both `begin_epoch(epoch)` and `batch_at(index, plan)`."""
    return callable(getattr(source, "batch_at", None)) and callable(
        getattr(source, "begin_epoch", None)
    )
