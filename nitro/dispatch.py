"""Public import path of `nitro.engine.dispatch` (steps per program call)."""

import sys

from nitro.engine import dispatch as _module

sys.modules[__name__] = _module  # `nitro.dispatch` is `nitro.engine.dispatch` itself
