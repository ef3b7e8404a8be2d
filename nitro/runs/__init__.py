"""A run on disk: its directory, checkpoints, lifecycle, resume, early stopping, and the weights
a run starts from.

Internal, except the names the facade re-exports (`nitro.Checkpointer`, `nitro.EarlyStopping`,
`nitro.saved_runs`, `nitro.average`). Imports `programs` and below.

- `run_dirs`: run directories, the runs of an experiment on disk (`nitro.saved_runs`)
- `run_lock`: one writer per run directory (an advisory lock on `run.lock`)
- `identity`: which experiment a run belongs to, which run `resume="auto"` continues
- `lifecycle`: a run's life on disk: its files, checkpoints after each epoch, resume
- `checkpoints`: `Checkpointer`, the orbax checkpoints of a whole `TrainState`
- `training_config`: the training keywords a checkpoint records and a resume compares
- `early_stopping`: `EarlyStopping`, ending a run when a validation metric stops improving
- `weights`: the weights a run starts from (`weights=`, `nitro.average`) and their fit
- `population_dirs`: which directories are a population's
- `population_files`: a population's directory: every member in one checkpoint, a directory
  per member, a member's weights
"""

__all__: list[str] = []
