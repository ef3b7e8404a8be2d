"""Notebook integration for Nitro: %nitro magics, background runs, hot reload, live plots.

Uses only nitro's public API; nitro never imports this package at module level.
"""


def load_ipython_extension(ipython) -> None:  # pragma: no cover - filled in by the magics
    pass


def unload_ipython_extension(ipython) -> None:  # pragma: no cover
    pass
