import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import nitro  # noqa: E402


@pytest.fixture
def fresh_cache():
    """An empty compile cache, so a test can assert exact counts."""
    nitro.cache_reset()
    yield
    nitro.cache_reset()


@pytest.fixture(autouse=True)
def _runs_in_a_temporary_directory(tmp_path, monkeypatch):
    """Runs write their directories (runs/<Experiment>/<run id>) under the working directory:
    keep each test's in its own temporary directory."""
    monkeypatch.chdir(tmp_path)
