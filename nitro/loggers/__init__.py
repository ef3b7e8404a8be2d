"""Logging: metrics, parameters and run facts, written to files that real tools read.

A logger implements ten verbs (`Logger`; `BaseLogger` gives no-op defaults):
`log_metrics(metrics, *, step, epoch, context)` with context "train" (each optimizer
step), "validate" or "data" (each epoch); `log_params`; `log_tags`; `log_other`;
`log_confusion`; `finish(status)`; `run_id`; `run_url`; `state()` and `reattach(state)`
for resume (and `flush()`, optional). The file backends keep records in memory for at most
`FLUSH_SECONDS` and flush at the end of each call. `LoggingReporter` turns a run's events into these calls; `LoggerGroup` (or a
list) fans out. Backends: `JSONLinesLogger` (the default, `<run_dir>/metrics.jsonl`),
`TensorBoardLogger` (needs `nitro[logging]`), `CSVLogger`, `MLflowLogger` (`nitro[mlflow]`) and
`WandbLogger` (`nitro[wandb]`). `log_figure` and `log_image` (optional verbs, ignored by the
backends that cannot store images) put matplotlib figures and images in TensorBoard, MLflow
and W&B. See docs/logging.md.

- `protocol`: the ten verbs (`Logger`, `BaseLogger`) and `LoggerGroup`, which fans out
- `reporter`: `LoggingReporter`, a run's events as logger calls
- `files`: `JSONLinesLogger` and `CSVLogger`, appending to one local file
- `tensorboard_events`: `TensorBoardLogger`, TensorBoard event files written with tensorboardX
- `mlflow_tracking`: `MLflowLogger`, a run in an MLflow tracking store
- `wandb_runs`: `WandbLogger`, a Weights & Biases run
- `sender`: `Sender`, the thread that runs a network logger's calls in order, off the training
  thread
- `media`: images and figures, checked and brought to 8-bit for the loggers that store them

```python
from nitro.loggers import JSONLinesLogger, LoggingReporter, TensorBoardLogger

n = nitro.Nitro(exp, progress=LoggingReporter([JSONLinesLogger(), TensorBoardLogger()]))
```
"""

from nitro.loggers.files import CSVLogger, JSONLinesLogger
from nitro.loggers.mlflow_tracking import MLflowLogger
from nitro.loggers.protocol import (
    CONTEXTS,
    FINISH_STATUSES,
    FLUSH_SECONDS,
    LOGGER_VERBS,
    MEDIA_VERBS,
    BaseLogger,
    Logger,
    LoggerGroup,
    as_logger,
    finite_metrics,
    logger_info,
)
from nitro.loggers.reporter import LoggingReporter, finish_status, run_params
from nitro.loggers.tensorboard_events import TensorBoardLogger
from nitro.loggers.wandb_runs import WandbLogger

__all__ = [
    "CONTEXTS",
    "FINISH_STATUSES",
    "FLUSH_SECONDS",
    "LOGGER_VERBS",
    "MEDIA_VERBS",
    "BaseLogger",
    "CSVLogger",
    "JSONLinesLogger",
    "Logger",
    "LoggerGroup",
    "LoggingReporter",
    "MLflowLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "as_logger",
    "finish_status",
    "finite_metrics",
    "logger_info",
    "run_params",
]
