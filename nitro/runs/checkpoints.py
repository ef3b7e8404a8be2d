"""Checkpoints: the whole `TrainState` saved with orbax after an epoch's validation.

`Checkpointer(k=3, metric="val_loss", mode="min", every=1, budget=0.05)` configures the
default checkpointer, an orbax `CheckpointManager` in `<run_dir>/checkpoints`. It keeps the
best `k` checkpoints by `metric` plus the newest, and saves in the background: a thread of
the store writes each save while training goes on (one written, one waiting; a newer save
takes the waiting one's place), and this process's readers of the directory, `close()` and
the process's end wait for it. A save is the parameters, the model's other
variables and the optimizer state as nested dicts of numpy arrays (item `state`), and a JSON
record (item `meta`): step, epoch, seed, history, the GraphConst configuration, the Device
values, the code fingerprints, the run id and the epoch's metrics. Plain orbax reads them:

```python
import orbax.checkpoint as ocp
manager = ocp.CheckpointManager("runs/Digits/20261130-181500-a3f9/checkpoints")
saved = manager.restore(manager.latest_step())
saved["state"]["params"]["hidden1"]["kernel"]        # a numpy array
saved["meta"]["epoch"], saved["meta"]["history"][-1]
```

A sharded run's (`sharding="fsdp"`, rules) sharded leaves are saved as the jax.Arrays
themselves instead (an on-device copy: orbax writes each shard from its device, nothing is
gathered), and a resume restores them onto the fresh state's shardings, resharding onto
another mesh; plain orbax reads them whole with numpy targets (docs/distributed-checkpoints.md).

`budget` bounds what checkpoints cost: a save is skipped when the time since the last one,
times `budget`, is less than what the last one cost (its background write included), so
tiny epochs (the digits demo's take milliseconds) do not spend their time in orbax. The newest committed epoch is always saved
when a run ends at an epoch boundary, and so is the run's best epoch by `metric`: one the
budget (or `every`) skips is held on the host and written with the next save or at the end of
the call (`nitro.runs.lifecycle`); `budget=None` saves every `every` epochs regardless.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nitro.core.run_setup import CheckpointPolicy, CheckpointRef
from nitro.errors import SetupError

__all__ = [
    "CHECKPOINT_FORMAT",
    "Checkpointer",
    "CheckpointStore",
    "Save",
    "SavedStep",
    "await_writers",
    "describe_checkpoints",
    "describe_saved",
    "host_tree",
    "is_sharded",
    "place_like",
    "ranked_steps",
    "resolve_checkpoint",
    "restore_targets",
]

CHECKPOINT_FORMAT = 1

# Orbax deletes a step by removing its files one by one: a process killed meanwhile would
# leave a step directory that still lists as saved but no longer restores. So steps are moved
# into this subdirectory first (one atomic rename) and removed from there.
DELETING = "deleting"


@dataclasses.dataclass(frozen=True)
class Checkpointer:
    """How a run saves checkpoints (the `checkpointer=` run keyword; `None` turns them off).

    Args:
      k: keep the best `k` checkpoints by `metric` (plus the newest).
      metric: the history column that ranks checkpoints (`val_loss`, `val_acc`, `loss`, ...).
      mode: "min" or "max": which way is better.
      every: consider a save every `every` epochs.
      budget: the largest fraction of training time checkpoints may take (saves are skipped
        while the last one's cost exceeds `budget` x the time since it; the run's best epoch
        by `metric` is saved all the same); None saves every `every` epochs.

    >>> Checkpointer(k=5, metric="val_acc", mode="max")
    Checkpointer(k=5, metric='val_acc', mode='max', every=1, budget=0.05)
    """

    k: int = 3
    metric: str = "val_loss"
    mode: str = "min"
    every: int = 1
    budget: float | None = 0.05

    def __post_init__(self) -> None:
        for name in ("k", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SetupError(f"Checkpointer({name}={value!r}): {name} must be an int >= 1")
        if self.mode not in ("min", "max"):
            raise SetupError(f"Checkpointer(mode={self.mode!r}): mode must be 'min' or 'max'")
        if not isinstance(self.metric, str) or not self.metric:
            raise SetupError(f"Checkpointer(metric={self.metric!r}): name a history column")
        if self.budget is not None and not (
            isinstance(self.budget, (int, float)) and 0 < self.budget <= 1
        ):
            raise SetupError(
                f"Checkpointer(budget={self.budget!r}): a fraction in (0, 1], or None to save "
                f"every `every` epochs"
            )

    def better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b


# ---------------------------------------------------------------------------------------------
# trees of host arrays


def _host(x: Any) -> np.ndarray:
    """A host copy of a (replicated) array; PRNG keys as their key data."""
    if isinstance(x, jax.Array):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if not x.is_fully_addressable:
            x = x.addressable_data(0)
    return np.array(x, copy=True)


def _saved(x: Any) -> Any:
    """What a save holds of a leaf: a host copy of a replicated array (`_host`), or of a
    sharded one (not fully replicated: `sharding="fsdp"`, rules) a copy with the same
    sharding in the host memory of its devices (`pinned_host`, where the devices have it), which
    orbax writes shard by shard (across processes each process writes its own shards); nothing
    is gathered. The copy is taken now, before the next step donates the live arrays to the
    program; in host memory it takes no device memory while it waits to be written (a device
    without host memory keeps an on-device copy)."""
    if is_sharded(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if _has_host_memory(x):
            return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
        return x.copy()
    return _host(x)


def _has_host_memory(x: jax.Array) -> bool:
    device = next(iter(x.sharding.device_set))
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except Exception:  # noqa: BLE001 - a backend without memory kinds
        return False


def is_sharded(x: Any) -> bool:
    """Whether `x` is a device array laid out in shards (not fully replicated)."""
    return isinstance(x, jax.Array) and not x.sharding.is_fully_replicated


def place_like(value: Any, like: Any, put_replicated: Any) -> Any:
    """A restored leaf laid out as the template leaf `like`: `put_replicated(value)` when
    `like` is replicated (as runs have always placed a restore), else onto `like`'s sharding,
    each device receiving only its own shard of the host value (nothing is gathered on one
    device; a checkpoint of another mesh is resharded here). A leaf orbax already restored
    onto that sharding is kept as it is."""
    if not is_sharded(like):
        return put_replicated(value)
    if isinstance(value, jax.Array) and value.sharding == like.sharding:
        return value
    if jnp.issubdtype(like.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(value) if isinstance(value, jax.Array) else value
        host = np.asarray(data)
        placed = jax.make_array_from_callback(host.shape, like.sharding, lambda i: host[i])
        return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(like))
    host = np.asarray(value)
    return jax.make_array_from_callback(like.shape, like.sharding, lambda i: host[i])


def _nest(paths: tuple[str, ...], leaves: list) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, leaf in zip(paths, leaves, strict=True):
        node = tree
        *parents, last = path.split(".") if path else ["value"]
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    return tree


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(_flatten(value, path))
        else:
            flat[path] = value
    return flat


# the loss-scale variables of a float16 run, as a checkpoint names them
LOSS_SCALE_KEYS = ("scale", "finite_steps", "skipped_steps")


class _Later:
    """A replicated array that no later step donates, copied to the host only when its save is
    written (`host_tree(lazy=True)`): a save that a newer one replaces copies nothing."""

    __slots__ = ("array",)

    def __init__(self, array: jax.Array):
        self.array = array


def _later(x: Any) -> Any:
    return _Later(x) if isinstance(x, jax.Array) and not is_sharded(x) else _saved(x)


def _materialized(tree: Any) -> Any:
    """`tree` with each `_Later` leaf copied to the host now."""
    return jax.tree.map(lambda x: _host(x.array) if isinstance(x, _Later) else x, tree)


def host_tree(setup: Any, variables: Any, lazy: bool = False) -> dict[str, Any]:
    """The variables as nested dicts of numpy arrays, keyed by the model's leaf paths; a
    sharded leaf is an on-device copy of its shards instead (`_saved`). `lazy`: no later
    step donates the variables, so a replicated leaf is copied to the host when the save is
    written, on the saver's thread, instead of now (`CheckpointStore.save` materializes it)."""
    held = _later if lazy else _saved
    paths = setup.model.leaf_paths
    tree: dict[str, Any] = {
        "params": _nest(paths["parameter"], [held(x) for x in variables.params]),
        "model_state": _nest(paths["model state"], [held(x) for x in variables.model_state]),
    }
    if variables.opt_state is not None:
        tree["opt_state"] = _nest(paths["optimizer state"], [held(x) for x in variables.opt_state])
    if variables.ema is not None:  # the moving average of the weights (ema=)
        tree["ema"] = _nest(paths["parameter"], [held(x) for x in variables.ema])
        tree["ema_steps"] = held(variables.ema_steps)
    if variables.loss_scale is not None:  # precision="float16": the dynamic loss scale
        tree["loss_scale"] = dict(
            zip(LOSS_SCALE_KEYS, map(held, variables.loss_scale), strict=True)
        )
    return tree


