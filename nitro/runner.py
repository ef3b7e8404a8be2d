"""Public import path of `nitro.engine.runner` (worker threads, interrupts, run control)."""

import sys

from nitro.engine import runner as _module

sys.modules[__name__] = _module  # `nitro.runner` is `nitro.engine.runner` itself
