"""`n.profile(steps=20)`: train a few steps under `jax.profiler`, and say where a call's time
went.

The steps are training steps, as `n.train(steps=20)` trains them: the weights, the optimizer
state, `n.step` and the epoch under way move on (as Lightning's profilers profile real
training). While they run, the loop marks each call's parts on a `CallTimer` and waits for
each call before the next (`nitro.engine.profiling`), and `jax.profiler` records a trace into
`<run_dir>/profile/plugins/profile/<timestamp>/`, where TensorBoard's profiler reads it
(`tensorboard --logdir <run_dir>/profile`) and Perfetto opens its `perfetto_trace.json.gz`.
The report adds what XLA says each program costs (`Program.cost()`) and the device's peak.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
import time
from html import escape
from pathlib import Path
from typing import Any, TypeAlias

import jax

from nitro.core.progress import format_bytes, format_flops
from nitro.engine.diagnostics import data_wait_advice
from nitro.engine.dispatch import DispatchChoice, DispatchPlan
from nitro.engine.profiling import (
    CallRecord,
    CallTimer,
    Peak,
    device_peak,
    module_name,
    trace_executions,
)
from nitro.errors import RunningError, SetupError
from nitro.programs.costs import ProgramCost

# the handle (a `nitro.Nitro`): this module sits beneath it, `Nitro.profile` calls it
Nitro: TypeAlias = Any

__all__ = ["ProfileReport", "ProgramProfile", "profile_handle"]

# the rows of a call's breakdown: (label, the CallRecord parts it sums)
ROWS = (
    ("waiting for data", ("data",)),
    ("host: feed and dispatch", ("feed",)),
    ("device program", ("device",)),
    ("readback", ("readback",)),
    ("host: bookkeeping and reporters", ("bookkeeping",)),
)


@dataclasses.dataclass(frozen=True)
class ProgramProfile:
    """One program the profile ran: its calls, their device time, what XLA says it costs, and
    the FLOP/s it reached against the device's peak (per device)."""

    title: str
    steps: int  # steps a call
    calls: int
    device_seconds: float  # a call's device time, the mean of its calls that did not compile
    cost: ProgramCost
    peak: Peak | None

    @property
    def achieved_flops(self) -> float | None:
        """FLOP/s while the device ran it: a call's FLOPs over its device time."""
        flops = self.cost.flops
        if flops is None or self.device_seconds <= 0:
            return None
        return flops / self.device_seconds

    @property
    def utilization(self) -> float | None:
        """The achieved FLOP/s as a share of the device's peak."""
        achieved = self.achieved_flops
        if achieved is None or self.peak is None:
            return None
        return achieved / self.peak.flops

    def lines(self) -> list[str]:
        cost = self.cost
        per = "a step" if self.steps == 1 else f"a call of {self.steps} steps"
        lines = [
            f"{self.title} ({self.calls} call{'s' * (self.calls != 1)}): "
            f"{format_flops(cost.flops)} {per}, {format_bytes(cost.bytes_accessed)} read "
            f"and written"
        ]
        memory = [f"{name} {format_bytes(size)}" for name, size in cost.arguments.items()]
        if cost.output_bytes is not None:
            memory.append(
                f"outputs {format_bytes(cost.output_bytes)} ("
                f"{format_bytes(cost.alias_bytes)} of it over donated arguments)"
            )
        if cost.temp_bytes is not None:
            memory.append(f"scratch {format_bytes(cost.temp_bytes)}")
        lines.append(f"memory {format_bytes(cost.memory_bytes)}: " + ", ".join(memory))
        achieved = self.achieved_flops
        if achieved is not None:
            said = f"{format_flops(achieved)}/s while on the device"
            if self.peak is not None and self.utilization is not None:
                said += (
                    f", {self.utilization:.1%} of the peak {format_flops(self.peak.flops)}/s "
                    f"({self.peak.source})"
                )
            lines.append(said)
        return lines