def restore_targets(setup: Any, variables: Any) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """Where a restore puts each sharded leaf of `variables` (the fresh state: the template):
    its checkpoint path -> shape, dtype and the template leaf's sharding. Orbax reads each of
    them straight onto those devices, each process only its own shards, resharding a
    checkpoint written on another mesh. Replicated leaves are not named: they are read to
    the host and placed as ever."""
    paths = setup.model.leaf_paths
    groups = [("params", paths["parameter"], variables.params)]
    groups.append(("model_state", paths["model state"], variables.model_state))
    if variables.opt_state is not None:
        groups.append(("opt_state", paths["optimizer state"], variables.opt_state))
    if variables.ema is not None:
        groups.append(("ema", paths["parameter"], variables.ema))
    targets = {}
    for key, names, leaves in groups:
        for name, leaf in zip(names, leaves, strict=True):
            if is_sharded(leaf) and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                parts = tuple(name.split(".")) if name else ("value",)
                targets[(key, *parts)] = jax.ShapeDtypeStruct(
                    leaf.shape, leaf.dtype, sharding=leaf.sharding
                )
    return targets


def _dtype(x: Any) -> np.dtype:
    """An array's dtype, without copying a device array to the host."""
    return x.dtype if isinstance(x, (np.ndarray, jax.Array)) else np.asarray(x).dtype


