"""Public import path of `nitro.serving.serve` (`nitro serve`: serving exported bundles).

Its names are read and set there (`nitro._public_path`).
"""

import typing

if __name__ == "__main__":  # python -m nitro.serve
    from nitro.serving.serve import main

    main()
else:
    from nitro import _public_path

    _public_path.stand_for(__name__, "nitro.serving.serve")

if typing.TYPE_CHECKING:  # its names, for type checkers and readers
    from nitro.serving.serve import *  # noqa: F403