@dataclasses.dataclass(frozen=True)
class ProfileReport:
    """What `n.profile()` measured. `calls`: every call's parts (`CallRecord`, seconds);
    `part_seconds()`: a call's parts on average (the calls that compiled apart);
    `programs`: each program's cost and FLOP/s; `trace_dir`, `trace_files`: the trace;
    `wall_seconds`: the whole `profile()` (the calls, and between them validation and
    checkpoints when an epoch ended); `advice`: what to change for the part that dominates."""

    experiment: str
    steps: int
    calls: tuple[CallRecord, ...]
    programs: tuple[ProgramProfile, ...]
    wall_seconds: float
    dispatch: str
    trace_dir: str | None
    trace_files: tuple[str, ...]
    advice: str
    notes: tuple[str, ...]

    @property
    def timed_calls(self) -> tuple[CallRecord, ...]:
        """The calls the averages are taken over: those whose program did not compile for
        them (all of them when every call did)."""
        warm = tuple(c for c in self.calls if not _first_call(c))
        return warm or self.calls

    def part_seconds(self) -> dict[str, float]:
        """A call's time by part, in seconds: the mean over `timed_calls`."""
        calls = self.timed_calls
        return {
            label: statistics.fmean(sum(getattr(c, p) for p in parts) for c in calls)
            if calls
            else 0.0
            for label, parts in ROWS
        }

    def shares(self) -> dict[str, float]:
        """Each part's share of a call (of `part_seconds`), as the table shows it and the
        advice quotes it."""
        parts = self.part_seconds()
        total = sum(parts.values())
        return {label: seconds / total if total else 0.0 for label, seconds in parts.items()}

    def total_seconds(self) -> dict[str, float]:
        """Every call's parts added up, in seconds (with `compile`)."""
        totals: dict[str, float] = {
            label: float(sum(getattr(c, p) for c in self.calls for p in parts))
            for label, parts in ROWS
        }
        totals["compile"] = sum(c.compile for c in self.calls)
        return totals

    def to_frame(self):
        """One row per call: its first step, steps, program, and each part in milliseconds."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "step": c.index + 1,
                    "steps": c.steps,
                    "program": getattr(c.program, "title", ""),
                    **{
                        f"{part}_ms": getattr(c, part) * 1e3
                        for part in ("data", "feed", "compile", "device", "readback", "bookkeeping")
                    },
                }
                for c in self.calls
            ]
        ).set_index("step")

    # ------------------------------------------------------------------------------------------
    # display

    def _header(self) -> str:
        calls = len(self.calls)
        per = {c.steps for c in self.calls}
        size = ""
        if len(per) == 1:
            (steps,) = per
            size = f"{steps} step{'s' * (steps != 1)} a call"
        return (
            f"profile of {self.experiment}: {self.steps} steps in {calls} call"
            f"{'s' * (calls != 1)} ({size or self.dispatch}), {self.wall_seconds:.3f} s in all"
        )

    def _average_note(self) -> str:
        timed, first = len(self.timed_calls), len(self.calls) - len(self.timed_calls)
        compile_seconds = sum(c.compile for c in self.calls)
        said = f"a call, the mean of {timed} call{'s' * (timed != 1)}"
        if first:
            said += (
                f" (the {first} that compiled {'its' if first == 1 else 'their'} program, "
                f"{compile_seconds:.2f} s, apart)"
            )
        return said

    def __str__(self) -> str:
        parts, shares = self.part_seconds(), self.shares()
        total = sum(parts.values())
        lines = [self._header()]
        if self.trace_dir:
            lines.append(f"trace: {self.trace_dir}")
        lines.append(self._average_note() + ":")
        for label, seconds in parts.items():
            share = shares[label]
            lines.append(f"  {label:<34}{seconds * 1e3:>10.3f} ms {share:>7.1%}")
        lines.append(f"  {'a call':<34}{total * 1e3:>10.3f} ms")
        lines.append("programs:")
        for program in self.programs:
            first, *rest = program.lines()
            lines.append(f"  {first}")
            lines.extend(f"    {line}" for line in rest)
        lines.append(self.advice)
        lines.extend(self.notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        parts, shares = self.part_seconds(), self.shares()
        total = sum(parts.values())
        rows = "".join(
            f"<tr><td style='text-align:left'>{escape(label)}</td>"
            f"<td style='text-align:right'>{seconds * 1e3:.3f} ms</td>"
            f"<td style='text-align:right'>{shares[label]:.1%}</td>"
            f"<td style='text-align:left'><div style='background:#4c78a8;height:0.8em;"
            f"width:{200 * shares[label]:.0f}px'></div></td></tr>"
            for label, seconds in parts.items()
        )
        rows += (
            f"<tr><th style='text-align:left'>a call</th>"
            f"<th style='text-align:right'>{total * 1e3:.3f} ms</th><th></th><th></th></tr>"
        )
        programs = "".join(
            f"<li>{escape(first)}<br>" + "<br>".join(escape(line) for line in rest) + "</li>"
            for first, *rest in (p.lines() for p in self.programs)
        )
        trace = f"<p>trace: <code>{escape(self.trace_dir)}</code></p>" if self.trace_dir else ""
        notes = "".join(f"<p style='color:#555'>{escape(note)}</p>" for note in self.notes)
        return (
            f"<p><b>{escape(self._header())}</b></p>{trace}"
            f"<p>{escape(self._average_note())}:</p><table>{rows}</table>"
            f"<p>programs:</p><ul>{programs}</ul><p><b>{escape(self.advice)}</b></p>{notes}"
        )


def _first_call(call: CallRecord) -> bool:
    return call.first


# ---------------------------------------------------------------------------------------------
# running it


def profile_handle(
    handle: Nitro, steps: int, *, trace: bool = True, python: bool = False
) -> ProfileReport:
    """Train `steps` more steps of `handle` under the call timer (and `jax.profiler` with
    `trace`); the report. See `Nitro.profile`."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"profile(steps=...) takes a positive int, the training steps to profile (they "
            f"train the handle, as train(steps=N) does), got {steps!r}"
        )
    guard = handle._guard
    if guard.activity is not None:
        raise RunningError(guard.busy_message("profile()"))
    if "train" not in handle.setup.splits:
        raise SetupError(
            "profile() trains a few steps, and this handle has no 'train' split (splits: "
            f"{', '.join(handle.setup.splits) or 'none'})"
        )
    runtime = handle.runtime
    plan = runtime.dispatch
    notes = [
        f"These {steps} steps trained the handle, as n.train(steps={steps}) does: the weights, "
        f"the optimizer state and n.step moved on (now {{step}}).",
        "Each call was waited for before the next was dispatched, so the device's time is "
        "apart from the host's; training overlaps the host's work on one call with the "
        "device's on the call before, so it runs a little faster than this. The history's "
        "host_ms and device_ms split every epoch trained at no cost, with that overlap: "
        "their device_ms (the live panel's 'device wait') is the wait for the device that "
        "the host's work did not hide, not the device program's time.",
    ]
    timer = CallTimer()
    trace_root = Path(handle.run_dir) / "profile"
    if trace:
        _check_trace_root(trace_root)
    # jax writes the trace when it stops, after the steps trained: into a directory of our
    # own, then moved under the run directory, so nothing there can fail it and lose them
    scratch = Path(tempfile.mkdtemp(prefix="nitro-trace-")) if trace else None
    began = time.perf_counter()
    if scratch is not None:
        try:
            _start_trace(scratch, python)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    trace_failure: str | None = None
    runtime.profiler = timer
    try:
        if plan.measuring:  # "auto" still timing: the profile's waits would skew its measurement
            runtime.dispatch = DispatchPlan(
                DispatchChoice(plan.choice.setting, plan.steps or 1, "as far as auto had come")
            )
            notes.append(
                f'steps_per_dispatch="auto" had not decided yet: profiled at {plan.steps or 1} '
                f"step{'s' * ((plan.steps or 1) != 1)} a call, outside its measurement; train() "
                f"goes on deciding."
            )
        handle.train(steps=steps)
    finally:
        wall = time.perf_counter() - began
        runtime.profiler = None
        runtime.dispatch = plan
        timer.close()
        if trace:
            try:
                jax.profiler.stop_trace()  # writes the trace's files
            except Exception as error:  # noqa: BLE001 - the steps trained: keep their report
                trace_failure = f"{type(error).__name__}: {error}"
    calls = timer.calls()
    trace_dir, files = None, ()
    if scratch is not None and trace_failure is None:
        trace_dir, files, kept_at = _keep_trace(scratch, trace_root)
        if kept_at is not None:
            notes.append(
                f"The trace could not be moved under {trace_root} ({kept_at}); it is in "
                f"{trace_dir}. Make {trace_root} a writable directory for the next profile."
            )
    elif scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
        notes.append(
            f"The trace could not be written ({trace_failure}); the times below are the call "
            f"timer's."
        )
    if _apply_trace(calls, files):
        notes.append(
            "The device program's time is each call's execution as the trace records it; "
            "the rest of the time from a call's batch to its results is the host's (the "
            "feed and the dispatch)."
        )
    elif calls:
        notes.append(
            "The device program's time runs from the dispatch's return to the results: "
            "what the program ran during the dispatch counts as the host's."
        )
    if trace_dir:
        notes.append(
            f"Open the trace in TensorBoard (tensorboard --logdir {trace_root}, its Profile "
            f"tab) or in Perfetto (ui.perfetto.dev: open "
            f"{Path(trace_dir).name}/perfetto_trace.json.gz)."
        )
    notes[0] = notes[0].format(step=handle.step)
    report = ProfileReport(
        experiment=handle.cls.__name__,
        steps=sum(c.steps for c in calls),
        calls=tuple(calls),
        programs=tuple(_programs(handle, calls)),
        wall_seconds=wall,
        dispatch=handle.dispatch.describe(),
        trace_dir=trace_dir,
        trace_files=files,
        advice="",
        notes=tuple(notes),
    )
    return dataclasses.replace(report, advice=_advice(handle, report))


