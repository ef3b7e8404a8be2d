"""Public import path of `nitro.engine.dispatch` (steps per program call).

Its names are read and set there (`nitro._public_path`).
"""

import typing

from nitro import _public_path

_public_path.stand_for(__name__, "nitro.engine.dispatch")

if typing.TYPE_CHECKING:  # its names, for type checkers and readers
    from nitro.engine.dispatch import *  # noqa: F403
