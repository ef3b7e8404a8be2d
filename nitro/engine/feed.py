"""Per-step values fed to the train step: optimizer hyperparameters and Device fields.

All numeric optimizer hyperparameters cross as one float32 vector, and every Device field as
its own array, in the same argument slots whether they are constant or scheduled, so changing
a schedule never changes a program. A value crosses to the device only when it changes: a
constant crosses once. Schedules are evaluated on the host, in vectorized chunks when the
schedule accepts an array of steps (optax schedules do).

A fed hyperparameter takes the schedule bound to its own name (`head/learning_rate`), else
the schedule of its bare name (`learning_rate`) times its factor (the group's `group_lr`
ratio), else its constant.

When a hook takes `rngs`, the train step's Device fields carry one more entry,
`nitro.programs.tracing.RNG_FIELD`: the words of `jax.random.key(seed)` and the step, from
which the step derives `fold_in(key(seed), step)`. A key that is a function of the step alone
makes a resumed run, and K fused steps, draw what one step at a time draws.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from nitro.optim.plateau import ReduceOnPlateau
from nitro.optim.schedules import BoundSchedule
from nitro.programs.tracing import RNG_FIELD

__all__ = ["StackedFeed", "StepFeed"]

_CHUNK = 1024


class _Evaluator:
    """Evaluates one schedule at a step, a chunk of steps at a time when it vectorizes."""

    def __init__(self, fn: Callable[[Any], Any]):
        self.fn = fn  # called with a step, or tried with an array of steps (vectorized)
        self.vectorized: bool | None = None
        self.start = -1
        self.values: np.ndarray | None = None

    def block(self, start: int, count: int) -> np.ndarray:
        """The values of steps start .. start + count - 1."""
        if self.vectorized is not False:
            if self.values is None or not (
                self.start <= start and start + count <= self.start + _CHUNK
            ):
                self._fill(start)
            if self.vectorized:
                assert self.values is not None  # a vectorized fill keeps its values
                offset = start - self.start
                return self.values[offset : offset + count]
        return np.array([float(np.asarray(self.fn(s))) for s in range(start, start + count)])

    def __call__(self, step: int) -> float:
        if self.vectorized is not False:
            if self.values is None or not self.start <= step < self.start + _CHUNK:
                self._fill(step)
            if self.vectorized:
                assert self.values is not None  # a vectorized fill keeps its values
                return float(self.values[step - self.start])
        return float(np.asarray(self.fn(step)))

    def _fill(self, step: int) -> None:
        steps = np.arange(step, step + _CHUNK)
        try:
            values = np.asarray(self.fn(steps), dtype=np.float64)
        except Exception:  # noqa: BLE001 - a schedule written for scalars only
            self.vectorized = False
            return
        if values.shape != steps.shape:
            self.vectorized = False
            return
        if self.vectorized is None:  # trust it only if it agrees with the scalar call
            self.vectorized = bool(np.isclose(values[0], float(np.asarray(self.fn(step)))))
        self.start, self.values = step, values


class StepFeed:
    def __init__(
        self,
        *,
        hyper_names: Sequence[str],
        hyper_constants: Mapping[str, float],
        schedules: Sequence[BoundSchedule],
        hyper_sources: Mapping[str, tuple[str, float]] | None = None,
        device_values: Mapping[str, Any],
        device_dtypes: Mapping[str, Any],
        placement,
        device_sets: Mapping[str, tuple[Any, tuple[str, ...]]] | None = None,
    ):
        self.placement = placement
        self.sets = dict(device_sets or {})  # a buffer set's field -> (structure, its parts)
        self._rng_words: np.ndarray | None = None  # the seed's key words, for `rngs`
        self.hyper_names = tuple(hyper_names)
        self.device_dtypes = dict(device_dtypes)
        evaluators = {s.name: _Evaluator(s.fn) for s in schedules if s.target == "opt"}
        sources = self._sources = dict(hyper_sources or {})
        # fed name -> (evaluator, factor, the schedule's key) for the scheduled ones
        self._opt: dict[str, tuple[_Evaluator, float, str]] = {}
        for name in self.hyper_names:
            if name in evaluators:
                self._opt[name] = (evaluators[name], 1.0, name)
            elif name in sources and sources[name][0] in evaluators:
                key, factor = sources[name]
                self._opt[name] = (evaluators[key], factor, key)
        self._scheduled = [
            (i, *self._opt[name][:2])
            for i, name in enumerate(self.hyper_names)
            if name in self._opt
        ]
        self._dev = {s.name: _Evaluator(s.fn) for s in schedules if s.target == "device"}
        self._constants = np.array(
            [hyper_constants[name] for name in self.hyper_names], dtype=np.float32
        )
        self._hparams_host = self._constants.copy()
        self._hparams = placement.put_replicated(self._constants)
        self._device = dict(device_values)
        self._device_host = {k: np.asarray(v) for k, v in device_values.items()}
        self._version = 0  # bumped when a constant changes: cached blocks are stale
        self._blocks: dict[tuple, Any] = {}
        self._given = (self._scheduled, self._opt, self._dev)  # the run's own schedules

    def set_schedules(self, schedules: Sequence[BoundSchedule]) -> None:
        """Follow `schedules` from the next call on (a live change, from another thread):
        each replaces the schedule or the constant of its hyperparameter or Device field. The
        fed layout stays as it is, so nothing recompiles."""
        evaluators = {s.name: _Evaluator(s.fn) for s in schedules if s.target == "opt"}
        opt = dict(self._opt)
        for name in self.hyper_names:
            if name in evaluators:
                opt[name] = (evaluators[name], 1.0, name)
            elif name in self._sources and self._sources[name][0] in evaluators:
                key, factor = self._sources[name]
                opt[name] = (evaluators[key], factor, key)
        scheduled = [(i, *opt[name][:2]) for i, name in enumerate(self.hyper_names) if name in opt]
        dev = {**self._dev, **{s.name: _Evaluator(s.fn) for s in schedules if s.target == "device"}}
        # each a new object, assigned whole: the loop reads them between calls without a lock
        self._scheduled, self._opt, self._dev = scheduled, opt, dev
        self._version += 1

    def reset_schedules(self) -> None:
        """Follow the run's own schedules again (`schedules=`), dropping every live change
        (`set_schedules`): a rewind replays the changes made up to its step on top."""
        self._scheduled, self._opt, self._dev = self._given
        if not np.array_equal(self._hparams_host, self._constants):  # a schedule's last values
            self._hparams_host = self._constants.copy()
            self._hparams = self.placement.put_replicated(self._constants)
        self._version += 1

    def react(self, history: Sequence[Mapping[str, Any]]) -> list[str]:
        """Let each `ReduceOnPlateau` schedule decide its scale from the committed `history`
        (after an epoch's validation, and as a run starts: a resumed run's history decides
        as the uninterrupted run's did); the keys whose value changed, which the next call
        follows (nothing recompiles). Cheap without such schedules."""
        changed = [
            (name, evaluator.fn)
            for name, evaluator in [
                *((key, ev) for ev, _, key in self._opt.values()),
                *self._dev.items(),
            ]
            if isinstance(evaluator.fn, ReduceOnPlateau) and evaluator.fn.react(history)
        ]
        if not changed:
            return []
        fresh = {id(fn): _Evaluator(fn) for _, fn in changed}  # their cached values are stale
        opt = {
            name: (fresh.get(id(ev.fn), ev), factor, key)
            for name, (ev, factor, key) in self._opt.items()
        }
        scheduled = [(i, *opt[name][:2]) for i, name in enumerate(self.hyper_names) if name in opt]
        dev = {name: fresh.get(id(ev.fn), ev) for name, ev in self._dev.items()}
        self._scheduled, self._opt, self._dev = scheduled, opt, dev
        self._version += 1
        return list(dict.fromkeys(name for name, _ in changed))

    def hparams(self, step: int):
        if not self._opt:
            return self._hparams
        values = self._constants.copy()
        for i, evaluator, factor in self._scheduled:
            values[i] = evaluator(step) * factor
        if not np.array_equal(values, self._hparams_host):
            self._hparams_host = values
            self._hparams = self.placement.put_replicated(values)
        return self._hparams

    def hyperparams_at(self, step: int) -> dict[str, float]:
        """The hyperparameters a step uses (schedules evaluated at `step`), on the host."""
        values = {name: float(v) for name, v in zip(self.hyper_names, self._constants, strict=True)}
        for name, (evaluator, factor, _) in self._opt.items():
            values[name] = evaluator(step) * factor
        return values

    def schedule_of(self, name: str) -> str | None:
        """The schedule a fed hyperparameter follows (its own name or its bare name), or None
        for a constant."""
        scheduled = self._opt.get(name)
        return None if scheduled is None else scheduled[2]

    def seed_keys(self, seed: int) -> None:
        """Feed every train step its key words: `jax.random.key(seed)`'s and the step."""
        self._rng_words = np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)

    def device(self, step: int) -> dict[str, Any]:
        """The Device fields of the train step `step` (with its key words, for `rngs`)."""
        return self._with_key(self._device_at(step), step, None)

    def _with_key(self, values: dict[str, Any], start: int, count: int | None):
        if self._rng_words is None:
            return values
        steps = np.arange(start, start + (count or 1), dtype=np.uint32)[:, None]
        words = np.concatenate(
            [np.broadcast_to(self._rng_words, (len(steps), self._rng_words.size)), steps], 1
        )
        words = words[0] if count is None else words
        return {**values, RNG_FIELD: self.placement.put_replicated(words)}

    def _device_at(self, step: int) -> dict[str, Any]:
        if not self._dev:
            return self._device
        for name, evaluator in self._dev.items():
            value = np.asarray(evaluator(step), dtype=self.device_dtypes[name])
            if not np.array_equal(value, self._device_host[name]):
                self._device_host[name] = value
                self._device = {**self._device, name: self.placement.put_replicated(value)}
        return self._device

    def hparams_block(self, start: int, count: int):
        """The hyperparameters of `count` steps from `start`, as one f32[count, H] array."""
        key = ("hparams", count, self._version)
        if not self._opt:
            block = self._blocks.get(key)
            if block is None:
                self._blocks = {k: v for k, v in self._blocks.items() if k[0] != "hparams"}
                values = np.broadcast_to(self._constants, (count, len(self._constants)))
                block = self._blocks[key] = self.placement.put_replicated(np.array(values))
            return block
        values = np.tile(self._constants, (count, 1))
        for i, evaluator, factor in self._scheduled:
            values[:, i] = evaluator.block(start, count) * factor
        self._hparams_host = values[-1].copy()
        return self.placement.put_replicated(values)

    def device_block(self, start: int, count: int) -> dict[str, Any]:
        """Every Device field for `count` steps from `start`, each with a leading axis of
        `count`: scheduled ones step by step, the others repeated (and the key words)."""
        return self._with_key(self._device_block(start, count), start, count)

    def _device_block(self, start: int, count: int) -> dict[str, Any]:
        key = ("device", count, self._version)
        constant = self._blocks.get(key)
        if constant is None:
            self._blocks = {k: v for k, v in self._blocks.items() if k[0] != "device"}
            constant = self._blocks[key] = {
                name: self.placement.put_replicated(
                    np.array(np.broadcast_to(value, (count, *np.shape(value))))
                )
                for name, value in self._device_host.items()
                if name not in self._dev
            }
        if not self._dev:
            return constant
        block = dict(constant)
        for name, evaluator in self._dev.items():
            shape = self._device_host[name].shape
            if shape:  # an array-valued schedule: step by step
                values = np.stack(
                    [np.asarray(evaluator.fn(s)) for s in range(start, start + count)]
                )
            else:
                values = evaluator.block(start, count)
            values = np.asarray(values, dtype=self.device_dtypes[name]).reshape((count, *shape))
            if not np.array_equal(values[-1], self._device_host[name]):
                # what evaluation after this call sees, as after single steps
                self._device_host[name] = values[-1].copy()
                self._device = {
                    **self._device,
                    name: self.placement.put_replicated(self._device_host[name]),
                }
            block[name] = self.placement.put_replicated(values)
        return block

    def hparams_host(self, start: int, count: int | None = None) -> np.ndarray:
        """On the host, what `hparams(start)` (f32[H]) or `hparams_block(start, count)`
        (f32[count, H]) puts on the device: a population stacks its members' before one
        transfer."""
        if count is None:
            values = self._constants.copy()
            for i, evaluator, factor in self._scheduled:
                values[i] = evaluator(start) * factor
            self._hparams_host = values
            return values
        values = np.tile(self._constants, (count, 1))
        for i, evaluator, factor in self._scheduled:
            values[:, i] = evaluator.block(start, count) * factor
        self._hparams_host = values[-1].copy()
        return values

    def device_host(self, start: int, count: int | None = None) -> dict[str, np.ndarray]:
        """On the host, what `device(start)` or `device_block(start, count)` puts on the
        device (with the key words, for `rngs`); the current values follow, as there."""
        values: dict[str, np.ndarray] = {}
        for name, value in self._device_host.items():
            evaluator = self._dev.get(name)
            dtype = self.device_dtypes[name]
            if evaluator is None:
                values[name] = (
                    value if count is None else np.broadcast_to(value, (count, *value.shape))
                )
                continue
            if count is None:
                now = np.asarray(evaluator(start), dtype=dtype)
                values[name] = last = now
            else:
                if value.shape:  # an array-valued schedule: step by step
                    block = np.stack(
                        [np.asarray(evaluator.fn(s)) for s in range(start, start + count)]
                    )
                else:
                    block = evaluator.block(start, count)
                values[name] = np.asarray(block, dtype=dtype).reshape((count, *value.shape))
                last = values[name][-1].copy()
            if not np.array_equal(last, value):
                self._device_host[name] = last
                self._device = {**self._device, name: self.placement.put_replicated(last)}
        if self._rng_words is not None:
            steps = np.arange(start, start + (count or 1), dtype=np.uint32)[:, None]
            words = np.concatenate(
                [np.broadcast_to(self._rng_words, (len(steps), self._rng_words.size)), steps], 1
            )
            values[RNG_FIELD] = words[0] if count is None else words
        return values

    def device_host_values(self) -> dict[str, np.ndarray]:
        """Every Device field's current value on the host (what evaluation sees)."""
        return dict(self._device_host)

    def current_device(self) -> dict[str, Any]:
        return self._device

    def device_value(self, name: str) -> Any:
        """A Device field's current value on the host (a Python scalar for 0-d values; a
        buffer set as its dict or tuple of parts)."""
        if name in self.sets:
            treedef, parts = self.sets[name]
            return treedef.unflatten([self.device_value(part) for part in parts])
        value = self._device_host[name]
        return value.item() if np.ndim(value) == 0 else np.array(value)

    def hyperparams_now(self) -> dict[str, float]:
        return {
            name: float(v) for name, v in zip(self.hyper_names, self._hparams_host, strict=True)
        }

    def set_constant(self, name: str, value: Any) -> None:
        """Write a Device field (coerced to its dtype; its shape must not change). A buffer
        set's every part is checked before any is written."""
        if name in self.sets:
            treedef, parts = self.sets[name]
            leaves, given = jax.tree_util.tree_flatten(value)
            if given != treedef:
                shown = ", ".join(parts)
                raise ValueError(
                    f"Device field {name!r} is a buffer set of {len(parts)} parts ({shown}); "
                    f"the new value has another structure ({given}): give the same keys or "
                    f"items, each an array of its part's shape"
                )
            arrays = {
                part: self._checked(part, leaf) for part, leaf in zip(parts, leaves, strict=True)
            }
        else:
            arrays = {name: self._checked(name, value)}
        self._device_host.update(arrays)
        placed = {part: self.placement.put_replicated(array) for part, array in arrays.items()}
        self._device = {**self._device, **placed}
        self._version += 1

    def _checked(self, name: str, value: Any) -> np.ndarray:
        """`value` as Device field (or part) `name` takes it: its dtype, its shape."""
        dtype = self.device_dtypes[name]
        try:
            array = np.asarray(value, dtype=dtype)
        except (TypeError, ValueError):
            raise TypeError(
                f"Device field {name!r} holds {np.dtype(dtype).name}; cannot convert "
                f"{value!r} to it"
            ) from None
        old = self._device_host[name]
        if array.shape != old.shape:
            raise ValueError(
                f"Device field {name!r} has shape {old.shape}; the new value has shape "
                f"{array.shape}. A different shape would need a new program: build a new handle"
            )
        return array

    def scheduled(self, name: str) -> bool:
        """Whether a schedule sets the fed value `name` (a hyperparameter's bare name, whose
        schedule reaches its groups too, or a Device field)."""
        if name in self.device_dtypes:
            return name in self._dev
        return any(key == name for _, _, key in self._opt.values())

    def value(self, name: str) -> Any:
        """The constant fed as `name`: a hyperparameter by its bare name (`learning_rate`;
        a group's share follows it through its factor) or a Device field, on the host."""
        if name in self.device_dtypes:
            value = self._device_host[name]
            if np.ndim(value) == 0 and np.issubdtype(value.dtype, np.floating):
                return float(str(value[()]))
            return self.device_value(name)
        for fed, constant in zip(self.hyper_names, self._constants, strict=True):
            key, factor = self._sources.get(fed, (fed, 1.0))
            if key == name:  # float32's shortest reading: 0.001, not 0.0010000000474974513
                return float(str(constant)) if factor == 1.0 else float(constant) / factor
        raise KeyError(name)

    def set_value(self, name: str, value: Any) -> None:
        """Feed `value` as the constant `name` from the next call on (`value`'s reading; a
        group's hyperparameter takes its factor of it). Nothing recompiles."""
        if name in self.device_dtypes:
            self.set_constant(name, value)
            return
        constants = self._constants.copy()
        for i, fed in enumerate(self.hyper_names):
            key, factor = self._sources.get(fed, (fed, 1.0))
            if key == name:
                constants[i] = value * factor
        self._constants, self._hparams_host = constants, constants.copy()
        self._hparams = self.placement.put_replicated(constants)
        self._version += 1

    def fed_names(self) -> list[str]:
        """The names `value` reads: the hyperparameters' bare names and the Device fields."""
        keys = (self._sources.get(fed, (fed, 1.0))[0] for fed in self.hyper_names)
        return [*dict.fromkeys(keys), *self.device_dtypes]


