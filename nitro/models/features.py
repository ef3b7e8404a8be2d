"""Which intermediate features `forward_intermediates` returns, chosen as timm chooses them.

Every model of `nitro.models` numbers its feature maps from the input on (ResNet: the stem's
output, then its four stages; ConvNeXt: its four stages). `indices` picks some of them: None
takes all, an int `n` the last `n`, a sequence those numbers (negative ones count from the end).

>>> take_indices(5, None), take_indices(5, 2), take_indices(4, [0, -1])
((0, 1, 2, 3, 4), (3, 4), (0, 3))
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["take_indices"]


def take_indices(count: int, indices: int | Sequence[int] | None) -> tuple[int, ...]:
    """The feature numbers, in `range(count)`, that `indices` selects (timm's rule)."""
    if indices is None:
        return tuple(range(count))
    if isinstance(indices, int):
        if not 0 < indices <= count:
            raise ValueError(
                f"indices={indices}: the model has {count} feature maps; give a count from 1 "
                f"to {count}, or a list of feature numbers"
            )
        return tuple(range(count - indices, count))
    taken = tuple(i + count if i < 0 else i for i in indices)
    wrong = [i for i, t in zip(indices, taken, strict=True) if not 0 <= t < count]
    if wrong:
        raise ValueError(
            f"indices={list(indices)}: {wrong} not among the model's {count} feature maps "
            f"(0 to {count - 1}, or -1 to -{count} from the end)"
        )
    return taken
