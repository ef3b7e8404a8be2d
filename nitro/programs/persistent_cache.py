"""JAX's persistent compilation cache, as Nitro turns it on: one directory, written safely.

Programs compiled in one process are reloaded by the next instead of compiled again. Nitro
turns the cache on before its first compile, in `~/.cache/nitro/jax-compilation-cache`;
`NITRO_COMPILATION_CACHE` moves it (a path) or turns it off (`0`, `off`), and
`nitro.set_compilation_cache(path_or_None)` does the same from Python. A directory the user
configured in JAX itself wins, and is left as JAX manages it.

What can go wrong with a directory, and what Nitro does:

- it cannot be created or written (a read-only file system, a file where the directory should
  be): one warning naming it and the way to move or turn off the cache, and the process runs
  without a persistent cache;
- a write fails half-way (a full disk): JAX writes an entry in place, so a failed write
  leaves an empty or truncated entry that every later process fails to read and never
  replaces. Nitro writes each entry to a temporary file and renames it into place, so a failed
  write leaves nothing, and removes empty entries (left by other writers) when it opens the
  directory.

>>> import nitro
>>> nitro.set_compilation_cache(None)  # compile everything afresh in this process
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import jax

from nitro.errors import CompilationCacheError, Once

# JAX's options are attributes set at run time, which type checkers cannot see
_JAX_OPTIONS: Any = jax.config

__all__ = ["compilation_cache_dir", "configure_persistent_cache", "set_compilation_cache"]

_ENTRY_SUFFIX = "-cache"  # JAX's name for an entry file: "<key>-cache"
_TEMP_PREFIX = ".nitro-partial-"  # an entry being written; renamed when complete
_STALE_TEMP_SECONDS = 3600  # a temporary file this old belongs to a process that died

_LOCK = threading.Lock()  # configuring is rare; the lock keeps two threads from racing it
_CONFIGURED = Once()  # by the first compile, or by set_compilation_cache
_cache_dir: str | None = None  # where the cache is now (None: off); written under _LOCK


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nitro", "jax-compilation-cache")


def configure_persistent_cache() -> None:
    """Turn on JAX's persistent compilation cache once, before the first compile.

    A directory that cannot be used is reported by one warning, and the process runs without
    a persistent cache.
    """
    global _cache_dir
    if _CONFIGURED.done:
        return
    with _LOCK:
        if not _CONFIGURED.claim():
            return
        setting = os.environ.get("NITRO_COMPILATION_CACHE", "").strip()
        if setting.lower() in {"0", "off", "false", "no", "none"}:
            return
        if _JAX_OPTIONS.jax_compilation_cache_dir:
            _cache_dir = _JAX_OPTIONS.jax_compilation_cache_dir
            return
        path = setting or _default_cache_dir()
        error = _usable(path)
        if error is not None:
            origin = "set by NITRO_COMPILATION_CACHE" if setting else "the default"
            warnings.warn_explicit(
                _unusable_message(path, origin, error),
                RuntimeWarning,
                filename="nitro",
                lineno=0,
                module="nitro.programs.persistent_cache",
            )
            _disable()
            return
        _enable(path)


def set_compilation_cache(path: str | os.PathLike | None) -> None:
    """Move JAX's persistent compilation cache to `path`, or turn it off with `None`.

    Programs compiled in one process are then reloaded by the next instead of recompiled.
    Raises `CompilationCacheError` (and leaves the cache off) when `path` cannot be written.
    """
    with _LOCK:
        _CONFIGURED.claim()
        if path is None:
            _disable()
            return
        path = os.fspath(path)
        error = _usable(path)
        if error is not None:
            _disable()
            raise CompilationCacheError(
                _unusable_message(path, "given to set_compilation_cache", error)
            ) from error
        _enable(path)


def compilation_cache_dir() -> str | None:
    """The directory of the persistent compilation cache, or None when it is off."""
    return _cache_dir


def _unusable_message(path: str, origin: str, error: OSError) -> str:
    return (
        f"the compilation cache directory {path} ({origin}) cannot be used: "
        f"{type(error).__name__}: {error.strerror or error}. Nitro runs without a persistent "
        f"cache, so a new process compiles its programs again. Point the cache at a directory "
        f"you can write (NITRO_COMPILATION_CACHE=/some/dir, or "
        f"nitro.set_compilation_cache('/some/dir')), or turn it off "
        f"(NITRO_COMPILATION_CACHE=off) to silence this warning."
    )


def _usable(path: str) -> OSError | None:
    """None when `path` is (or can be made) a directory Nitro can write; else the error."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = Path(path) / f"{_TEMP_PREFIX}probe-{os.getpid()}-{threading.get_ident()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        return error
    return None


def _reset_jax() -> None:
    try:
        from jax.experimental.compilation_cache import compilation_cache as jax_cc

        jax_cc.reset_cache()
    except Exception:  # noqa: BLE001 - older jax: nothing initialized yet
        pass


def _disable() -> None:
    global _cache_dir
    _reset_jax()
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)
    _cache_dir = None


def _enable(path: str) -> None:
    global _cache_dir
    _reset_jax()
    _remove_broken_entries(path)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _install_safe_writes(path)
    _cache_dir = path


def _remove_broken_entries(path: str) -> None:
    """Remove empty entries (a write that failed at once: JAX would fail to read them in every
    process, and never replace them) and temporary files of writers that died."""
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.name.endswith(_ENTRY_SUFFIX) and entry.stat().st_size == 0:
                    os.unlink(entry.path)
                elif (
                    entry.name.startswith(_TEMP_PREFIX)
                    and now - entry.stat().st_mtime > _STALE_TEMP_SECONDS
                ):
                    os.unlink(entry.path)


def write_entry(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see all of it or nothing: a write that fails
    (a full disk) leaves no file behind."""
    temp = path.with_name(f"{_TEMP_PREFIX}{path.name}-{os.getpid()}-{threading.get_ident()}")
    try:
        # O_EXCL: never write through a file another writer is using; 0o666: the umask applies
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _install_safe_writes(path: str) -> None:
    """Give JAX a cache object for `path` whose writes go through `write_entry`.

    JAX offers no public hook for how entries are written, so this replaces the file cache JAX
    would create for `path` with a subclass differing only in `put`. Where that internal API
    is not there (another JAX version), JAX writes entries itself, and empty entries are still
    removed at the next start.
    """
    try:
        from jax._src import compilation_cache as jax_cache
        from jax._src.lru_cache import LRUCache

        if _JAX_OPTIONS.jax_compilation_cache_check_contents:
            return  # JAX wraps its cache in a verifying one: leave it to JAX

        class SafeWrites(LRUCache):
            def put(self, key: str, value: bytes) -> None:
                if self.eviction_enabled:  # a size limit: JAX's own locking and bookkeeping
                    return super().put(key, value)
                if not key:
                    raise ValueError("key cannot be empty")
                entry = Path(self.path) / f"{key}{_ENTRY_SUFFIX}"
                if not entry.exists():
                    write_entry(entry, value)

        cache = SafeWrites(path, max_size=_JAX_OPTIONS.jax_compilation_cache_max_size)
        with jax_cache._cache_initialized_mutex:
            jax_cache._cache = cache
            jax_cache._cache_initialized = True
    except (ImportError, AttributeError, TypeError):
        return
