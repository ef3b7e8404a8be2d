"""Public import path of `nitro.core.events` (the event path and the reporter protocol).

Its names are read and set there (`nitro._public_path`).
"""

import typing

from nitro import _public_path

_public_path.stand_for(__name__, "nitro.core.events")

if typing.TYPE_CHECKING:  # its names, for type checkers and readers
    from nitro.core.events import *  # noqa: F403
