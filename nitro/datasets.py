"""Public import path of `nitro.data.datasets` (the built-in data sets).

Its names are read and set there (`nitro._public_path`).
"""

import typing

from nitro import _public_path

_public_path.stand_for(__name__, "nitro.data.datasets")

if typing.TYPE_CHECKING:  # its names, for type checkers and readers
    from nitro.data.datasets import *  # noqa: F403
