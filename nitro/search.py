"""Public import path of `nitro.engine.search` (search inside one population: spaces,
`Random` and `Sobol` members, `PBT`, `Halving`).

Its names are read and set there (`nitro._public_path`).
"""

import typing

from nitro import _public_path

_public_path.stand_for(__name__, "nitro.engine.search")

if typing.TYPE_CHECKING:  # its names, for type checkers and readers
    from nitro.engine.search import *  # noqa: F403