def _apply_trace(calls: list[CallRecord], files: tuple[str, ...]) -> bool:
    """Take each call's device time from the trace where its program's executions there
    match its calls one to one; the rest of the time from its batch to its results is its
    feed. True when every call's was taken so."""
    executions: dict[str, list[float]] = {}
    for path in files:
        if path.endswith(".xplane.pb"):
            for name, spans in trace_executions(path).items():
                executions.setdefault(name, []).extend(spans)
    groups: dict[str | None, list[CallRecord]] = {}
    for call in calls:
        groups.setdefault(module_name(call.program), []).append(call)
    taken = 0
    for name, group in groups.items():
        spans = executions.get(name, []) if name is not None else []
        if len({id(c.program) for c in group}) != 1 or len(spans) != len(group):
            continue  # two programs of one name, or executions not one per call
        for call, seconds in zip(group, spans, strict=True):
            window = call.feed + call.device
            call.device = min(seconds, window)
            call.feed = window - call.device
        taken += len(group)
    return bool(calls) and taken == len(calls)


def _check_trace_root(root: Path) -> None:
    """Refuse, before anything trains, a trace directory that cannot be created or written
    (jax would fail only at the end, after the steps trained)."""
    folder = root / "plugins" / "profile"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise type(error)(
            f"profile() writes its trace under {root}, which cannot be created or written "
            f"({error.strerror or error}: {error.filename}); make it a writable directory "
            f"(move away what is in its way, or fix its permissions), give the handle another "
            f"run_dir=, or call profile(trace=False) to time the calls without a trace. "
            f"Nothing was trained"
        ) from None


