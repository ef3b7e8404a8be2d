"""Public import path of `nitro.handle.gallery` (samples drawn in one figure: the
`visualize` hook, the default views; `n.render()` and the live panel's gallery draw with it).

Its names are read and set there (`nitro._public_path`).
"""

import typing

from nitro import _public_path

_public_path.stand_for(__name__, "nitro.handle.gallery")

if typing.TYPE_CHECKING:  # its names, for type checkers and readers
    from nitro.handle.gallery import *  # noqa: F403
