"""What the agent tools do, on the runs of one session.

A run is a `nitro.Nitro` handle or a `nitro.Population` (a run of many members, trained by
one program): the tools read, train on, stop, validate and evaluate either through one code
path, and only what a population alone has (its members: creating them, pruning one, taking
one as a run) is its own. A `ToolSession` acts on

- runs the tools started, kept in a `RunRegistry` under 8-hex-digit run ids;
- handles and populations bound to names in the session's namespace, such as the runs a person
  started in the notebook; their run id is the variable name.

Either is also found by its own id (`n.run_id`, the run directory's name); see `describe` for
why the tools keep ids of their own.

Each method takes the tool's arguments and returns plain data (the tool's JSON answer), or
raises `ToolFailure` with a message for the agent. Only the handle's public API is used.

>>> session = ToolSession()
>>> run = session.train(experiment="nitro.examples.digits.Digits", max_epochs=1)
>>> run["status"]                                   # it trains on a background thread
'running'
>>> _ = session.registry.wait(run["run_id"], timeout=120)
>>> status = session.status(run["run_id"])
>>> status["status"], status["epoch"], status["step"]
('done', 1, 9)
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from nitro._version import __version__
from nitro.engine.member_axis import shown_settings
from nitro.engine.search import split_search
from nitro.errors import PopulationError
from nitro.experiments.declaration import field_specs, has_method
from nitro.handle.handle import Nitro
from nitro.handle.population import Population
from nitro.mcp.convert import (
    OUTPUT_FILES,
    PREVIEW_ELEMENTS,
    as_batch,
    first_rows,
    jsonable,
    output_elements,
    output_suffix,
    save_outputs,
    shapes,
)
from nitro.mcp.describe import describe, latest_steps
from nitro.mcp.json_keywords import check_run_keywords, checkpoint_pair
from nitro.mcp.lookup import ToolFailure, build_experiment, find_experiment
from nitro.mcp.members import (
    check_member,
    member_files,
    population_failure,
    varied_by,
)
from nitro.mcp.paths import PathPolicy
from nitro.mcp.registry import RUNS, RunRecord, RunRegistry, RunStatus
from nitro.mcp.rewinds import fork as fork_run
from nitro.mcp.rewinds import rewind as rewind_run
from nitro.mcp.search_json import search_from_json

__all__ = ["ToolSession"]


def _input_dtypes(handle: Nitro) -> dict[str, str]:
    """Field -> the dtype the model's batches give it (the evaluation splits' first)."""
    specs = handle.batch_specs
    dtypes: dict[str, str] = {}
    for split in ("val", "test", "train", *specs):
        for field, (_, dtype) in specs.get(split, {}).items():
            dtypes.setdefault(field, dtype)
    return dtypes


Run = Nitro | Population


def _noun(run: Run | None, record: RunRecord | None = None) -> str:
    population = isinstance(run, Population) or (record is not None and record.kind == "population")
    return "population" if population else "run"


def _summary(run: Run) -> dict[str, Any]:
    summary = {"epoch": run.epoch, "step": run.step, "stop_reason": run.stop_reason}
    if isinstance(run, Population):
        summary["stopped"] = sorted(run.stopped)
    return summary


def _table(value: Any) -> Any:
    """A population's answer (a DataFrame, one row per member) as a list of rows."""
    if hasattr(value, "reset_index"):
        return value.reset_index().to_dict("records")
    return value


def _training(
    build: Callable[[RunRecord], Run], epochs: int | None, steps: int | None
) -> Callable[[RunRecord], dict[str, Any]]:
    """The work of a training run (a population's too): get the run, train it, wait for the
    end."""

    def work(record: RunRecord) -> dict[str, Any]:
        run = build(record)
        latest_steps(run, create=True)
        if not record.stop_requested:
            run.train(epochs, steps=steps, background=True)
            if record.stop_requested:  # asked while the run was starting
                run.stop()
            run.wait()
        return _summary(run)

    return work


def _check_amount(epochs: int | None, steps: int | None) -> None:
    if epochs is not None and steps is not None:
        raise ToolFailure(
            f"steps: give epochs (whole epochs more) or steps (steps more), not both; got "
            f"epochs={epochs}, steps={steps}"
        )


@dataclasses.dataclass
class _Found:
    run_id: str
    record: RunRecord | None
    handle: Run | None  # None while a tool run sets it up


