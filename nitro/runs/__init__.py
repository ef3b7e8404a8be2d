"""A run on disk: its directory, checkpoints, saves at epoch end, resume, early stopping, and
the weights a run starts from.

Internal, except the names the facade re-exports (`nitro.Checkpointer`, `nitro.EarlyStopping`,
`nitro.saved_runs`, `nitro.average`). Imports `programs` and below.

- `run_dirs`: run directories, the runs of an experiment on disk (`nitro.saved_runs`), which
  directories are a population's
- `run_lock`: one writer per run directory (an advisory lock on `run.lock`)
- `identity`: which experiment a run belongs to, which run `resume="auto"` continues
- `run_files`: a run's identity and files: its directory, run id, run.json, one writer; a
  population's (`PopulationFiles`: the run's, with a directory per member)
- `run_origin`: where a run (or an export) comes from: the git state of its code, the
  uncommitted diff (`working_tree.patch`), the packages' versions, its resolved configuration
- `epoch_saves`: saving a run at the end of its epochs and calls, its best epoch held until saved
- `resume`: which checkpoint `resume=` continues, what differs, its `Variables` read back
- `watched_metrics`: an early stop or checkpointer watching a metric the run lacks, refused
- `checkpoints`: `Checkpointer`, the policy of when a run saves and which checkpoints it keeps
- `checkpoint_record`: `CheckpointRecord`, the typed JSON record of a saved step (a run's or a
  population's, its members' `MemberRecord`s), written by `to_json`, read by `from_json`
- `checkpoint_writer`: `CheckpointStore`, the background writer of a run's orbax checkpoints
- `checkpoint_trees`: a state's variables as the nested arrays a checkpoint holds, and back
- `checkpoint_reads`: reading saved steps: listing, ranking, one step's arrays and record
- `training_config`: the training keywords a checkpoint records and a resume compares
- `early_stopping`: `EarlyStopping`, ending a run when a validation metric stops improving
- `initial_weights`: the weights a run starts from (`weights=`, `nitro.average`) and their fit
"""

__all__: list[str] = []
