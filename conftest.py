"""The `>>>` examples in nitro's docstrings run with the suite: `pytest` collects tests/ and the
doctests of every module under nitro/ (pyproject's `testpaths`).

Collected here rather than with `--doctest-modules`, which would import every helper module in
tests/ too: some are scripts for subprocesses (they read sys.argv, or expect fake devices set
up before JAX starts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _pytest.doctest import DoctestItem, DoctestModule

NITRO = Path(__file__).resolve().parent / "nitro"


# KServe's gRPC protos and tritonclient's (the tests' client, tests/test_serve.py) register the
# same proto file, so one process cannot import both: the server's modules are tested through a
# server process and real clients instead, and their one example (it starts a server) is skipped
_IN_A_SERVER_PROCESS_ONLY = {NITRO / "serving" / "server.py", NITRO / "serving" / "transport.py"}


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    # __main__.py is an entry point: importing it must not run it, so it is never collected;
    # with --doctest-modules pytest collects every module itself
    if (
        not parent.config.option.doctestmodules
        and file_path.suffix == ".py"
        and NITRO in file_path.parents
        and file_path.name != "__main__.py"
        and file_path not in _IN_A_SERVER_PROCESS_ONLY
    ):
        return DoctestModule.from_parent(parent, path=file_path)
    return None


@pytest.fixture(autouse=True)
def _doctests_run_in_a_temporary_directory(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An example that trains writes runs/ under the working directory: keep it out of the
    checkout (tests/conftest.py does the same for the tests)."""
    if isinstance(request.node, DoctestItem):
        monkeypatch.chdir(tmp_path)