def leaves_from(
    what: str,
    saved: Mapping[str, Any],
    paths,
    template: list,
    misfit: str | None = None,
    here: str = "this model",
) -> list:
    """Leaves in the template's order from a saved nested dict; a mismatch names the leaves
    (`here`: what the template is), after `misfit` (what it means and the fix; by default,
    that the model differs)."""
    flat = _flatten(saved) if paths != ("",) else {"": saved.get("value")}
    missing = [p for p in paths if p not in flat]
    extra = [p for p in flat if p not in set(paths)]
    problems = [f"  {p}: missing from the checkpoint" for p in missing[:6]]
    problems += [f"  {p}: in the checkpoint, not in {here}" for p in extra[:6]]
    leaves = []
    for path, like in zip(paths, template, strict=True):
        value = flat.get(path)
        if value is None:
            continue
        is_key = isinstance(like, jax.Array) and jnp.issubdtype(like.dtype, jax.dtypes.prng_key)
        expected = np.shape(jax.random.key_data(like)) if is_key else np.shape(like)
        dtype = jax.random.key_data(like).dtype if is_key else _dtype(like)
        found = _dtype(value)
        if tuple(np.shape(value)) != tuple(expected) or found != dtype:
            problems.append(
                f"  {path}: {here} {dtype}{list(expected)}, checkpoint "
                f"{found}{list(np.shape(value))}"
            )
            continue
        if is_key:
            value = jax.random.wrap_key_data(
                value if isinstance(value, jax.Array) else np.asarray(value),  # pyright: ignore[reportArgumentType]  # jax annotates Array, takes any array
                impl=jax.random.key_impl(like),
            )
        leaves.append(value)
    if problems:
        raise SetupError(
            (
                misfit
                or f"the checkpoint's {what} do not fit this model (build it with the same "
                f"GraphConst values and model code):"
            )
            + "\n"
            + "\n".join(problems)
        )
    return leaves


# ---------------------------------------------------------------------------------------------
# the store


_OPEN: weakref.WeakSet = weakref.WeakSet()


class _OrbaxAccess:
    """Orbax is not safe to drive from several threads at once: two managers saving in
    parallel (two handles training in the background) corrupt each other's OCDBT writes.

    Every orbax call runs under `held(manager)`. A manager whose background write is still in
    flight keeps its turn after the call returns: the next call for another manager first
    waits for that write to finish. One run's own saves still overlap its training.

    A write that fails is reported to the store that started it (`failed`), never to the
    caller that happened to wait for it, and its manager gives up its turn whatever happens:
    a failed write cannot hold the lock or make the next caller wait on it again.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._writing: Any = None  # the manager whose background write may be in flight
        self._failed: Any = None  # (error) -> None: its store's report of a failed write

    @contextmanager
    def held(self, manager: Any = None) -> Iterator[None]:
        with self._lock:
            writing, failed = self._writing, self._failed
            if writing is not None and writing is not manager:
                self._writing = self._failed = None
                try:
                    writing.wait_until_finished()
                except Exception as error:  # noqa: BLE001 - its own store reports it
                    if failed is not None:
                        failed(error)
            yield

    def started_write(self, manager: Any, failed: Any = None) -> None:
        """Under `held(manager)`: `manager` begins a background write; `failed(error)`
        reports its failure when another caller finds it."""
        self._writing, self._failed = manager, failed

    def closed(self, manager: Any) -> None:
        """Under `held(manager)`: `manager` has finished its writes (or failed) and is closed."""
        if self._writing is manager:
            self._writing = self._failed = None


_ORBAX = _OrbaxAccess()

_EXIT_HOOK = threading.Lock()
_exit_hooked = False


def _finish_at_exit() -> None:  # pragma: no cover - runs at interpreter exit
    for store in list(_OPEN):
        store.wait()


_WARMED = threading.Event()


def warm_up() -> None:
    """Import orbax in a thread of its own, once a process, ahead of the first save: a run
    that starts now is usually compiling (native code, the interpreter lock free), so the
    second of importing it goes there instead of into the training calls that follow the
    first save."""
    if _WARMED.is_set() or "orbax.checkpoint.checkpoint_managers" in sys.modules:
        return
    _WARMED.set()

    def load() -> None:
        try:
            from orbax.checkpoint import checkpoint_managers  # noqa: F401
        except Exception:  # noqa: BLE001, S110 - the first save imports it again and says why
            pass

    threading.Thread(target=load, name="nitro-import-orbax", daemon=True).start()


def _hook_exit() -> None:
    """Have the process's end wait for the saves in flight, before `concurrent.futures`
    stops its executors (orbax writes with them, and refuses new work once they stop): the
    interpreter calls `threading`'s exit hooks before it joins the remaining threads, the
    latest registered first, and those before `atexit`'s."""
    global _exit_hooked
    import concurrent.futures.thread  # noqa: F401 - its hook is registered first, so runs last

    with _EXIT_HOOK:
        if _exit_hooked:
            return
        _exit_hooked = True
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            try:
                register(_finish_at_exit)
            except RuntimeError:  # the interpreter is ending already
                pass


@atexit.register
def _close_all() -> None:  # pragma: no cover - runs at interpreter exit
    for store in list(_OPEN):
        store.close()


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, np.generic):
        return _json_safe(value.item())
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return repr(value)


