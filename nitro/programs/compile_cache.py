"""The module-level cache of compiled programs: the only place that calls `jax.jit`.

Every handle in the process shares it. A program is looked up by its kind, the experiment
class, the fingerprint of the code it runs, its static settings, and the shapes, dtypes and
shardings of its arguments; within that, by the values of the GraphConst fields the program
actually read while it was traced (recorded by the trace view), functions among them by their
code and closure, as hooks are. Each miss is explained, each compile is announced, and
`cache_stats()` counts hits, misses and entries.

Compiles run outside the cache's lock: the first thread to miss a key registers an in-flight
future and compiles; another thread that needs the same program waits on that future instead
of compiling it again, and everything else (other lookups, `cache_stats()`) proceeds.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import functools
import reprlib
import threading
import time
import types
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax

from nitro.core import events, progress
from nitro.core.progress import format_bytes, format_flops
from nitro.experiments.fingerprint import (
    CodeFingerprint,
    callable_token,
    code_digest,
    diff_parts,
    is_function_like,
)
from nitro.programs.costs import ProgramCost, program_cost
from nitro.programs.persistent_cache import (  # noqa: F401 - compilation_cache_dir is re-exported
    compilation_cache_dir,
    configure_persistent_cache,
    set_compilation_cache,
)

__all__ = [
    "CacheStats",
    "CompileLog",
    "CompileRecord",
    "Program",
    "ProgramKind",
    "ProgramSpec",
    "cache_reset",
    "cache_stats",
    "explain_compiles",
    "record_compile",
    "set_compilation_cache",
]


class ProgramKind(enum.StrEnum):
    """What a compiled program does. Kinds key the cache and name programs in reports."""

    TRAIN_STEP = "train step"  # forward, loss, gradient and optimizer update, fused
    MULTI_STEP = "multi-step train"  # K train steps in one program (lax.scan)
    EVAL_FORWARD = "eval forward"  # forward (+ loss) on an evaluation batch
    PREDICT = "predict"  # forward alone
    DEVICE_METRICS = "device metrics"  # a metrics hook traced on device
    POPULATION_STEP = "population train step"  # the train step (or K) vmapped over members
    POPULATION_EVAL = "population eval forward"  # eval forward vmapped over members
    EXPORT = "export"  # jax.export of forward: outside the cache, listed in its compile log

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass
class ProgramSpec:
    """Everything needed to key, explain and build one program.

    `build(reads)` returns the function to trace; trace views inside it add the names of the
    GraphConst fields they read to `reads`.
    """

    kind: ProgramKind
    owner: str
    build: Callable[[set[str]], Callable]
    code: CodeFingerprint
    static: Mapping[str, Hashable]
    graphconst: Mapping[str, Any]
    arg_names: Sequence[str]
    donate_argnums: tuple[int, ...] = ()
    leaf_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # XLA options for `.compile(compiler_options=...)` (`compile_options=`); keyed in `static`
    compile_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def with_options(self, options: Mapping[str, Any]) -> ProgramSpec:
        """This spec compiled with the XLA `options` (the same spec when there are none)."""
        if not options:
            return self
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
        static = {**self.static, "compile options": shown}
        merged = {**self.compile_options, **options}
        return dataclasses.replace(self, static=static, compile_options=merged)

    @property
    def title(self) -> str:
        return self.kind.value


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    program: str
    owner: str
    seconds: float
    reason: str
    at: float
    thread: str = ""  # the thread that compiled it (a live edit compiles beside the loop)

    def __str__(self) -> str:
        return f"{self.program} [{self.owner}] {self.seconds:.2f} s: {self.reason}"


class CompileLog(list):
    """The compile records, newest last; prints as a table."""

    def __str__(self) -> str:
        if not self:
            return "no programs compiled"
        return "\n".join(str(r) for r in self)

    def _repr_html_(self) -> str:
        from html import escape

        rows = "".join(
            f"<tr><td>{escape(r.program)}</td><td>{escape(r.owner)}</td>"
            f"<td>{r.seconds:.2f} s</td><td>{escape(r.reason)}</td></tr>"
            for r in self
        )
        return (
            "<table><tr><th>program</th><th>experiment</th><th>compile</th><th>why</th></tr>"
            f"{rows}</table>"
        )

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([dataclasses.asdict(r) for r in self])


class Opaque(str):
    """A static key component that explanations report as "changed" rather than by value."""


class FunctionValue:
    """A function given as a GraphConst value, as the cache keys it: by what it does.

    A new lambda is a new object, equal to no other; keyed by its code, closure and what it
    references (as hooks are), equal code compiles once. The trace still sees the function.
    """

    __slots__ = ("function", "token")

    def __init__(self, function):
        self.function = function
        self.token = callable_token(function)

    def __eq__(self, other) -> bool:
        return isinstance(other, FunctionValue) and other.token == self.token

    def __hash__(self) -> int:
        return hash(self.token)

    def __repr__(self) -> str:
        return _callable_name(self.function)


def _callable_name(fn) -> str:
    if isinstance(fn, functools.partial):
        args = [_callable_name(fn.func), *map(reprlib.repr, fn.args)]
        args += [f"{k}={reprlib.repr(v)}" for k, v in fn.keywords.items()]
        return f"partial({', '.join(args)})"
    if isinstance(fn, types.MethodType):
        return f"{type(fn.__self__).__qualname__}.{fn.__func__.__name__}"
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def graphconst_keys(values: Mapping[str, Any]) -> dict[str, Any]:
    """GraphConst values as the cache compares them: functions by their code and closure."""
    return {k: FunctionValue(v) if is_function_like(v) else v for k, v in values.items()}


def _show_change(old: Any, new: Any) -> str:
    if isinstance(old, FunctionValue) and isinstance(new, FunctionValue):
        if repr(old) == repr(new):
            functions = old.function, new.function
            if all(isinstance(f, types.FunctionType) for f in functions):
                same_code = code_digest(functions[0]) == code_digest(functions[1])
                what = "its closure, defaults or what it calls" if same_code else "its code"
            else:
                what = "what it calls or binds"
            return f"{old!r} changed ({what})"
    return f"{old!r} -> {new!r}"


@dataclasses.dataclass
class Traced:
    """What a program's function finds out about itself while it is traced, for its compiled
    `Program`: the specs (`split_modes`) of the metrics it returns. A spec's `build` hangs one
    on the function it returns (`fn.nitro_traced`); the function fills it in as it traces."""

    metric_specs: Any = None


class Program:
    """A compiled program. Calling it runs the XLA executable and counts a cache hit."""

    __slots__ = (
        "kind",
        "title",
        "owner",
        "compiled",
        "reads",
        "code",
        "static",
        "signature",
        "graphconst",
        "compile_seconds",
        "calls",
        "metric_specs",
        "_cost",
    )

    def __init__(self, spec: ProgramSpec, compiled, reads, signature, seconds, graphconst):
        self.kind = spec.kind
        self.title = spec.title
        self.owner = spec.owner
        self.compiled = compiled
        self.reads = reads
        self.code = spec.code
        self.static = dict(spec.static)
        self.signature = signature
        self.graphconst = dict(graphconst)  # as the cache compares them (`graphconst_keys`)
        self.compile_seconds = seconds
        self.calls = 0
        self.metric_specs: Any = None  # its metrics' specs, as its trace found them
        self._cost: ProgramCost | None = None

    def cost(self) -> ProgramCost:
        """Its FLOPs, bytes and memory, read from the executable on first use and kept."""
        if self._cost is None:
            self._cost = program_cost(self.compiled, self.static, self.signature)
        return self._cost

    def __call__(self, *args):
        with _COUNT_LOCK:  # exact under threads; an uncontended lock costs ~0.1 us
            if self.calls:
                _COUNTS["hits"] += 1
            self.calls += 1
        return self.compiled(*args)

    def __repr__(self) -> str:
        return f"<Program {self.title} of {self.owner}, {self.calls} calls>"


# A call counts as a hit unless it is the first call of a program (the call it compiled for).
_COUNT_LOCK = threading.Lock()
_COUNTS = {"hits": 0, "misses": 0}


@dataclasses.dataclass
class CacheStats:
    hits: int
    misses: int
    entries: int
    programs: list[dict]
    compiles: CompileLog

    def __getitem__(self, key: str):
        return getattr(self, key)

    def keys(self):
        return ("hits", "misses", "entries", "programs", "compiles")

    def __str__(self) -> str:
        lines = [f"compile cache: {self.hits} hits, {self.misses} misses, {self.entries} entries"]
        for p in self.programs:
            reads = ", ".join(p["graphconst_read"]) or "none"
            lines.append(
                f"  {p['program']} [{p['owner']}]: {p['calls']} call{'s' * (p['calls'] != 1)}, "
                f"compiled in "
                f"{p['compile_seconds']:.2f} s, {format_flops(p['flops'])} a call, memory "
                f"{format_bytes(p['memory_bytes'])}, GraphConst read: {reads}"
            )
        if self.compiles:
            lines.append("compiles:")
            lines.extend(f"  {r}" for r in self.compiles)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from html import escape

        return f"<pre>{escape(str(self))}</pre>"


def _default_device() -> Any:
    configured = getattr(jax.config, "jax_default_device", None)
    return configured if isinstance(configured, jax.Device) else jax.local_devices()[0]


def _placement_key(sharding: Any) -> Any:
    """The sharding as the cache keys it. A host array and an array on the default device
    run the same compiled program (a host one is put there by the call), so both key as
    `None`: a feed that hands the program host batches one run and staged ones the next (its
    choice follows how long a batch takes to build) reuses the program."""
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        default = _default_device()
        if device == default and sharding.memory_kind in (None, default.default_memory().kind):
            return None
    return sharding


def _leaf_signature(path, leaf) -> tuple:
    shape = tuple(getattr(leaf, "shape", ()))
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        dtype = jax.numpy.asarray(leaf).dtype
    placed = isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and leaf.sharding is not None
    sharding = _placement_key(leaf.sharding) if placed else None
    weak = bool(getattr(leaf, "weak_type", False))
    return (jax.tree_util.keystr(path), shape, str(dtype), sharding, weak)


def argument_signature(arg_names: Sequence[str], args: Sequence[Any]) -> tuple:
    signature = []
    for name, arg in zip(arg_names, args, strict=True):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(arg)
        signature.append((name, treedef, tuple(_leaf_signature(p, x) for p, x in leaves)))
    return tuple(signature)


_SHORT_DTYPES = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "bfloat16": "bf16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "uint32": "u32",
    "bool": "bool",
}


def short_dtype(dtype: str) -> str:
    return _SHORT_DTYPES.get(dtype, dtype)


def _format_leaf(sig: tuple) -> str:
    _, shape, dtype, _, _ = sig
    return f"{short_dtype(dtype)}[{','.join(map(str, shape))}]"


def _diff_signatures(old: tuple, new: tuple, labels: Mapping[str, str]) -> list[str]:
    notes = []
    for (name, old_tree, old_leaves), (_, new_tree, new_leaves) in zip(old, new, strict=True):
        if old_tree != new_tree:
            notes.append(f"argument {name}: structure changed")
            continue
        for o, n in zip(old_leaves, new_leaves, strict=True):
            if o != n:
                where = labels.get(f"{name}{o[0]}") or (f"{name}{o[0]}" if o[0] else name)
                if o[3] != n[3] and o[1:3] == n[1:3]:
                    notes.append(f"argument {where}: sharding changed")
                else:
                    notes.append(f"argument {where}: {_format_leaf(o)} -> {_format_leaf(n)}")
    if len(notes) > 3:
        notes = notes[:3] + [f"and {len(notes) - 3} more argument changes"]
    return notes


class CompileCache:
    def __init__(self):
        self._lock = threading.RLock()  # guards the tables below; never held across a compile
        self._entries: dict[tuple, list[Program]] = {}
        self._siblings: dict[tuple, list[Program]] = {}  # (kind, owner, title) -> programs
        self._inflight: dict[tuple, concurrent.futures.Future] = {}
        self.log = CompileLog()

    def lookup(self, spec: ProgramSpec, args: Sequence[Any]) -> Program:
        signature = argument_signature(spec.arg_names, args)
        base = (
            spec.kind,
            spec.owner,
            spec.code.digest,
            tuple(sorted(spec.static.items())),
            signature,
        )
        graphconst = graphconst_keys(spec.graphconst)
        # Which GraphConst fields the program reads is known only after tracing, so an
        # in-flight compile is matched on all of the experiment's GraphConst values.
        flight = (base, tuple(sorted(graphconst.items())))
        while True:
            with self._lock:
                program = self._find(base, graphconst)
                if program is not None:
                    return program
                pending = self._inflight.get(flight)
                if pending is None:
                    pending = self._inflight[flight] = concurrent.futures.Future()
                    reason = self._explain(spec, signature, graphconst)
                    break
            try:
                pending.result()  # another thread compiles this program: use its result
            except BaseException:  # noqa: BLE001 - its compile failed: try ourselves
                pass
        try:
            program = self._compile(spec, args, signature, reason, graphconst)
        except BaseException as error:
            with self._lock:
                del self._inflight[flight]
            pending.set_exception(error)
            raise
        with self._lock:
            self._entries.setdefault(base, []).append(program)
            siblings = self._siblings.setdefault((spec.kind, spec.owner, spec.title), [])
            siblings.append(program)
            del siblings[:-8]
            del self._inflight[flight]
            self.log.append(
                CompileRecord(
                    spec.title,
                    spec.owner,
                    program.compile_seconds,
                    reason,
                    time.time(),
                    threading.current_thread().name,
                )
            )
        with _COUNT_LOCK:
            _COUNTS["misses"] += 1
        pending.set_result(program)
        return program

    def _find(self, base: tuple, graphconst: Mapping[str, Any]) -> Program | None:
        for program in self._entries.get(base, ()):
            if all(graphconst.get(k, _MISSING) == v for k, v in program.reads.items()):
                return program
        return None

    def _compile(self, spec: ProgramSpec, args, signature, reason: str, graphconst) -> Program:
        configure_persistent_cache()
        reads: set[str] = set()
        fn = spec.build(reads)
        progress.note(f"compiling {spec.title} of {spec.owner.rpartition('.')[2]} ...")
        run_events = events.current()
        previous = run_events.current_phase if run_events is not None else ""
        if run_events is not None:
            run_events.phase(f"compiling {spec.title}")
        start = time.perf_counter()
        try:
            lowered = jax.jit(fn, donate_argnums=spec.donate_argnums).lower(*args)
            compiled = lowered.compile(compiler_options=dict(spec.compile_options) or None)
        finally:
            if run_events is not None:
                run_events.phase(previous)
        seconds = time.perf_counter() - start
        progress.note(f"compiled {spec.title} in {seconds:.2f} s ({reason})", done=True)
        values = {name: graphconst[name] for name in sorted(reads) if name in graphconst}
        program = Program(spec, compiled, values, signature, seconds, graphconst)
        program.metric_specs = getattr(fn, "nitro_traced", Traced()).metric_specs
        return program

    def _explain(self, spec: ProgramSpec, signature, graphconst) -> str:
        siblings = self._siblings.get((spec.kind, spec.owner, spec.title))
        if not siblings:
            return "new program"
        # Explain against the closest earlier program: the one with the fewest differences.
        candidates = [_differences(p, spec, signature, graphconst) for p in reversed(siblings)]
        notes = min(candidates, key=lambda notes: sum(n.count(",") + 1 for n in notes))
        return "; ".join(notes) or "new variant (values of GraphConst fields it reads)"

    def reset(self) -> None:
        with self._lock:
            self._entries.clear()
            self._siblings.clear()
            self.log = CompileLog()
        with _COUNT_LOCK:
            _COUNTS["hits"] = _COUNTS["misses"] = 0

    def stats(self) -> CacheStats:
        with self._lock:
            programs = [p for entries in self._entries.values() for p in entries]
            log = CompileLog(self.log)
        with _COUNT_LOCK:
            hits, misses = _COUNTS["hits"], _COUNTS["misses"]
        costs = [p.cost() for p in programs]  # outside the lock: read once, then kept
        return CacheStats(
            hits=hits,
            misses=misses,
            entries=len(programs),
            programs=[
                {
                    "program": p.title,
                    "kind": p.kind.value,
                    "owner": p.owner,
                    "calls": p.calls,
                    "compile_seconds": p.compile_seconds,
                    "graphconst_read": sorted(p.reads),
                    **cost.as_dict(),
                }
                for p, cost in zip(programs, costs, strict=True)
            ],
            compiles=log,
        )


def _differences(previous: Program, spec: ProgramSpec, signature, graphconst) -> list[str]:
    notes = []
    changed_code = diff_parts(previous.code.parts, spec.code.parts)
    if changed_code:
        notes.append("code changed: " + ", ".join(changed_code))
    for name in sorted(previous.reads):
        old, new = previous.reads[name], graphconst.get(name, _MISSING)
        if old != new:
            notes.append(f"GraphConst {name}: {_show_change(old, new)}")
    shape_notes = _diff_signatures(previous.signature, signature, spec.leaf_labels)
    static_notes = []
    for name in sorted(set(previous.static) | set(spec.static)):
        old, new = previous.static.get(name), spec.static.get(name)
        if old != new:
            if isinstance(new, Opaque) or not isinstance(new, (bool, int, float, str, type(None))):
                static_notes.append(f"{name} changed")
            else:
                static_notes.append(f"setting {name}: {old!r} -> {new!r}")
    if shape_notes or static_notes:
        # GraphConst fields read outside the trace (by build_model) show up as new shapes
        moved = [
            f"GraphConst {k}: {_show_change(previous.graphconst[k], v)}"
            for k, v in graphconst.items()
            if k in previous.graphconst and previous.graphconst[k] != v and k not in previous.reads
        ]
        if moved:
            notes.append("; ".join(moved) + " (read by build_model)")
    return notes + static_notes + shape_notes


class _Missing:
    def __repr__(self) -> str:
        return "<unset>"


_MISSING = _Missing()

CACHE = CompileCache()


def compile_with_options(options: Mapping[str, Any]) -> None:
    """Compile a one-operation program with the XLA `options` (outside the cache): XLA
    raises for an option it does not know or a value it cannot take (`compile_options=`)."""

    def compile_options_check(x):  # its name, where an option writes files (xla_dump_to)
        return x + 1

    lowered = jax.jit(compile_options_check).lower(jax.numpy.zeros((), "float32"))
    lowered.compile(compiler_options=dict(options))


def cache_stats() -> CacheStats:
    """Hits, misses and entries of the compile cache, with per-program detail (calls, compile
    seconds, and what the executable costs: `flops` and `bytes_accessed` a call,
    `flops_per_step`, `memory_bytes` and its parts, `arguments` by what they hold; see
    `nitro.programs.costs`) and the log of compiles, each with the time it took and why it
    missed.

    A call of a compiled program counts as a hit, except the call that compiled it.
    """
    return CACHE.stats()


def cache_reset() -> None:
    """Empty the compile cache and its counters. Live handles keep the programs they hold."""
    CACHE.reset()


def explain_compiles() -> CompileLog:
    """Every compile so far: the program, its experiment, the time it took and why it missed."""
    with CACHE._lock:
        return CompileLog(CACHE.log)


def record_compile(program: str, owner: str, seconds: float, reason: str) -> CompileRecord:
    """Add work compiled outside the program cache (an export, say) to the compile log, so
    `explain_compiles()` lists it too; cache hits and misses do not change.

    >>> record = record_compile("export", "my.Experiment", 0.05, "outside the program cache")
    >>> explain_compiles()[-1] is record
    True
    """
    record = CompileRecord(program, owner, seconds, reason, time.time())
    with CACHE._lock:
        CACHE.log.append(record)
    return record
