"""The records everything reads: what a run decided (`RunSetup`, deep-frozen), what it changes
(`TrainState`), metrics, resolved run keywords, and the event path to reporters.

Internal. Imports only lower layers (`experiments`, `optim`, `data`).

- `run_setup`: `RunSetup` and its parts
- `train_state`: `TrainState` and the `Variables` the programs take
- `metrics`: metric accumulation and split modes
- `events`, `progress`: the event path, the reporter protocol, the default reporters
"""

__all__: list[str] = []