class CheckpointStore:
    """One run's orbax `CheckpointManager`, opened on first use, closed when the run's
    handle goes away (or at exit), with the budget that decides which epochs are saved."""

    def __init__(self, directory: str | os.PathLike, config: CheckpointPolicy, deterministic: bool):
        self.directory = Path(directory).absolute()  # orbax writes absolute paths only
        self.config = config
        self.deterministic = deterministic  # across processes: decide by epoch count only
        self._manager = None
        self._lock = threading.Lock()
        self._last_start: float | None = None
        self._last_cost = 0.0
        self.saved_epoch: int | None = None
        self.saved_step: int | None = None  # the newest step saved (or resumed from)
        self.costs: list[float] = []  # seconds each save took, its background write included
        self.failures: list[str] = []
        # Saves are written by a thread of the store's own (`_drain`), one at a time, so the
        # caller goes on at once: at most one save in flight and one pending, the pending
        # one replaced by a newer one. Several processes save together: they write inline.
        self._background = not deterministic
        self._queue = threading.Condition()  # guards the three below
        self._pending: _Job | None = None
        self._saver: threading.Thread | None = None
        self._in_flight_since: float | None = None
        self._ended: threading.Thread | None = None  # the saver that finished last
        # The budget holds the saver's own work too (it shares the cores and Python's lock
        # with training): after a save that took c seconds it rests c * (1/budget - 1) before
        # the next, the one waiting meanwhile replaced by newer ones; not while anyone waits
        # for the writes (a reader, `wait()`, the process's end).
        self._rest_until = 0.0
        self._hurry = 0  # callers waiting for the writes
        _OPEN.add(self)

    def _open(self, ranked: bool = True):
        """The manager. `ranked`: this run produces the metric, so orbax records it with each
        step and keeps the best k by it plus the newest; a run without it (no 'val' split for
        'val_loss') keeps the newest only."""
        if self._manager is None:
            import orbax.checkpoint as ocp
            from orbax.checkpoint import checkpoint_managers as managers

            config = self.config
            metric = config.metric
            keep: list[managers.PreservationPolicy] = [managers.LatestN(n=1)]
            ranking = {}
            if ranked:
                keep.append(
                    managers.BestN(
                        get_metric_fn=lambda m: m[metric],
                        reverse=config.mode == "min",
                        n=config.k,
                        keep_checkpoints_without_metrics=False,
                    )
                )
                ranking = {"best_fn": lambda m: m[metric], "best_mode": config.mode}
            options = ocp.CheckpointManagerOptions(
                preservation_policy=managers.AnyPreservationPolicy(keep),
                enable_async_checkpointing=True,
                cleanup_tmp_directories=True,
                todelete_subdir=DELETING,
                **ranking,
            )
            self._empty_trash()  # what a killed process was deleting
            _quiet_orbax()
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_names=("state", "meta")
            )
        return self._manager

    def due(self, epoch: int, ends_in: float | None = None, hold: bool = False) -> bool:
        """Whether the epoch just committed should be saved now. A save still being written
        counts as costing at least the time since it began; none is due while one waits.
        `ends_in`: the seconds until the call's end, which saves its newest epoch; a save is
        not due mid-call where the call ends sooner than the budget would allow the next
        (its write would only slow the call's last epochs, and a newer one comes). `hold`:
        the caller's timing must not share the cores with a write (under a budget)."""
        config = self.config
        if epoch % config.every:
            return False
        if config.budget is None or self.deterministic:
            return True
        if hold:
            return False
        pending = self._pending
        if pending is not None and pending.saves:
            return False  # the last save has not even begun: a newer one would replace it
        now = time.perf_counter()
        start, cost = self._last_start, self._last_cost
        since = self._in_flight_since
        if since is not None:
            start, cost = since, max(cost, now - since)
        if start is None:
            return True
        if ends_in is not None and ends_in * config.budget < cost:
            return False
        return (now - start) * config.budget >= cost

    def save(
        self,
        step: int,
        tree: Mapping[str, Any],
        meta: Mapping[str, Any],
        value,
        *,
        then_close: bool = False,
        best: bool = False,
        earlier: Save | None = None,
    ) -> None:
        """Save `tree` (host arrays, the caller's own) as `step`. Returns at once: the write
        goes on in the background, after the one in flight; a save still waiting for its
        turn gives way to this newer one (with `budget=None`, this one waits for that one's
        turn instead, so every `every` epochs are saved), except a new best by the metric
        (`best`), which is written before it. `earlier`: a best epoch held since (one the
        budget did not save), written first. `then_close`: the run ends here; once written,
        the manager closes (unless another save is waiting)."""
        if self.saved_step is None or step >= self.saved_step:  # not a best held since
            self.saved_epoch = meta.get("epoch")
            self.saved_step = step
        saves = (earlier,) if earlier is not None else ()
        self._submit(_Job((*saves, Save(step, tree, meta, value, best)), then_close))

    def close_later(self) -> None:
        """Finish the writes in flight and close the manager, in the background."""
        self._submit(_Job((), True))

    def _submit(self, job: _Job) -> None:
        if not self._background:
            self._run(job)
            return
        with self._queue:
            if self.config.budget is None and job.saves:
                while self._pending is not None and self._pending.saves:
                    self._queue.wait()
            pending = self._pending
            if pending is not None:
                job = _Job(
                    _coalesced(pending.saves, job.saves), job.then_close or pending.then_close
                )
            self._pending = job
            if self._saver is None:
                _hook_exit()
                self._saver = threading.Thread(
                    target=self._drain, name=f"nitro-save {self.directory}", daemon=False
                )
                self._saver.start()

    def _drain(self) -> None:
        """The saver thread: runs the pending jobs until none is left. Not a daemon: a
        process that ends waits for its writes."""
        while True:
            with self._queue:
                while self._pending is not None and not self._hurry:
                    left = self._rest_until - time.perf_counter()
                    if left <= 0:
                        break
                    self._queue.wait(left)
                job, self._pending = self._pending, None
                self._in_flight_since = time.perf_counter() if job is not None else None
                if job is None:
                    self._saver, self._ended = None, threading.current_thread()
                self._queue.notify_all()
            if job is None:
                return
            try:
                self._run(job)
            except Exception as error:  # noqa: BLE001 - a failed save must not end the saver
                self._failed(error, job.saves[-1].step if job.saves else None)

    def _run(self, job: _Job) -> None:
        if job.saves:
            began = time.perf_counter()
            for save in job.saves:
                if self._write(*save[:4]) and self._background:
                    self._finish()  # the cost counts the background write too
            ended = time.perf_counter()
            cost = ended - began
            self._last_start, self._last_cost = began, cost
            self.costs.append(cost)
            budget = self.config.budget
            if budget is not None and self._background:
                self._rest_until = ended + cost * (1 / budget - 1)
        if job.then_close and self._pending is None:
            self._close_manager()

    def _write(self, step: int, tree: Mapping[str, Any], meta: Mapping[str, Any], value) -> bool:
        """Hand the save to orbax, after the previous write; False when nothing was begun."""
        import orbax.checkpoint as ocp

        tree = _materialized(tree)  # a lazy snapshot's host copy, on this (the saver's) thread

        metrics = (
            {self.config.metric: float(value)}
            if value is not None and math.isfinite(value)
            else None
        )
        with self._lock:
            manager = None
            try:
                manager = self._open(ranked=metrics is not None)
                with _ORBAX.held(manager):
                    if step in manager.all_steps():  # saved already (a run ending at a boundary)
                        return False
                    # save() waits for the previous save (and its deletions) anyway: wait
                    # here, so the steps it moved aside can be removed before the next ones
                    manager.wait_until_finished()
                    self._empty_trash()
                    _ORBAX.started_write(manager, lambda error: self._failed(error, None))
                    manager.save(
                        step,
                        args=ocp.args.Composite(
                            state=ocp.args.StandardSave(tree),
                            meta=ocp.args.JsonSave(_json_safe(meta)),
                        ),
                        metrics=metrics,
                        force=True,
                    )
            except Exception as error:  # noqa: BLE001 - a full disk must not end the run
                self._failed(error, step)
                self._discard()
                return False
        return True

    def _empty_trash(self) -> None:
        """Remove the steps orbax moved aside for deletion (call with no save in flight)."""
        shutil.rmtree(self.directory / DELETING, ignore_errors=True)

    def _failed(self, error: BaseException, step: int | None) -> None:
        """A save that fails (a full disk, a vanished directory) leaves the earlier
        checkpoints as they were (orbax finalizes a step only once all of it is written);
        training goes on, and the first failure is reported."""
        if not self.failures:
            warnings.warn(
                f"a checkpoint could not be saved in {self.directory} "
                f"({_why(error)}); the earlier checkpoints are intact and "
                f"training goes on. Free space, or move the run with run_dir=.",
                RuntimeWarning,
                stacklevel=4,
            )
        self.failures.append(f"step {step}: {_why(error)}")

    def _discard(self) -> None:
        """Close the manager after a failed write (call under `self._lock`): orbax keeps a
        failed write's error and raises it at every later wait, so the next save opens a
        fresh manager. The failed step's temporary directory is removed when it opens."""
        manager, self._manager = self._manager, None
        if manager is not None:
            self._shut(manager, report=False)

    def _shut(self, manager: Any, report: bool = True) -> None:
        """Finish `manager`'s writes and close it; whatever fails, it gives up the orbax
        lock's turn (a failure is reported once, as a failed save)."""
        with _ORBAX.held(manager):
            try:
                manager.wait_until_finished()
            except Exception as error:  # noqa: BLE001 - a full disk must not end the run
                if report:
                    self._failed(error, None)
            finally:
                try:
                    manager.close()
                except Exception as error:  # noqa: BLE001 - the same failure, again
                    if report and not self.failures:
                        self._failed(error, None)
                finally:
                    _ORBAX.closed(manager)
                    self._empty_trash()

    def _finish(self) -> None:
        """Wait for the manager's write in flight; a failure is reported as a failed save."""
        with self._lock:
            if self._manager is not None:
                try:
                    with _ORBAX.held(self._manager):
                        self._manager.wait_until_finished()
                except Exception as error:  # noqa: BLE001
                    self._failed(error, None)
                    self._discard()

    def _close_manager(self) -> None:
        with self._lock:
            manager, self._manager = self._manager, None
        if manager is not None:
            self._shut(manager)

    def wait(self) -> None:
        """Wait until every save begun is on disk (or has failed, with its warning). Call
        with no orbax or store lock held: the saver thread needs them."""
        with self._queue:
            self._hurry += 1
            self._queue.notify_all()  # a resting saver writes what waits at once
            try:
                while self._saver is not None:
                    self._queue.wait()
            finally:
                self._hurry -= 1
            ended, self._ended = self._ended, None
        if ended is not None and ended is not threading.current_thread():
            ended.join()  # it has nothing left to do: its end is a moment away
        self._finish()

    def close(self) -> None:
        """Finish the saves and close the manager (a later save opens it again)."""
        self.wait()
        self._close_manager()

    def record_reason(self, step: int, reason: str) -> bool:
        """Record in saved step `step`'s JSON record why the run ended there (`stop_reason`),
        for a run stopped at an epoch boundary after that epoch was saved (call after
        `close()`). The record is replaced whole (a new file renamed over it), so a reader
        sees the old record or the new one; False where it is not there to update, or says
        why already."""
        path = self.directory / str(step) / "meta" / "metadata"  # orbax's JSON item file
        try:
            meta = json.loads(path.read_text())
            if not isinstance(meta, dict) or meta.get("step") != step or meta.get("stop_reason"):
                return False  # not that step's record, or one that says why already
            meta["stop_reason"] = reason
            partial = path.with_name(f".metadata-{os.getpid()}.tmp")
            partial.write_text(json.dumps(meta))
            os.replace(partial, path)
        except (OSError, ValueError):
            return False  # the record stays as saved, a readable checkpoint
        return True


