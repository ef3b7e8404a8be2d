"""Watching for edits: the source files of live experiments, when to reload them, and the
reports of what is stale.

The modules watched are those defining an experiment the notebook holds (an experiment class,
an instance, or a handle), plus the user modules those import (their helpers). watchdog
notices a save at once; the reload itself runs on the kernel's main thread, when no cell is
running (a callback on the kernel's event loop) or else before the next cell, so a reload
never runs under a cell.

A module that a training run holds (its experiment's module, or a helper that module imports)
reloads at once when every such run takes live edits (`n.live_edits`, on by default in a
notebook): each run whose code the edit reaches compiles it beside the run and swaps it in at
its next dispatch boundary (`n.apply_edits()`); a refused, failed or rolled-back edit is said
in the run's panel and before the next cell, and the run goes on. While a run with
`live_edits=False` trains, the reload waits until it stops. A class re-defined in a cell that
a running handle trains is the same live edit.

Without IPython's `%autoreload`, Nitro reloads the module itself (`reload.py`: a file that
does not compile, or a reload that raises, leaves the module exactly as it was, and the error
is shown). With the autoreload extension loaded, Nitro lets it reload first (before each
cell) and only reports; a changed file that autoreload left alone (not covered by its mode, or
its reload failed) Nitro reloads itself, with the same guarantees. Either way, each live
handle gets one report of the programs the edit makes stale. Cells that redefine an
experiment class are reported the same way (the `post_run_cell` event)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import threading
import types
import weakref
from typing import Any

import nitro
from nitro.staleness import (
    class_is_gone,
    current_class,
    edit_generation,
    is_experiment,
    is_library_module,
)

from .edit_impact import EditImpact, edit_impact
from .reload import changed_names, code_tokens, reload_module, syntax_error
from .runs import handle_names, live_handles, live_runs

__all__ = ["CodeWatcher"]

# after a file event, how long the watcher waits for the save's other events (an editor's
# truncate, write and rename come within milliseconds) before it reads the file: short, since a
# live edit's time from save to new code training is this plus the compile
SETTLE_SECONDS = 0.03


@dataclasses.dataclass
class _Source:
    module: str
    path: str
    stamp: tuple[int, int]
    digest: str
    tokens: dict[str, str]
    snapshot: dict[str, Any]  # the module's namespace after its last good load
    failed: str | None = None
    deferred: bool = False
    deleted: bool = False  # reported as deleted; watched again if it comes back
    users: set[str] = dataclasses.field(default_factory=set)  # experiment modules using it
    gone: set[str] = dataclasses.field(default_factory=set)  # classes reported gone


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_size)


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class CodeWatcher:
    def __init__(self, shell: Any):
        self.shell = shell
        self.sources: dict[str, _Source] = {}
        self.reloads = 0
        self.history: list[str] = []  # every reload and staleness message, newest last
        self._lock = threading.RLock()
        self._pending: list[str] = []
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._generation = edit_generation()
        self._observer = None
        self._observed: set[str] = set()
        self._scheduled = False
        self._applied: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # handle -> class
        self._edits: list[_Watched] = []  # live edits whose outcome is still to say

    # ------------------------------------------------------------------------------------------
    # IPython events

    def register(self) -> None:
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self.shell.events.register("post_run_cell", self.post_run_cell)

    def unregister(self) -> None:
        for event, callback in (
            ("pre_run_cell", self.pre_run_cell),
            ("post_run_cell", self.post_run_cell),
        ):
            try:
                self.shell.events.unregister(event, callback)
            except ValueError:
                pass
        if self._observer is not None:
            self._observer.stop()
            self._observer = None

    def pre_run_cell(self, info: Any = None) -> None:
        self._show(self.check(after_autoreload=True))

    def post_run_cell(self, result: Any = None) -> None:
        self.track()
        self._run_after_autoreload()
        if edit_generation() != self._generation:
            messages = self.report_stale()
            self.history.extend(messages)
            self._show(messages)

    def _show(self, messages: list[str]) -> None:
        with self._lock:
            messages, self._pending = self._pending + messages, []
        for message in messages:
            print(f"nitro: {message}", flush=True)

    def _run_after_autoreload(self) -> None:
        """Keep our pre_run_cell last, so it sees what %autoreload reloaded before it."""
        callbacks = self.shell.events.callbacks["pre_run_cell"]
        if callbacks and callbacks[-1] != self.pre_run_cell:
            self.shell.events.unregister("pre_run_cell", self.pre_run_cell)
            self.shell.events.register("pre_run_cell", self.pre_run_cell)

    # ------------------------------------------------------------------------------------------
    # what to watch

    def track(self) -> None:
        """Watch the modules of the experiments the notebook holds, and their helpers."""
        ns = self.shell.user_ns
        classes = set()
        for value in list(ns.values()):
            if isinstance(value, (nitro.Nitro, nitro.Population)):
                classes.add(value.cls)
            elif is_experiment(value):
                classes.add(value if isinstance(value, type) else type(value))
        for handle in live_handles(ns):
            classes.add(handle.cls)
        for module_name in {cls.__module__ for cls in classes}:
            module = sys.modules.get(module_name)
            if module is None or not self._watch(module, module_name):
                continue
            for value in list(vars(module).values()):
                helper = value if isinstance(value, types.ModuleType) else None
                if helper is None and isinstance(value, (type, types.FunctionType)):
                    helper = sys.modules.get(value.__module__)
                if helper is not None and helper is not module:
                    self._watch(helper, module_name)

    def _watch(self, module: types.ModuleType, user: str) -> bool:
        """Watch `module`'s file, which the experiments of module `user` use."""
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py") or is_library_module(module.__name__):
            return False
        if module.__name__ == "__main__":
            return False
        path = os.path.realpath(path)
        with self._lock:
            if path in self.sources:
                self.sources[path].users.add(user)
                return True
            try:
                with open(path, "rb") as file:
                    data = file.read()
                stamp = _stamp(path)
            except OSError:
                return False
            self.sources[path] = _Source(
                module.__name__,
                path,
                stamp,
                _digest(data),
                code_tokens(module),
                dict(vars(module)),
                users={user, module.__name__},
            )
        self._observe(os.path.dirname(path))
        return True

    def _observe(self, directory: str) -> None:
        if directory in self._observed:
            return
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:  # polling before each cell still works
            return
        watcher = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event):
                for path in (event.src_path, getattr(event, "dest_path", "")):
                    if path and os.path.realpath(path) in watcher.sources:
                        watcher._file_saved()

        if self._observer is None:
            self._observer = Observer()
            self._observer.daemon = True
            self._observer.start()
        self._observer.schedule(Handler(), directory, recursive=False)
        self._observed.add(directory)

    def _file_saved(self) -> None:
        """On watchdog's thread: ask the kernel's main thread to check once it is idle."""
        loop = getattr(getattr(self.shell, "kernel", None), "io_loop", None)
        if loop is None:
            return  # terminal IPython: the next prompt checks
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        loop.add_callback(lambda: loop.call_later(SETTLE_SECONDS, self._check_when_idle))

    def _check_when_idle(self) -> None:
        with self._lock:
            self._scheduled = False
        messages = self.check(after_autoreload=False)
        with self._lock:
            self._pending.extend(messages)

    # ------------------------------------------------------------------------------------------
    # reloading

    def _autoreload_loaded(self) -> bool:
        loaded = getattr(getattr(self.shell, "extension_manager", None), "loaded", ())
        return "autoreload" in loaded or "IPython.extensions.autoreload" in loaded

    def check(self, after_autoreload: bool = True) -> list[str]:
        """Reload the watched modules whose source changed; return the messages to show,
        after what became of the live edits under way (so that notes keep their order)."""
        messages: list[str] = self.live_outcomes()
        reloaded: list[tuple[_Source, list[str]]] = []
        with self._lock:
            for source in list(self.sources.values()):
                try:
                    stamp = _stamp(source.path)
                except FileNotFoundError:
                    if not source.deleted:
                        source.deleted = True
                        messages.append(self._deleted(source))
                    continue
                except OSError:
                    continue
                source.deleted = False
                if stamp == source.stamp:
                    continue
                try:
                    with open(source.path, "rb") as file:
                        data = file.read()
                except OSError:
                    continue
                digest = _digest(data)
                if digest in (source.digest, source.failed):
                    source.stamp = stamp
                    continue
                module = sys.modules.get(source.module)
                if module is None:
                    del self.sources[source.path]
                    continue
                name = os.path.basename(source.path)
                error = syntax_error(data, source.path)
                if error is not None:
                    source.stamp, source.failed = stamp, digest
                    messages.append(
                        f"{name} line {error.lineno}: {error.msg}. Kept the last good code of "
                        f"{source.module} (not reloaded); fix the file and save it again."
                    )
                    running = [h for h in live_runs(self.shell.user_ns) if _holds(h, source)]
                    if running:
                        messages[-1] += " The run goes on with the code it had."
                        self._note(running, messages[-1])
                    continue
                busy = [h for h in live_runs(self.shell.user_ns) if _holds(h, source)]
                waiting = [h for h in busy if h.live_edits is False]
                if waiting:
                    if not source.deferred:
                        names = ", ".join(
                            (handle_names(self.shell.user_ns, h) or ["a run"])[0] for h in waiting
                        )
                        messages.append(
                            f"{name} changed; it reloads once {names} stops training "
                            f"(live edits are off for it; `%nitro stop` stops a run)."
                        )
                        self._note(waiting, messages[-1])
                    source.deferred = True
                    continue
                source.deferred = False
                autoreload = self._autoreload_loaded()
                if autoreload and not after_autoreload:
                    continue  # autoreload reloads it before the next cell; report then
                if not (autoreload and code_tokens(module) != source.tokens):
                    error = reload_module(
                        module, source.snapshot, self.shell.user_ns, live=bool(busy)
                    )
                    if error is not None:
                        source.stamp, source.failed = stamp, digest
                        messages.append(
                            f"reloading {source.module} raised {type(error).__name__}: {error}. "
                            f"Kept the last good code (the module is as before the edit); fix "
                            f"the file and save it again."
                        )
                        self._note(busy, messages[-1])
                        continue
                module = sys.modules[source.module]
                tokens = code_tokens(module)
                changed = changed_names(source.tokens, tokens)
                source.stamp, source.digest, source.failed = stamp, digest, None
                source.tokens, source.snapshot = tokens, dict(vars(module))
                self.reloads += 1
                reloaded.append((source, changed))
        for source, changed in reloaded:
            what = ", ".join(changed) or "nothing that runs (comments or formatting)"
            messages.append(f"reloaded {source.module}: changed {what}.")
            messages.extend(self._gone_classes(source))
        if reloaded:
            messages.extend(self.report_stale({s.module for s, _ in reloaded}))
        self.history.extend(messages)
        return messages

    def _note(self, handles: list[Any], message: str) -> None:
        """Show `message` in the panels of `handles`' runs."""
        from .reporters import add_note

        for handle in handles:
            add_note(handle, message)

    # ------------------------------------------------------------------------------------------
    # reports

    def _holders(self, held) -> list[str]:
        """Names the notebook gives to the values `held(value)` accepts; a handle by its first
        name."""
        ns = self.shell.user_ns
        names = [
            name
            for name, value in list(ns.items())
            if not name.startswith("_") and not isinstance(value, nitro.Nitro) and held(value)
        ]
        for handle in live_handles(ns):
            handle_name = handle_names(ns, handle)
            if handle_name and handle_name != ["_nitro"] and held(handle):
                names.append(handle_name[0])
        return names

    def _deleted(self, source: _Source) -> str:
        """The message for a watched module whose file is gone."""

        def held(value: Any) -> bool:
            if isinstance(value, types.ModuleType):
                return value.__name__ == source.module
            if isinstance(value, nitro.Nitro):
                return value.cls.__module__ == source.module
            if is_experiment(value):
                cls = value if isinstance(value, type) else type(value)
                return cls.__module__ == source.module
            return False

        names = self._holders(held) or [source.module]
        verb = "keeps the code it has" if len(names) == 1 else "keep the code they have"
        return f"{os.path.basename(source.path)} was deleted; {_join(names)} {verb}."

    def _gone_classes(self, source: _Source) -> list[str]:
        """One message per experiment class of `source` that the reload removed (renamed or
        deleted) while the notebook holds it."""
        ns = self.shell.user_ns
        classes: dict[str, type] = {}
        for value in [*list(ns.values()), *live_handles(ns)]:
            cls = value.cls if isinstance(value, nitro.Nitro) else value
            if is_experiment(cls):
                cls = cls if isinstance(cls, type) else type(cls)
                if cls.__module__ == source.module:
                    classes.setdefault(cls.__qualname__, cls)
        messages = []
        for qualname, cls in classes.items():
            if not class_is_gone(cls):
                source.gone.discard(qualname)
                continue
            if qualname in source.gone:
                continue
            source.gone.add(qualname)

            def held(value: Any, qualname=qualname) -> bool:
                if isinstance(value, nitro.Nitro):
                    cls = value.cls
                elif is_experiment(value) and not isinstance(value, type):
                    cls = type(value)
                else:
                    return False
                return cls.__module__ == source.module and cls.__qualname__ == qualname

            names = self._holders(held)
            if not names:
                continue
            one = len(names) == 1
            messages.append(
                f"{os.path.basename(source.path)}: class {qualname} is gone (renamed or "
                f"deleted); {_join(names)} keep{'s' if one else ''} using the {qualname} "
                f"{'it was' if one else 'they were'} built with. Rename it back, or build a new "
                f"handle from the new class."
            )
        return messages

    def report_stale(self, reloaded: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """One message per named handle whose staleness changed since it was last reported
        (handles the notebook no longer names, such as replaced runs, are not reported). A
        training handle that takes live edits gets the edit instead: `reloaded`, the modules
        just reloaded, tells which runs an edit of a helper reaches."""
        from .reporters import add_note

        self._generation = edit_generation()
        ns = self.shell.user_ns
        messages = []
        for handle in live_runs(ns):
            names = handle_names(ns, handle)
            live = handle.running and handle.live_edits is not False
            if not live and (not names or names == ["_nitro"]):
                continue
            name = names[0] if names else f"a {handle.cls.__name__} run"
            impact = edit_impact(handle, name)
            key = (impact.changes, impact.recompile) if impact is not None else None
            if live:
                if impact is not None and self._edited(handle, reloaded):
                    self._seen.pop(handle, None)  # once it stops, report what is stale anew
                    messages.extend(self._apply_live(handle, name, impact))
                elif impact is None and self._reloaded_for(handle, reloaded):
                    # e.g. a file saved back after a refused or failed edit
                    messages.append(f"{name} already runs this code; nothing to swap in.")
                    add_note(handle, messages[-1])
                continue
            if key != self._seen.get(handle):
                self._seen[handle] = key
                if impact is not None:
                    messages.append(str(impact))
                    add_note(handle, str(impact))
        return messages

    # ------------------------------------------------------------------------------------------
    # live edits

    def _edited(self, handle: Any, reloaded: set[str] | frozenset[str]) -> bool:
        """Whether `handle`'s code was edited since its last live edit: a module it holds
        was reloaded, or its class was re-defined (in a cell)."""
        current = current_class(handle.cls)
        if self._applied.get(handle) is not current:
            return True
        return self._reloaded_for(handle, reloaded)

    def _reloaded_for(self, handle: Any, reloaded: set[str] | frozenset[str]) -> bool:
        """Whether a module `handle`'s run holds is among the modules just `reloaded`."""
        return any(_holds(handle, s) for s in self.sources.values() if s.module in reloaded)

    def _apply_live(self, handle: Any, name: str, impact: EditImpact) -> list[str]:
        """Compile the edit beside `handle`'s run; the message that says so (or why not)."""
        from .reporters import add_note

        self._applied[handle] = current_class(handle.cls)
        edit = handle.apply_edits()
        what = ", ".join(f"`{unit}`" for unit in edit.changes) or _join(impact.changes)
        if edit.status == "compiling":
            count = len(edit.programs)
            message = (
                f"{name}: compiling the edit of {what} beside the run; it swaps in after "
                f"compiling {count} program{'s' if count != 1 else ''} "
                f"({', '.join(edit.programs)})."
                if count
                else f"{name}: the edit of {what} compiles nothing; it swaps in at the next step."
            )
            add_note(handle, message)
            self._edits.append(_Watched(name, handle, edit, "compiling"))
            return [message]
        if edit.status == "refused":  # the handle's reporters said it too
            return [f"{name}: the edit of {_join(impact.changes)} was refused: {edit.note}."]
        return []

    def live_outcomes(self) -> list[str]:
        """What became of the live edits under way since last asked: swapped in, failed,
        rolled back (the run's panel said it as it happened)."""
        messages = []
        with self._lock:
            watched = list(self._edits)
        for entry in watched:
            status = entry.edit.status
            if status == entry.said:
                continue
            entry.said = status
            record = entry.edit.record or {}
            if status == "swapped":
                messages.append(
                    f"{entry.name}: swapped in the edit of {_units(entry.edit.changes)} at "
                    f"step {record.get('step')}."
                )
            elif status in ("failed", "rolled back"):
                messages.append(f"{entry.name}: {entry.edit.note}.")
        with self._lock:  # keep the swapped ones while they may still roll back
            self._edits = [
                e
                for e in self._edits
                if e.edit.status in ("compiling", "ready")
                or (e.edit.status == "swapped" and e.handle.running)
            ]
        return messages


@dataclasses.dataclass(eq=False)
class _Watched:
    name: str
    handle: Any
    edit: Any
    said: str


def _holds(handle: Any, source: _Source) -> bool:
    """Whether `handle` trains code of `source`'s module (its experiment's module, a base
    class's, or a helper one of those imports)."""
    if not handle.running:
        return False
    return any(c.__module__ in source.users for c in handle.cls.__mro__)


def _units(changes: Any) -> str:
    return ", ".join(f"`{unit}`" for unit in changes) or "the code"


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
