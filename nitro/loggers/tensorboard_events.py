"""TensorBoard event files, written with tensorboardX.

Scalars are tagged `<context>/<name>` (`train/loss`, `validate/val_acc`,
`data/data_wait_frac`) against the optimizer step. Parameters, tags, other values and
confusion matrices are markdown text; at `finish` the parameters go to the HParams dashboard
with the validation metrics, and the status to `run/status`.

Events are written on the calling thread through tensorboardX's `EventsWriter` (buffered, and
flushed every `flush_secs`, at the end of each call, before a checkpoint records `state()`
and at `finish`), not through `SummaryWriter`, whose
inter-process queue costs several times more per scalar than the write itself (measured in
docs/logging.md). Each writer opens a new event file in the log directory; TensorBoard reads
them in order, so a second `train()` or a resumed run continues the curves, and a resumed run
purges the steps the crashed run logged after its checkpoint.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nitro.loggers.media import figure_png, image_pixels, png_bytes
from nitro.loggers.protocol import FLUSH_SECONDS, BaseLogger, confusion_rows, plain_value

__all__ = ["TensorBoardLogger"]

# finish status -> the HParams dashboard's session status
_STATUS = {
    "completed": "STATUS_SUCCESS",
    "early_stop": "STATUS_SUCCESS",
    "requested": "STATUS_UNKNOWN",
    "error": "STATUS_FAILURE",
}


def _require_tensorboardx() -> None:
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        raise ImportError(
            "TensorBoardLogger writes with tensorboardX, which is not installed: "
            "pip install 'nitro[logging]' (or pip install tensorboardX)"
        ) from None


def _markdown_table(rows: Mapping[str, Any], header: tuple[str, str]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {name} | {plain_value(value)} |" for name, value in rows.items()]
    return "\n".join(lines)


class TensorBoardLogger(BaseLogger):
    """Logs to TensorBoard event files in `logdir` (default: the run directory).

    >>> import nitro
    >>> from nitro.examples.digits import Digits
    >>> n = nitro.Nitro(Digits(max_epochs=1), logger=nitro.loggers.TensorBoardLogger(), progress=False)
    >>> n.train().step
    9
    >>> # tensorboard --logdir runs/
    """

    def __init__(
        self, logdir: str | os.PathLike | None = None, *, flush_secs: float = FLUSH_SECONDS
    ):
        _require_tensorboardx()
        self._explicit = logdir is not None
        self._logdir = os.fspath(logdir) if logdir is not None else None
        self.flush_secs = flush_secs
        self._writer = None
        self._lock = threading.Lock()
        self._last_flush = 0.0
        self._step: int | None = None  # the latest step logged
        self._purge_step: int | None = None
        self._params: dict[str, Any] = {}
        self._metric_tags: dict[str, None] = {}  # validation tags, for the HParams dashboard

    @property
    def logdir(self) -> str | None:
        return self._logdir

    def bind_run(self, run_dir: str, run_id: str | None) -> None:
        self._run_id = run_id
        if not self._explicit and os.fspath(run_dir) != self._logdir:
            self._close()
            self._logdir = os.fspath(run_dir)

    # writing ------------------------------------------------------------------------------

    def _open(self):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog  # pyright: ignore[reportAttributeAccessIssue]  # protobuf-generated, no stubs

        if self._logdir is None:
            raise RuntimeError(
                "TensorBoardLogger() has no log directory yet: give it one, "
                "TensorBoardLogger('runs/tb'), or let a run bind it to its directory"
            )
        Path(self._logdir).mkdir(parents=True, exist_ok=True)
        # a unique, time-ordered name: TensorBoard reads a directory's files in name order
        suffix = f".{time.time_ns()}.{os.getpid()}"
        self._writer = EventsWriter(os.path.join(self._logdir, "events"), suffix)
        self._last_flush = time.monotonic()
        if self._purge_step is not None:  # drop what a crashed run logged after its checkpoint
            self._writer.write_event(
                Event(
                    step=self._purge_step,
                    wall_time=time.time(),
                    session_log=SessionLog(status=SessionLog.START),
                )
            )
            self._purge_step = None
        return self._writer

    def _write(self, summary, step: int | None, flush: bool = False) -> None:
        from tensorboardX.proto.event_pb2 import Event  # pyright: ignore[reportAttributeAccessIssue]  # protobuf-generated, no stubs

        event = Event(wall_time=time.time(), step=step or 0, summary=summary)
        with self._lock:
            writer = self._writer or self._open()
            writer.write_event(event)
            now = time.monotonic()
            if flush or now - self._last_flush >= self.flush_secs:
                writer.flush()
                self._last_flush = now

    def _text(self, tag: str, text: str, flush: bool = False) -> None:
        from tensorboardX.summary import text as text_summary

        self._write(text_summary(tag, text), self._step, flush)

    def _close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def close(self) -> None:
        """Flush and close the event file now (the next record opens a new one)."""
        self._close()

    def flush(self) -> None:
        """Write the buffered events to the event file now."""
        with self._lock:
            if self._writer is not None:
                self._writer.flush()
                self._last_flush = time.monotonic()

    # the verbs ----------------------------------------------------------------------------

    def log_metrics(self, metrics, *, step, epoch, context) -> None:
        from tensorboardX.proto.summary_pb2 import Summary  # pyright: ignore[reportAttributeAccessIssue]  # protobuf-generated, no stubs

        values = []
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"TensorBoardLogger logs real numbers; metric {name!r} is "
                    f"{type(value).__name__} ({value!r})"
                )
            value = float(value)
            if math.isfinite(value):
                values.append(Summary.Value(tag=f"{context}/{name}", simple_value=value))
        if context == "validate":
            self._metric_tags.update(dict.fromkeys(v.tag for v in values))
        if step is not None:
            self._step = step
        if values:
            self._write(Summary(value=values), step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._params = {name: plain_value(value) for name, value in params.items()}
        self._text("params", _markdown_table(self._params, ("parameter", "value")))

    def log_tags(self, tags: Mapping[str, str]) -> None:
        self._text("tags", _markdown_table(tags, ("tag", "value")))

    def log_other(self, key: str, value: Any) -> None:
        text = value if isinstance(value, str) else json.dumps(value, default=plain_value)
        self._text(f"other/{key}", "\n".join("    " + line for line in text.splitlines()))

    def log_confusion(self, matrix: Any, labels: Sequence[Any], *, epoch: int | None) -> None:
        rows, names = confusion_rows(matrix, labels)
        lines = [
            f"epoch {epoch} (rows: true, columns: predicted)",
            "",
            "| | " + " | ".join(names) + " |",
            "|---" * (len(names) + 1) + "|",
        ]
        lines += [
            f"| **{n}** | " + " | ".join(map(str, r)) + " |"
            for n, r in zip(names, rows, strict=True)
        ]
        self._text("confusion", "\n".join(lines))

    def log_figure(self, name: str, figure: Any, *, step: int | None = None) -> None:
        """The figure as a PNG image tagged `name` at `step` (default: the latest step)."""
        data, pixels = figure_png(figure, name)
        self._image(name, data, pixels.shape, step)

    def log_image(self, name: str, image: Any, *, step: int | None = None) -> None:
        """The image (H, W[, C]; uint8, or floats in 0-1) tagged `name` at `step`."""
        pixels = image_pixels(image, name)
        self._image(name, png_bytes(pixels), pixels.shape, step)

    def _image(self, tag: str, png: bytes, shape: tuple[int, ...], step: int | None) -> None:
        from tensorboardX.proto.summary_pb2 import Summary  # pyright: ignore[reportAttributeAccessIssue]  # protobuf-generated, no stubs

        height, width, channels = shape
        image = Summary.Image(
            height=height, width=width, colorspace=channels, encoded_image_string=png
        )
        self._write(Summary(value=[Summary.Value(tag=tag, image=image)]), _at(step, self._step))

    def finish(self, status: str) -> None:
        self._text("run/status", status)
        if self._params:
            for summary in _hparams(self._params, list(self._metric_tags), status):
                self._write(summary, self._step)
        self._close()

    # resume -------------------------------------------------------------------------------

    def state(self) -> dict[str, Any] | None:
        """The log directory and the latest step logged (a checkpoint stores it), once the
        events logged so far are on disk."""
        if self._logdir is None:
            return None
        self.flush()
        return {"logdir": os.path.abspath(self._logdir), "step": self._step}

    def reattach(self, state: Any) -> None:
        """Continue the curves of the run that wrote `state`: the same log directory, and the
        steps it logged after `state["step"]` (lost with a crash) purged from the view."""
        if not isinstance(state, Mapping) or "logdir" not in state:
            raise TypeError(
                f"TensorBoardLogger.reattach takes the state() of a TensorBoardLogger, a dict "
                f"with 'logdir'; got {state!r}"
            )
        saved = state["logdir"]
        if self._logdir is not None and os.path.abspath(self._logdir) != saved:
            raise ValueError(
                f"this TensorBoardLogger writes to {os.path.abspath(self._logdir)}, but the run "
                f"being resumed wrote its events to {saved}: give TensorBoardLogger(logdir="
                f"{saved!r}) to continue its curves"
            )
        self._logdir, self._explicit = saved, True
        step = state.get("step")
        self._step = step
        self._purge_step = None if step is None else step + 1
        if self._writer is not None:  # already writing: purge from here on
            self._close()

    @property
    def run_url(self) -> str | None:
        return Path(self._logdir).resolve().as_uri() if self._logdir else None

    def info(self) -> dict[str, Any]:
        return {"type": "TensorBoardLogger", "logdir": self._logdir, "step": self._step}


def _at(step: Any, latest: int | None) -> int | None:
    """The step an image is logged at: `step`, else the latest step logged."""
    if step is None:
        return latest
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step= takes a whole number >= 0 or None; got {step!r}")
    return int(step)


def _hparams(params: Mapping[str, Any], metric_tags: list[str], status: str):
    """The three HParams summaries: the experiment (parameters and the metric tags the
    dashboard shows), the session start (the values) and the session end (its status)."""
    from tensorboardX.proto.api_pb2 import Status  # pyright: ignore[reportAttributeAccessIssue]  # protobuf-generated, no stubs
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData, SessionEndInfo  # pyright: ignore[reportAttributeAccessIssue]  # protobuf-generated, no stubs
    from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata  # pyright: ignore[reportAttributeAccessIssue]  # protobuf-generated, no stubs
    from tensorboardX.summary import hparams

    experiment, start, _ = hparams(dict(params), dict.fromkeys(metric_tags, 0.0))
    end = HParamsPluginData(
        session_end_info=SessionEndInfo(status=Status.Value(_STATUS.get(status, "STATUS_UNKNOWN"))),
        version=0,
    )
    metadata = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(
            plugin_name="hparams", content=end.SerializeToString()
        )
    )
    end_summary = Summary(
        value=[Summary.Value(tag="_hparams_/session_end_info", metadata=metadata)]
    )
    return experiment, start, end_summary