class Save(NamedTuple):
    """One save: the state `tree` of `step`, its JSON record and its metric's `value`;
    `best`: a new best by the metric when it was taken (a newer save never replaces it)."""

    step: int
    tree: Mapping[str, Any]
    meta: Mapping[str, Any]
    value: Any
    best: bool = False


class _Job(NamedTuple):
    """What the saver does next: the saves, oldest first (none: only close), then whether
    to close the manager."""

    saves: tuple[Save, ...]
    then_close: bool


def _coalesced(waiting: tuple[Save, ...], newer: tuple[Save, ...]) -> tuple[Save, ...]:
    """The saves of a job that takes the place of a waiting one: its own, after the waiting
    job's newest best unless it brings a best of its own (a newer best is a better one); the
    waiting job's other saves give way. A job with no saves (a close) keeps the waiting
    saves."""
    if not newer:
        return waiting
    if any(save.best for save in newer):
        return newer
    bests = [save for save in waiting if save.best]
    return (*bests[-1:], *newer)


def await_writers(path: str | os.PathLike) -> None:
    """Wait for this process's saves in flight that a reader of `path` (a checkpoints
    directory, its run directory or one of its steps) would see: the first one creates the
    directory."""
    where = os.path.realpath(path)
    for store in list(_OPEN):
        directory = os.path.realpath(store.directory)
        if where in (directory, os.path.dirname(directory)) or where.startswith(directory + os.sep):
            store.wait()


