"""Public import path of `nitro.core.events` (the event path and the reporter protocol)."""

import sys

from nitro.core import events as _module

sys.modules[__name__] = _module  # `nitro.events` is `nitro.core.events` itself
