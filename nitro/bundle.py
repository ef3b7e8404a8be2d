"""Public import path of `nitro.serving.bundle` (loading an exported bundle)."""

import sys

from nitro.serving import bundle as _module

sys.modules[__name__] = _module  # `nitro.bundle` is `nitro.serving.bundle` itself