def _from_orbax(record: logging.LogRecord) -> bool:
    if "orbax" in record.pathname:
        return True
    trace = record.exc_info[2] if record.exc_info else None
    while trace is not None:
        if "orbax" in trace.tb_frame.f_code.co_filename:
            return True
        trace = trace.tb_next
    return False


def _quiet_failed_writes(record: logging.LogRecord) -> bool:
    """Drop orbax's own reports of a failed write (its errors, with tracebacks, logged by
    every thread that waits for the write, and asyncio's "exception was never retrieved"
    for each array it could not write): the store reports each failure as one warning."""
    return not (record.levelno >= logging.ERROR and _from_orbax(record))


_QUIETED = threading.Lock()


def _quiet_orbax() -> None:
    """Install the filters for orbax's failure reports, once per process."""
    with _QUIETED:
        if getattr(sys.unraisablehook, "nitro_quiet", False):
            return
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addFilter(_quiet_failed_writes)
        sys.unraisablehook = _late_reads_quiet(sys.unraisablehook)


def _quiet_read_only(record: logging.LogRecord) -> bool:
    """Drop the warning orbax logs for every read-only manager ("Given directory is read
    only"): reading checkpoints is routine here, not something to warn about. Installed only
    while a reader is built, under the orbax lock."""
    return not (record.levelno == logging.WARNING and record.module == "checkpoint_manager")


class _reader:
    """A read-only manager, used under the orbax lock: `with _reader(dir) as manager:`.
    This process's saves in flight into the directory finish first."""

    def __init__(self, directory: Path):
        self.directory = Path(directory).absolute()  # orbax reads absolute paths only

    def __enter__(self):
        import orbax.checkpoint as ocp

        await_writers(self.directory)
        self._held = _ORBAX.held()
        self._held.__enter__()
        options = ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0, create=False)
        absl = logging.getLogger("absl")
        absl.addFilter(_quiet_read_only)
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except BaseException:
            self._held.__exit__(None, None, None)
            raise
        finally:
            absl.removeFilter(_quiet_read_only)
        return self.manager

    def __exit__(self, *exc):
        try:
            self.manager.close()
        finally:
            self._held.__exit__(*exc)


def _meta_args():
    import orbax.checkpoint as ocp

    return ocp.args.Composite(meta=ocp.args.JsonRestore())


