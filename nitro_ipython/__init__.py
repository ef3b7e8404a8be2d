"""Notebook integration for Nitro: %nitro magics, background runs, hot reload, live plots.

`%load_ext nitro` (or `%load_ext nitro_ipython`) does four things:

- registers the `%nitro` line magic (`%nitro?` for help; see `magics.py`, and `rebuild.py`
  for when `%nitro train` builds a new handle after an edit);
- makes runs with `progress=True` report into a live widget panel in a notebook, or a tqdm
  bar in a terminal IPython (`reporters.py`, `panel.py`, `curves.py`, `record.py`),
  populations too (a run is a population of one; what only several members have, their
  table, is `member_table.py`);
- routes each training thread's output to the cell that started it (`worker.py`);
- watches the source files of live experiments and reloads them on save, reporting which
  compiled programs the edit makes stale, or, for a run training meanwhile, compiling the edit
  beside it and swapping it in (`code_watcher.py`; the safe reload itself in `reload.py`;
  `edit_impact.py`: which programs an edit makes stale).

`%nitro mcp start` serves the kernel's runs to a coding agent (`agents.py`).

Also: `runs.py` (handles by name, their live numbers, status lines, the runs an agent
started), `curves.py` (training curves redrawn in place), `sample_gallery.py` (the panel's
gallery of validation samples, drawn on its own thread), `record.py` (the static record a run
leaves in its cell), `failures.py` (a failed run's folded traceback), `cache_table.py`
(`%nitro cache` as tables).

Uses only nitro's public API; nitro never imports this package at module level. No module of
this package imports itself through others: the extension's functions here import the modules,
and no module imports this package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_ipython_extension", "unload_ipython_extension", "live_panel", "watcher"]

_STATE: dict[str, Any] = {}


def load_ipython_extension(ipython) -> None:
    import nitro.progress
    import nitro.runner

    from . import worker
    from .code_watcher import CodeWatcher
    from .magics import NitroMagics
    from .reporters import make_factory

    if _STATE.get("shell") is ipython:
        return
    code_watcher = CodeWatcher(ipython)
    code_watcher.register()
    code_watcher.track()
    ipython.register_magics(NitroMagics(ipython, watcher=code_watcher))
    ipython.events.register("post_run_cell", worker.cell_finished)
    factory = make_factory(ipython)
    nitro.progress.set_default_factory(factory)
    nitro.progress.set_default_factory(factory, population=True)
    nitro.runner.add_worker_initializer(worker.initializer)
    png = ipython.display_formatter.formatters["image/png"]
    png.for_type_by_name("matplotlib.figure", "Figure", _figure_png)
    _STATE.update(shell=ipython, watcher=code_watcher)


def unload_ipython_extension(ipython) -> None:
    import nitro.progress
    import nitro.runner

    from . import agents, worker

    if agents.serving() is not None:
        agents.stop()
    code_watcher = _STATE.pop("watcher", None)
    if code_watcher is not None:
        code_watcher.unregister()
    _STATE.pop("shell", None)
    if worker.cell_finished in ipython.events.callbacks["post_run_cell"]:
        ipython.events.unregister("post_run_cell", worker.cell_finished)
    nitro.progress.set_default_factory(None)
    nitro.progress.set_default_factory(None, population=True)
    nitro.runner.remove_worker_initializer(worker.initializer)
    ipython.magics_manager.magics["line"].pop("nitro", None)
    png = ipython.display_formatter.formatters["image/png"]
    try:
        png.pop("matplotlib.figure.Figure")
    except KeyError:
        pass


def _figure_png(figure) -> bytes:
    """Figures returned by `n.plot()` and `%nitro plot` display inline without pyplot."""
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return buffer.getvalue()


def live_panel(handle):
    """The live widget panel of `handle`'s latest run in this notebook (None if it has none);
    `handle` may be a `nitro.Population`."""
    from .reporters import panel_of

    return panel_of(handle)


def watcher():
    """The code watcher of the loaded extension: `.sources` (watched files), `.reloads`,
    `.history` (every reload message), `.check()` (check the files now)."""
    return _STATE.get("watcher")
