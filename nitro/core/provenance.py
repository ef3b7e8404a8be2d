"""A run keyword as resolved: its value and where it came from (the binding report's provenance)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Resolved"]


@dataclasses.dataclass(frozen=True)
class Resolved:
    """One run keyword's value and its source (`"Nitro(...)"`, a hook, a field, the default)."""

    value: Any
    source: str
