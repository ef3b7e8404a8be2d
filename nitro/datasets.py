"""Public import path of `nitro.data.datasets` (the built-in data sets)."""

import sys

from nitro.data import datasets as _module

sys.modules[__name__] = _module  # `nitro.datasets` is `nitro.data.datasets` itself