def _stacked(values: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.stack([v[name] for v in values]) for name in values[0]}


class StackedFeed:
    """The feeds of a population's members as one feed, with `StepFeed`'s interface for the
    loop: each value is every member's, evaluated on the host as its own run's feed does,
    stacked on a leading member axis and placed by `place` (one transfer per argument)."""

    def __init__(self, feeds: Sequence[StepFeed], place: Callable[[Any], Any]):
        self.feeds = tuple(feeds)
        self.place = place
        self.hyper_names = self.feeds[0].hyper_names
        self.device_dtypes = self.feeds[0].device_dtypes

    def hparams(self, step: int):
        return self.place(np.stack([feed.hparams_host(step) for feed in self.feeds]))

    def hparams_block(self, start: int, count: int):
        return self.place(np.stack([feed.hparams_host(start, count) for feed in self.feeds]))

    def device(self, step: int) -> dict[str, Any]:
        return self.place(_stacked([feed.device_host(step) for feed in self.feeds]))

    def device_block(self, start: int, count: int) -> dict[str, Any]:
        return self.place(_stacked([feed.device_host(start, count) for feed in self.feeds]))

    def current_device(self) -> dict[str, Any]:
        """Every member's Device fields as they are now (what evaluation sees)."""
        return self.place(_stacked([feed.device_host_values() for feed in self.feeds]))

    def hyperparams_at(self, step: int) -> dict[str, float]:
        """The first member's hyperparameters at `step` (a member's own feed has its own)."""
        return self.feeds[0].hyperparams_at(step)
