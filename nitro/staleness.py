"""Public import path of `nitro.programs.staleness` (what an edit changed and which programs
it reaches).

Its names are read and set there (`nitro._public_path`).
"""

import typing

from nitro import _public_path

_public_path.stand_for(__name__, "nitro.programs.staleness")

if typing.TYPE_CHECKING:  # its names, for type checkers and readers
    from nitro.programs.staleness import *  # noqa: F403