def _why(error: BaseException) -> str:
    """An error in one line, for a warning naming a damaged checkpoint."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def _skip(directory: Path, step: int, why: str) -> None:
    """Warn of a damaged step, unless it is gone: a live run's writer removed it (its keep
    policy) while it was read, which is no damage."""
    if not (directory / str(step)).exists():
        return
    warnings.warn(
        f"skipping the damaged checkpoint {str(directory.absolute() / str(step))!r} ({why}); the other "
        f"checkpoints are used. Delete that step directory once you no longer need it.",
        RuntimeWarning,
        stacklevel=4,
    )


def _records(manager, directory: Path) -> list[tuple[int, dict]]:
    """(step, JSON record) of each saved step whose record reads, oldest first; a step whose
    record does not (an empty step directory, a truncated or corrupted file) is skipped with
    a warning naming it. Reads no array."""
    found = []
    for step in manager.all_steps():
        try:
            meta = manager.restore(step, args=_meta_args())["meta"]
            if not isinstance(meta, Mapping):
                raise ValueError(f"its record is {type(meta).__name__}, not a JSON object")
        except Exception as error:  # noqa: BLE001 - any unreadable step is skipped, named
            _skip(directory, step, _why(error))
            continue
        found.append((step, dict(meta)))
    return found


def _metric_value(manager, step: int, metric: str | None) -> float | None:
    try:
        value = (manager.metrics(step) or {}).get(metric)
    except Exception:  # noqa: BLE001 - a step without readable metrics is unranked
        return None
    return value if isinstance(value, (int, float)) else None


def _ranking(manager, records: list[tuple[int, dict]]) -> tuple[str | None, str, list]:
    """(metric, mode, [(step, value)] best first) by the checkpointer's own metric and mode,
    as recorded in the newest readable checkpoint."""
    config = (records[-1][1].get("checkpointer") if records else None) or {}
    metric, mode = config.get("metric"), config.get("mode", "min")
    ranked = [
        (step, value)
        for step, _ in records
        if (value := _metric_value(manager, step, metric)) is not None
    ]
    ranked.sort(key=lambda item: item[1], reverse=mode == "max")
    return metric, mode, ranked


def ranked_steps(directory: str | os.PathLike) -> tuple[str | None, list[tuple[int, float]]]:
    """(the checkpointer's metric, [(step, value)] best first) of a checkpoints directory:
    the readable saved steps that recorded the metric, ranked by its mode."""
    directory = Path(directory)
    with _reader(directory) as manager:
        metric, _, ranked = _ranking(manager, _records(manager, directory))
    return metric, ranked


def describe_checkpoints(directory: str | os.PathLike):
    """(saved steps, latest epoch, metric name, best value) of a checkpoint directory, read
    from orbax's metadata and the JSON records, without loading any array. Damaged steps are
    left out (with a warning naming each); a directory orbax cannot read at all lists none."""
    directory = Path(directory)
    await_writers(directory)
    if not directory.is_dir():
        return [], None, None, None
    try:
        with _reader(directory) as manager:
            records = _records(manager, directory)
            if not records:
                return [], None, None, None
            metric, _, ranked = _ranking(manager, records)
    except Exception as error:  # noqa: BLE001 - one damaged run must not hide the others
        warnings.warn(
            f"skipping the checkpoints in {str(directory)!r}: they cannot be listed "
            f"({_why(error)})",
            RuntimeWarning,
            stacklevel=3,
        )
        return [], None, None, None
    best = ranked[0][1] if ranked else None
    return [step for step, _ in records], records[-1][1].get("epoch"), metric, best


def describe_saved(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """One row per readable saved checkpoint of a run: step, epoch, the metric and the path."""
    directory = Path(run_dir) / "checkpoints"
    await_writers(directory)
    if not directory.is_dir():
        return []
    with _reader(directory) as manager:
        rows = []
        for step, meta in _records(manager, directory):
            row = {"step": step, "epoch": meta.get("epoch")}
            try:
                row.update(manager.metrics(step) or {})
            except Exception:  # noqa: BLE001 - the step itself reads: list it without them
                pass
            row["path"] = str(directory / str(step))
            rows.append(row)
        return rows


# The last step `resolve_checkpoint` read whole to check it, kept for the `read_checkpoint`
# that follows it (resume and weights= read the step they resolved at once): one entry,
# taken by that read, so a checked step is not read twice.
_CHECKED: dict[tuple[Path, int], tuple[Any, dict[str, Any]]] = {}


def _late_reads_quiet(hook: Any) -> Any:
    """`sys.unraisablehook` less the reports of a failed restore's other reads: tensorstore
    completes them after orbax closed its event loop, and each would print a traceback
    ("Event loop is closed") for a failure already reported once."""

    def quiet(report: Any) -> None:
        error = report.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        hook(report)

    quiet.nitro_quiet = True  # pyright: ignore[reportFunctionMemberAccess]
    return quiet


def _restore_item(manager, step: int, targets: Mapping[tuple[str, ...], Any]) -> Any:
    """The tree orbax restores the state into: None (each leaf as it was saved: numpy arrays)
    for a checkpoint of host arrays read without targets, as ever; else the step's own tree
    (from its array metadata, empty subtrees included: a model without model state saves an
    empty `model_state`), each leaf named in `targets` that fits it (same shape and dtype)
    onto the target's sharding and every other leaf as a numpy array. The item never differs
    from the checkpoint's own tree, so what the restoring handle expects cannot fail the
    read: a checkpoint that does not fit the handle is read, and the leaves that differ are
    named where they are placed (`leaves_from`). A leaf saved sharded is never restored onto
    the devices it was written from (which may not exist here): without a target it is read
    whole to the host."""
    import orbax.checkpoint as ocp
    from etils import epath

    handler = ocp.StandardCheckpointHandler()
    try:
        tree = handler.metadata(epath.Path(manager.directory) / str(step) / "state").tree
    finally:
        handler.close()
    if not targets and all(
        getattr(m, "sharding", None) is None for m in _flatten_keys(tree).values()
    ):
        return None
    return _item_of(tree, targets, ())


def _item_of(node: Any, targets: Mapping[tuple[str, ...], Any], path: tuple[str, ...]) -> Any:
    """The restore item of one node of a step's metadata tree (`_restore_item`)."""
    if isinstance(node, Mapping):
        return {str(k): _item_of(v, targets, (*path, str(k))) for k, v in node.items()}
    shape, dtype = tuple(node.shape), np.dtype(node.dtype)
    target = targets.get(path)
    if target is None or tuple(target.shape) != shape or np.dtype(target.dtype) != dtype:
        return np.broadcast_to(np.zeros((), dtype), shape)  # a numpy leaf, no memory
    return target


def _flatten_keys(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple, Any]:
    flat: dict[tuple, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten_keys(value, (*prefix, str(key))))
        else:
            flat[(*prefix, str(key))] = value
    return flat


def _restore(
    manager, step: int, targets: Mapping[tuple[str, ...], Any] | None = None
) -> tuple[Any, dict[str, Any]]:
    """(state, meta) of one step, the leaves named in `targets` onto their shardings. A step
    that reads whole to the host where the targeted read failed is not damaged: that read is
    returned instead (`place_like` lays its leaves out), so only a step whose own tree does
    not read is ever called damaged."""
    try:
        return _read_item(manager, step, _restore_item(manager, step, targets or {}))
    except Exception as error:
        _quiet_orbax()
        if not targets:
            raise
        failed = error
    try:
        return _read_item(manager, step, _restore_item(manager, step, {}))
    except Exception:  # noqa: BLE001 - damaged: the first failure says why
        raise failed from None


def _read_item(manager, step: int, item: Any) -> tuple[Any, dict[str, Any]]:
    import orbax.checkpoint as ocp

    restored = manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(item), meta=ocp.args.JsonRestore()),
    )
    state, meta = restored["state"], restored["meta"]
    if not isinstance(state, Mapping) or "params" not in state:
        raise ValueError("its state holds no parameters")
    if not isinstance(meta, Mapping):
        raise ValueError("its record is not a JSON object")
    return state, dict(meta)


