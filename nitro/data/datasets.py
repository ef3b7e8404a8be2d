"""Built-in datasets that need no download."""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from nitro.data import ArrayLoader

__all__ = ["digits", "digits_arrays"]


def _bundled_digits() -> np.ndarray:
    """The digits table scikit-learn ships (64 pixel columns, then the label), read directly:
    importing scikit-learn itself costs seconds."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("nitro.datasets.digits needs scikit-learn: pip install 'nitro[examples]'")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    return np.loadtxt(path, delimiter=",", dtype=np.float64)


def digits_arrays(seed: int = 0, val_fraction: float = 0.1, test_fraction: float = 0.2):
    """scikit-learn's bundled 8x8 digits (1,797 samples) split into train, val and test.

    Returns `{"train": {"x", "y"}, "val": {...}, "test": {...}}` with `x` float32 of shape
    (n, 64) scaled to [0, 1] and `y` int32 labels.
    """
    raw = _bundled_digits()
    x = (raw[:, :-1] / 16.0).astype(np.float32)
    y = raw[:, -1].astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = int(round(len(x) * test_fraction))
    n_val = int(round(len(x) * val_fraction))
    test = slice(0, n_test)
    val = slice(n_test, n_test + n_val)
    train = slice(n_test + n_val, None)
    return {
        "train": {"x": x[train], "y": y[train]},
        "val": {"x": x[val], "y": y[val]},
        "test": {"x": x[test], "y": y[test]},
    }


def digits(
    batch_size: int = 128,
    seed: int | None = None,
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
) -> dict[str, ArrayLoader]:
    """The digits splits as loaders: a shuffled `train` that drops its partial batch, and
    `val` and `test` in order, keeping their final partial batch.

    `seed` picks which samples go to which split (0 when None) and, when given, the train
    order; None leaves the train order to the run's `seed=`. Across processes
    (`jax.distributed`) each feeds its share of every global train batch, and the whole of
    `val` and `test`, whose last batch must then be full: a `batch_size` that divides the
    180 samples of `val` (60, 90, ...).

    >>> splits = digits(batch_size=128)
    >>> sorted(splits), len(splits["train"])
    (['test', 'train', 'val'], 9)
    """
    arrays = digits_arrays(0 if seed is None else seed, val_fraction, test_fraction)
    return {
        "train": ArrayLoader(
            arrays["train"], batch_size, shuffle=True, drop_last=True, seed=seed, per_process=True
        ),
        "val": ArrayLoader(arrays["val"], batch_size, shuffle=False, drop_last=False),
        "test": ArrayLoader(arrays["test"], batch_size, shuffle=False, drop_last=False),
    }
