"""`MLflowLogger`: a run's metrics, parameters, tags and figures in an MLflow tracking store.

It talks to the store through `mlflow.tracking.MlflowClient` (no fluent API, so no
process-wide active run): a tracking server (`http://...`), a database (`sqlite:///...`) or
a local directory (`file://...`; MLflow 3 asks `MLFLOW_ALLOW_FILE_STORE=true` for it). The run
is created at the first record, in the experiment named `experiment` (default: the Nitro
experiment's class name, from the run's tags), named after the Nitro run id, tagged with
the run directory.

Metrics keep their names (`loss`, `epoch_loss`, `val_acc`, `data_wait_frac`) against the
optimizer step, buffered like the file loggers (`FLUSH_SECONDS`) and sent in one
`log_batch`. MLflow keeps a parameter's first value: a parameter that changes later (a Device
field set between `train()` calls) is recorded as the tag `param_changed.<name>`. The binding
report and other values are text artifacts (`<key>.txt`), a confusion matrix a JSON artifact,
figures PNG artifacts under `figures/`, images MLflow images (`log_image` with a key and a
step). `finish` ends the run (FINISHED, KILLED for a stop request, FAILED for an error);
`state()` is the run id and the latest step, and `reattach` continues that run.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from nitro.loggers.media import figure_png, image_pixels
from nitro.loggers.protocol import FLUSH_SECONDS, BaseLogger, confusion_rows, plain_value
from nitro.loggers.sender import Sender

__all__ = ["MLflowLogger"]

_STATUS = {
    "completed": "FINISHED",
    "early_stop": "FINISHED",
    "requested": "KILLED",
    "error": "FAILED",
}
_PARAM_LENGTH = 500  # MLflow's smallest limit on a parameter value (older stores)
_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # the stores MLflow reaches by SQLAlchemy


def _require_mlflow():
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ImportError(
            "MLflowLogger writes with mlflow, which is not installed: pip install "
            "'nitro[mlflow]' (or pip install mlflow-skinny sqlalchemy alembic)"
        ) from None
    return MlflowClient


def _client(client_class: Any, uri: str | None) -> Any:
    """An `MlflowClient` on `uri`; a database store without SQLAlchemy (`mlflow-skinny`
    alone) is refused naming what to install."""
    try:
        return client_class(tracking_uri=uri)
    except Exception:
        from mlflow.tracking import get_tracking_uri

        resolved = uri or get_tracking_uri()
        scheme = resolved.split(":", 1)[0].split("+", 1)[0]
        if scheme in _DATABASES:
            try:
                import alembic  # noqa: F401
                import sqlalchemy  # noqa: F401
            except ImportError:
                raise ImportError(
                    f"the MLflow store {resolved} is a database, which MLflow reaches through "
                    f"sqlalchemy and alembic, not installed here (mlflow-skinny leaves them "
                    f"out): pip install 'nitro[mlflow]' (or pip install sqlalchemy alembic)"
                ) from None
        raise


class MLflowLogger(BaseLogger):
    """Logs to an MLflow tracking store.

    `tracking_uri`: where (None: MLflow's default, `MLFLOW_TRACKING_URI`, else
    `sqlite:///mlflow.db` in the working directory); `experiment`: the MLflow experiment's name
    (created when missing; None: the Nitro experiment's class name, or "nitro" for a logger
    used outside a run); `run_name`: the MLflow run's name (None: the Nitro run id); `tags`:
    extra tags of the run; `flush_secs`: how long metrics wait in memory at most; `timeout`:
    how long a flush, a checkpoint or the end of a run waits for the store at most (seconds).
    """

    def __init__(
        self,
        tracking_uri: str | os.PathLike | None = None,
        *,
        experiment: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        flush_secs: float = FLUSH_SECONDS,
        timeout: float = 30.0,
    ):
        client_class = _require_mlflow()
        if tracking_uri is not None and not isinstance(tracking_uri, str | os.PathLike):
            raise TypeError(
                f"MLflowLogger(tracking_uri=...) takes a URI string (file:///path, "
                f"sqlite:///path.db, http://host:5000) or None; got {type(tracking_uri).__name__}"
            )
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(
                f"MLflowLogger(timeout=...) takes the seconds a flush waits for the store at "
                f"most, a positive number; got {timeout!r}"
            )
        self._uri = os.fspath(tracking_uri) if tracking_uri is not None else None
        self._client = _client(client_class, self._uri)
        self.experiment = experiment
        self.run_name = run_name
        self.extra_tags = dict(tags or {})
        self.flush_secs = flush_secs
        self.timeout = float(timeout)
        self._sender = Sender("nitro-mlflow")
        self._lock = threading.Lock()  # the metrics buffer, shared with the sender
        self._run_dir: str | None = None
        self._mlflow_id: str | None = None  # the MLflow run's id, once created
        self._experiment_id: str | None = None
        self._pending: list[Any] = []
        self._due = 0.0
        self._step: int | None = None
        self._params: dict[str, str] = {}  # what the run holds as parameters
        self._waiting_params: Mapping[str, Any] | None = None  # logged before the run exists

    # the sender ---------------------------------------------------------------------------

    def _send(self, call, *args: Any, **kwargs: Any) -> None:
        """`call(*args, **kwargs)` on the sender's thread, after what was sent before; a
        failure of the store so far raises here first."""
        self._check()
        self._sender.submit(lambda: call(*args, **kwargs))

    def _check(self) -> None:
        failure = self._sender.failure
        if failure is None:
            return
        if isinstance(failure, TimeoutError):
            cause = f"the tracking store {self._client.tracking_uri} gave {failure}"
        else:
            cause = (
                f"writing to the tracking store {self._client.tracking_uri} failed with "
                f"{type(failure).__name__}: {failure}"
            )
        raise RuntimeError(
            f"{cause}. Nothing more is sent to it; check that the store is up (an MLflow "
            f"server: mlflow server --port 5000) or give MLflowLogger(tracking_uri=...) one "
            f"that is, e.g. sqlite:///mlflow.db"
        )

    def _wait(self) -> None:
        self._sender.wait(self.timeout)
        self._check()

    def _reachable(self) -> None:
        """A tracking server that refuses connections or does not answer within `timeout`
        fails here, at once, rather than after MLflow's minutes of retries."""
        uri = self._client.tracking_uri
        if not uri.startswith(("http://", "https://")):
            return
        import requests

        try:
            requests.get(f"{uri.rstrip('/')}/health", timeout=self.timeout)
        except requests.RequestException as error:
            raise ConnectionError(
                f"no MLflow server answers at {uri} ({type(error).__name__})"
            ) from None

    # the run ------------------------------------------------------------------------------

    def bind_run(self, run_dir: str, run_id: str | None) -> None:
        self._run_id = run_id
        self._run_dir = os.fspath(run_dir)

    def _run(self, experiment_hint: str | None = None) -> str:
        """The MLflow run's id, created at the first record (the parameters wait for the
        tags, which name the experiment). On the sender's thread."""
        if self._mlflow_id is not None:
            return self._mlflow_id
        self._reachable()
        name = self.experiment or experiment_hint or "nitro"
        found = self._client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found else self._client.create_experiment(name)
        tags = {**self.extra_tags}
        if self._run_dir is not None:
            tags["nitro.run_dir"] = os.path.abspath(self._run_dir)
        if self._run_id is not None:
            tags["nitro.run_id"] = self._run_id
        run = self._client.create_run(
            experiment_id, run_name=self.run_name or self._run_id, tags=tags
        )
        self._experiment_id = experiment_id
        self._mlflow_id = mlflow_id = run.info.run_id
        if self._waiting_params is not None:
            params, self._waiting_params = self._waiting_params, None
            self._send_params(params)
        return mlflow_id

    # metrics, buffered --------------------------------------------------------------------

    def log_metrics(self, metrics, *, step, epoch, context) -> None:
        from mlflow.entities import Metric

        self._check()
        now = int(time.time() * 1000)
        if step is not None:
            self._step = step
        records = [
            Metric(key=name, value=float(value), timestamp=now, step=step or 0)
            for name, value in metrics.items()
        ]
        with self._lock:
            self._pending.extend(records)
            due = time.monotonic() >= self._due
            if due:
                self._due = time.monotonic() + self.flush_secs
        if due:
            self._sender.submit(self._send_pending)

    def _send_pending(self) -> None:
        with self._lock:
            records, self._pending = self._pending, []
        if not records:
            return
        run = self._run()
        for start in range(0, len(records), 1000):  # MLflow's batch limit
            self._client.log_batch(run, metrics=records[start : start + 1000])

    def flush(self) -> None:
        """Send the buffered metrics now, and wait for the store (`timeout` at most)."""
        self._send(self._send_pending)
        with self._lock:
            self._due = time.monotonic() + self.flush_secs
        self._wait()

    # the rest -----------------------------------------------------------------------------

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._send(self._send_params, dict(params))

    def _send_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param, RunTag

        if self._mlflow_id is None and self.experiment is None:
            self._waiting_params = params  # the run starts with the tags, which name it
            return
        run = self._run()
        new, changed = [], []
        for name, value in params.items():
            text = str(plain_value(value))[:_PARAM_LENGTH]
            if name not in self._params:
                new.append(Param(name, text))
            elif self._params[name] != text:
                changed.append(RunTag(f"param_changed.{name}", text))
            self._params.setdefault(name, text)
        if new:
            for start in range(0, len(new), 100):  # MLflow's limit of parameters a batch
                self._client.log_batch(run, params=new[start : start + 100])
        if changed:
            self._client.log_batch(run, tags=changed)

    def log_tags(self, tags: Mapping[str, str]) -> None:
        self._send(self._send_tags, dict(tags))

    def _send_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        owner = str(tags.get("experiment", "")).rsplit(".", 1)[-1] or None
        run = self._run(experiment_hint=owner)
        self._client.log_batch(run, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_other(self, key: str, value: Any) -> None:
        text = value if isinstance(value, str) else json.dumps(value, default=plain_value)
        self._send(lambda: self._client.log_text(self._run(), text, f"{key}.txt"))

    def log_confusion(self, matrix: Any, labels: Sequence[Any], *, epoch: int | None) -> None:
        rows, names = confusion_rows(matrix, labels)
        where = f"confusion/epoch_{epoch}.json" if epoch is not None else "confusion/matrix.json"
        table = {"labels": names, "matrix": rows}
        self._send(lambda: self._client.log_dict(self._run(), table, where))

    def log_figure(self, name: str, figure: Any, *, step: int | None = None) -> None:
        """The figure as a PNG artifact `figures/<name>/step_<step>.png` (without a step or
        a step logged: `figures/<name>.png`). Rendered here: the caller may close it."""
        png, _ = figure_png(figure, name)
        step = self._step if step is None else step
        where = f"figures/{name}.png" if step is None else f"figures/{name}/step_{step}.png"
        self._send(self._send_file, png, where)

    def _send_file(self, data: bytes, where: str) -> None:
        folder, file_name = os.path.split(where)
        with tempfile.TemporaryDirectory() as scratch:
            with open(os.path.join(scratch, file_name), "wb") as file:
                file.write(data)
            self._client.log_artifact(self._run(), file.name, folder or None)

    def log_image(self, name: str, image: Any, *, step: int | None = None) -> None:
        """The image as an MLflow image under `name` at `step` (the run's Images tab)."""
        pixels = image_pixels(image, name).copy()  # the caller may reuse its array
        step = self._step if step is None else step
        if pixels.shape[2] == 1:
            pixels = pixels[:, :, 0]
        self._send(lambda: self._client.log_image(self._run(), pixels, key=name, step=step or 0))

    def finish(self, status: str) -> None:
        self._send(self._send_pending)
        self._send(self._send_finish, status)
        self._wait()

    def _send_finish(self, status: str) -> None:
        run = self._run()
        self._client.set_tag(run, "nitro.finish_status", status)
        self._client.set_terminated(run, status=_STATUS.get(status, "FAILED"))

    # resume -------------------------------------------------------------------------------

    def state(self) -> dict[str, Any] | None:
        """The MLflow run's id, the tracking URI and the latest step logged, once the
        buffered metrics are sent; None before the run exists."""
        self.flush()
        if self._mlflow_id is None:
            return None
        return {"run_id": self._mlflow_id, "tracking_uri": self._uri, "step": self._step}

    def reattach(self, state: Any) -> None:
        """Continue the MLflow run that wrote `state`: the same run, RUNNING again, its
        parameters kept (a changed one is logged as `param_changed.<name>`)."""
        if not isinstance(state, Mapping) or "run_id" not in state:
            raise TypeError(
                f"MLflowLogger.reattach takes the state() of an MLflowLogger, a dict with "
                f"'run_id'; got {state!r}"
            )
        self._check()
        found = self._sender.submit(lambda: self._client.get_run(state["run_id"]), fatal=False)
        self._wait()
        try:
            run = found.result(timeout=0)
        except Exception as error:  # mlflow's own exception types vary by store
            raise ValueError(
                f"the MLflow run {state['run_id']} of the run being resumed is not in the "
                f"tracking store {self._client.tracking_uri} ({type(error).__name__}); give "
                f"MLflowLogger the tracking_uri it was logged to ({state.get('tracking_uri')!r})"
            ) from None
        self._mlflow_id = run.info.run_id
        self._experiment_id = run.info.experiment_id
        self._params = dict(run.data.params)
        self._step = state.get("step")
        self._send(self._client.update_run, self._mlflow_id, status="RUNNING")

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id (None until the run is created)."""
        return self._mlflow_id

    @property
    def run_url(self) -> str | None:
        """The run's page on a tracking server, or its artifacts' URI for other stores."""
        if self._mlflow_id is None:
            return None
        uri = self._client.tracking_uri
        if uri.startswith(("http://", "https://")):
            return f"{uri.rstrip('/')}/#/experiments/{self._experiment_id}/runs/{self._mlflow_id}"
        return self._client.get_run(self._mlflow_id).info.artifact_uri

    def info(self) -> dict[str, Any]:
        return {
            "type": "MLflowLogger",
            "tracking_uri": self._client.tracking_uri,
            "experiment": self.experiment,
            "run_id": self._mlflow_id,
        }
