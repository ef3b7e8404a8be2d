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
"""

from __future__ import annotations

import dataclasses

from nitro.errors import SetupError

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
