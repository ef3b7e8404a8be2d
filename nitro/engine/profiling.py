"""`n.profile()`'s measurements: each call's time taken apart, and the device's peak.

`CallTimer` is what the loop marks while `n.profile()` trains (`RunTime.profiler`);
otherwise the loop marks `PASS_THROUGH`, a timer whose marks do nothing (Lightning's
`PassThroughProfiler`). Each mark ends a part of one call (the
call whose first step has global index `index`): the time since the previous mark is that
part's. The parts, in the order the loop goes through them:

- `data`: from the end of the previous call's work to this call's batches in hand (the
  stream's `next`: the wait for data, and the loop's checks between calls);
- `feed`: the step's arguments (the fed hyperparameters, Device fields, key words) and the
  dispatch of the program (Python and the runtime's launch), less a compile (`compile`);
- `device`: from the dispatch's return until the call's results are ready: the timer waits
  for them here (`jax.block_until_ready`), so the device's time is apart from the host's;
- `readback`: the copy of the call's report (its losses and the guard's verdict) to the host;
- `bookkeeping`: the call's accounting on the host: losses, train metrics, and the reporters
  (the progress bar, the live panel, loggers).

Training reads each call back one call late, so the host's work for one call overlaps the
device's work on the one before; under the timer every call is waited for before the next
is dispatched, so the parts add up to the calls' time, and steps run a little slower than
they train. The gap between streams (validation at an epoch's end, checkpoints) and within
(an evaluation `val_every_steps` asks for) is no call's.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax

__all__ = ["PARTS", "PASS_THROUGH", "CallRecord", "CallTimer", "PassThrough", "Peak", "device_peak"]

PARTS = ("data", "feed", "compile", "device", "readback", "bookkeeping")


@dataclasses.dataclass
class CallRecord:
    """One call's parts, in seconds (see the module docstring), its steps and its program."""

    index: int  # the global index (0-based) of its first step
    steps: int = 0  # 0: never dispatched (a batch staged ahead of a stop)
    program: Any = None
    first: bool = False  # the first call of its program: it compiled for it
    data: float = 0.0
    feed: float = 0.0
    compile: float = 0.0
    device: float = 0.0
    readback: float = 0.0
    bookkeeping: float = 0.0

    @property
    def host(self) -> float:
        """Host-side Python: the feed and dispatch, and the bookkeeping."""
        return self.feed + self.bookkeeping

    @property
    def total(self) -> float:
        return sum(getattr(self, part) for part in PARTS)


class CallTimer:
    """The marks of the calls of one `n.profile()`, on the loop's thread."""

    def __init__(self) -> None:
        self.records: dict[int, CallRecord] = {}
        self._mark: float | None = None  # None: between streams, nothing is timed
        self._step: Any = None  # the open StepTraceAnnotation of the call under way

    def _record(self, index: int) -> CallRecord:
        record = self.records.get(index)
        if record is None:
            record = self.records[index] = CallRecord(index)
        return record

    def start_stream(self) -> None:
        """A stream of calls begins (or resumes after an evaluation or a swap): the time
        since the last mark is no call's."""
        self._close_step()
        self._mark = time.perf_counter()

    def mark(self, part: str, index: int) -> None:
        """The `part` of the call at `index` ends now."""
        now = time.perf_counter()
        if self._mark is not None:
            record = self._record(index)
            setattr(record, part, getattr(record, part) + now - self._mark)
        self._mark = now
        if part == "data":  # the call's step in the trace: its feed, dispatch and run
            self._close_step()
            self._step = jax.profiler.StepTraceAnnotation("train", step_num=index)
            self._step.__enter__()

    def compiled(self, index: int, seconds: float) -> None:
        """The call at `index` looked up (and maybe compiled) its program, for `seconds`:
        that is its `compile`, not its feed."""
        self._record(index).compile += seconds
        if self._mark is not None:
            self._mark += seconds

    def dispatched(self, index: int, steps: int, program: Any, report: Any) -> None:
        """The call at `index` (`steps` steps of `program`) was dispatched: its feed ends;
        wait for its results (its device time)."""
        self.mark("feed", index)
        record = self.records[index]
        record.steps, record.program = steps, program
        record.first = getattr(program, "calls", 0) == 1
        jax.block_until_ready(report)
        self.mark("device", index)
        self._close_step()

    def _close_step(self) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(None, None, None)

    def close(self) -> None:
        self._close_step()
        self._mark = None

    def calls(self) -> list[CallRecord]:
        """The calls dispatched, in order."""
        return sorted((r for r in self.records.values() if r.steps), key=lambda r: r.index)


class PassThrough:
    """The call timer of a run that is not profiled: its marks do nothing."""

    __slots__ = ()

    def start_stream(self) -> None:
        pass

    def mark(self, part: str, index: int) -> None:
        pass

    def compiled(self, index: int, seconds: float) -> None:
        pass

    def dispatched(self, index: int, steps: int, program: Any, report: Any) -> None:
        pass

    def close(self) -> None:
        pass


PASS_THROUGH = PassThrough()


# ---------------------------------------------------------------------------------------------
# the device's peak


