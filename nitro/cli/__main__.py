"""`python -m nitro.cli ...`: the `nitro` command."""

import sys

from nitro.cli import main

sys.exit(main())