def read_checkpoint(
    directory: Path,
    step: int,
    weights_only: bool = False,
    targets: Mapping[tuple[str, ...], Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """(state tree of numpy arrays, meta) of one saved step. A step that cannot be read (a
    truncated file, corrupted bytes: a checksum failure) raises a `SetupError` naming it.

    `targets` (`restore_targets`: checkpoint path -> `jax.ShapeDtypeStruct` with a sharding)
    restores those leaves straight onto their shardings instead. A step read already to check
    it (`resolve_checkpoint`) is returned as that check read it: onto the targets it was given
    then (a resume passes the same ones), else as host arrays that `place_like` lays out, each
    device receiving only its shard."""
    directory = Path(directory).absolute()
    checked = _CHECKED.pop((directory, step), None)
    if checked is not None:
        return checked
    with _reader(directory) as manager:
        try:
            return _restore(manager, step, targets)
        except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many kinds
            raise SetupError(
                f"the checkpoint {str(directory / str(step))!r} cannot be read "
                f"({_why(error)}); it is damaged. Use another of the run's checkpoints"
            ) from error


class SavedStep(NamedTuple):
    """One saved checkpoint: its checkpoints directory and step."""

    directory: Path
    step: int

    @property
    def path(self) -> Path:
        return self.directory / str(self.step)


def resolve_checkpoint(
    source: CheckpointRef | str | os.PathLike | tuple,
    which: str = "latest",
    *,
    read: bool = True,
    targets: Mapping[tuple[str, ...], Any] | None = None,
) -> SavedStep:
    """Where a checkpoint is: a run directory (its newest or best checkpoint), a checkpoints
    directory, or one step's directory; `(run_dir, "best" | "latest")` chooses.

    The chosen step is read whole first. A damaged one (an empty step directory, a truncated
    or corrupted file) is skipped with a warning naming it, and the next one is taken: the
    newest before it, or for "best" the next best, then the newest. A step named explicitly
    is not replaced: its damage is an error naming it. `read=False` checks only the steps'
    JSON records (for a reader that handles damaged arrays itself). `targets`
    (`restore_targets`) reads the sharded leaves of that check straight onto their shardings,
    so a resume of a sharded run never holds its whole state on one host."""
    if isinstance(source, tuple):
        if len(source) != 2 or source[1] not in ("best", "latest"):
            raise SetupError(
                f"a checkpoint is a path or (run_dir, 'best' | 'latest'); got {source!r}"
            )
        source = CheckpointRef(os.fspath(source[0]), source[1])
    if isinstance(source, CheckpointRef):
        source, which = source.path, source.which
    path = Path(source).absolute()  # orbax reads absolute paths only
    await_writers(path)
    if not path.exists():
        raise SetupError(f"no checkpoint at {str(path)!r}: the path does not exist")
    step = None
    if (path / "checkpoints").is_dir():
        directory = path / "checkpoints"
    elif path.name.isdigit() and path.parent.is_dir() and (path / "state").exists():
        directory, step = path.parent, int(path.name)
    else:
        directory = path
    with _reader(directory) as manager:
        if step is not None:
            if step not in manager.all_steps():
                steps = list(manager.all_steps())
                raise SetupError(
                    f"{str(path)!r} is not a finished checkpoint (saved steps: {steps})"
                )
            candidates = [step]
        else:
            records = _records(manager, directory)
            if not records:
                listed = list(manager.all_steps())
                raise SetupError(
                    f"no checkpoint in {str(directory)!r}: it holds no saved steps (a run "
                    f"saves after each epoch's validation)"
                    if not listed
                    else f"no readable checkpoint in {str(directory)!r}: every saved step "
                    f"({', '.join(map(str, listed))}) is damaged (see the warnings above)"
                )
            candidates = [s for s, _ in reversed(records)]
            if which == "best":
                ranked = [s for s, _ in _ranking(manager, records)[2]]
                candidates = ranked + [s for s in candidates if s not in ranked]
        if not read:
            return SavedStep(directory, candidates[0])
        _CHECKED.clear()
        damaged = []
        for candidate in candidates:
            try:
                _CHECKED[(directory, candidate)] = _restore(manager, candidate, targets)
            except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many kinds
                if step is not None:
                    raise SetupError(
                        f"the checkpoint {str(path)!r} cannot be read ({_why(error)}); it is "
                        f"damaged. Give another step, or the run directory for its newest "
                        f"readable checkpoint"
                    ) from error
                _skip(directory, candidate, _why(error))
                damaged.append(candidate)
                continue
            return SavedStep(directory, candidate)
    raise SetupError(
        f"no readable checkpoint in {str(directory)!r}: every saved step "
        f"({', '.join(map(str, sorted(set(damaged))))}) is damaged (see the warnings above)"
    )
