"""`n.lr_find()`: a learning rate for a handle, from a log grid of them trained side by side.

The grid method (the default) is a `Population` of the handle's experiment, one member per
learning rate on a log grid, every member starting from the handle's current weights and
trained on the train split with the handle's other settings for a few dozen steps, in one
program; each member's loss over the last quarter of its steps says how well its rate trains.
The ramp method is the classic one-run range test (Smith 2015, fastai's `lr_find`): one run
whose rate grows geometrically every step, stopped once its smoothed loss passes 4x its
minimum. Neither changes the handle: `result.apply()` sets the suggestion on it when asked.
See docs/lr-find.md.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from html import escape
from typing import Any

import numpy as np

from nitro.engine.dispatch import MAX_STEPS as FUSED_LIMIT
from nitro.errors import DivergenceError, Interrupted, OptimizerError, ScheduleError, SetupError
from nitro.handle.handle import EXTENSIONS, Nitro
from nitro.handle.population import Population
from nitro.runs.initial_weights import WeightsSource

__all__ = ["LRFindResult", "lr_find"]

METHODS = ("grid", "ramp")
DEFAULT_STEPS = {"grid": 50, "ramp": 100}
MAX_STEPS = 1000  # a probe, not a run: longer comparisons are a Population's
KNEE = 0.1  # the grid's rule: within 10% of the best member's drop of the loss
RAMP_BETA = 0.98  # the ramp's smoothing (fastai's): a debiased moving average of the loss
RAMP_STOP = 4.0  # the ramp stops once its smoothed loss passes this many times its minimum

# The handle's keywords a population does not take (it writes no run and validates nothing
# here), and the ones lr_find sets itself.
_DROPPED = (
    "run_dir",
    "checkpointer",
    "logger",
    "early_stop",
    "resume",
    "name",
    "max_steps",
    "val_every_steps",
    "eval_splits",
    "steps_per_dispatch",
    "progress",
    "learning_rate",
    "schedules",
    "snapshots",  # a probe goes back nowhere
    "spike",
)


@dataclasses.dataclass(frozen=True, eq=False)
class LRFindResult:
    """What `n.lr_find()` found: the learning rates tried, their losses and a suggestion.

    - `method`: "grid" (one member per rate, trained side by side) or "ramp" (one run, its
      rate growing every step);
    - `learning_rates`: the grid's rates, or the ramp's rate at each step it ran;
    - `losses`: grid: each member's mean training loss over the last quarter of its steps
      (NaN for a member whose loss turned non-finite); ramp: the smoothed loss at each step;
    - `suggestion`: the suggested learning rate, by `rule` (in words);
    - `diverged`: learning rate -> why it is too high (a non-finite loss, a loss that rose
      above where it started; the ramp: the rate at which it stopped);
    - `curves`: the raw training loss at every step, [members, steps] (the ramp: [1, steps]);
    - `start_loss`: the loss at the first step (every member starts from the same weights on
      the same batch); `steps`: the steps each member trained; `seconds`: the wall time,
      building and compiling included; `note`: a hint when the grid looks too narrow.

    `frame` is a DataFrame of it, `plot()` draws it, `apply()` sets the suggestion on the
    handle it came from.
    """

    method: str
    learning_rates: np.ndarray
    losses: np.ndarray
    suggestion: float
    rule: str
    diverged: dict[float, str]
    curves: np.ndarray
    start_loss: float
    steps: int
    seconds: float
    note: str | None = None
    handle: Any = dataclasses.field(default=None, repr=False)

    @property
    def frame(self):
        """grid: one row per learning rate (its `loss`, and why it `diverged` or None);
        ramp: one row per step (its `learning_rate`, raw `loss` and `smoothed` loss)."""
        import pandas as pd

        if self.method == "grid":
            frame = pd.DataFrame(
                {
                    "learning_rate": self.learning_rates,
                    "loss": self.losses,
                    "diverged": [self.diverged.get(float(lr)) for lr in self.learning_rates],
                }
            )
            return frame.set_index("learning_rate")
        frame = pd.DataFrame(
            {
                "learning_rate": self.learning_rates,
                "loss": self.curves[0, : len(self.learning_rates)],
                "smoothed": self.losses,
            }
        )
        frame.index.name = "step"
        return frame

    def plot(self, path: str | None = None):
        """The loss against the learning rate (log axis), the diverged rates crossed out at
        its top edge (the axis spans the rates that trained, and the start) and the
        suggestion marked. Returns the matplotlib Figure; writes a PNG when `path` is
        given."""
        try:
            from matplotlib.figure import Figure
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise ImportError("plotting needs matplotlib: pip install 'nitro[plot]'") from error
        figure = Figure(figsize=(5.0, 3.4), layout="constrained")
        ax = figure.subplots()
        rates, losses = self.learning_rates, self.losses
        if self.method == "grid":
            bad = [i for i, lr in enumerate(rates) if float(lr) in self.diverged]
            kept = np.asarray(losses, np.float64).copy()
            kept[bad] = np.nan  # a diverged rate's loss (up to 1e4 and more) is no scale
            ax.plot(rates, kept, marker="o", markersize=4, label="loss, last quarter")
            finite = [*kept[np.isfinite(kept)], self.start_loss]
            low, high = min(finite), max(finite)
            pad = 0.08 * (high - low) or 0.08 * abs(high) or 0.08
            ax.set_ylim(low - pad, high + 2 * pad)
            if bad:  # at the top edge, where the diverged losses went
                ax.plot(
                    rates[bad], [0.96] * len(bad), "x", color="tab:red", markersize=8,
                    transform=ax.get_xaxis_transform(), label="diverged (above)",
                )  # fmt: skip
        else:
            ax.plot(rates, losses, label="smoothed loss")
        ax.axhline(self.start_loss, color="0.6", linewidth=1, linestyle=":", label="start")
        ax.axvline(self.suggestion, color="tab:green", linestyle="--", linewidth=1.2)
        ax.annotate(
            f"suggestion {self.suggestion:.3g}",
            (self.suggestion, 0.98),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="tab:green",
        )
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("training loss")
        ax.set_title(f"lr_find ({self.method}, {self.steps} steps)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if path is not None:
            figure.savefig(path, dpi=100)
        return figure

    def apply(self, learning_rate: float | None = None) -> Nitro:
        """Set the suggestion (or `learning_rate`) on the handle as its constant learning rate,
        with `n.set_schedule(learning_rate=...)`: its next step trains at it and nothing
        recompiles; like any `set_schedule`, it lasts for this handle (a resumed run follows
        its keywords). Refused when the handle schedules its learning rate, whose shape a
        constant would replace. Returns the handle."""
        handle = self.handle
        if handle is None:
            raise SetupError("this result has no handle to apply to: n.lr_find() makes one")
        rate = self.suggestion if learning_rate is None else learning_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise SetupError(f"apply(learning_rate=) takes a positive number, got {rate!r}")
        scheduled = [
            key
            for key, value in dict(handle.given_keywords.get("schedules") or {}).items()
            if _is_learning_rate(key) and not isinstance(value, (int, float))
        ]
        if scheduled:
            raise ScheduleError(
                f"this handle schedules its learning rate (schedules[{scheduled[0]!r}]); "
                f"apply() sets a constant rate, which would replace that schedule's shape. "
                f"Build the schedule around the suggestion instead, e.g. n.set_schedule("
                f"learning_rate=optax.cosine_decay_schedule({float(rate):.3g}, n.total_steps))"
            )
        return handle.set_schedule(learning_rate=float(rate))

    def __repr__(self) -> str:
        low, high = float(self.learning_rates[0]), float(self.learning_rates[-1])
        what = (
            f"grid of {len(self.learning_rates)} learning rates {low:.3g}..{high:.3g}"
            if self.method == "grid"
            else f"ramp {low:.3g}..{high:.3g}"
        )
        diverged = ", ".join(f"{lr:.3g}" for lr in self.diverged) or "none"
        text = (
            f"LRFindResult({what}, {self.steps} steps, {self.seconds:.1f} s: suggestion "
            f"{self.suggestion:.3g}; diverged: {diverged})"
        )
        return text if self.note is None else f"{text}\n  note: {self.note}"

    def _repr_html_(self) -> str:
        rows = []
        if self.method == "grid":
            for lr, loss in zip(self.learning_rates, self.losses, strict=True):
                why = self.diverged.get(float(lr), "")
                mark = " style='font-weight:bold'" if float(lr) == self.suggestion else ""
                rows.append(
                    f"<tr{mark}><td>{lr:.3g}</td><td>{loss:.4g}</td><td>{escape(why)}</td></tr>"
                )
            head = "<tr><th>learning rate</th><th>loss</th><th>diverged</th></tr>"
        else:
            head = ""
        caption = (
            f"lr_find ({self.method}, {self.steps} steps, {self.seconds:.1f} s): suggestion "
            f"<b>{self.suggestion:.3g}</b> ({escape(self.rule)})"
        )
        note = f"<p>{escape(self.note)}</p>" if self.note else ""
        return f"<table><caption>{caption}</caption>{head}{''.join(rows)}</table>{note}"


def lr_find(
    handle: Nitro,
    *,
    start: float = 1e-5,
    end: float = 1.0,
    num: int = 11,
    steps: int | None = None,
    method: str = "grid",
    progress: Any = None,
) -> LRFindResult:
    """See `Nitro.lr_find`."""
    began = time.perf_counter()
    steps = _check_arguments(start, end, num, steps, method)
    setup = handle.setup
    if "train" not in setup.splits:
        raise SetupError(
            f"lr_find trains on the 'train' split, and this handle has none (splits: "
            f"{', '.join(setup.splits) or 'none'})"
        )
    optimizer = setup.optimizer
    if optimizer is None or not any(f.key == "learning_rate" for f in optimizer.fed):
        raise OptimizerError(
            "lr_find varies the learning rate, but this handle's optimizer has none fed to it "
            f"({optimizer.description if optimizer else 'no optimizer'}): return the optax "
            f"factory (e.g. `return optax.adamw`) or wrap it in optax.inject_hyperparams"
        )
    with handle._guard.hold("finding a learning rate"):
        keywords = _keywords(handle, progress)
        per_epoch = _steps_an_epoch(handle)
        if method == "grid":
            rates = [float(x) for x in np.geomspace(start, end, num)]
            k, steps = _calls(steps, per_epoch)
            return _grid(handle, keywords, rates, k, steps, began)
        return _ramp(handle, keywords, float(start), float(end), steps, began)


def _check_arguments(start, end, num, steps, method) -> int:
    if method not in METHODS:
        raise SetupError(f"lr_find(method={method!r}): pass 'grid' (the default) or 'ramp'")
    for name, value in (("start", start), ("end", end)):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise SetupError(
                f"lr_find({name}={value!r}): learning rates on a log grid must be positive, "
                f"finite numbers, e.g. start=1e-5, end=1.0"
            )
    if end <= start:
        raise SetupError(
            f"lr_find(start={start!r}, end={end!r}): end must be above start, e.g. start=1e-5, "
            f"end=1.0"
        )
    if method == "grid" and (isinstance(num, bool) or not isinstance(num, int) or num < 2):
        raise SetupError(
            f"lr_find(num={num!r}): the grid needs at least 2 learning rates (an int), "
            f"e.g. num=11, every half decade from 1e-5 to 1"
        )
    steps = DEFAULT_STEPS[method] if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise SetupError(
            f"lr_find(steps={steps!r}): a probe of 1 to {MAX_STEPS} steps (an int); to compare "
            f"learning rates over longer training, train a nitro.Population(e, "
            f"learning_rate=[...])"
        )
    return steps


def _is_learning_rate(key: str) -> bool:
    return key == "learning_rate" or key.endswith("/learning_rate")


def _keywords(handle: Nitro, progress: Any) -> dict[str, Any]:
    """The population's keywords: the handle's own, less what a short unvalidated probe does
    not take and the learning rate's schedules, from the handle's current weights."""
    given = handle.given_keywords
    keywords = {k: v for k, v in given.items() if k not in _DROPPED}
    schedules = {
        k: v for k, v in dict(given.get("schedules") or {}).items() if not _is_learning_rate(k)
    }
    if schedules:
        keywords["schedules"] = schedules
    if progress is None:
        setting = handle.keywords["progress"].value
        progress = setting if isinstance(setting, (bool, str)) else False
    keywords.update(
        progress=progress,
        eval_splits=(),  # the training loss is what lr_find reads
        checkpointer=None,  # a probe writes no run directory
        logger=None,
        weights=_current_weights(handle),
        data=handle.splits,
    )
    return keywords


def _current_weights(handle: Nitro) -> WeightsSource:
    """Copies of the handle's current parameters and model state (the handle is held)."""
    return WeightsSource.of(
        handle.setup.model,
        handle.state.variables,
        f"the weights of a {handle.cls.__name__} run at epoch {handle.epoch}, step {handle.step}",
    )


