"""Public import path of `nitro.programs.manual` (`Step` for `train_step` hooks).

Its names are read and set there (`nitro._public_path`).
"""

import typing

from nitro import _public_path

_public_path.stand_for(__name__, "nitro.programs.manual")

if typing.TYPE_CHECKING:  # its names, for type checkers and readers
    from nitro.programs.manual import *  # noqa: F403
