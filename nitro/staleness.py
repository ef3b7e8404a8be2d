"""Public import path of `nitro.programs.staleness` (what an edit changed and which programs it reaches)."""

import sys

from nitro.programs import staleness as _module

sys.modules[__name__] = _module  # `nitro.staleness` is `nitro.programs.staleness` itself
