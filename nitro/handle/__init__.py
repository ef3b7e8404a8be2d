"""The handle: `Nitro`, the binding report, and the handle's displays.

`nitro.Nitro` is the public name. Imports `engine` and below.

- `handle`: `Nitro`
- `binding_report`: where every value came from
- `displays`, `plotting`: the handle's repr and HTML; history plots
"""

from nitro.handle.handle import Nitro

__all__ = ["Nitro"]
