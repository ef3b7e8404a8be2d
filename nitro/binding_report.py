"""The binding report: where every value of a run came from.

Splits and their batch geometry, which batch fields each hook receives, every run keyword with
its source (a `Nitro(...)` keyword, a method or field of the experiment, or the framework
default), the schedules, the optimizer's hyperparameters and the Device fields.
"""

from __future__ import annotations

import dataclasses
from html import escape
from typing import Any

import numpy as np

from .run_setup import RunSetup

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


def binding_report(
    setup: RunSetup, step: int, run_dir: str | None = None, run_id: str | None = None
) -> BindingReport:
    """Where every value came from: splits, hook fields, run keywords, schedules, optimizer,
    Device fields."""
    experiment = setup.experiment
    sections = []
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
        detail.append(f"prefetch {info.prefetcher.describe()}")
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
    lines.append(f"steps per dispatch: {setup.dispatch.describe()}")
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

    lines = []
    optimizer = setup.optimizer
    if optimizer is None:
        lines.append("none (no 'train' split)")
    else:
        scheduled = {s.name: s.fn for s in setup.schedules if s.target == "opt"}
        lines.append(f"{optimizer.description}  [{setup.keywords['optimizer'].source}]")
        for name, value in setup.feed.hyperparams_now().items():
            if name in scheduled:
                value = float(np.asarray(scheduled[name](step)))
                lines.append(f"{name} = {value:g} at step {step} (scheduled, fed per step)")
            else:
                lines.append(f"{name} = {value:g} (constant, fed per step)")
        if not optimizer.hyperparams:
            lines.append("hyperparameters baked into the program (not injected: unschedulable)")
    lines.append(f"parameters: {setup.model.param_count:,}")
    sections.append(("optimizer", lines))

    lines = [
        f"{name}: {type(getattr(experiment.instance, name)).__name__} = "
        f"{_fmt(setup.feed.device_value(name))}"
        for name in experiment.device_specs
    ] or ["none"]
    sections.append(("Device fields", lines))
    return BindingReport(sections)
