"""Public import path of `nitro.serving.bundle` (loading an exported bundle).

Its names are read and set there (`nitro._public_path`).
"""

import typing

from nitro import _public_path

_public_path.stand_for(__name__, "nitro.serving.bundle")

if typing.TYPE_CHECKING:  # its names, for type checkers and readers
    from nitro.serving.bundle import *  # noqa: F403
