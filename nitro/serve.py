"""Public import path of `nitro.serving.serve` (`nitro serve`: serving exported bundles)."""

import sys

if __name__ == "__main__":  # python -m nitro.serve
    from nitro.serving.serve import main

    main()
else:
    from nitro.serving import serve as _module

    sys.modules[__name__] = _module
