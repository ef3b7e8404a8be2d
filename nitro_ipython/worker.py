"""What a training thread inherits from the cell that started it.

`nitro.runner` calls `initializer(handle)` on the starting thread and runs what it returns
first on the worker. On the starting (main) thread it captures the cell's parent message and,
in a notebook, when the run reports to a panel, displays a hidden `LivePanel` in that cell
(the panel `%nitro train` already showed while it set the run up, or for a population one
with a table of its members). On the worker it routes
the thread's output to that cell and leaves the panel for the run's reporter to claim.
Without the routing, ipykernel sends a thread's output to whichever cell is running at the
time (or, in some versions, nowhere); with it, a background run writes into the cell that
started it, and its panel's final record replaces the panel there.

A thread marked `quiet` (an agent's, by `%nitro mcp start`) passes that on too: its runs print
no progress lines into the cell (the agent reads progress through its tools; `%nitro panel`
shows it to the person).

`cell_finished` runs after every cell (IPython's `post_run_cell` event): from then on the
panels that cell displayed get clicks, so their Stop buttons turn on.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = [
    "cell_finished",
    "claim_panel",
    "initializer",
    "is_quiet",
    "panel_reporters",
    "quiet_thread",
    "reserve_panel",
    "reserved_panel",
    "say",
    "widgets_available",
]

_LOCAL = threading.local()

# Reporters that draw into a panel; a panel is displayed only for a run of one of them.
panel_reporters: weakref.WeakSet = weakref.WeakSet()
# Panels displayed by the cell running now (main thread only).
_IN_CELL: list[Any] = []


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - nitro_ipython is used inside IPython
        return None
    return get_ipython()


def widgets_available(shell: Any = None) -> bool:
    """True in a Jupyter kernel with ipywidgets installed (not in a terminal IPython)."""
    shell = shell if shell is not None else _shell()
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def quiet_thread() -> None:
    """Runs started on this thread from now on print no progress lines."""
    _LOCAL.quiet = True


def is_quiet() -> bool:
    """True on a `quiet_thread`, and on the training threads of the runs it starts."""
    return getattr(_LOCAL, "quiet", False)


def initializer(handle: Any = None):
    shell = _shell()
    if shell is None:
        return None
    quiet = is_quiet()
    get_parent = getattr(shell, "get_parent", None)
    parent = get_parent() if get_parent is not None else None
    panel = None
    on_main = threading.current_thread() is threading.main_thread()
    reporter = getattr(handle, "reporter", None)
    if on_main and widgets_available(shell) and reporter in set(panel_reporters):
        from .member_table import members_of

        members = members_of(handle)
        if members is None:  # a run: the panel its setup showed, if it did
            panel = getattr(_LOCAL, "reserved", None)
            _LOCAL.reserved = None
        if panel is None:
            from .panel import LivePanel

            panel = LivePanel(members)
            panel.show()
            _hold_until_cell_ends(panel)

    def on_worker() -> None:
        set_thread_parent = getattr(shell, "set_thread_parent", None)
        if parent and set_thread_parent is not None:
            set_thread_parent(parent)
        _LOCAL.panel = panel
        _LOCAL.quiet = quiet

    return on_worker


def reserve_panel(panel: Any) -> None:
    """Show `panel` now (a run's setup takes seconds) and give it to the next run started on
    this thread; `reserve_panel(None)` discards a panel no run took."""
    previous = getattr(_LOCAL, "reserved", None)
    _LOCAL.reserved = panel
    if panel is not None:
        _hold_until_cell_ends(panel)
    elif previous is not None:
        previous.discard()


def reserved_panel():
    """The panel `reserve_panel` holds for the next run on this thread, or None."""
    return getattr(_LOCAL, "reserved", None)


def claim_panel():
    """The panel displayed for the run on this thread, once (None when there is none)."""
    panel = getattr(_LOCAL, "panel", None)
    _LOCAL.panel = None
    return panel


def say(text: str) -> None:
    """Say `text` beside the title of the panel the running cell displayed last, while its
    run lives (its record and stand-in leave it out, so it never stays under a finished run);
    on stdout, as `nitro: text`, without one (main thread)."""
    live = [held for held in _IN_CELL if not held.closed]
    if live:
        live[-1].say(text)
    else:
        print(f"nitro: {text}")


def _hold_until_cell_ends(panel: Any) -> None:
    """Keep `panel` for `cell_finished`; panels whose runs already left their record are let go
    (a cell that trains a hundred times holds one panel, not a hundred)."""
    _IN_CELL[:] = [held for held in _IN_CELL if not held.closed]
    _IN_CELL.append(panel)


def cell_finished(*_result) -> None:
    """After a cell: the panels it displayed now receive clicks."""
    while _IN_CELL:
        _IN_CELL.pop().cell_finished()
