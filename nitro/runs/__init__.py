"""A run on disk: its directory, checkpoints, saves at epoch end, resume, early stopping, and
the weights a run starts from.

Internal, except the names the facade re-exports (`nitro.Checkpointer`, `nitro.EarlyStopping`,
`nitro.saved_runs`, `nitro.average`) and those here: `read`, `checkpoint_name` (the default
name of named checkpoints, `Checkpointer(name=nitro.runs.checkpoint_name)`) and `NamedSteps`
(their orbax step naming, for reading them with plain orbax). Imports `programs` and below.

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
- `checkpoint_names`: what checkpoints are called on disk (`Checkpointer(name=)`), orbax's
  step naming that finds them (`NamedSteps`)
- `checkpoint_record`: `CheckpointRecord`, the typed JSON record of a saved step (a run's or a
  population's, its members' `MemberRecord`s), written by `to_json`, read by `from_json`
- `checkpoint_writer`: `CheckpointStore`, the background writer of a run's orbax checkpoints
- `checkpoint_trees`: a state's variables as the nested arrays a checkpoint holds, and back
- `checkpoint_reads`: reading saved steps: listing, ranking, one step's arrays and record
- `training_config`: the training keywords a checkpoint records and a resume compares
- `early_stopping`: `EarlyStopping`, ending a run when a validation metric stops improving
- `initial_weights`: the weights a run starts from (`weights=`, `nitro.average`) and their fit
"""

from typing import Any

from nitro.runs.checkpoint_names import NamedSteps, checkpoint_name

__all__ = ["NamedSteps", "checkpoint_name", "read"]


def read(source: Any, which: str = "latest") -> Any:
    """The `CheckpointRecord` of a saved step, read without a handle and without its arrays:
    its run id, step, epoch, metrics, stop reason, history (`record.member.history`), the
    configuration a resume compares, and the versions that wrote it. `source`: a run
    directory (its newest checkpoint; `which="best"` its best by the checkpointer's metric),
    its `checkpoints` directory, or one step's directory.

    >>> import nitro, tempfile
    >>> from nitro.examples.digits import Digits
    >>> n = nitro.Nitro(Digits(max_epochs=1), run_dir=tempfile.mkdtemp(), progress=False)
    >>> record = nitro.runs.read(n.train().run_dir)
    >>> record.step, record.epoch, record.stop_reason, sorted(record.metrics)[:2]
    (9, 1, 'completed', ['data_wait_frac', 'device_ms'])
    """
    from nitro.runs.checkpoint_reads import read_record

    return read_record(source, which)
