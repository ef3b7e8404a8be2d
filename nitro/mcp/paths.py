"""Where the tools may read and write: the session's root and the directories the user allowed.

Every path an agent passes (an export's `dir`, `run_dir`, `weights`, `resume`, a prediction's
`out`) is resolved (relative to the root, symlinks followed) and must fall inside the root or
an allowed directory; anything else is refused with a message naming the argument, the root
and how the user allows more.

>>> import tempfile
>>> root = Path(tempfile.mkdtemp()).resolve()
>>> paths = PathPolicy(root)
>>> paths.check("dir", "exports/digits") == root / "exports" / "digits"
True
>>> paths.check("dir", "../elsewhere")
Traceback (most recent call last):
...
nitro.mcp.lookup.ToolFailure: dir: '../elsewhere' is .../elsewhere, outside this session's root ...
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from nitro.mcp.lookup import ToolFailure

__all__ = ["HOW_TO_ALLOW", "PathPolicy"]

HOW_TO_ALLOW = (
    "`%nitro mcp start --allow DIR` in the notebook, `python -m nitro.mcp --allow DIR` from a "
    "shell, or ToolSession(allow=[DIR])"
)


class PathPolicy:
    """The root and the other directories tools may use. Without a `root`, the root is the
    working directory as it is at each call (where a run's default `runs/` goes)."""

    def __init__(
        self, root: str | os.PathLike | None = None, allow: Iterable[str | os.PathLike] = ()
    ):
        self._root = None if root is None else Path(root).expanduser().resolve()
        self.allowed = tuple(Path(p).expanduser().resolve() for p in allow)

    @property
    def root(self) -> Path:
        return self._root if self._root is not None else Path.cwd().resolve()

    @property
    def places(self) -> tuple[Path, ...]:
        return (self.root, *self.allowed)

    def resolve(self, value: str | os.PathLike) -> Path:
        """`value` as an absolute path, relative to the root, every symlink followed."""
        path = Path(value).expanduser()
        return (path if path.is_absolute() else self.root / path).resolve()

    def inside(self, path: Path) -> bool:
        return any(path.is_relative_to(place) for place in self.places)

    def check(self, argument: str, value: str | os.PathLike) -> Path:
        """`value` resolved, or a `ToolFailure` naming `argument` when it leads outside."""
        path = self.resolve(value)
        if not self.inside(path):
            raise ToolFailure(self.refusal(argument, value, path))
        return path

    def refusal(self, argument: str, value: object, path: Path) -> str:
        allowed = f" or the allowed {', '.join(map(str, self.allowed))}" if self.allowed else ""
        return (
            f"{argument}: {str(value)!r} is {path}, outside this session's root {self.root}"
            f"{allowed}; give a path inside the root. The user can allow a directory with "
            f"{HOW_TO_ALLOW}"
        )
