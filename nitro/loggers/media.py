"""Images and figures for the loggers that store them: arrays checked and brought to 8-bit
pixels, matplotlib figures rendered to PNG.

`log_image(name, image, *, step)` takes an array of shape (H, W), (H, W, 1), (H, W, 3) or
(H, W, 4), unsigned 8-bit (0-255) or floating point (0-1, clipped); `log_figure(name,
figure, *, step)` a matplotlib `Figure`, rendered once with `savefig` (its own size and dpi).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

__all__ = ["check_figure", "figure_png", "image_pixels", "png_bytes"]


def image_pixels(image: Any, name: str = "image") -> np.ndarray:
    """`image` as an (H, W, C) uint8 array, C in 1, 3, 4; a clear error for anything else.

    >>> image_pixels(np.ones((2, 3))).shape, int(image_pixels(np.ones((2, 3))).max())
    ((2, 3, 1), 255)
    """
    if hasattr(image, "savefig"):
        raise TypeError(
            f"log_image({name!r}, ...) got a matplotlib figure; log it with "
            f"log_figure({name!r}, figure, step=...)"
        )
    array = np.asarray(image)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4) or 0 in array.shape:
        raise ValueError(
            f"log_image({name!r}, ...) takes an image of shape (H, W), (H, W, 1), (H, W, 3) or "
            f"(H, W, 4), channels last; got shape {array.shape}. For a channels-first "
            f"(C, H, W) array, pass array.transpose(1, 2, 0)"
        )
    if array.dtype == np.uint8:
        return array
    if array.dtype.kind == "f":
        if not np.isfinite(array).all():
            raise ValueError(f"log_image({name!r}, ...) got non-finite pixel values")
        return (np.clip(array, 0.0, 1.0) * 255 + 0.5).astype(np.uint8)
    if array.dtype.kind == "b":
        return array.astype(np.uint8) * 255
    raise TypeError(
        f"log_image({name!r}, ...) takes uint8 pixels (0-255) or floats (0-1); got "
        f"{array.dtype}. Scale integers with image.astype('uint8') or image / image.max()"
    )


def png_bytes(pixels: np.ndarray) -> bytes:
    """An (H, W, C) uint8 array as PNG bytes (Pillow, which matplotlib installs)."""
    from PIL import Image

    mode = {1: "L", 3: "RGB", 4: "RGBA"}[pixels.shape[2]]
    buffer = io.BytesIO()
    Image.fromarray(pixels[:, :, 0] if mode == "L" else pixels, mode=mode).save(buffer, "PNG")
    return buffer.getvalue()


def check_figure(figure: Any, name: str = "figure") -> None:
    """Refuse what is not a matplotlib figure (anything without `savefig`)."""
    if not hasattr(figure, "savefig"):
        raise TypeError(
            f"log_figure({name!r}, ...) takes a matplotlib Figure (plt.figure(), "
            f"plt.subplots()[0]); got {type(figure).__name__}. Log an array with "
            f"log_image({name!r}, array, step=...)"
        )


def figure_png(figure: Any, name: str = "figure") -> tuple[bytes, np.ndarray]:
    """A matplotlib figure rendered to PNG: the bytes and the (H, W, 4) pixels."""
    check_figure(figure, name)
    from PIL import Image

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    data = buffer.getvalue()
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGBA"))
    return data, pixels
