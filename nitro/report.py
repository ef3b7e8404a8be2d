"""Reports about a handle: the binding report, the stale-handle report and its displays."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from html import escape
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .fingerprint import Fingerprinter, diff_parts

if TYPE_CHECKING:  # pragma: no cover
    from .handle import Nitro

__all__ = [
    "BindingReport",
    "binding_report",
    "check_same_tree",
    "stale_changes",
    "stale_report",
]


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


def binding_report(h: Nitro) -> BindingReport:
    sections = []
    lines = []
    for split, info in h._split_info.items():
        batches = info["batches"]
        counts = (
            f"{batches:,} batches x {info['width']}"
            if batches is not None
            else (f"batches of {info['width']} (length unknown)")
        )
        detail = []
        samples = info["samples"]
        if samples is not None:
            used = samples - info["dropped"]
            detail.append(f"{used:,} of {samples:,} samples")
            if info["dropped"]:
                detail.append(f"{info['dropped']} dropped by drop_last")
            elif split != "train" and samples % info["width"]:
                detail.append(
                    f"final batch of {samples % info['width']} padded to {info['width']} then "
                    f"sliced"
                )
        prefetcher = h._prefetchers[split]
        detail.append(f"prefetch {prefetcher.describe()}")
        lines.append(f"{split}: {counts}; " + "; ".join(detail))
        lines.append(
            f"  fields {', '.join(info['fields'])}; to device: "
            f"{', '.join(info['device_fields']) or 'none'}"
        )
    sections.append(("splits", lines))

    lines = []
    for hook, spec in h._hook_fields.items():
        residency = ""
        if hook in ("metrics", "train_metrics"):
            residency = f" [{h._residency[hook]}]"
        routed = {split: fields.get(hook) for split, fields in h._fields.items()}
        where = "; ".join(
            f"{split}: {', '.join(f) if f else '(none)'}"
            for split, f in routed.items()
            if f is not None
        )
        lines.append(f"{hook}({spec.describe()}){residency} <- {where or 'no split routes it'}")
    if "metrics" not in h._hooks:
        lines.append("metrics: none; validation reports val_loss through loss")
    sections.append(("hooks receive", lines))

    lines = [
        f"{name} = {_fmt(resolved.value)}  [{resolved.source}]"
        for name, resolved in h.run.items()
        if name not in ("schedules",)
    ]
    lines.append(f"devices: {h.placement.describe()}")
    sections.append(("run keywords", lines))

    lines = []
    for schedule in h.schedules:
        lines.append(
            f"{schedule.key} -> {schedule.qualified} ({schedule.form})  "
            f"[{h.run['schedules'].source}]"
        )
    if not lines:
        lines.append(f"none  [{h.run['schedules'].source}]")
    if h.total_steps is not None:
        lines.append(f"horizon: {h.total_steps:,} optimizer steps")
    sections.append(("schedules", lines))

    lines = []
    if h.optimizer is None:
        lines.append("none (no 'train' split)")
    else:
        scheduled = {s.name: s.fn for s in h.schedules if s.target == "opt"}
        lines.append(f"{h.optimizer.description}  [{h.run['optimizer'].source}]")
        for name, value in h._feed.hyperparams_now().items():
            if name in scheduled:
                value = float(np.asarray(scheduled[name](h.step)))
                lines.append(f"{name} = {value:g} at step {h.step} (scheduled, fed per step)")
            else:
                lines.append(f"{name} = {value:g} (constant, fed per step)")
        if not h.optimizer.hyperparams:
            lines.append("hyperparameters baked into the program (not injected: unschedulable)")
    lines.append(f"parameters: {h.param_count:,}")
    sections.append(("optimizer", lines))

    lines = [
        f"{s.name}: {type(getattr(h.experiment, s.name)).__name__} = {_fmt(h.device_value(s.name))}"
        for s in h._device_specs.values()
    ] or ["none"]
    sections.append(("Device fields", lines))
    return BindingReport(sections)


# ---------------------------------------------------------------------------------------------
# staleness


def current_class(cls: type) -> type:
    """The class now bound to `cls`'s qualified name in the namespace that defined it.

    After a re-run cell or a module reload that is a new class; the namespace is found through
    the globals of the class's own functions (a module's dict survives `importlib.reload`).
    """
    namespace = None
    for attr in vars(cls).values():
        fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        if inspect.isfunction(fn):
            namespace = fn.__globals__
            break
    if namespace is None:
        module = sys.modules.get(cls.__module__)
        namespace = vars(module) if module is not None else {}
    head, *rest = cls.__qualname__.split(".")
    target = namespace.get(head)
    for part in rest:
        target = getattr(target, part, None)
    return target if isinstance(target, type) else cls


def _own_changes(frozen_parts, fp: Fingerprinter, skip: str = "") -> list[str]:
    return [
        d for d in diff_parts(frozen_parts, fp.parts) if d != skip and not d.startswith("library ")
    ]


def stale_changes(h: Nitro) -> dict[str, list[str]]:
    live = current_class(h.cls)
    changes: dict[str, list[str]] = {}
    for name, frozen in h._code.items():
        if name == "optimizer":
            continue
        if name == "model":
            fp = Fingerprinter()
            for cls in h._model_classes:
                fp._class(current_class(cls))
            diff = _own_changes(frozen.parts, fp)
            if diff:
                changes["model"] = diff
            continue
        try:
            attr = inspect.getattr_static(live, name)
        except AttributeError:
            changes[name] = ["removed"]
            continue
        fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        fp = Fingerprinter(self_class=live)
        try:
            fp.hook(name, fn)
        except Exception:  # noqa: BLE001 - an unreadable hook counts as changed
            changes[name] = []
            continue
        diff = _own_changes(frozen.parts, fp, skip=f"hook {name}")
        if diff or frozen.digest != fp.fingerprint().digest:
            changes[name] = diff
    for name in ("metrics", "train_metrics", "finalize_metrics"):
        if name not in h._hooks and hasattr(live, name):
            changes[name] = ["added"]
    return changes


def stale_report(h: Nitro) -> str | None:
    from .programs import programs_using

    changes = stale_changes(h)
    if not changes:
        return None
    what = "; ".join(
        f"{unit} ({', '.join(parts)})" if parts else unit for unit, parts in changes.items()
    )
    affected = []
    for unit in changes:
        for kind in programs_using(unit):
            if kind.value not in affected:
                affected.append(kind.value)
    held = sorted({p.title for p in h._programs.copy().values()}) or ["none yet"]
    reach = (
        f" It reaches the {', '.join(affected)} programs."
        if affected
        else (" It runs on the host: no program recompiles.")
    )
    return (
        f"{h.cls.__name__} changed since this handle was built: {what}.{reach} This handle "
        f"keeps what it froze (programs held: {', '.join(held)}); build a new handle to use "
        f"the edit, e.g. nitro.Nitro({h.cls.__name__}(...), weights=n)."
    )


# ---------------------------------------------------------------------------------------------
# trees


def _tree_summary(tree) -> dict[str, str]:
    from .compile_cache import short_dtype

    return {
        jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"): (
            f"{short_dtype(str(x.dtype))}[{','.join(map(str, np.shape(x)))}]"
        )
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def check_same_tree(what: str, expected, given) -> None:
    exp, got = _tree_summary(expected), _tree_summary(given)
    if exp == got:
        return
    lines = [
        f"  {key}: this model {exp.get(key, 'missing')}, weights {got.get(key, 'missing')}"
        for key in sorted(set(exp) | set(got))
        if exp.get(key) != got.get(key)
    ]
    more = f"\n  ... and {len(lines) - 6} more" if len(lines) > 6 else ""
    from .handle import SetupError

    raise SetupError(
        f"weights= does not fit: the {what} differ (build the model with the same GraphConst "
        f"values)\n" + "\n".join(lines[:6]) + more
    )


# ---------------------------------------------------------------------------------------------
# displays


def short_repr(h: Nitro) -> str:
    return (
        f"Nitro({h.cls.__name__}, {h.phase}, epoch {h.epoch}/{h.target_epoch}, step {h.step}, "
        f"{h.param_count:,} params)"
    )


def handle_html(h: Nitro) -> str:
    rows = [
        ("experiment", h.owner),
        ("phase", h.phase),
        ("epoch", f"{h.epoch} / {h.target_epoch}"),
        ("step", f"{h.step}"),
        *([("schedule horizon", f"{h.total_steps:,} steps")] if h.total_steps else []),
        ("stop reason", h.stop_reason or "-"),
        ("parameters", f"{h.param_count:,}"),
        ("devices", h.placement.describe()),
        ("weights", h.weights_origin),
        ("seed", h.seed),
    ]
    if h.last_metrics:
        metrics = ", ".join(
            f"{k} {v:.4g}"
            for k, v in h.last_metrics.items()
            if isinstance(v, float) and k not in ("epoch_seconds", "data_wait_frac")
        )
        rows.append(("latest", metrics))
    body = "".join(
        f"<tr><th style='text-align:left'>{escape(str(k))}</th>"
        f"<td style='text-align:left'>{escape(str(v))}</td></tr>"
        for k, v in rows
    )
    return f"<table><caption>Nitro: {escape(h.cls.__name__)}</caption>{body}</table>"
