"""Public import path of `nitro.core.progress` (the default reporters)."""

import sys

from nitro.core import progress as _module

sys.modules[__name__] = _module  # `nitro.progress` is `nitro.core.progress` itself
