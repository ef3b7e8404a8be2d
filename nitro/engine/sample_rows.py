"""A batch's samples on the host: its fields, `forward`'s outputs and each sample's loss,
real rows only (`SampleRows`), read from an evaluation call and its staged batch; and what
validation hands the reporters that draw samples (`ValSamples`, read only when asked for).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nitro.core.run_setup import RunSetup

__all__ = ["SampleRows", "ValSamples", "rows_of"]


class SampleRows:
    """One batch's real rows on the host: `fields` (every field the batch carried to the
    device, and its host fields), `outputs` (forward's, a member axis first for a
    population), `losses` (f32[rows], `[members, rows]`; None when the loss couples samples
    or the program computes none) and `start`, the first row's index in the split."""

    __slots__ = ("fields", "losses", "outputs", "start")

    def __init__(self, fields: dict[str, np.ndarray], outputs: Any, losses: Any, start: int):
        self.fields, self.outputs, self.losses, self.start = fields, outputs, losses, start

    @property
    def rows(self) -> int:
        return len(next(iter(self.fields.values())))


def rows_of(setup: RunSetup, staged: Any, result: Any, stacked: bool, start: int) -> list:
    """The `SampleRows` of each batch of one evaluation call (`staged`, its `EvalOutput`
    `result`), the first starting at row `start` of the split; read back whole, sliced on
    the host (slicing on the device would compile)."""
    read = setup.placement.gather(result)
    batch = setup.placement.gather(dict(staged.device))
    out = []
    for i, real in enumerate(np.atleast_1d(np.asarray(staged.n_real)).tolist()):
        one = read if staged.count == 1 else jax.tree.map(lambda a, i=i: a[i], read)
        fields = batch if staged.count == 1 else {k: v[i] for k, v in batch.items()}
        host = staged.host if staged.count == 1 else (staged.host or [None] * (i + 1))[i]
        cut = (slice(None), slice(0, real)) if stacked else slice(0, real)
        fields = {k: np.asarray(v)[:real] for k, v in {**(host or {}), **fields}.items()}
        outputs = jax.tree.map(lambda a, cut=cut: np.asarray(a)[cut], one.outputs)
        losses = None if one.losses is None else np.asarray(one.losses)[cut]
        out.append(SampleRows(fields, outputs, losses, start))
        start += real
    return out


class ValSamples:
    """The first call of a validation, for a reporter that draws samples: `split`, and
    `rows()`, its first batch's `SampleRows` (forward's outputs None when validation's
    program returns none). Read it during the event: the batch is freed after it."""

    def __init__(self, setup: RunSetup, split: str, staged: Any, result: Any):
        self.split = split
        self._read = lambda: rows_of(setup, staged, result, False, 0)[0]

    def rows(self) -> SampleRows:
        return self._read()