@dataclasses.dataclass(frozen=True)
class Peak:
    """A device's peak matrix throughput for a dtype, in FLOP/s, and where the figure comes
    from (a datasheet, or a matmul measured on the device)."""

    flops: float
    dtype: str
    source: str


# device kind (as jax names it; the first match wins) -> dense matmul TFLOP/s by dtype, and
# the source. float32 matmuls on these GPUs run as TF32 at JAX's default precision
# (`jax.lax.Precision.DEFAULT`), on TPUs as bfloat16 passes, so float32 reads those peaks.
_DATASHEETS: tuple[tuple[str, dict[str, float], str], ...] = (
    (
        "H100 PCIe",
        {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0},
        "NVIDIA H100 PCIe datasheet, dense (float32 as TF32)",
    ),
    (
        "H100",
        {"bfloat16": 989.0, "float16": 989.0, "float32": 495.0},
        "NVIDIA H100 SXM datasheet, dense (float32 as TF32)",
    ),
    (
        "H200",
        {"bfloat16": 989.0, "float16": 989.0, "float32": 495.0},
        "NVIDIA H200 datasheet, dense (float32 as TF32)",
    ),
    (
        "A100",
        {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
        "NVIDIA A100 datasheet, dense (float32 as TF32)",
    ),
    ("TPU v4", {"bfloat16": 275.0, "float32": 275.0}, "Google Cloud TPU v4 documentation"),
    ("TPU v5 lite", {"bfloat16": 197.0, "float32": 197.0}, "Google Cloud TPU v5e documentation"),
    ("TPU v5", {"bfloat16": 459.0, "float32": 459.0}, "Google Cloud TPU v5p documentation"),
    ("TPU v6 lite", {"bfloat16": 918.0, "float32": 918.0}, "Google Cloud TPU v6e documentation"),
)

_MEASURED: dict[tuple[str, str, int, str], Peak] = {}
_MEASURE_LOCK = threading.Lock()


def device_peak(device: Any, dtype: str = "float32") -> Peak:
    """The peak of `device` for matmuls in `dtype`: its datasheet's where Nitro knows the
    device kind, else a square matmul measured on it (the best of 5 runs, 1024 wide on a
    CPU, 4096 elsewhere), once a process."""
    kind = getattr(device, "device_kind", "") or ""
    for name, peaks, source in _DATASHEETS:
        if name in kind and dtype in peaks:
            return Peak(peaks[dtype] * 1e12, dtype, f"{source}: {kind}")
    key = (device.platform, kind, device.id, dtype)
    with _MEASURE_LOCK:
        peak = _MEASURED.get(key)
        if peak is None:
            peak = _MEASURED[key] = _measure(device, dtype)
    return peak


def _measure(device: Any, dtype: str) -> Peak:
    import jax.numpy as jnp

    width = 1024 if device.platform == "cpu" else 4096
    a = jax.device_put(jnp.ones((width, width), dtype), device)
    b = jax.device_put(jnp.full((width, width), 0.5, dtype), device)
    jax.block_until_ready(jnp.matmul(a, b))  # compiles it
    best = float("inf")
    for _ in range(5):
        begin = time.perf_counter()
        jax.block_until_ready(jnp.matmul(a, b))
        best = min(best, time.perf_counter() - begin)
    where = "CPU" if device.platform == "cpu" else getattr(device, "device_kind", "device")
    return Peak(
        2 * width**3 / best,
        dtype,
        f"measured: a {width}x{width} {dtype} matmul on this {where}, the best of 5 runs",
    )


# ---------------------------------------------------------------------------------------------
# the trace's own figures


def module_name(program: Any) -> str | None:
    """The name XLA gives `program`'s module in a trace (`jit_step`, `jit_train_steps`)."""
    try:
        return program.compiled.runtime_executable().hlo_modules()[0].name
    except Exception:  # noqa: BLE001 - a backend or a jax without it: no trace figures
        return None


def trace_executions(xplane: str) -> dict[str, list[float]]:
    """Each XLA module's executions in the trace file `xplane` (an `.xplane.pb`), in seconds,
    in the order they started: the spans of the "XLA Modules" line where the device has one
    (GPUs, TPUs), else of each run's ops (`hlo_module`, `run_id`: XLA's CPU backend)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane)
    modules: dict[str, list[tuple[float, float]]] = {}
    runs: dict[tuple[str, Any], list[float]] = {}
    for plane in data.planes:
        for line in plane.lines:
            if line.name == "XLA Modules":
                for event in line.events:
                    name = event.name.split("(", 1)[0]
                    modules.setdefault(name, []).append((event.start_ns, event.duration_ns))
                continue
            for event in line.events:
                stats = dict(event.stats)
                module, run = stats.get("hlo_module"), stats.get("run_id")
                if module is None or run is None:
                    continue
                span = runs.get((module, run))
                end = event.start_ns + event.duration_ns
                if span is None:
                    runs[(module, run)] = [event.start_ns, end]
                else:
                    span[0], span[1] = min(span[0], event.start_ns), max(span[1], end)
    if not modules:
        for (module, _), (start, end) in runs.items():
            modules.setdefault(module, []).append((start, end - start))
    return {
        name: [duration / 1e9 for _, duration in sorted(spans)] for name, spans in modules.items()
    }
