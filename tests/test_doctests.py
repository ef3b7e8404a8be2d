"""The docstring examples hold wherever the machine keeps its temporary files: an example that
makes a temporary directory must not depend on how deep it lies (CI sets TMPDIR freely)."""

from __future__ import annotations

import doctest
import importlib
import tempfile
from pathlib import Path

import pytest

NITRO = Path(__file__).resolve().parent.parent / "nitro"
USES_TEMPFILE = sorted(
    path for path in NITRO.rglob("*.py") if ">>> import tempfile" in path.read_text("utf-8")
)


def test_some_docstring_example_makes_a_temporary_directory():
    assert NITRO / "mcp" / "paths.py" in USES_TEMPFILE


@pytest.mark.parametrize("path", USES_TEMPFILE, ids=lambda p: str(p.relative_to(NITRO.parent)))
@pytest.mark.parametrize("depth", [1, 6])
def test_an_example_with_a_temporary_directory_holds_at_any_depth(
    path, depth, tmp_path, monkeypatch
):
    deep = tmp_path.joinpath(*[f"level{i}" for i in range(depth)])
    deep.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    name = ".".join(path.relative_to(NITRO.parent).with_suffix("").parts)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE  # pyproject's doctest_optionflags
    result = doctest.testmod(importlib.import_module(name), optionflags=flags, report=False)
    assert result.attempted > 0
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
