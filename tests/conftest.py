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