@dataclasses.dataclass
class _Ready:
    """A run found and set up: its handle is there."""

    run_id: str
    record: RunRecord | None
    handle: Run


class ToolSession:
    """The runs and experiments the tools see.

    `namespace` is where experiment names and notebook handles are looked up (a kernel's user
    namespace; empty for a server started from a shell). `before_run` runs first on the thread
    of every run a tool starts (a notebook uses it to keep the run's output out of its cells).
    Paths the tools take stay inside `root` (default: the working directory) or one of the
    `allow`ed directories (`paths.PathPolicy`).
    """

    def __init__(
        self,
        registry: RunRegistry | None = None,
        namespace: Mapping[str, Any] | None = None,
        before_run: Callable[[], None] | None = None,
        root: str | os.PathLike | None = None,
        allow: Iterable[str | os.PathLike] = (),
    ):
        self.registry = registry if registry is not None else RUNS
        self.namespace = namespace if namespace is not None else {}
        self.before_run = before_run
        self.paths = PathPolicy(root, allow)
        self.n_devs: int | None = None  # the default `nitro_setup` set for new runs

    # ------------------------------------------------------------------------------------------
    # finding runs

    def _notebook_runs(self) -> dict[str, Run]:
        """Name -> run (a handle or a population) in the namespace that no tool run holds."""
        held = {id(r.handle) for r in self.registry.records() if r.handle is not None}
        found: dict[str, Run] = {}
        for name, value in list(self.namespace.items()):
            if name.startswith("_") or not isinstance(value, Run) or id(value) in held:
                continue
            if all(other is not value for other in found.values()):
                found[name] = value
        return found

    def _lookup(self, run_id: str) -> _Found | None:
        """A tool run by its id, a notebook handle or population by its name, or a run by
        its own run id (`n.run_id`; the newest training run holding it)."""
        record = self.registry.get(run_id)
        if record is not None:
            return _Found(run_id, record, record.handle)
        value = self.namespace.get(run_id)
        if isinstance(value, Run):
            return _Found(run_id, None, value)
        records = [r for r in self.registry.records() if r.handle and r.handle.run_id == run_id]
        if records:
            training = [r for r in records if r.kind in ("train", "population")]
            record = (training or records)[-1]
            return _Found(record.run_id, record, record.handle)
        for name, handle in self._notebook_runs().items():
            if handle.run_id == run_id:
                return _Found(name, None, handle)
        return None

    def _find(self, run_id: str) -> _Found:
        found = self._lookup(run_id)
        if found is not None:
            return found
        known = [r.run_id for r in self.registry.records()]
        known += list(self._notebook_runs())
        listing = f"runs: {', '.join(known)}" if known else "there are no runs yet"
        raise ToolFailure(f"run_id: no run {run_id!r}; {listing} (nitro_runs lists them)")

    def _handle(
        self, run_id: str, what: str, idle: bool = True, population: bool = False
    ) -> _Ready:
        """The run `run_id`, set up (and, with `idle`, not training); a population only
        where the tool works on one (`population`)."""
        found = self._find(run_id)
        run, record = found.handle, found.record
        if isinstance(run, Population) and not population:
            raise ToolFailure(
                f"run_id: run {run_id} is a population of {len(run)} members, not a single "
                f"run; to {what}, take one member as a run with nitro_member (the best, or "
                f"member=i)"
            )
        if run is None:
            if _noun(run, record) == "population":
                raise ToolFailure(
                    f"run_id: population {run_id} is still setting up its members; {what} "
                    f"once nitro_status shows them"
                )
            raise ToolFailure(
                f"run_id: run {run_id} is still setting up; {what} once nitro_status shows "
                f"phase 'training' or later"
            )
        if idle and run.running:
            raise ToolFailure(
                f"run_id: {_noun(run)} {run_id} is {run.phase} (epoch {run.epoch}/"
                f"{run.max_epochs}, step {run.step}); {what} after it finishes, or nitro_stop "
                f"it first"
            )
        return _Ready(found.run_id, record, run)

    def _describe(self, found: _Found, brief: bool = False) -> dict[str, Any]:
        names = [] if found.handle is None else self._names(found.handle)
        return describe(found.run_id, found.record, found.handle, names, brief)

    def _names(self, handle: Any) -> list[str]:
        return [k for k, v in list(self.namespace.items()) if v is handle and not k.startswith("_")]

    # ------------------------------------------------------------------------------------------
    # the tools

    def setup(self, backend: str | None = None, n_devs: int | None = None) -> dict[str, Any]:
        import jax

        current = jax.default_backend()
        if backend is not None and backend != current:
            raise ToolFailure(
                f"backend: JAX chose the {current!r} backend when it started and cannot switch "
                f"in a running session; start the session with JAX_PLATFORMS={backend} instead"
            )
        count = jax.device_count()
        if n_devs is not None:
            if n_devs > count:
                raise ToolFailure(
                    f"n_devs: {n_devs} devices asked for, but this session has {count} "
                    f"({current}); use n_devs between 1 and {count}"
                )
            self.n_devs = n_devs
        devices = jax.devices()
        return {
            "backend": current,
            "device_count": count,
            "local_device_count": jax.local_device_count(),
            "process_count": jax.process_count(),
            "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in devices[:16]],
            "n_devs": self.n_devs if self.n_devs is not None else count,
            "n_devs_source": "nitro_setup" if self.n_devs is not None else "all devices (default)",
            "jax_version": jax.__version__,
            "nitro_version": __version__,
        }

    def _new_handle_plan(
        self,
        experiment: str | None,
        overrides: Mapping[str, Any] | None,
        keywords: Mapping[str, Any] | None,
        typed: Mapping[str, Any],
        preset: str | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """The experiment instance (from `preset` of its class, when given) and checked run
        keywords for a new handle, refusing anything wrong before a thread starts."""
        if experiment is None:
            raise ToolFailure(
                "experiment: required: an experiment class name ('Digits' in a notebook) or a "
                "module-qualified one ('nitro.examples.digits.Digits'); or run_id for a run "
                "that exists"
            )
        for name in overrides or {}:
            if name in (keywords or {}) or typed.get(name) is not None:
                raise ToolFailure(
                    f"overrides.{name}: {name!r} is given both as a field override and as the run "
                    f"keyword {name}; give it once"
                )
        target = find_experiment(experiment, self.namespace)
        checked = self._run_keywords(keywords, typed)
        instance = build_experiment(target, overrides, preset)
        cls = type(instance)
        declares = has_method(cls, "n_devs") or any(s.name == "n_devs" for s in field_specs(cls))
        if self.n_devs is not None and "n_devs" not in checked and not declares:
            checked["n_devs"] = self.n_devs
        return instance, checked

    def _run_keywords(
        self, keywords: Mapping[str, Any] | None, typed: Mapping[str, Any]
    ) -> dict[str, Any]:
        """`keywords` and the run keywords given as arguments of their own (`typed`), checked:
        their JSON forms turned into the engine's values, paths inside the root, `weights`
        resolved."""
        typed = {k: v for k, v in typed.items() if v is not None}
        extra = dict(keywords or {})
        for name in typed:
            if name in extra:
                raise ToolFailure(
                    f"{name}: given both as the {name} argument and in keywords; give it once"
                )
        run_keywords = {**extra, **typed}
        where = {name: name for name in typed}
        weights = run_keywords.pop("weights", None)
        checked = check_run_keywords(run_keywords, where)
        self._confine_run_paths(checked, where)
        if weights is not None:
            checked["weights"] = self._weights(weights, where.get("weights", "keywords.weights"))
        return checked

    def _confine_run_paths(self, checked: dict[str, Any], where: Mapping[str, str]) -> None:
        """`run_dir` and `resume` resolved inside the root; without `run_dir`, the default
        `runs/` of the working directory must be inside too."""
        run_dir = checked.get("run_dir")
        if run_dir is not None:
            checked["run_dir"] = str(
                self.paths.check(where.get("run_dir", "keywords.run_dir"), run_dir)
            )
        else:
            default = Path("runs").resolve()
            if not self.paths.inside(default):
                raise ToolFailure(
                    self.paths.refusal("run_dir", "runs (the default)", default)
                    + "; or give run_dir inside the root"
                )
        resume = checked.get("resume")
        argument = where.get("resume", "keywords.resume")
        if isinstance(resume, tuple):
            checked["resume"] = (str(self.paths.check(argument, resume[0])), resume[1])
        elif isinstance(resume, str) and resume != "auto":
            checked["resume"] = str(self.paths.check(argument, resume))

    def _weights(self, value: Any, where: str) -> Any:
        """`weights`: a run's handle by its run id, a run directory or checkpoint path, or
        (run_dir, "best" | "latest")."""
        value = checkpoint_pair(where, value)
        if isinstance(value, tuple):
            return (str(self.paths.check(where, value[0])), value[1])
        if not isinstance(value, str):
            raise ToolFailure(
                f'{where}: give a run id, a run directory or checkpoint path, or [run_dir, "best"]; '
                f"got {value!r}"
            )
        if self._lookup(value) is not None:  # a handle copies its weights even while training
            return self._handle(value, "start from its weights", idle=False).handle
        path = self.paths.check(where, value)
        if path.exists():
            return str(path)
        raise ToolFailure(
            f"{where}: no run {value!r} (nitro_runs lists them) and no run directory or "
            f"checkpoint at {str(path)!r}"
        )

    def _build(self, record: RunRecord, instance: Any, keywords: dict[str, Any]) -> Nitro:
        handle = Nitro(instance, **keywords)
        record.handle = handle
        return handle

    def train(
        self,
        experiment: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        epochs: int | None = None,
        steps: int | None = None,
        run_id: str | None = None,
        keywords: Mapping[str, Any] | None = None,
        preset: str | None = None,
        **typed: Any,
    ) -> dict[str, Any]:
        _check_amount(epochs, steps)
        if run_id is not None:
            others = {
                "experiment": experiment,
                "overrides": overrides,
                "keywords": keywords,
                "preset": preset,
            }
            self._continues(run_id, {**others, **typed})
            return self._continue(run_id, epochs, steps)
        instance, checked = self._new_handle_plan(experiment, overrides, keywords, typed, preset)
        record = self.registry.start(
            "train",
            _training(lambda record: self._build(record, instance, checked), epochs, steps),
            experiment=type(instance).__qualname__,
            before=self.before_run,
        )
        return {
            "run_id": record.run_id,
            "status": "running",
            "experiment": record.experiment,
            "note": "training on a background thread; poll nitro_status with this run_id (it "
            "shows handle_run_id and run_dir once the run is set up)",
        }

    def _continues(self, run_id: str, others: Mapping[str, Any]) -> None:
        """Refuse what a new run would take beside `run_id`, which continues a run as it is."""
        given = [name for name, value in others.items() if value is not None]
        if given:
            noun = _noun(None, self.registry.get(run_id))
            if isinstance(self.namespace.get(run_id), Population):
                noun = "population"
            raise ToolFailure(
                f"{given[0]}: run_id continues {noun} {run_id} as it is; leave out "
                f"{', '.join(given)}, or start a new {noun} from experiment instead"
            )

    def _continue(self, run_id: str, epochs: int | None, steps: int | None) -> dict[str, Any]:
        """Train run `run_id` (a population too) on: `epochs` or `steps` more, or to its
        max_epochs; under a new run id whose `source` is `run_id`."""
        found = self._handle(run_id, "train it on", population=True)
        run = found.handle
        noun = _noun(run)
        if epochs is None and steps is None and run.epoch >= run.max_epochs:
            raise ToolFailure(
                f"epochs: {noun} {run_id} already trained its {run.epoch} epochs "
                f"(max_epochs={run.max_epochs}); pass epochs=N (or steps=N) to train N more"
            )
        if isinstance(run, Population) and len(run.stopped) == len(run):
            raise ToolFailure(
                f"run_id: every member of population {run_id} has stopped; nitro_member takes "
                f"one as a run that trains on"
            )
        record = self.registry.start(
            "population" if noun == "population" else "train",
            _training(lambda record: run, epochs, steps),
            experiment=run.cls.__qualname__,
            handle=run,
            source=found.run_id,
            before=self.before_run,
        )
        row = self._describe(self._find(record.run_id), brief=True)
        row["run_dir"] = run.run_dir
        row["note"] = f"continues {noun} {found.run_id} on a background thread; poll nitro_status"
        return row

    def _job(
        self,
        kind: str,
        action: Callable[[Any], Any],
        run_id: str | None,
        new_handle: Mapping[str, Any],
        wait_seconds: float,
        population: bool = False,
    ) -> dict[str, Any]:
        """Run `action(handle)` on a thread, on the run `run_id` (a population too, where
        `population`) or on a new handle (`new_handle`: experiment, overrides, keywords,
        weights); answer its result if it finishes within `wait_seconds`."""
        if run_id is not None:
            given = [name for name, value in new_handle.items() if value is not None]
            if given:
                raise ToolFailure(
                    f"run_id: give either run_id (an existing run) or experiment (a new handle, "
                    f"with {', '.join(new_handle)}), not both; {', '.join(given)} given too"
                )
            found = self._handle(run_id, kind, population=population)
            handle = found.handle
            record = self.registry.start(
                kind,
                lambda record: jsonable(_table(action(handle))),
                experiment=handle.cls.__qualname__,
                handle=handle,
                source=found.run_id,
                before=self.before_run,
            )
        else:
            fields = dict(new_handle)
            preset = fields.pop("preset", None)
            instance, checked = self._new_handle_plan(
                fields.pop("experiment"),
                fields.pop("overrides"),
                fields.pop("keywords"),
                fields,
                preset,
            )

            def work(record: RunRecord) -> Any:
                return jsonable(action(self._build(record, instance, checked)))

            record = self.registry.start(
                kind, work, experiment=type(instance).__qualname__, before=self.before_run
            )
        return self._answer(kind, record, wait_seconds)

    def _answer(self, kind: str, record: RunRecord, wait_seconds: float) -> dict[str, Any]:
        """A tool run's result once it finishes within `wait_seconds`, else its run id."""
        self.registry.wait(record.run_id, wait_seconds)
        if record.status is RunStatus.FAILED:
            raise ToolFailure(f"{kind} (run {record.run_id}) failed: {record.error}")
        if record.status is RunStatus.RUNNING:
            return {
                "run_id": record.run_id,
                "status": "running",
                "note": f"still running after {wait_seconds:g} s; nitro_status with this run_id "
                f"shows the result when it finishes",
            }
        return {"run_id": record.run_id, "status": record.status.value, "result": record.result}

    def validate(
        self,
        run_id: str | None = None,
        wait_seconds: float = 60.0,
        **new_handle: Any,
    ) -> dict[str, Any]:
        return self._job(
            "validate", lambda h: h.validate(), run_id, new_handle, wait_seconds, population=True
        )

    def evaluate(
        self,
        split: str = "test",
        run_id: str | None = None,
        wait_seconds: float = 60.0,
        **new_handle: Any,
    ) -> dict[str, Any]:
        if run_id is not None:
            run = self._handle(run_id, "evaluate", population=True).handle
            splits = run.splits if isinstance(run, Nitro) else None
            if splits is not None and split not in splits:
                raise ToolFailure(
                    f"split: run {run_id} has no split {split!r}; its splits: "
                    f"{', '.join(splits) or 'none'}"
                )
        return self._job(
            "evaluate",
            lambda h: h.evaluate(split=split),
            run_id,
            new_handle,
            wait_seconds,
            population=True,
        )

    def predict(
        self, run_id: str, inputs: Mapping[str, Any], out: str | None = None
    ) -> dict[str, Any]:
        handle = self._handle(run_id, "predict").handle
        assert isinstance(handle, Nitro)  # a population is refused above
        path = None if out is None else self.paths.check("out", out)
        if path is not None and path.suffix not in OUTPUT_FILES:
            raise ToolFailure(
                f"out: {out!r} has no known suffix; end it with {', '.join(OUTPUT_FILES)}"
            )
        batch = as_batch(inputs, _input_dtypes(handle))
        try:
            outputs = handle.predict(batch)
        except (TypeError, ValueError, KeyError) as error:
            raise ToolFailure(f"inputs: {error}") from None
        rows = next(iter(batch.values())).shape[0]
        answer = {"run_id": run_id, "rows": rows, "shapes": shapes(outputs)}
        elements = output_elements(outputs)
        if path is None and elements <= PREVIEW_ELEMENTS:
            return {**answer, "outputs": jsonable(outputs)}
        if path is None:
            name = f"{run_id}-{secrets.token_hex(4)}{output_suffix(outputs)}"
            path = self.paths.root / "predictions" / name
        save_outputs(path, outputs)
        shown = rows if elements <= PREVIEW_ELEMENTS else PREVIEW_ELEMENTS * rows // elements
        return {
            **answer,
            "outputs": jsonable(first_rows(outputs, shown)),
            "preview_rows": shown,
            "file": str(path),
            "note": f"outputs shows the first {shown} of {rows} rows; {path.name} holds them "
            f"all (numpy.load reads .npy and .npz)",
        }

    def render(
        self,
        run_id: str,
        view: str = "samples",
        split: str | None = None,
        k: int = 9,
        samples: int = 16,
        member: int | None = None,
    ) -> dict[str, Any]:
        """A run's samples as PNG images (`images`, for the protocol's image content) and
        their rows: its predictions (`n.render`), its data alone (`n.show_batch`), its
        highest losses (`n.top_losses`) or its confusion matrix (`n.confusion`)."""
        run = self._handle(run_id, "render", idle=view != "data", population=True).handle
        split = split or ("train" if view == "data" else "val")
        if split not in run.splits:
            raise ToolFailure(
                f"split: run {run_id} has no split {split!r}; its splits: "
                f"{', '.join(run.splits) or 'none'}"
            )
        if view == "confusion":
            found = run.confusion(split, member=member)
            results = found if isinstance(found, list) else [found]
            return {
                "run_id": run_id,
                "view": view,
                "split": split,
                "accuracy": [one.accuracy for one in results],
                "matrix": [one.matrix.tolist() for one in results],
                "per_class": [
                    one.per_class().round(4).reset_index().to_dict("records") for one in results
                ],
                "images": [_png(one.figure) for one in results],
            }
        if view == "data":
            found = run.show_batch(split, samples=samples)
        elif view == "top_losses":
            found = run.top_losses(k, split, member=member)
        else:
            found = run.render(split, samples=samples, member=member)
        galleries = found if isinstance(found, list) else [found]
        return {
            "run_id": run_id,
            "view": view,
            "split": split,
            "rows": [jsonable(g.rows) for g in galleries],
            "images": [g.png() for g in galleries],
        }

    def export(
        self,
        dir: str,
        name: str | None = None,
        platforms: list[str] | None = None,
        run_id: str | None = None,
        wait_seconds: float = 300.0,
        echo: list[str] | None = None,
        batch_sizes: list[int] | None = None,
        axes: dict[str, list[str | None]] | None = None,
        **new_handle: Any,
    ) -> dict[str, Any]:
        from nitro.serving.export import ExportError, check_axes, check_batch_sizes

        directory = self.paths.check("dir", dir)
        try:  # their form, before a handle is found or built (their fit: the export's)
            sizes = check_batch_sizes(batch_sizes) or None
            named = check_axes(axes) or None
        except ExportError as error:
            raise ToolFailure(str(error)) from None
        kept = tuple(echo or ())

        def action(handle: Nitro) -> dict[str, Any]:
            chosen = tuple(platforms) if platforms else None
            manifest = handle.export(
                str(directory), name, platforms=chosen, echo=kept, batch_sizes=sizes, axes=named
            )
            return {"directory": str(directory), "manifest": manifest}

        if run_id is None and new_handle.get("experiment") is None:
            raise ToolFailure(
                "run_id: give the run to export (run_id), or an experiment to build with "
                "weights (a checkpoint path, a run directory or a run id)"
            )
        return self._job("export", action, run_id, new_handle, wait_seconds)

    def runs(self) -> dict[str, Any]:
        rows = [
            self._describe(_Found(r.run_id, r, r.handle), brief=True)
            for r in self.registry.records()
        ]
        rows += [
            self._describe(_Found(name, None, run), brief=True)
            for name, run in self._notebook_runs().items()
        ]
        return {"runs": rows, "kept_finished": self.registry.max_finished}

    def status(self, run_id: str, history: bool = False) -> dict[str, Any]:
        found = self._find(run_id)
        row = self._describe(found)
        if history and found.handle is not None:
            row["history"] = jsonable(_table(found.handle.history()))
        return row

    def logger(self, run_id: str) -> dict[str, Any]:
        found = self._handle(run_id, "read its logger", idle=False, population=True)
        handle = found.handle
        answer = {"run_id": found.run_id, "handle_run_id": handle.run_id, "run_dir": handle.run_dir}
        if isinstance(handle, Population):
            return {**answer, **member_files(handle)}
        logger = handle.logger
        if logger is None:
            return {
                **answer,
                "logger": None,
                "info": {},
                "note": "this run logs nothing (logger=None); nitro_status shows its latest "
                "metrics and, with history=true, every epoch",
            }
        return {
            **answer,
            "logger": type(logger).__name__,
            "info": jsonable(handle.logger_info()),
            "run_url": logger.run_url,
        }

    def stop(
        self, run_id: str, wait_seconds: float = 30.0, member: int | None = None
    ) -> dict[str, Any]:
        found = self._find(run_id)
        if member is not None:
            return self._prune(found, member)
        record, handle = found.record, found.handle
        record_running = record is not None and record.status is RunStatus.RUNNING
        if record_running and record is not None:
            record.stop_requested = True
        if handle is not None and handle.running:
            handle.stop()
        elif not record_running:
            row = self._describe(found)
            noun = _noun(handle, record)
            row["note"] = f"{noun} {run_id} is not running ({row['phase']}); nothing to stop"
            return row
        deadline = time.monotonic() + wait_seconds
        while time.monotonic() < deadline:
            idle = found.handle is None or not found.handle.running
            if record.done.is_set() if record is not None else idle:
                break
            time.sleep(0.05)
            found = self._find(run_id)
        row = self._describe(found)
        if row["status"] == "running":
            row["note"] = (
                f"asked to stop; still finishing after {wait_seconds:g} s (the current step or "
                f"compile); poll nitro_status"
            )
        return row

    def _prune(self, found: _Found, member: int) -> dict[str, Any]:
        """Stop one member of a population (`pop.stop(member)`); the others train on."""
        population, record = found.handle, found.record
        if population is None and record is not None and record.kind == "population":
            with record.setting_up:
                population = record.handle
                if population is None:  # still building its members: stop it once built
                    return self._queue_stop(found, record, member)
            found = self._find(found.run_id)
        if not isinstance(population, Population):
            raise ToolFailure(
                f"member: run {found.run_id} is a single run, not a population; leave member out "
                f"to stop it"
            )
        check_member(found.run_id, len(population), member)
        already = population.stopped.get(member)
        if already is None:
            population.stop(member, why=f"stopped by nitro_stop (member {member})")
        row = self._describe(found)
        if already is not None:
            row["note"] = f"member {member} had stopped already: {already}"
        elif population.running:
            row["note"] = (
                f"member {member} stops before the population's next call (its variables stay "
                f"as they are from there); the other members train on as they would have"
            )
        else:
            row["note"] = (
                f"member {member} is stopped: when the population trains on, its variables stay "
                f"as they are and the other members train as they would have"
            )
        return row

    def _queue_stop(self, found: _Found, record: RunRecord, member: int) -> dict[str, Any]:
        """Stop `member` of a population still setting up: before its first step (called
        with the record's `setting_up` lock held)."""
        check_member(found.run_id, record.members, member)
        if record.status is not RunStatus.RUNNING:  # its setup failed: nothing will train
            raise ToolFailure(
                f"run_id: population {found.run_id} did not set up ({record.error}); nothing "
                f"to stop"
            )
        record.queued_stops.append(member)
        row = self._describe(found, brief=True)
        row["note"] = (
            f"population {found.run_id} is still setting up its members; member {member} stops "
            f"before the first step (its variables stay as built) and the others train as they "
            f"would have"
        )
        return row

    # ------------------------------------------------------------------------------------------
    # populations

    def population(
        self,
        experiment: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        keywords: Mapping[str, Any] | None = None,
        weights: Any = None,
        axes: Mapping[str, list[Any]] | None = None,
        members: list[Mapping[str, Any]] | None = None,
        max_epochs: int | None = None,
        epochs: int | None = None,
        steps: int | None = None,
        run_id: str | None = None,
        wait_seconds: float = 60.0,
        preset: str | None = None,
        search: Any = None,
    ) -> dict[str, Any]:
        _check_amount(epochs, steps)
        if run_id is not None:
            others = {
                "experiment": experiment,
                "overrides": overrides,
                "preset": preset,
                "keywords": keywords,
                "weights": weights,
                "axes": axes,
                "members": members,
                "max_epochs": max_epochs,
                "search": search,
            }
            self._continues(run_id, others)
            return self._continue(run_id, epochs, steps)
        typed = {"max_epochs": max_epochs, "weights": weights}
        shared = {name: f"keywords.{name}" for name in keywords or {}}
        shared |= {name: name for name, value in typed.items() if value is not None}
        shared |= {name: f"overrides.{name}" for name in overrides or {}}
        searched = None if search is None else search_from_json(search)
        proposal = split_search(searched)[0] if searched is not None else None
        if proposal is not None:  # the members come from the search's space
            where = shared | {name: f"search.space.{name}" for name in proposal.space}
        else:
            where = shared | varied_by(axes, members, shared)
        argument = (
            "search" if proposal is not None else "members" if members is not None else "axes"
        )
        count = (
            len(proposal)
            if proposal is not None
            else len(members)
            if members is not None
            else math.prod(map(len, (axes or {}).values()))
        )
        instance, checked = self._new_handle_plan(experiment, overrides, keywords, typed, preset)
        # a list would be an axis: a shared value that is a list (eval_splits) goes as a tuple
        checked: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) and k != "logger" else v for k, v in checked.items()
        }
        ready = threading.Event()
        refused: list[PopulationError] = []

        def build(record: RunRecord) -> Population:
            try:
                population = Population(
                    instance, members=members, search=searched, **(axes or {}), **checked
                )
            except PopulationError as error:
                refused.append(error)
                raise
            finally:
                ready.set()
            with record.setting_up:  # the members nitro_stop asked for meanwhile stop first
                record.handle = population
                for member in dict.fromkeys(record.queued_stops):
                    population.stop(member, why=f"stopped by nitro_stop (member {member})")
            return population

        record = self.registry.start(
            "population",
            _training(build, epochs, steps),
            experiment=type(instance).__qualname__,
            before=self.before_run,
            members=count,
        )
        if not ready.wait(wait_seconds):
            row = self._describe(self._find(record.run_id), brief=True)
            row["note"] = (
                f"still setting up its members after {wait_seconds:g} s; poll nitro_status with "
                f"this run_id"
            )
            return row
        if refused:
            raise population_failure(refused[0], where, argument)
        if record.handle is None:  # the setup failed: a hook, the data
            self.registry.wait(record.run_id, 30)
            raise ToolFailure(f"population (run {record.run_id}) failed: {record.error}")
        row = self._describe(self._find(record.run_id), brief=True)
        row["note"] = (
            "training every member on a background thread; poll nitro_status with this run_id "
            "(history=true: every member's epochs), nitro_member takes one as a run"
        )
        return row

    def member(
        self,
        run_id: str,
        member: int | None = None,
        metric: str = "val_loss",
        mode: str | None = None,
        keywords: Mapping[str, Any] | None = None,
        max_epochs: int | None = None,
        wait_seconds: float = 60.0,
    ) -> dict[str, Any]:
        found = self._handle(run_id, "take a member", idle=False, population=True)
        population = found.handle
        if not isinstance(population, Population):
            raise ToolFailure(
                f"run_id: run {run_id} is a single run, not a population (nitro_runs marks them "
                f'"population": true); nitro_member takes a member of one'
            )
        self._handle(run_id, "take a member", population=True)  # not while it trains
        check_member(run_id, len(population), member)
        index, value = member, None
        if index is None:
            _, ranked = population.ranking(metric, mode)
            if not ranked:
                columns = sorted({k for row in population.last_metrics for k in row})
                known = f"; history columns: {', '.join(columns)}" if columns else ""
                raise ToolFailure(
                    f"metric: no member of population {run_id} that still trains has a finite "
                    f"{metric!r} to choose by{known}; train it first, or give member=i"
                )
            index, value = ranked[0]
        if "weights" in (keywords or {}):
            raise ToolFailure(
                "keywords.weights: the run starts from the member's weights; leave weights out"
            )
        checked = self._run_keywords(keywords, {"max_epochs": max_epochs})
        settings = jsonable(shown_settings(population.members[index]))
        chosen = index

        def work(record: RunRecord) -> dict[str, Any]:
            handle = population.member(chosen, **checked)
            record.handle = handle
            return {
                "member": chosen,
                "settings": settings,
                "chosen_by": None if member is not None else {"metric": metric, "value": value},
                "weights_origin": handle.weights_origin,
            }

        record = self.registry.start(
            "member",
            work,
            experiment=population.cls.__qualname__,
            source=found.run_id,
            before=self.before_run,
        )
        answer = self._answer("member", record, wait_seconds)
        if answer["status"] == "running":
            return answer
        return {
            **answer,
            "handle_run_id": record.handle.run_id,
            "note": "a single run with the member's weights (its optimizer state and counters "
            "start fresh): nitro_validate, nitro_evaluate, nitro_predict, nitro_export and "
            "nitro_train (run_id, epochs) take this run_id",
        }

    def rewind(self, run_id: str, step: int | None = None) -> dict[str, Any]:
        return rewind_run(self, run_id, step)

    def fork(
        self,
        run_id: str,
        step: int | None = None,
        overrides: Mapping[str, Any] | None = None,
        keywords: Mapping[str, Any] | None = None,
        wait_seconds: float = 60.0,
    ) -> dict[str, Any]:
        return fork_run(self, run_id, step, overrides, keywords, wait_seconds)


def _png(figure: Any) -> bytes:
    """A matplotlib figure as PNG bytes."""
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
