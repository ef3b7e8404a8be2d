"""Iterator state of sources without random access, for exact resume without replay.

A plain iterable resumes mid-epoch by replaying its epoch up to the stopping batch. A source
whose epoch iterator can save and restore its own state skips that replay: Grain's iterators
(`iter(grain.IterDataset)`, `iter(grain.DataLoader)`) have `get_state()`/`set_state()`, and
`nitro.data.HFIterableSource`'s passes wrap a `datasets.IterableDataset`'s
`state_dict()`/`load_state_dict()` the same way. The prefetcher reads the state after every
batch it builds, the loop keeps the one after the last batch trained
(`TrainState.data_state`), and each mid-epoch checkpoint records it
(`partial_epoch.data_state` of its JSON meta); a resume restores it into the epoch's fresh
iterator instead of pulling the batches already trained.

A state is kept only when it is JSON (a `DataLoader`'s state is JSON text in bytes: kept as
that text), and only on a single-process run: a checkpoint records one process's state.
Anything else, and a checkpoint from before states were saved, resumes by replay.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["decode", "encode", "open_epoch", "reads_state"]

_TEXT = "json_text"  # the key of a state that was JSON text in bytes (a grain.DataLoader's)


def reads_state(iterator: Any) -> bool:
    """Whether an epoch iterator has Grain's state protocol (`get_state`/`set_state`)."""
    return callable(getattr(iterator, "get_state", None)) and callable(
        getattr(iterator, "set_state", None)
    )


def encode(state: Any) -> Any:
    """`state` as JSON values (a copy), or None when it is not JSON: then it is not kept."""
    if state is None:
        return None
    if isinstance(state, bytes):
        try:
            return {_TEXT: state.decode("utf-8")}
        except UnicodeDecodeError:
            return None
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError):
        return None


def decode(state: Any) -> Any:
    """What `encode` kept, as the iterator's `set_state` takes it."""
    if isinstance(state, dict) and set(state) == {_TEXT}:
        return state[_TEXT].encode("utf-8")
    return state


def open_epoch(
    source: Any, epoch: int, start: int, state: Any = None
) -> tuple[Iterator[Any], Callable[[], Any] | None]:
    """The iterator of epoch `epoch` from batch `start`, and a function that reads its state
    (encoded; None when it has none). `state`: the state after batch `start - 1` from a
    checkpoint; restored when the iterator takes one, else the epoch is replayed to `start`."""
    iter_epoch: Callable[[int], Iterable[Any]] | None = getattr(source, "iter_epoch", None)
    iterator: Any = iter(iter_epoch(epoch) if iter_epoch is not None else source)
    stateful = reads_state(iterator)
    if start and state is not None and stateful:
        iterator.set_state(decode(state))
    else:
        for _ in range(start):  # no state to restore: replay what was consumed
            next(iterator, None)
    if not stateful or _multi_process():
        return iterator, None
    return iterator, lambda: encode(iterator.get_state())


def _multi_process() -> bool:
    import jax

    return jax.process_count() > 1
