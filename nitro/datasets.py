"""Built-in datasets that need no download."""

from __future__ import annotations

import numpy as np

from .data import ArrayLoader

__all__ = ["digits", "digits_arrays"]


def digits_arrays(seed: int = 0, val_fraction: float = 0.1, test_fraction: float = 0.2):
    """scikit-learn's bundled 8x8 digits (1,797 samples) split into train, val and test.

    Returns `{"train": {"x", "y"}, "val": {...}, "test": {...}}` with `x` float32 of shape
    (n, 64) scaled to [0, 1] and `y` int32 labels.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "nitro.datasets.digits needs scikit-learn: pip install 'nitro[examples]'"
        ) from error
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
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
    batch_size: int = 128, seed: int = 0, val_fraction: float = 0.1, test_fraction: float = 0.2
) -> dict[str, ArrayLoader]:
    """The digits splits as loaders: a shuffled `train` that drops its partial batch, and
    `val` and `test` in order, keeping their final partial batch.

    >>> splits = digits(batch_size=128)
    >>> sorted(splits), len(splits["train"])
    (['test', 'train', 'val'], 9)
    """
    arrays = digits_arrays(seed, val_fraction, test_fraction)
    return {
        "train": ArrayLoader(arrays["train"], batch_size, shuffle=True, drop_last=True, seed=seed),
        "val": ArrayLoader(arrays["val"], batch_size, shuffle=False, drop_last=False),
        "test": ArrayLoader(arrays["test"], batch_size, shuffle=False, drop_last=False),
    }