def _start_trace(root: Path, python: bool) -> None:
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python else 0  # off: it slows host-side Python
    try:
        jax.profiler.start_trace(str(root), create_perfetto_trace=True, profiler_options=options)
    except RuntimeError as error:  # one trace at a time, in a process
        raise RunningError(
            f"profile() cannot start its trace: {error} A trace begun with "
            f"jax.profiler.start_trace() is still running: jax.profiler.stop_trace() ends it; "
            f"or profile(trace=False) times the calls without a trace"
        ) from None


def _keep_trace(scratch: Path, root: Path) -> tuple[str | None, tuple[str, ...], str | None]:
    """Move the trace jax wrote under `scratch` to `root` (the same layout: jax names the
    folder by the second it began, and two profiles within a second share one): its folder,
    its files, and None; or, when the move fails, the trace left in `scratch` and why."""
    written = sorted((scratch / "plugins" / "profile").glob("*"))
    if not written:
        shutil.rmtree(scratch, ignore_errors=True)
        return None, (), None
    source = written[-1]
    target = root / "plugins" / "profile" / source.name
    names = sorted(f.name for f in source.iterdir())
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.move(str(source / name), str(target / name))
    except OSError as error:
        files = tuple(sorted(str(f) for f in source.iterdir()))
        return str(source), files, f"{type(error).__name__}: {error}"
    shutil.rmtree(scratch, ignore_errors=True)
    return str(target), tuple(str(target / name) for name in names), None


