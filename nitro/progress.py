"""Public import path of `nitro.core.progress` (the default reporters).

Its names are read and set there (`nitro._public_path`).
"""

import typing

from nitro import _public_path

_public_path.stand_for(__name__, "nitro.core.progress")

if typing.TYPE_CHECKING:  # its names, for type checkers and readers
    from nitro.core.progress import *  # noqa: F403
