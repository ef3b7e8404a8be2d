"""Nitro's version, in one place: `nitro.__version__`, the package's metadata
(`pyproject.toml` reads it) and every `run.json` and bundle manifest. A leaf: imports nothing.
"""

__version__ = "0.2.0"