def _programs(handle: Nitro, calls: list[CallRecord]) -> list[ProgramProfile]:
    leaves = jax.tree.leaves(handle.state.variables.params)
    dtype = str(leaves[0].dtype) if leaves else "float32"
    device = handle.placement.devices[0]
    peak = device_peak(device, dtype)
    by_program: dict[int, list[CallRecord]] = {}
    for call in calls:
        by_program.setdefault(id(call.program), []).append(call)
    programs = []
    for group in by_program.values():
        program = group[0].program
        warm = [c for c in group if not _first_call(c)] or group
        programs.append(
            ProgramProfile(
                title=program.title,
                steps=group[0].steps,
                calls=len(group),
                device_seconds=statistics.fmean(c.device for c in warm),
                cost=program.cost(),
                peak=peak,
            )
        )
    return programs


def _advice(handle: Nitro, report: ProfileReport) -> str:
    """What to change for the part of a call that takes the most: the data, the host or the
    device, each the sum of its rows of the table, with the rows' shares as the table
    shows them."""
    shares = report.shares()
    groups = {
        "data": ("waiting for data",),
        "host": ("host: feed and dispatch", "host: bookkeeping and reporters"),
        "device": ("device program", "readback"),
    }
    if not any(shares.values()):
        return "Nothing was timed."
    share = {name: sum(shares[label] for label in rows) for name, rows in groups.items()}
    most = max(share, key=share.__getitem__)

    def quoted(name: str) -> str:
        rows = groups[name]
        if len(rows) == 1:
            return f"{share[name]:.1%}"
        return f"{share[name]:.1%}: " + " + ".join(f"{row} {shares[row]:.1%}" for row in rows)

    if most == "data":
        prefetcher = handle.runtime.prefetcher("train")
        return (
            f"Waiting for data takes the most of a call ({quoted('data')}): the device "
            f"idles until the next batch is built. " + data_wait_advice(handle.setup, prefetcher)
        )
    if most == "host":
        per_call = handle.dispatch.steps or 1
        return (
            f"Host-side Python takes the most of a call ({quoted('host')}): the device "
            f"finishes before the host has the next call ready. Fuse more steps a call "
            f"(steps_per_dispatch=K; now {per_call}, {handle.dispatch.reason or 'as set'}), "
            f"train larger batches (more work a call), keep train metrics on the device, "
            f"and keep reporters and loggers light."
        )
    utilization = [p.utilization for p in report.programs if p.utilization is not None]
    low = bool(utilization) and max(utilization) < 0.3
    said = (
        f"The device takes the most of a call ({quoted('device')}): the host and the data "
        f"keep up, the model's compute is what to speed up."
    )
    if low:
        said += (
            f" It reaches {max(utilization):.0%} of the device's peak: larger batches, wider "
            f"layers or lower-precision compute use the device better."
        )
    elif utilization:
        said += (
            f" It reaches {max(utilization):.0%} of the device's peak: near what the device "
            f"can do; less compute a step (a smaller model) or more devices are what is left."
        )
    return said
