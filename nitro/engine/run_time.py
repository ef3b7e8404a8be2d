"""`RunTime`: what changes while a run lives, beside the `RunSetup` that does not.

The handle owns one, built by the setup sequence, and passes it to the loop and evaluation
beside the setup (`train_epochs(setup, runtime, state, ...)`):

- `experiment`: the handle's live copy of the experiment; `set_device` writes its Device
  fields, and host hooks (host metrics, `finalize_metrics`) receive it as `self`;
- `feed`: the values fed to every step (optimizer hyperparameters, Device fields);
- `dispatch`: the steps-per-dispatch measurement and its current `DispatchChoice`;
- `prefetchers`: one per split, with its worker threads and its counters;
- `live`: the live edits: the newest, and the swap compiled beside the run that waits for
  the loop's next dispatch boundary (`nitro.engine.live_edit`);
- `snapshots`, `spikes`: the run's snapshots in host memory and its watch over loss spikes
  (`nitro.engine.snapshots`, `nitro.engine.spikes`);
- `profiler`: while `n.profile()` trains, the timer the loop marks each call's parts on
  (`nitro.engine.profiling`); None otherwise, and the loop marks `PASS_THROUGH`, whose marks
  do nothing.

The setup stays as it was decided; the `TrainState` (arrays, counters, history) is the
third record, which only the loop writes in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nitro.core.run_setup import RunSetup
from nitro.data import Prefetcher
from nitro.engine.dispatch import DispatchPlan
from nitro.engine.feed import StepFeed
from nitro.engine.swaps import LiveEdits

__all__ = ["RunTime"]


@dataclasses.dataclass(eq=False)
class RunTime:
    """The live parts of one handle's runs: written while it runs, by the handle (Device
    fields) and the loop (the dispatch measurement, the prefetchers' counters)."""

    experiment: Any  # the live copy of the user's experiment
    feed: StepFeed
    dispatch: DispatchPlan
    prefetchers: Mapping[str, Prefetcher]  # split name -> its prefetcher
    live: LiveEdits = dataclasses.field(default_factory=LiveEdits)
    profiler: Any = None  # `n.profile()`'s call timer (`profiling.CallTimer`) while it runs
    # the guard's keeping is the loop's (`nitro.engine.loop.RESTORE_BYTES`): no call donates the
    # variables. Decided at the handle's first call, for its life; None before it
    restores: bool | None = None
    # the snapshots in host memory (`nitro.engine.snapshots.SnapshotRing`; None: none kept
    # yet, or `snapshots=False`) and the watch over loss spikes (`spikes.SpikeWatch`)
    snapshots: Any = None
    spikes: Any = None

    def prefetcher(self, split: str) -> Prefetcher:
        return self.prefetchers[split]

    def call_host_hook(self, setup: RunSetup, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call host hook `name` (as frozen at setup) on the live experiment; on its first
        use after a live edit changed it, one that raises raises `HostHookFailed`."""
        fn = setup.experiment.hook_functions[name]
        return self.live.call_host_hook(setup, name, lambda: fn(self.experiment, *args, **kwargs))

    def device_values(self) -> dict[str, Any]:
        """Device field -> its current value on the host (what checkpoints record)."""
        return {name: self.feed.device_value(name) for name in self.feed.device_dtypes}
