"""`WandbLogger`: a run's metrics, config, tags and figures in a Weights & Biases run.

The W&B run starts at the first record (`wandb.init(..., reinit="create_new")`, so several
handles in one process each have their own run), with its files in the Nitro run directory
(`<run_dir>/wandb/`) unless `dir=` says otherwise, and its name the Nitro run id. Online or
offline is W&B's choice (`mode=`, or `WANDB_MODE=offline`; `wandb sync` uploads an offline
run later).

Metrics keep their names (`loss`, `epoch_loss`, `val_acc`, `data_wait_frac`) and go to
`run.log(..., step=step)` with the step W&B plots against (its own buffering: wandb's service
process writes them). The parameters are the run's config, the tags its tags (`key=value`),
the binding report and other values text files saved with the run, a confusion matrix a
`wandb.Table`, figures and images `wandb.Image`s. `finish` ends the run (exit code 1 for an
error) with the status in its summary (`nitro_status`); `state()` is the W&B run's id, and
`reattach` continues it (`resume="allow"`).

Every call to W&B (`wandb.init` included, which waits for W&B's servers when online) runs on
a thread of the logger's own (`Sender`), never the training thread; a checkpoint's `state()`
and `finish` wait for it `timeout` seconds at most. A W&B that fails or does not answer in
time makes the logger raise at its next verb, and the run's `LoggerGroup` switches it off
with one warning; the run goes on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from nitro.loggers.media import check_figure, figure_png, image_pixels
from nitro.loggers.protocol import BaseLogger, confusion_rows, plain_value
from nitro.loggers.sender import Sender

__all__ = ["WandbLogger"]


def _require_wandb():
    try:
        import wandb
    except ImportError:
        raise ImportError(
            "WandbLogger writes with wandb, which is not installed: pip install "
            "'nitro[wandb]' (or pip install wandb)"
        ) from None
    return wandb


class WandbLogger(BaseLogger):
    """Logs to a Weights & Biases run.

    `project`, `entity`, `name` (None: the Nitro run id), `tags`, `group`, `mode` ("online",
    "offline", "disabled"; None: W&B's default, `WANDB_MODE`) and `dir` (None: the Nitro run
    directory) go to `wandb.init`, with any other keyword in `init`. `timeout`: how long a
    checkpoint or the end of a run waits for W&B at most (seconds).
    """

    def __init__(
        self,
        project: str | None = None,
        *,
        entity: str | None = None,
        name: str | None = None,
        tags: Sequence[str] = (),
        group: str | None = None,
        mode: str | None = None,
        dir: str | os.PathLike | None = None,
        timeout: float = 30.0,
        **init: Any,
    ):
        _require_wandb()
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(
                f"WandbLogger(timeout=...) takes the seconds a checkpoint waits for W&B at "
                f"most, a positive number; got {timeout!r}"
            )
        if mode not in (None, "online", "offline", "disabled"):
            raise ValueError(
                f"WandbLogger(mode=...) takes 'online', 'offline', 'disabled' or None "
                f"(W&B's default, WANDB_MODE); got {mode!r}"
            )
        if isinstance(tags, str):
            raise TypeError(f"WandbLogger(tags=...) takes a list of strings; got {tags!r}")
        self.project = project
        self.options = {
            "entity": entity,
            "name": name,
            "tags": list(tags),
            "group": group,
            "mode": mode,
            **init,
        }
        self._dir = os.fspath(dir) if dir is not None else None
        self._run_dir: str | None = None
        self._run: Any = None
        self._resume_id: str | None = None
        self._wandb_id: str | None = None
        self._step: int | None = None
        self.timeout = float(timeout)
        self._sender = Sender("nitro-wandb")

    # the sender ---------------------------------------------------------------------------

    def _send(self, call) -> None:
        """`call()` on the sender's thread, after what was sent before; a failure of W&B so
        far raises here first."""
        self._check()
        self._sender.submit(call)

    def _check(self) -> None:
        failure = self._sender.failure
        if failure is None:
            return
        cause = (
            f"W&B gave {failure}"
            if isinstance(failure, TimeoutError)
            else f"W&B failed with {type(failure).__name__}: {failure}"
        )
        raise RuntimeError(
            f"{cause}. Nothing more is sent to it; check the network and the login (wandb "
            f"login), or log offline: WandbLogger(mode='offline'), which wandb sync uploads "
            f"later"
        )

    def _wait(self) -> None:
        self._sender.wait(self.timeout)
        self._check()

    def bind_run(self, run_dir: str, run_id: str | None) -> None:
        self._run_id = run_id
        self._run_dir = os.fspath(run_dir)

    def _live(self) -> Any:
        """The W&B run, started at the first record."""
        if self._run is not None:
            return self._run
        wandb = _require_wandb()
        where = self._dir or self._run_dir or "."
        os.makedirs(where, exist_ok=True)
        options = {k: v for k, v in self.options.items() if v is not None}
        if self._resume_id is not None:
            options.update(id=self._resume_id, resume="allow")
        options.setdefault("name", self._run_id)
        self._run = wandb.init(project=self.project, dir=where, reinit="create_new", **options)
        self._wandb_id = self._run.id
        return self._run

    def _at(self, step: int | None) -> dict[str, Any]:
        step = self._step if step is None else step
        return {} if step is None else {"step": int(step)}

    # the verbs ----------------------------------------------------------------------------

    def log_metrics(self, metrics, *, step, epoch, context) -> None:
        if step is not None:
            self._step = step
        values = {name: float(value) for name, value in metrics.items()}
        if epoch is not None:
            values["epoch"] = epoch
        at = self._at(step)
        self._send(lambda: self._live().log(values, **at))

    def log_params(self, params: Mapping[str, Any]) -> None:
        values = {name: plain_value(value) for name, value in params.items()}
        self._send(lambda: self._live().config.update(values, allow_val_change=True))

    def log_tags(self, tags: Mapping[str, str]) -> None:
        added = [f"{k}={v}"[:64] for k, v in tags.items()]  # W&B's limit on a tag

        def send() -> None:
            run = self._live()
            run.tags = tuple(dict.fromkeys((*run.tags, *added)))

        self._send(send)

    def log_other(self, key: str, value: Any) -> None:
        text = value if isinstance(value, str) else json.dumps(value, default=plain_value)

        def send() -> None:
            run = self._live()
            path = os.path.join(run.dir, f"{key}.txt")
            with open(path, "w", encoding="utf-8") as file:
                file.write(text)
            run.save(path, base_path=run.dir, policy="end")

        self._send(send)

    def log_confusion(self, matrix: Any, labels: Sequence[Any], *, epoch: int | None) -> None:
        wandb = _require_wandb()
        rows, names = confusion_rows(matrix, labels)
        data: list[Any] = [[n, *r] for n, r in zip(names, rows, strict=True)]
        at = self._at(None)
        self._send(
            lambda: self._live().log(
                {"confusion": wandb.Table(columns=["true", *names], data=data)}, **at
            )
        )

    def log_figure(self, name: str, figure: Any, *, step: int | None = None) -> None:
        """The figure as a `wandb.Image` under `name` at `step` (default: the latest step).
        Rendered here: the caller may close it."""
        check_figure(figure, name)
        _, pixels = figure_png(figure, name)
        self._send_image(name, pixels, self._at(step))

    def log_image(self, name: str, image: Any, *, step: int | None = None) -> None:
        """The image as a `wandb.Image` under `name` at `step` (default: the latest step)."""
        pixels = image_pixels(image, name).copy()  # the caller may reuse its array
        if pixels.shape[2] == 1:
            pixels = pixels[:, :, 0]
        self._send_image(name, pixels, self._at(step))

    def _send_image(self, name: str, pixels: Any, at: dict[str, Any]) -> None:
        wandb = _require_wandb()
        self._send(lambda: self._live().log({name: wandb.Image(pixels)}, **at))

    def finish(self, status: str) -> None:
        def send() -> None:
            run = self._live()
            run.summary["nitro_status"] = status
            run.finish(exit_code=1 if status == "error" else 0)
            self._run = None
            self._resume_id = self._wandb_id  # a later train() continues the same W&B run

        self._send(send)
        self._wait()

    # resume -------------------------------------------------------------------------------

    def state(self) -> dict[str, Any] | None:
        """The W&B run's id, project and entity, and the latest step logged; None before the
        run started."""
        self._wait()  # the run W&B is starting, if any
        if self._wandb_id is None:
            return None
        run = self._run
        return {
            "id": self._wandb_id,
            "project": run.project if run is not None else self.project,
            "entity": run.entity if run is not None else self.options.get("entity"),
            "step": self._step,
        }

    def reattach(self, state: Any) -> None:
        """Continue the W&B run that wrote `state` (`wandb.init(id=..., resume="allow")` at
        the next record). W&B drops what is logged at a step below its latest, so the steps
        the crashed run logged after its checkpoint keep their first values (the same ones,
        resume being exact)."""
        if not isinstance(state, Mapping) or "id" not in state:
            raise TypeError(
                f"WandbLogger.reattach takes the state() of a WandbLogger, a dict with 'id'; "
                f"got {state!r}"
            )

        def send() -> None:
            if self._run is not None:
                self._run.finish()
                self._run = None
            self._resume_id = self._wandb_id = str(state["id"])
            if self.project is None and state.get("project"):
                self.project = state["project"]

        self._step = state.get("step")
        self._send(send)
        self._wait()

    @property
    def run_id(self) -> str | None:
        """The W&B run's id (None until it started)."""
        return self._wandb_id

    @property
    def run_url(self) -> str | None:
        """The run's page (online), else the URI of its local directory."""
        run = self._run
        if run is None:
            return None
        url = getattr(run, "url", None)
        return url or f"file://{os.path.abspath(os.path.dirname(run.dir))}"

    def info(self) -> dict[str, Any]:
        return {
            "type": "WandbLogger",
            "project": self.project,
            "mode": self.options.get("mode"),
            "run_id": self._wandb_id,
        }