def _steps_an_epoch(handle: Nitro) -> int | None:
    batches = handle.setup.splits["train"].batches
    return None if batches is None else -(-batches // handle.setup.accum)


def _calls(steps: int, per_epoch: int | None) -> tuple[int, int]:
    """(steps per call, `steps` rounded up to whole calls) such that every call is the same
    program: K-step calls that fit the first epoch, or, past it, a K that divides the epoch."""
    calls = -(-steps // FUSED_LIMIT)
    k = -(-steps // calls)
    if per_epoch is None or calls * k <= per_epoch:
        return k, calls * k
    k = max(d for d in range(1, min(per_epoch, FUSED_LIMIT) + 1) if not per_epoch % d)
    return k, -(-steps // k) * k


class _Losses:
    """A reporter that keeps every call's losses ([members, steps], NaN after a member
    stopped); `limit` (the ramp's) asks the population to stop once it says so."""

    def __init__(self, pop: Population | None = None, limit=None):
        self.chunks: list[tuple[int, np.ndarray]] = []
        self.pop, self.limit, self.stopped_at = pop, limit, None

    def member_steps(self, first: int, losses: Any) -> None:
        self.chunks.append((first, np.array(losses, np.float64)))
        if self.limit is not None and self.pop is not None and self.stopped_at is None:
            self.stopped_at = self.limit(self.curves())
            if self.stopped_at is not None:
                self.pop.stop()

    def curves(self) -> np.ndarray:
        chunks = sorted(self.chunks, key=lambda c: c[0])
        return np.concatenate([c for _, c in chunks], axis=1)


def _train(pop: Population, steps: int, collector: _Losses, method: str) -> None:
    try:
        pop.train(steps=steps)
    except DivergenceError:
        if method == "ramp":
            return  # the ramp's member diverged: where it ends
        lrs = [m["learning_rate"] for m in pop.members]
        raise DivergenceError(
            f"every learning rate of the grid diverged ({lrs[0]:.3g} to {lrs[-1]:.3g}): "
            f"{'; '.join(pop.stopped.values())}. Try a lower start= and end="
        ) from None
    if pop.stop_reason == "requested" and collector.stopped_at is None:
        raise Interrupted("lr_find was interrupted; nothing changed on the handle")


def _grid(handle, keywords, rates, k, steps, began) -> LRFindResult:
    pop = Population(handle.experiment, learning_rate=rates, steps_per_dispatch=k, **keywords)
    collector = _Losses()
    pop.events.add(collector)
    _train(pop, steps, collector, "grid")
    curves = collector.curves()
    tail = max(1, curves.shape[1] // 4)
    losses = curves[:, -tail:].mean(axis=1)  # NaN for a member that stopped
    start_loss = float(np.nanmean(curves[:, 0]))
    diverged: dict[float, str] = {}
    for i, lr in enumerate(rates):
        if i in pop.stopped:
            diverged[lr] = pop.stopped[i]
        elif not np.isfinite(curves[i]).all():
            at = int(np.argmin(np.isfinite(curves[i])))
            diverged[lr] = f"non-finite loss at step {at + 1}"
    healthy = [i for i, lr in enumerate(rates) if lr not in diverged]
    if not healthy:
        raise DivergenceError(
            f"every learning rate of the grid ({rates[0]:.3g} to {rates[-1]:.3g}) gave a "
            f"non-finite loss. Try a lower start= and end="
        )
    best = min(healthy, key=lambda i: losses[i])
    for i in healthy:
        if rates[i] > rates[best] and losses[i] > start_loss:
            diverged[rates[i]] = f"its loss rose from {start_loss:.4g} to {losses[i]:.4g}"
    healthy = [i for i in healthy if rates[i] not in diverged]
    threshold = losses[best] + KNEE * max(0.0, start_loss - losses[best])
    pick = min(i for i in healthy if losses[i] <= threshold)
    note = None
    if losses[best] >= start_loss:
        note = (
            f"no learning rate lowered the loss below its start ({start_loss:.4g}) in {steps} "
            f"steps: the suggestion is the lowest loss's; try more steps= or another range"
        )
    elif best == len(rates) - 1:
        note = "the lowest loss is at the grid's largest rate: try a larger end="
    elif pick == 0:
        note = "the grid's smallest rate already trains near the best: try a smaller start="
    return LRFindResult(
        method="grid",
        learning_rates=np.asarray(rates),
        losses=losses,
        suggestion=rates[pick],
        rule=(
            f"the smallest learning rate whose loss (mean of the last quarter of the steps) "
            f"is within {KNEE:.0%} of the best member's drop from the start"
        ),
        diverged=diverged,
        curves=curves,
        start_loss=start_loss,
        steps=curves.shape[1],
        seconds=time.perf_counter() - began,
        note=note,
        handle=handle,
    )


def _smoothed(losses: np.ndarray) -> np.ndarray:
    """fastai's smoothing: a moving average of the loss (beta 0.98), debiased."""
    out, average = np.empty(len(losses)), 0.0
    for i, loss in enumerate(losses):
        average = RAMP_BETA * average + (1 - RAMP_BETA) * loss
        out[i] = average / (1 - RAMP_BETA ** (i + 1))
    return out


def _ramp_stop(curves: np.ndarray) -> int | None:
    """The first step whose loss is not finite or whose smoothed loss passes 4x its minimum
    so far, or None."""
    raw = curves[0]
    bad = ~np.isfinite(raw)
    if bad.any():
        return int(np.argmax(bad))
    smooth = _smoothed(raw)
    over = smooth > RAMP_STOP * np.minimum.accumulate(smooth)
    return int(np.argmax(over)) if over.any() else None


def _ramp(handle, keywords, start, end, steps, began) -> LRFindResult:
    ratio = end / start
    span = max(1, steps - 1)

    def ramp(step):
        return start * ratio ** (np.minimum(step, span) / span)

    schedules: Mapping[str, Any] = {**keywords.pop("schedules", {}), "learning_rate": ramp}
    pop = Population(handle.experiment, schedules=schedules, steps_per_dispatch=1, **keywords)
    collector = _Losses(pop, _ramp_stop)
    pop.events.add(collector)
    _train(pop, steps, collector, "ramp")
    curves = collector.curves()
    stop = _ramp_stop(curves)
    if stop == 0:
        raise DivergenceError(
            f"the loss is not finite at the ramp's first step ({curves[0, 0]}, learning rate "
            f"{start:.3g}), before any rate could matter: look at the weights and the loss"
        )
    diverged: dict[float, str] = {}
    ran = curves.shape[1] if stop is None else stop  # the steps before it stopped
    note = None
    if stop is None:
        note = (
            f"the loss never passed {RAMP_STOP:g}x its minimum up to {end:.3g}: the suggestion "
            f"may be low; try a larger end="
        )
    else:
        why = (
            f"non-finite loss at step {stop + 1}"
            if not math.isfinite(curves[0, stop])
            else f"the smoothed loss passed {RAMP_STOP:g}x its minimum at step {stop + 1}"
        )
        diverged[float(ramp(stop))] = why
    smooth = _smoothed(curves[0, :ran])
    rates = np.asarray([float(ramp(i)) for i in range(ran)])
    lowest = int(np.argmin(smooth))
    return LRFindResult(
        method="ramp",
        learning_rates=rates,
        losses=smooth,
        suggestion=float(rates[lowest] / 10),
        rule="a tenth of the learning rate at the smoothed loss's minimum (fastai's lr_min)",
        diverged=diverged,
        curves=curves[:, : ran if stop is None else stop + 1],  # and the step it stopped at
        start_loss=float(curves[0, 0]),
        steps=ran,
        seconds=time.perf_counter() - began,
        note=note,
        handle=handle,
    )


EXTENSIONS["lr_find"] = lr_find  # `n.lr_find()`
