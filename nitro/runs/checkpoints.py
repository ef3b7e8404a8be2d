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
the call (`nitro.runs.epoch_saves`); `budget=None` saves every `every` epochs regardless.

`name` names each checkpoint's directory (`nitro.runs.checkpoint_names`): a hook called as
`name(epoch=, step=, metric=, score=)` (`nitro.runs.checkpoint_name` gives
`epoch-0006-step-4500-val_loss=0.0416831`), or a format string with those fields
(`"epoch-{epoch:04d}-step-{step}"`; `{score}` is `none` where the epoch has no score). None
(the default) keeps orbax's step directories, which `ocp.CheckpointManager(directory)` reads
with no options.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from nitro.errors import SetupError
from nitro.runs.checkpoint_names import name_problem

__all__ = ["Checkpointer"]


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
      name: what each checkpoint's directory is called: a hook called as
        `name(epoch=, step=, metric=, score=)` returning a str (`nitro.runs.checkpoint_name`:
        `epoch-0006-step-4500-val_loss=0.0416831`; `epoch`: the epochs completed; `score` is
        None where the epoch has no value of `metric`), or a format string with those fields;
        None: the step number.
        Each name must be unique in the run, without path separators.

    >>> Checkpointer(k=5, metric="val_acc", mode="max")
    Checkpointer(k=5, metric='val_acc', mode='max', every=1, budget=0.05, name=None)
    >>> Checkpointer(name="epoch-{epoch:04d}-step-{step}").name_of(epoch=3, step=27, score=None)
    'epoch-0003-step-27'
    """

    k: int = 3
    metric: str = "val_loss"
    mode: str = "min"
    every: int = 1
    budget: float | None = 0.05
    name: str | Callable[..., str] | None = dataclasses.field(default=None, hash=False)

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
        self._check_name()

    def _check_name(self) -> None:
        """Refuse a name that could never work, before any training: a format string with
        other fields or none, or whose names are no file names; a hook that does not take the
        four keywords."""
        name = self.name
        if name is None:
            return
        if isinstance(name, str):
            try:
                text = name.format(**_fields(1, 1, self.metric, 0.5))
            except (KeyError, IndexError, ValueError, TypeError, AttributeError) as error:
                raise SetupError(
                    f"Checkpointer(name={name!r}): the format string fails ({type(error).__name__}: "
                    f"{error}); its fields are {{epoch}}, {{step}}, {{metric}} and {{score}}, "
                    f"e.g. name='epoch-{{epoch:04d}}-step-{{step}}'"
                ) from None
            if text == name.format(**_fields(2, 2, self.metric + "_", 0.25)):
                raise SetupError(
                    f"Checkpointer(name={name!r}): a format string without fields names every "
                    f"checkpoint alike, and each needs a name of its own; put {{step}} in it "
                    f"(e.g. name='epoch-{{epoch:04d}}-step-{{step}}'), or pass a function "
                    f"itself (name=nitro.runs.checkpoint_name), not its name"
                )
            if name_problem(text, 1) is not None:
                raise SetupError(
                    f"Checkpointer(name={name!r}): a checkpoint's name must be "
                    f"{name_problem(text, 1)}; change the format string (e.g. "
                    f"name='epoch-{{epoch:04d}}-step-{{step}}')"
                )
            return
        if not callable(name):
            raise SetupError(
                f"Checkpointer(name={name!r}): a hook called as name(epoch=, step=, metric=, "
                f"score=) that returns a str, a format string, or None (step directories)"
            )
        try:
            inspect.signature(name).bind(epoch=1, step=1, metric=self.metric, score=0.5)
        except TypeError as error:
            raise SetupError(
                f"Checkpointer(name={_hook(name)}): the hook is called with the keywords "
                f"epoch=, step=, metric= and score= ({error}); define it as "
                f"def {_hook(name)}(*, epoch, step, metric, score) -> str"
            ) from None
        except ValueError:  # no signature to read (a builtin): its call says
            pass

    def name_of(self, *, epoch: int, step: int, score: float | None) -> str | None:
        """The name of the checkpoint of `step` (None: its step number), checked: a str,
        not empty, without path separators, not another step's number. `score`: the
        epoch's value of `metric` (None where it has none)."""
        name = self.name
        if name is None:
            return None
        if isinstance(name, str):
            given = name.format(**_fields(epoch, step, self.metric, score))
            source, fix = f"Checkpointer(name={name!r})", "Change the format string"
        else:
            source, fix = f"Checkpointer(name={_hook(name)})", "Return a file name"
            try:
                given = name(epoch=epoch, step=step, metric=self.metric, score=score)
            except Exception as error:
                raise SetupError(
                    f"{source} raised {type(error).__name__}: {error}, naming the checkpoint "
                    f"of epoch {epoch}, step {step}. Fix the hook: it must return a file name "
                    f"such as nitro.runs.checkpoint_name gives, unique to the step"
                ) from error
        problem = name_problem(given, step)
        if problem is not None:
            raise SetupError(
                f"{source} named the checkpoint of epoch {epoch}, step {step}: a checkpoint's "
                f"name must be {problem}. {fix} such as nitro.runs.checkpoint_name gives "
                f"('epoch-0006-step-4500-val_loss=0.0417'), unique to the step"
            )
        return given

    def better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b


class _Score:
    """A score in a format string: `format(score, spec)` as a float, `none` where missing."""

    def __init__(self, value: float | None):
        self.value = value

    def __format__(self, spec: str) -> str:
        return "none" if self.value is None else format(self.value, spec)


def _fields(epoch: int, step: int, metric: str, score: float | None) -> dict[str, Any]:
    return {"epoch": epoch, "step": step, "metric": metric, "score": _Score(score)}


def _hook(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
