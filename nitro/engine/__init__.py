"""One run: the run keywords, the setup sequence (keywords -> `RunSetup` + `RunTime` +
`TrainState`), the training and evaluation loops, steps per dispatch, the step feed and run
control.

Internal, except `nitro.dispatch`, `nitro.runner` and `nitro.search` (public import paths). Imports `runs` and
below; never the handle.

- `run_keywords`: every run keyword declared once, with its resolution order
- `resolved`: `RunKeywords`, the resolved keywords as one typed record
- `setup`: the setup sequence, one function per step
- `run_time`: `RunTime`, what changes while a run lives (feed, dispatch, prefetchers, the live
  experiment copy), beside the frozen setup
- `loop`: the training loop (epochs as transactions, lagged read-back)
- `evaluation`: the evaluation loop and the weights it uses
- `diagnostics`: what the loop says when something goes wrong
- `prediction`: a batch through the predict program, in chunks of one compiled width
- `sample_pass`: a split's fields, outputs and per-sample losses from the eval program, on the
  host (what render, top losses and confusion read); `sample_rows`: one call's samples on the
  host, and the first validation call's for reporters that draw samples (`val_samples`)
- `dispatch`: steps per program call (a fixed K or "auto")
- `stepwise`: a fused call's steps one at a time, and "auto"'s bit-for-bit check of a size
- `feed`: per-step hyperparameters and Device values fed as arguments
- `runner`: worker threads, interrupts, the run guard, run control
- `weights_copy`: a copy of a handle's weights, taken at a step boundary while it trains
- `live_edit`: code edited while a handle trains, re-frozen and compiled beside the run
- `swaps`: the records of live edits, and the loop's side of a swap
- `profiling`: `n.profile()`'s measurements: each call's time taken apart, the device's peak
- `snapshots`: the run's state kept on the host at a cadence (`snapshots=`), as checkpoint
  records, and restored as a resume restores
- `spikes`: `spike=`'s watch over each call's losses, and the roll-back it asks for
- `member_spikes`: `spike=` in a population: every member's losses judged at once, and a
  member's roll-back and its record
- `member_axis`: who the loop, evaluation and prediction train: `SINGLE` (a run) or `Stacked` (a
  population's members, on a leading axis), and a population's records (its members, the
  stacked state, pruning)
- `search`: what a search inside a population declares: spaces, `Random` and `Sobol` members,
  `PBT`, `Halving` (public: `nitro.search`)
- `population_search`: what `PBT` and `Halving` do at their boundaries (an exploit gathered
  along the member axis, a rung that shrinks the population), their lineage and saved state
"""

__all__: list[str] = []
