"""Public import path of `nitro.programs.manual` (`Step` for `train_step` hooks)."""

import sys

from nitro.programs import manual as _module

sys.modules[__name__] = _module  # `nitro.manual` is `nitro.programs.manual` itself
