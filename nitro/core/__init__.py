"""The records everything reads: what a run decided (`RunSetup`, deep-frozen), what it changes
(`TrainState`), metrics, resolved run keywords, and the event path to reporters.

Internal. Imports only lower layers (`experiments`, `optim`, `data`).

- `run_setup`: `RunSetup` and its parts (deep-frozen: never written after setup)
- `train_state`: `TrainState` and the `Variables` the programs take (one in-place writer: the
  loop; a restore makes a new one)
- `placement`: one device or a data-parallel mesh; batch sharding
- `sharding`: each state leaf's `PartitionSpec` (replicated, fsdp, rules)
- `frozen`: `FrozenDict` and `freeze`, the read-only containers of the records
- `metrics`: metric accumulation and split modes
- `provenance`: `Resolved`, a run keyword's value and its source
- `events`, `progress`: the event path, the reporter protocol, the default reporters
"""

__all__: list[str] = []
