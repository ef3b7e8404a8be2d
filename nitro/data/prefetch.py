"""The prefetcher: worker threads build host batches, one transfer stage puts them on the
device, and a bounded queue feeds the loop.

```
source --(workers: batch_at)--> host stage (host_batches) --(transfer)--> device queue
        (device_batches) --> loop
```

An index-addressable source fans out over several workers (threads, or processes with
`prefetch="processes"`: see `nitro.data.processes`); any other iterable gets one producer
thread. With `ordered=True` (the default) batches arrive in source order, so runs are
reproducible. A producer's exception is re-raised in the loop with its traceback. Closing an
epoch stream (normally, on a stop, or on an error) stops the threads and deletes every device
batch it staged that the loop never received.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from nitro.data.iter_state import open_epoch
from nitro.data.loaders import NoPrefetch, is_index_addressable
from nitro.data.processes import WorkerPool, WorkersDidNotStart, gil_speedup, unguarded_script
from nitro.errors import SetupError

__all__ = [
    "INLINE_BELOW_SECONDS",
    "PREFETCH_MODES",
    "PrefetchSettings",
    "Prefetcher",
    "StagedBatch",
    "consumed",
    "epoch_indices",
    "pad_batch",
]


PREFETCH_MODES = ("auto", "threads", "processes", "inline")
# Below this build time per batch, "auto" builds batches on the loop thread.
INLINE_BELOW_SECONDS = 100e-6
# "auto" uses processes when a batch takes at least this long to build and two threads build
# batches less than THREADS_SCALE_AT times as fast as one (the work holds the interpreter lock)
PROCESSES_FROM_SECONDS = 1e-3
THREADS_SCALE_AT = 1.4


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclasses.dataclass(frozen=True)
class PrefetchSettings:
    """How a split is prefetched.

    Args:
      workers: threads building host batches of an index-addressable source (Nitro keyword
        `prefetch_workers`); any other source has one producer thread.
      device_batches: batches transferred to the device ahead of the loop. Device memory holds
        about `device_batches + 2` batches: the staged ones, the one in the running step and
        the one waiting for its loss read-back.
      host_batches: host batches built ahead (default `2 * workers`); at least `workers`.
      ordered: deliver batches in source order, so runs are reproducible. False hands each
        batch to the loop as soon as it is ready.
      persistent: worker processes (`prefetch="processes"`) outlive the run that started
        them, for the next one (Nitro keyword `persistent_workers`).
    """

    workers: int = dataclasses.field(default_factory=default_workers)
    device_batches: int = 1
    host_batches: int | None = None  # default 2 x workers
    ordered: bool = True
    persistent: bool = False

    def __post_init__(self):
        for name, keyword in (("workers", "prefetch_workers"), ("device_batches", None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                also = f" (Nitro keyword {keyword})" if keyword else ""
                raise ValueError(
                    f"prefetch setting {name}{also} must be an int >= 1, got {value!r}. "
                    f"To turn prefetching off, wrap the source in nitro.data.NoPrefetch."
                )
        host = self.host_batches
        if host is not None and (
            isinstance(host, bool) or not isinstance(host, int) or host < self.workers
        ):
            raise ValueError(
                f"prefetch setting host_batches must be an int >= workers ({self.workers}), "
                f"got {host!r}: fewer host slots than workers can deadlock. Raise host_batches, "
                f"lower prefetch_workers, or leave host_batches unset (2 x workers)."
            )
        if not isinstance(self.ordered, bool):
            raise ValueError(
                f"prefetch setting ordered must be True or False, got {self.ordered!r}"
            )
        if not isinstance(self.persistent, bool):
            raise ValueError(
                f"prefetch setting persistent (Nitro keyword persistent_workers) must be True "
                f"or False, got {self.persistent!r}"
            )

    @property
    def host_depth(self) -> int:
        return self.host_batches if self.host_batches is not None else 2 * self.workers


class StagedBatch:
    """One batch on its way through the loop: the host fields, the device fields, the number
    of real samples (the rest is padding) and its index in the epoch. A block of `count`
    stacked batches (fused steps) has device fields `[count, batch, ...]`, `index` of its
    first batch, and `host` a list of the batches' host fields. `after`: the source's
    iterator state after each of its batches (`nitro.data.iter_state`), or None."""

    __slots__ = (
        "index",
        "host",
        "device",
        "n_real",
        "count",
        "group",
        "after",
        "_freed",
        "_owner",
    )

    def __init__(self, index, host, device, n_real, owner, count=1, group=1):
        self.index = index
        self.host = host
        self.device = device
        self.n_real = n_real
        self.count = count  # training steps (optimizer updates) in this call
        self.group = group  # batches per step (micro-batches of gradient accumulation)
        self.after: tuple[Any, ...] | None = None
        self._freed = False
        self._owner = owner

    @property
    def stacked(self) -> bool:
        return self.count * self.group > 1

    def free(self) -> None:
        """Delete the device buffers now (idempotent); host memory is left to Python."""
        if self._freed:
            return
        self._freed = True
        for array in self.device.values():
            if isinstance(array, jax.Array) and not array.is_deleted():
                array.delete()
        self._owner._count("freed")


def pad_batch(batch: Mapping[str, np.ndarray], width: int) -> tuple[dict[str, np.ndarray], int]:
    """Pad a short batch to `width` rows by repeating its last sample; return it and the real
    sample count."""
    n_real = _batch_length(batch)
    if n_real == width:
        return dict(batch), n_real
    if n_real > width:
        raise ValueError(
            f"a batch of {n_real} samples is wider than the compiled width {width}; evaluation "
            f"batches must not grow"
        )
    padded = {}
    for name, value in batch.items():
        value = np.asarray(value)
        filler = np.repeat(value[-1:], width - n_real, axis=0)
        padded[name] = np.concatenate([value, filler], axis=0)
    return padded, n_real


def _batch_length(batch: Mapping[str, Any]) -> int:
    lengths = {np.shape(v)[0] if np.ndim(v) else None for v in batch.values()}
    if len(lengths) != 1 or None in lengths:
        shapes = {k: np.shape(v) for k, v in batch.items()}
        raise ValueError(f"batch fields must share their first (batch) axis; shapes: {shapes}")
    length = lengths.pop()
    assert length is not None  # refused above
    return length


def _plain_reason(source: Any) -> str:
    """Why "auto" reads a source with no random access on one producer thread."""
    reason = (
        f"{type(source).__name__} has no begin_epoch/batch_at, so no thread or worker "
        f"process can build its batches by index: one thread reads it in order"
    )
    library = type(source).__module__.partition(".")[0]
    if library == "grain":
        return (
            f"{reason}; Grain parallelizes it itself (a DataLoader's worker_count=, an "
            f"IterDataset's mp_prefetch), or give the MapDataset it was made from"
        )
    if library == "nitro" and type(source).__name__ == "HFIterableSource":
        return f"{reason}; a datasets.Dataset (random access) is built in parallel"
    return f"{reason}; to build it in parallel give it begin_epoch/batch_at (docs/data.md)"


class _End:
    pass


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_END = _End()


def _note(message: str) -> None:
    """What "auto" changed from its choice, on stderr with or without a reporter (a script's
    `progress=False` too): once, as a warning."""
    warnings.warn(message, RuntimeWarning, stacklevel=3)


class Prefetcher:
    """Wraps one split's source. `epoch(e, start)` returns a stream of `StagedBatch`es."""

    def __init__(
        self,
        source: Any,
        *,
        place: Callable[[Mapping[str, np.ndarray]], dict],
        route: frozenset[str] | None = None,
        settings: PrefetchSettings | None = None,
        pad_to: int | None = None,
        keep_host: bool = False,
        name: str = "data",
        mode: str = "threads",
        build_seconds: float | None = None,
        place_block: Callable[[Mapping[str, np.ndarray]], dict] | None = None,
        direct: bool = False,
    ):
        if mode not in PREFETCH_MODES:
            raise ValueError(
                f"prefetch must be one of {', '.join(map(repr, PREFETCH_MODES))}, got {mode!r}"
            )
        self.inline = isinstance(source, NoPrefetch)
        self.source = source.source if self.inline else source
        self.mode = mode
        self.build_seconds = build_seconds
        self.place = place
        self.place_block = place_block
        self.direct_allowed = direct  # one device, one process
        self.route = route
        self.settings = settings or PrefetchSettings()
        self.pad_to = pad_to
        self.keep_host = keep_host
        self.name = name
        self.placed = 0  # batches put on the device
        self.freed = 0  # of those, batches whose device buffers were deleted
        self._counter_lock = threading.Lock()
        self.pool: WorkerPool | None = None  # worker processes, when the path is "processes"
        self._auto: tuple[str, str] | None = None  # "auto"'s choice and why
        if mode == "processes" and not self.inline:
            if not is_index_addressable(self.source):
                raise SetupError(
                    f"prefetch='processes' needs an index-addressable '{name}' source "
                    f"(begin_epoch/batch_at, see docs/data.md): worker processes build batches "
                    f"by index. {type(self.source).__name__} is a plain iterable; use "
                    f"prefetch='threads', or give it begin_epoch and batch_at"
                )
            self.pool = WorkerPool(self.source, self.settings.workers, name)

    def _count(self, counter: str) -> None:
        with self._counter_lock:  # the loop and the transfer thread both free batches
            setattr(self, counter, getattr(self, counter) + 1)

    @property
    def auto_inline(self) -> bool:
        """Cheap in-memory batches are built on the loop thread: handing them over from a
        worker costs more than building them (thread wake-ups, the interpreter lock)."""
        return (
            not self.inline
            and self.mode == "auto"
            and is_index_addressable(self.source)
            and self.build_seconds is not None
            and self.build_seconds < INLINE_BELOW_SECONDS
        )

    def auto_choice(self) -> tuple[str, str]:
        """ "auto" on an index-addressable source whose batches take a while to build:
        "processes" when the work holds the interpreter lock (two threads build a few
        batches hardly faster than one) and there are cores to run them, else "threads";
        and why. Measured once, on the first call."""
        if self._auto is None:
            self._auto = self._measure()
        return self._auto

    def _measure(self) -> tuple[str, str]:
        seconds = self.build_seconds or 0.0
        if seconds < PROCESSES_FROM_SECONDS:
            return "threads", f"a batch builds in {seconds * 1e3:.2f} ms"
        cores = os.cpu_count() or 1
        if cores < 2:
            return "threads", "one core: processes would not run in parallel"
        speedup, seconds = gil_speedup(self.source)
        measured = f"2 threads built batches {speedup:.2f}x as fast as 1, a batch in {seconds * 1e3:.1f} ms"
        if speedup >= THREADS_SCALE_AT:
            return "threads", f"{measured}: the work runs in parallel on threads"
        script = unguarded_script()
        if script is not None:
            reason = (
                f"{measured}, but worker processes would run {os.path.basename(script)} again: "
                f'it trains outside `if __name__ == "__main__":`, which worker processes '
                f"need (put the training under it)"
            )
            _note(f"prefetch='auto' builds the '{self.name}' split's batches on threads: {reason}")
            return "threads", reason
        try:
            self.pool = WorkerPool(self.source, self.settings.workers, self.name, fallback=True)
        except SetupError as error:
            return "threads", f"{measured}, but the source does not pickle ({error.__cause__})"
        return "processes", f"{measured}: the work holds the interpreter lock"

    def fall_back_to_threads(self, error: WorkersDidNotStart) -> None:
        """ "auto"'s worker processes died before their first batch: threads from now on,
        said once."""
        assert self._auto is not None  # only "auto" falls back
        self.pool = None
        self._auto = ("threads", f"{self._auto[1]}, but {error}: threads instead")
        _note(
            f"prefetch='auto' builds the '{self.name}' split's batches on threads: {error} "
            f"(their error is above; prefetch='processes' raises it)"
        )

    @property
    def path(self) -> str:
        if self.inline or self.mode == "inline" or self.auto_inline:
            return "inline"
        if self.mode == "processes":
            return "processes"
        if (
            self.mode == "auto"
            and is_index_addressable(self.source)
            and self.auto_choice()[0] == "processes"
        ):
            return "processes"
        if is_index_addressable(self.source):
            if self.settings.workers == 1:
                return "single"
            return "fanout" if self.settings.ordered else "fanout_unordered"
        return "single"

    def describe(self) -> str:
        s = self.settings
        if self.path == "inline":
            if self.auto_inline:
                assert self.build_seconds is not None  # auto_inline measured it
                return (
                    f"inline: a batch builds in {self.build_seconds * 1e6:.0f} us, cheaper on "
                    f"the loop thread than handed over from a worker (prefetch='threads' "
                    f"forces workers)"
                )
            return "no prefetch (inline)"
        path = self.path
        workers = s.workers if path.startswith("fanout") or path == "processes" else 1
        if path == "processes":
            kind = "worker process" if workers == 1 else "worker processes"
        else:
            kind = "worker" if workers == 1 else "workers"
        described = (
            f"{path}: {workers} {kind}, host_batches={s.host_depth}, "
            f"device_batches={s.device_batches}, ordered={s.ordered}"
        )
        if self.mode == "auto" and self._auto is not None:
            described += f" (auto: {self._auto[1]})"
        elif self.mode == "auto" and not is_index_addressable(self.source):
            described += f" (auto: {_plain_reason(self.source)})"
        return described

    def release_workers(self, final: bool = False) -> None:
        """The end of a run: stop this split's worker processes, if it has any, unless they
        persist (`persistent_workers=True`: the next run checks they still have the source as
        it is, and uses them); `final` (the handle's close): stop them whatever the setting.
        The next epoch starts them again."""
        if self.pool is None:
            return
        if self.settings.persistent and not final:
            self.pool.park()
        else:
            self.pool.release()

    @property
    def direct(self) -> bool:
        """Inline batches on one device go into the program call as host arrays: the call's
        own transfer is cheaper than staging them first (there is nothing to overlap)."""
        return self.direct_allowed and self.path == "inline"

    def stage(self, index: int, host: Mapping[str, Any]) -> StagedBatch:
        """Pad (eval splits), route and transfer one host batch."""
        rows = _batch_length(host)
        if rows == 0:
            raise SetupError(
                f"the '{self.name}' split yielded a batch with 0 rows (batch {index} of the "
                f"epoch); a batch needs at least one sample: filter empty batches out of the "
                f"source"
            )
        if self.pad_to is not None:
            host, n_real = pad_batch(host, self.pad_to)
        else:
            n_real = rows
        routed = host if self.route is None else {k: host[k] for k in self.route if k in host}
        self._count("placed")
        if self.direct:
            return StagedBatch(index, host if self.keep_host else None, routed, n_real, self)
        device = self.place(routed)
        staged = StagedBatch(index, host if self.keep_host else None, device, n_real, self)
        staged.n_real = self._global_real(staged, _batch_length(routed) if routed else n_real)
        return staged

    def stage_block(self, index: int, hosts: list, group: int = 1) -> StagedBatch:
        """Route, stack and transfer `len(hosts)` consecutive batches as one block:
        `len(hosts) // group` steps of `group` batches each (fused steps, micro-batches of
        gradient accumulation), or evaluation batches (padded like single ones, with their
        real sample counts as an array); one batch is staged as usual."""
        if len(hosts) == 1:
            return self.stage(index, hosts[0])
        routed, n_reals = [], []
        for offset, host in enumerate(hosts):
            if _batch_length(host) == 0:
                raise SetupError(
                    f"the '{self.name}' split yielded a batch with 0 rows (batch "
                    f"{index + offset} of the epoch); a batch needs at least one sample: "
                    f"filter empty batches out of the source"
                )
            if self.pad_to is not None:  # evaluation: a short batch is padded, as alone
                host, n_real = pad_batch(host, self.pad_to)
                hosts[offset] = host
                n_reals.append(n_real)
            routed.append(
                host if self.route is None else {k: host[k] for k in self.route if k in host}
            )
        first = routed[0]
        for offset, batch in enumerate(routed[1:], start=1):
            for name, value in batch.items():
                value, like = np.asarray(value), np.asarray(first[name])
                if value.shape != like.shape or value.dtype != like.dtype:
                    raise SetupError(
                        f"{self.name} batch {index + offset} differs from batch {index}: "
                        f"{name!r} {like.dtype}{list(like.shape)} -> "
                        f"{value.dtype}{list(value.shape)}. Every training batch must have the "
                        f"same shapes and dtypes (drop a partial final batch with "
                        f"drop_last=True; cast in the loader)"
                    )
        stacked = {name: np.stack([b[name] for b in routed]) for name in first}
        device = stacked if self.direct else (self.place_block or self.place)(stacked)
        self._count("placed")
        rows = _batch_length(routed[0]) if routed[0] else _batch_length(hosts[0])
        return StagedBatch(
            index,
            hosts if self.keep_host else None,
            device,
            np.asarray(n_reals, np.int32) if n_reals else rows,  # per batch, when evaluating
            self,
            count=len(hosts) // group,
            group=group,
        )

    def stage_stacked(
        self, index: int, stacked: Mapping[str, np.ndarray], units: int, group: int = 1
    ) -> StagedBatch:
        """Route and transfer `units` consecutive training batches a source gathered already
        stacked (`block_at`): the steps of one fused call, as `stage_block` would stack them."""
        routed = (
            dict(stacked)
            if self.route is None
            else {k: stacked[k] for k in self.route if k in stacked}
        )
        device = routed if self.direct else (self.place_block or self.place)(routed)
        self._count("placed")
        rows = next(iter(stacked.values())).shape[1]
        return StagedBatch(index, None, device, rows, self, count=units // group, group=group)

    def _global_real(self, staged: StagedBatch, local_rows: int) -> int:
        """Real samples in the global batch. In a multi-process run each process places its
        share, so the device batch is `processes x` wider than the host one."""
        rows = next((a.shape[0] for a in staged.device.values() if np.ndim(a)), local_rows)
        if rows == local_rows:
            return staged.n_real
        if staged.n_real != local_rows:
            staged.free()
            raise ValueError(
                f"'{self.name}' batch {staged.index} has {staged.n_real} real samples of "
                f"{local_rows}: in a multi-process run every process must feed full batches "
                f"(padding one process's share would pad the middle of the global batch). "
                f"Use drop_last=True, or a sample count that divides into global batches."
            )
        return rows

    def epoch(
        self,
        epoch: int,
        start: int = 0,
        block: int | Iterable[int] = 1,
        group: int = 1,
        state: Any = None,
        skip: frozenset[int] = frozenset(),
    ) -> EpochStream:
        """The staged batches of one epoch from batch `start`. With `block > 1` or
        `group > 1`: calls of `block` steps of `group` stacked batches each; the epoch's
        remainder goes one step per call. `block` may be a sequence of call sizes, one per
        call in turn (the last repeats): the steps-per-call measurement alternates sizes.
        `state`: the source's iterator state after batch `start - 1` (a checkpoint's), which
        an iterator that takes one resumes from instead of replaying the epoch to `start`.
        `skip`: the source's batch indices this epoch leaves out (a spike's roll-back): the
        epoch is then the source's batches less those, `start` counting the batches kept,
        and each staged batch keeps its index in the source."""
        if self.path == "inline":
            stream: EpochStream = _InlineStream(self, epoch, start, block, group, state, skip)
        else:
            stream = _ThreadedStream(self, epoch, start, block, group, state, skip)
        return stream


class EpochStream:
    """An iterator of staged batches for one epoch; `close()` (or `with`) releases it.

    `fill_seconds`: how long the loop waited at the stream's two ends, for its first call
    (the pipeline's fill: nothing runs on the device yet that building it could overlap
    with) and for the word that it ended; `wait_seconds`: how long it waited for every other
    call, which a faster pipeline hides behind the call in flight. The epoch's
    `data_wait_frac` counts `wait_seconds` only: counting the ends, an epoch of a few calls
    (9 steps, or one fused call) over batches already in memory read 0.5 and more."""

    wait_seconds: float = 0.0
    fill_seconds: float = 0.0
    _filled: bool = False
    # the source's iterator state after each batch built and not yet staged, by index
    states: dict[int, Any] | None = None

    def _mark(self, staged: StagedBatch, indices: Iterable[int]) -> StagedBatch:
        """Give `staged` the iterator states after its batches (when the source has them)."""
        states = self.states
        if states is not None:
            after = tuple(states.pop(index, None) for index in indices)
            staged.after = after if all(a is not None for a in after) else None
        return staged

    def _waited(self, begin: float, end: bool = False) -> None:
        """Account the wait since `begin` (perf_counter) for one call of `__next__`; `end`:
        the call that found the stream ended."""
        elapsed = time.perf_counter() - begin
        if self._filled and not end:
            self.wait_seconds += elapsed
        else:
            self.fill_seconds += elapsed
            self._filled = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __iter__(self) -> EpochStream:
        return self

    def __next__(self) -> StagedBatch:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


def _call_sizes(block: int | Iterable[int]) -> Iterator[int]:
    """Steps per call, call after call: `block` each time, or the sizes `block` lists in
    turn, the last repeating."""
    if isinstance(block, int):
        return itertools.repeat(block)

    def sizes() -> Iterator[int]:
        size = 1
        for size in block:
            yield size
        yield from itertools.repeat(size)

    return sizes()


def consumed(start: int, skip: frozenset[int]) -> int:
    """The source's batches an epoch has gone through once it has yielded `start` batches,
    leaving out the indices in `skip`.

    >>> consumed(3, frozenset()), consumed(3, frozenset({1})), consumed(0, frozenset({0}))
    (3, 4, 0)
    """
    if not skip or not start:
        return start
    kept = (index for index in itertools.count() if index not in skip)
    return next(itertools.islice(kept, start - 1, None)) + 1


def epoch_indices(start: int, end: int, skip: frozenset[int]) -> Iterator[int]:
    """The source's batch indices an epoch yields from its `start`-th batch on, up to `end`
    (its length), less `skip`.

    >>> list(epoch_indices(2, 6, frozenset({1, 4})))
    [3, 5]
    """
    return (index for index in range(consumed(start, skip), end) if index not in skip)


def _source_iterator(
    source: Any,
    epoch: int,
    start: int,
    state: Any = None,
    states: dict[int, Any] | None = None,
    skip: frozenset[int] = frozenset(),
) -> Iterator[tuple[int, Any]]:
    """(index, batch) pairs of the epoch from batch `start` (less `skip`: `start` counts the
    batches kept). A plain iterable resumes from `state` when its iterator takes one, else by
    replaying to `start`; its iterator's state after each batch goes into `states` (when it
    has one)."""
    if is_index_addressable(source):
        plan = source.begin_epoch(epoch)
        for index in epoch_indices(start, len(source), skip):
            yield index, source.batch_at(index, plan)
        return
    # an epoch-aware stream (HFIterableSource) gives each epoch's pass itself
    begin = consumed(start, skip)
    iterator, read_state = open_epoch(source, epoch, begin, state)
    for index, batch in zip(itertools.count(begin), iterator):
        if read_state is not None and states is not None:
            states[index] = read_state()  # before the batch is handed on: it is that batch's
        if index not in skip:
            yield index, batch


def _steps_of(items: list, group: int) -> list[list]:
    """The epoch's remainder as single steps of `group` batches; the last takes what is left
    when `group` does not divide them (a step of fewer micro-batches: their mean gradient)."""
    return [items[i : i + group] for i in range(0, len(items), group)]


class _Batches:
    """The (index, batch) pairs of an epoch of a source with `block_at`, which can also
    hand over the next `count` batches stacked at once (`gather`)."""

    def __init__(self, source: Any, epoch: int, start: int):
        self.source, self.index, self.end = source, start, len(source)
        self.plan = source.begin_epoch(epoch)

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> tuple[int, Any]:
        if self.index >= self.end:
            raise StopIteration
        index, self.index = self.index, self.index + 1
        return index, self.source.batch_at(index, self.plan)

    def gather(self, count: int) -> tuple[int, dict[str, np.ndarray]] | None:
        if self.index + count > self.end:
            return None
        stacked = self.source.block_at(self.index, count, self.plan)
        if stacked is None:
            return None
        index, self.index = self.index, self.index + count
        return index, stacked


class _InlineStream(EpochStream):
    def __init__(
        self,
        owner: Prefetcher,
        epoch: int,
        start: int,
        block: int | Iterable[int] = 1,
        group: int = 1,
        state: Any = None,
        skip: frozenset[int] = frozenset(),
    ):
        self.owner = owner
        source = owner.source
        gathers = callable(getattr(source, "block_at", None)) and is_index_addressable(source)
        fast = gathers and not owner.keep_host and owner.pad_to is None and not skip
        self.states = None if is_index_addressable(source) else {}
        self.iterator = (
            _Batches(source, epoch, start)
            if fast
            else _source_iterator(source, epoch, start, state, self.states, skip)
        )
        self._sizes = _call_sizes(block)
        self.block, self.group = next(self._sizes), group
        self._short: list = []  # the epoch's remainder: one step per call

    def __next__(self) -> StagedBatch:
        begin, ended = time.perf_counter(), True
        try:
            staged = self._next()
            ended = False
            return staged
        finally:
            self._waited(begin, end=ended)

    def _next(self) -> StagedBatch:
        block, self.block = self.block, next(self._sizes)
        if block == 1 and self.group == 1 and not self._short:
            index, host = next(self.iterator)
            return self._mark(self.owner.stage(index, host), (index,))
        if not self._short:
            units = block * self.group
            gathered = self.iterator.gather(units) if isinstance(self.iterator, _Batches) else None
            if gathered is not None:
                return self.owner.stage_stacked(gathered[0], gathered[1], units, self.group)
            items = list(itertools.islice(self.iterator, units))
            if not items:
                raise StopIteration
            if len(items) == units:
                staged = self.owner.stage_block(
                    items[0][0], [host for _, host in items], self.group
                )
                return self._mark(staged, (index for index, _ in items))
            self._short = _steps_of(items, self.group)
        items = self._short.pop(0)
        staged = self.owner.stage_block(items[0][0], [host for _, host in items], len(items))
        return self._mark(staged, (index for index, _ in items))

    def close(self) -> None:
        close = getattr(self.iterator, "close", None)
        if close is not None:
            close()


class _ThreadedStream(EpochStream):
    def __init__(
        self,
        owner: Prefetcher,
        epoch: int,
        start: int,
        block: int | Iterable[int] = 1,
        group: int = 1,
        state: Any = None,
        skip: frozenset[int] = frozenset(),
    ):
        self.owner = owner
        self.skip = skip
        self.states = None if is_index_addressable(owner.source) else {}
        self._sizes = _call_sizes(block)
        self.block, self.group = next(self._sizes), group
        self._pending: list[tuple[int, Any]] = []  # host batches waiting to fill a block
        self.settings = owner.settings
        self.out: queue.Queue = queue.Queue(maxsize=self.settings.device_batches)
        self.stopping = threading.Event()
        self.finished = False
        self.executor = None
        self.producer = None
        name = f"nitro-prefetch-{owner.name}"
        source = owner.source
        if owner.path == "processes":
            target = self._fan_out
        elif is_index_addressable(source) and self.settings.workers > 1:
            self.executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.settings.workers, thread_name_prefix=f"{name}-worker"
            )
            target = self._fan_out
        else:
            self.host: queue.Queue = queue.Queue(maxsize=self.settings.host_depth)
            self.producer = threading.Thread(
                target=self._produce,
                args=(source, epoch, start, state),
                name=f"{name}-producer",
                daemon=True,
            )
            target = self._transfer_from_producer
        self.transfer = threading.Thread(
            target=target, args=(source, epoch, start), name=f"{name}-transfer", daemon=True
        )
        if self.producer is not None:
            self.producer.start()
        self.transfer.start()

    # producer side ---------------------------------------------------------------------------

    def _put(self, q: queue.Queue, item) -> bool:
        """Put unless stopping; False when the stream is closing."""
        while not self.stopping.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _emit(self, index: int, host) -> bool:
        if self.block > 1 or self.group > 1:
            self._pending.append((index, host))
            if len(self._pending) < self.block * self.group:
                return True
            flushed = self._flush()
            self.block = next(self._sizes)
            return flushed
        self.block = next(self._sizes)
        staged = self._mark(self.owner.stage(index, host), (index,))
        if not self._put(self.out, staged):
            staged.free()
            return False
        return True

    def _flush(self) -> bool:
        """Stage the block gathered so far; a short one (the epoch's remainder) goes one
        batch per call, so it needs no program of its own."""
        if not self._pending:
            return True
        items, self._pending = self._pending, []
        if len(items) < self.block * self.group:
            steps = _steps_of(items, self.group)
        else:
            steps = [items]
        staged_list = [
            self._mark(
                self.owner.stage_block(
                    step[0][0], [host for _, host in step], min(self.group, len(step))
                ),
                (index for index, _ in step),
            )
            for step in steps
        ]
        for number, staged in enumerate(staged_list):
            if not self._put(self.out, staged):
                for rest in staged_list[number:]:
                    rest.free()
                return False
        return True

    def _builders(self, source, epoch: int) -> tuple[Callable, Callable]:
        """`submit(index) -> future` and `result(index, future) -> batch`: on the worker
        threads, or in the worker processes (which call `begin_epoch` themselves)."""
        executor, pool = self.executor, self.owner.pool
        if pool is not None:
            return (
                lambda index: pool.submit(epoch, index),
                lambda index, future: pool.result(future, epoch, index),
            )
        assert executor is not None  # the thread fan-out starts its workers first
        plan = source.begin_epoch(epoch)
        return (
            lambda index: executor.submit(source.batch_at, index, plan),
            lambda index, future: future.result(),
        )

    def _fan_out(self, source, epoch: int, start: int) -> None:
        try:
            self._fan_out_once(source, epoch, start)
        except WorkersDidNotStart as error:  # "auto"'s processes: nothing was built by them
            self.owner.fall_back_to_threads(error)
            self.executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.settings.workers,
                thread_name_prefix=f"nitro-prefetch-{self.owner.name}-worker",
            )
            self._fan_out_once(source, epoch, start)

    def _fan_out_once(self, source, epoch: int, start: int) -> None:
        executor = self.executor
        pending: dict[int, concurrent.futures.Future] = {}
        try:
            submit, result = self._builders(source, epoch)
            indices = epoch_indices(start, len(source), self.skip)
            depth = self.settings.host_depth

            def submit_more():
                while len(pending) < depth:
                    index = next(indices, None)
                    if index is None:
                        return
                    pending[index] = submit(index)

            submit_more()
            while pending and not self.stopping.is_set():
                if self.settings.ordered:
                    index = min(pending)
                    future = pending.pop(index)
                    host = result(index, future)
                else:
                    done, _ = concurrent.futures.wait(
                        pending.values(), return_when=concurrent.futures.FIRST_COMPLETED
                    )
                    future = next(iter(done))
                    index = next(i for i, f in pending.items() if f is future)
                    pending.pop(index)
                    host = result(index, future)
                submit_more()
                if not self._emit(index, host):
                    break
            else:
                if not self._flush():
                    return
            self._put(self.out, _END)
        except WorkersDidNotStart:
            raise
        except BaseException as error:  # noqa: BLE001 - re-raised in the loop
            self._put(self.out, _Failure(error))
        finally:
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
            for future in pending.values():  # worker processes outlive the epoch: not theirs
                future.cancel()

    def _produce(self, source, epoch: int, start: int, state: Any) -> None:
        try:
            for item in _source_iterator(source, epoch, start, state, self.states, self.skip):
                if not self._put(self.host, item):
                    return
            self._put(self.host, _END)
        except BaseException as error:  # noqa: BLE001
            self._put(self.host, _Failure(error))

    def _transfer_from_producer(self, source, epoch: int, start: int) -> None:
        try:
            while not self.stopping.is_set():
                try:
                    item = self.host.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is _END and not self._flush():
                    return
                if item is _END or isinstance(item, _Failure):
                    self._put(self.out, item)
                    return
                if not self._emit(*item):
                    return
        except BaseException as error:  # noqa: BLE001
            self._put(self.out, _Failure(error))

    # consumer side ---------------------------------------------------------------------------

    def __next__(self) -> StagedBatch:
        if self.finished:
            raise StopIteration
        begin = time.perf_counter()
        item = self.out.get()
        self._waited(begin, end=item is _END)
        if item is _END:
            self.finished = True
            raise StopIteration
        if isinstance(item, _Failure):
            self.finished = True
            raise item.error
        return item

    def close(self) -> None:
        self.stopping.set()
        self.finished = True
        threads = [t for t in (self.transfer, self.producer) if t is not None]
        deadline = time.monotonic() + 30.0
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            self._drain()
            for t in threads:
                t.join(timeout=0.02)
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                item = self.out.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, StagedBatch):
                item.free()
