"""The binding report: where every value of a run came from.

The experiment's fields (each from the preset, the field's default, or given), splits and
their batch geometry, which batch fields each hook receives, every run keyword with
its source (a `Nitro(...)` keyword, a method or field of the experiment, or the framework
default), the schedules, the optimizer's hyperparameters and the Device fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from nitro.core.run_setup import RunSetup
from nitro.engine.run_time import RunTime
from nitro.errors import ExperimentError
from nitro.experiments.presets import presets
from nitro.programs.specs import ProgramSet
from nitro.runs.checkpoint_record import setting_token

__all__ = ["BindingReport", "binding_report"]


@dataclasses.dataclass
class BindingReport:
    sections: list[tuple[str, list[str]]]

    def __str__(self) -> str:
        out = []
        for title, lines in self.sections:
            out.append(title)
            out.extend(f"  {line}" for line in lines)
        return "\n".join(out)

    def __contains__(self, text: str) -> bool:
        return text in str(self)

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><th colspan=2 style='text-align:left'>{escape(title)}</th></tr>"
            + "".join(
                f"<tr><td></td><td style='text-align:left'><code>{escape(line)}</code></td></tr>"
                for line in lines
            )
            for title, lines in self.sections
        )
        return f"<table>{body}</table>"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__qualname__", None) or type(value).__name__
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


def _paths(paths, limit: int = 6) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f", ... ({len(paths) - limit} more)" if len(paths) > limit else "")


def _sharding(setup: RunSetup, limit: int = 12) -> list[str]:
    """Each parameter's shape, spec and bytes per device, and the parameters' and optimizer
    state's bytes per device against replicated; only for a sharded layout or a mesh of more
    than one device. The largest `limit` parameters are listed, the rest counted."""
    from nitro.core.progress import format_bytes

    placement = setup.placement
    layout = placement.layout
    if layout is None or (not placement.sharded and placement.n_devs == 1):
        return []
    rows = sorted(layout.param_rows, key=lambda row: -row[2])
    width = max(len(row[0]) for row in rows[:limit]) if rows else 0
    spec_width = max(len(str(row[3])) for row in rows[:limit]) if rows else 0
    lines = [f"{placement.sharding} over mesh {dict(layout.mesh.shape)}"]
    for path, shape, per_device, spec, _ in rows[:limit]:
        shown = "x".join(map(str, shape)) or "scalar"
        lines.append(
            f"{path:<{width}}  {shown:>12}  {str(spec):<{spec_width}}  {format_bytes(per_device)}/device"
        )
    if len(rows) > limit:
        rest = sum(row[2] for row in rows[limit:])
        lines.append(f"... {len(rows) - limit} more parameters, {format_bytes(rest)}/device")
    params = sum(row[2] for row in rows)
    whole = sum(row[4] for row in rows)
    opt, opt_whole = layout.opt_bytes
    lines.append(
        f"parameters + optimizer state: {format_bytes(params + opt)}/device "
        f"(replicated: {format_bytes(whole + opt_whole)}/device)"
    )
    return lines


def _fed_line(label: str, fed: Any, value: float, feed: Any, step: int) -> str:
    """`learning_rate = 0.001 (constant, fed per step)`, or how a schedule reaches it."""
    schedule = feed.schedule_of(fed.name)
    if schedule is None:
        ratio = f"{fed.scale:g} x learning_rate, " if fed.scale != 1.0 else ""
        return f"{label} = {value:g} ({ratio}constant, fed per step)"
    if schedule == fed.name or fed.scale == 1.0:
        how = "scheduled" if schedule == fed.name else f"the {schedule} schedule"
        return f"{label} = {value:g} at step {step} ({how}, fed per step)"
    return f"{label} = {value:g} at step {step} ({fed.scale:g} x the {schedule} schedule, fed per step)"


def _decay_line(setup: RunSetup, decay_to: str, decayed, paths) -> str:
    rule = "decay_mask" if setup.keywords["decay_mask"].value is not None else "ndim > 1"
    anchor = {"zero": "zero", "init": "the initial weights", "given": "the given anchor"}
    kept = [p for p in paths if p not in set(decayed)]
    return (
        f"decoupled weight decay toward {anchor[decay_to]}: "
        f"{len(decayed)} of {len(paths)} leaves ({rule}): {_paths(decayed) or 'none'}"
        + (f"; not {_paths(kept)}" if kept else "")
    )


def _precision(setup: RunSetup, history: Sequence[Mapping[str, Any]]) -> list[str]:
    """How the step computes; under float16 the loss scale at the last committed epoch and
    the steps skipped so far."""
    precision = setup.precision
    assert precision is not None  # shown for mixed precision only
    lines = [precision.describe()]
    scaled = [row for row in history if "loss_scale" in row]
    if precision.scaled and scaled:
        skipped = sum(int(row.get("skipped_steps", 0)) for row in scaled)
        lines.append(
            f"loss scale {scaled[-1]['loss_scale']:g} at epoch {scaled[-1]['epoch']}'s end; "
            f"{skipped} step{'s' * (skipped != 1)} skipped on overflow so far"
        )
    return lines


def _fields(setup: RunSetup) -> tuple[str, list[str]]:
    """The experiment's section: its title (the class and its preset) and one line per field
    with its value at setup and where it came from."""
    experiment = setup.experiment
    preset = experiment.preset
    try:
        preset_values = presets(setup.cls).get(preset, {}) if preset is not None else {}
    except ExperimentError:  # its presets() was since edited into an error: say nothing of them
        preset_values = {}
    defaults = {}
    for f in dataclasses.fields(setup.cls):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = setting_token(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = setting_token(f.default_factory())
    lines = []
    for name, value in experiment.values.items():
        value = setting_token(value)
        if name in preset_values and setting_token(preset_values[name]) == value:
            source = f"preset {preset!r}"
        elif name in defaults and defaults[name] == value:
            source = "default"
        else:
            source = "given"
        lines.append(f"{name} = {_fmt(value)}  [{source}]")
    title = f"experiment {setup.owner}" + (f", preset {preset!r}" if preset is not None else "")
    return title, lines or ["no fields"]


def _weights(setup: RunSetup) -> list[str]:
    """Where the initial weights came from (`weights=`); for `weights=nitro.Partial`, which
    leaves came from the file and which from build_model."""
    lines = [setup.model.weights_origin]
    by_source: dict[str, list[str]] = {}
    for path, origin in (setup.model.weights_from or {}).items():
        by_source.setdefault(origin.split(": ")[0], []).append(path)
    for source, paths in by_source.items():
        lines.append(f"{source}: {len(paths)} leaves: {_paths(paths)}")
    return lines


def _remat(setup: RunSetup, programs: ProgramSet) -> list[str]:
    """What `remat=` recomputes, and each train program's scratch memory against the same
    program without it (XLA's memory analysis)."""
    from nitro.core.progress import format_bytes

    lines = [setup.remat.describe()]
    for title, scratch, without in programs.scratch_without_remat():
        if scratch is None or without is None:
            lines.append(f"{title}: XLA reports no memory analysis here")
            continue
        change = f" ({(scratch - without) / without:+.0%})" if without else ""
        lines.append(
            f"{title} scratch {format_bytes(scratch)}, without remat "
            f"{format_bytes(without)}{change}"
        )
    if len(lines) == 1:
        lines.append("its memory shows once the train step is compiled")
    return lines


def binding_report(
    setup: RunSetup,
    runtime: RunTime,
    step: int,
    run_dir: str | None = None,
    run_id: str | None = None,
    history: Sequence[Mapping[str, Any]] = (),
    programs: ProgramSet | None = None,
) -> BindingReport:
    """Where every value came from: splits, hook fields, run keywords, schedules, optimizer,
    mixed precision, Device fields (as the run-time record holds them now; `history`: the
    committed epochs, for float16's loss scale at the last one; `programs`: the handle's, for
    what `remat=` saves)."""
    experiment = setup.experiment
    feed = runtime.feed
    sections = [_fields(setup)]
    lines = []
    for split, info in setup.splits.items():
        counts = (
            f"{info.batches:,} batches x {info.width}"
            if info.batches is not None
            else f"batches of {info.width} (length unknown)"
        )
        detail = []
        if info.samples is not None:
            used = info.samples - info.dropped
            detail.append(f"{used:,} of {info.samples:,} samples")
            if info.dropped:
                detail.append(f"{info.dropped} dropped by drop_last")
            elif split != "train" and info.samples % info.width:
                detail.append(
                    f"final batch of {info.samples % info.width} padded to {info.width} then sliced"
                )
        detail.append(f"prefetch {runtime.prefetcher(split).describe()}")
        lines.append(f"{split}: {counts}; " + "; ".join(detail))
        lines.append(
            f"  fields {', '.join(info.fields)}; to device: "
            f"{', '.join(info.device_fields) or 'none'}"
        )
    sections.append(("splits", lines))

    lines = []
    for hook, spec in experiment.hook_fields.items():
        residency = ""
        if hook in ("metrics", "train_metrics"):
            residency = f" [{experiment.residency[hook]}]"
        routed = {name: info.hook_fields.get(hook) for name, info in setup.splits.items()}
        where = "; ".join(
            f"{split}: {', '.join(f) if f else '(none)'}"
            for split, f in routed.items()
            if f is not None
        )
        lines.append(f"{hook}({spec.describe()}){residency} <- {where or 'no split routes it'}")
    if "metrics" not in experiment.hooks:
        lines.append("metrics: none; validation reports val_loss through loss")
    sections.append(("hooks receive", lines))

    lines = [
        f"{name} = {_fmt(resolved.value)}  [{resolved.source}]"
        for name, resolved in setup.keywords.items()
        if name not in ("schedules",)
    ]
    if run_dir is not None:
        lines = [
            f"run_dir = {run_dir}  [{setup.keywords['run_dir'].source}]"
            if line.startswith("run_dir = ")
            else line
            for line in lines
        ]
        lines.append(f"run id: {run_id}")
    lines.append(f"devices: {setup.placement.describe()}")
    lines.append(f"steps per dispatch: {runtime.dispatch.describe()}")
    sections.append(("run keywords", lines))

    lines = []
    source = setup.keywords["schedules"].source
    for schedule in setup.schedules:
        lines.append(f"{schedule.key} -> {schedule.qualified} ({schedule.form})  [{source}]")
    if not lines:
        lines.append(f"none  [{source}]")
    if setup.total_steps is not None:
        lines.append(f"horizon: {setup.total_steps:,} optimizer steps")
    sections.append(("schedules", lines))

    if setup.model.weights_origin != "build_model":
        sections.append(("weights", _weights(setup)))

    lines = []
    optimizer = setup.optimizer
    groups = []
    if optimizer is None:
        lines.append("none (no 'train' split)")
    else:
        lines.append(f"{optimizer.description}  [{setup.keywords['optimizer'].source}]")
        values = feed.hyperparams_at(step)
        for f in optimizer.fed:
            if f.group is None:
                lines.append(_fed_line(f.name, f, values[f.name], feed, step))
        if optimizer.decay_to is not None and not optimizer.groups:
            leaves = setup.model.leaf_paths["parameter"]
            lines.append(_decay_line(setup, optimizer.decay_to, optimizer.decayed, leaves))
        if not optimizer.hyperparams:
            lines.append("hyperparameters baked into the program (not injected: unschedulable)")
        for group in optimizer.groups:
            groups.append(
                f"{group.name}: {len(group.paths)} leaves, {group.size:,} parameters: "
                f"{_paths(group.paths)}"
            )
            for f in optimizer.fed:
                if f.group == group.name:
                    groups.append("  " + _fed_line(f.key, f, values[f.name], feed, step))
            if optimizer.decay_to is not None:
                decay_line = _decay_line(setup, optimizer.decay_to, group.decayed, group.paths)
                groups.append("  " + decay_line)
    lines.append(f"parameters: {setup.model.param_count:,}")
    sections.append(("optimizer", lines))
    if groups:
        sections.append(("parameter groups  [param_group method]", groups))

    if setup.precision is not None and setup.precision.mixed:  # float32: the keyword says it
        source = setup.keywords["precision"].source
        sections.append((f"precision  [{source}]", _precision(setup, history)))

    if setup.remat is not None and programs is not None:
        sections.append((f"remat  [{setup.keywords['remat'].source}]", _remat(setup, programs)))

    sharding = _sharding(setup)
    if sharding:
        sections.append((f"sharding  [{setup.keywords['sharding'].source}]", sharding))

    lines = [
        f"{name}: {type(getattr(runtime.experiment, name)).__name__} = "
        f"{_fmt(feed.device_value(name))}"
        for name in experiment.device_specs
    ] or ["none"]
    sections.append(("Device fields", lines))
    return BindingReport(sections)
