"""How a run's failure reads in a notebook: the failing hook named, the user's frames shown and
Nitro's folded into one line each, and where the exception is kept.

The traceback is the standard library's (`traceback.TracebackException`, chained exceptions
included), with its stacks' runs of frames under the nitro package folded. A run that fails
in the foreground re-raises into its cell, where IPython shows the exception's
`_render_traceback_`; a background run has no cell waiting, so its reporter prints the same
lines into the run's cell.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from typing import Any

import nitro

__all__ = ["describe", "failing_hook", "folded_traceback", "keep_for_ipython", "report"]

# Nitro's frames: the package and this extension (the directory of this module: importing the
# extension's package from here would import this module back through it)
_NITRO_DIRS = tuple(
    os.path.dirname(os.path.abspath(file)) + os.sep for file in (nitro.__file__, __file__)
)


_LIBRARY_DIRS = tuple(
    os.path.abspath(sysconfig.get_paths()[key]) + os.sep
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
)


def _in_nitro(frame: traceback.FrameSummary) -> bool:
    return os.path.abspath(frame.filename).startswith(_NITRO_DIRS)


def _in_library(frame: traceback.FrameSummary) -> bool:
    return os.path.abspath(frame.filename).startswith(_LIBRARY_DIRS)


class _FoldedStack(traceback.StackSummary):
    """A stack whose runs of frames in the nitro package format as one line."""

    def format(self) -> list[str]:
        lines: list[str] = []
        folded = 0
        for frame in self:
            if _in_nitro(frame):
                folded += 1
                continue
            if folded:
                lines.append(_fold_line(folded))
                folded = 0
            lines.append(self.format_frame_summary(frame))
        if folded:
            lines.append(_fold_line(folded))
        return lines


def _fold_line(count: int) -> str:
    return f"  … {count} frame{'s' if count != 1 else ''} in nitro\n"


def failing_hook(error: BaseException) -> traceback.FrameSummary | None:
    """The frame of user code that Nitro called and that the error went through: the hook
    (None when the error never left Nitro's own frames)."""
    called_by_nitro = False
    for frame in traceback.extract_tb(error.__traceback__):
        if _in_nitro(frame):
            called_by_nitro = True
        elif called_by_nitro and not _in_library(frame):  # JAX's frames may come between
            return frame
    return None


def folded_traceback(error: BaseException) -> list[str]:
    """The traceback of `error` as lines (no newlines), Nitro's frames folded."""
    report = traceback.TracebackException.from_exception(error)
    seen: set[int] = set()
    pending = [report]
    while pending:  # every exception of the chain
        each = pending.pop()
        if id(each) in seen:
            continue
        seen.add(id(each))
        each.stack = _FoldedStack(each.stack)
        pending.extend(e for e in (each.__cause__, each.__context__) if e is not None)
    return "".join(report.format()).rstrip("\n").split("\n")


def describe(error: BaseException, handle: Any, name: str | None) -> str:
    """One line: which hook failed where, the exception, and where it is kept."""
    hook = failing_hook(error)
    where = ""
    if hook is not None:
        owner = handle.cls.__name__ if hasattr(handle.cls, hook.name) else None
        label = f"{owner}.{hook.name}" if owner else hook.name
        where = f" in hook {label} ({os.path.basename(hook.filename)}, line {hook.lineno})"
    kept = f"{name}.error" if name else "the handle's .error"
    return f"failed{where}: {type(error).__name__}: {error} (the exception is kept in {kept})"


def keep_for_ipython(error: BaseException, summary: str) -> None:
    """Make IPython show `error` (when it reaches a cell) as its folded traceback, then
    `summary`."""
    lines = [*folded_traceback(error), f"nitro: {summary}"]
    try:
        error._render_traceback_ = lambda: lines  # type: ignore[attr-defined]
    except AttributeError:  # an exception type without attributes: the full traceback shows
        pass


def report(handle: Any, note) -> None:
    """A run of `handle` failed (called from its `except` clause, in a reporter's "failed"
    phase): `note` the one-line summary, make the cell that re-raises the exception show it
    folded, and print the folded traceback when no cell waits for the run (background)."""
    import sys

    error = sys.exc_info()[1]
    if not isinstance(error, Exception):
        return
    name = _name_of(handle)
    summary = describe(error, handle, name)
    keep_for_ipython(error, summary)
    note(summary)
    if getattr(handle, "background", False):
        print("\n".join(folded_traceback(error)), file=sys.stderr, flush=True)


def _name_of(handle: Any) -> str | None:
    from IPython import get_ipython

    from .runs import handle_names

    shell = get_ipython()
    names = handle_names(shell.user_ns, handle) if shell is not None else []
    return names[0] if names else None
