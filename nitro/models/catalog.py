"""The models `nitro.models` builds, by timm's names: `create` and `list_models`.

>>> list_models("convnextv2_*")
['convnextv2_atto', 'convnextv2_base', 'convnextv2_femto', 'convnextv2_nano', 'convnextv2_pico', 'convnextv2_tiny']
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from functools import partial
from typing import Any

from flax import nnx

from nitro.errors import did_you_mean
from nitro.models.convnext import ConvNeXt
from nitro.models.resnet import BasicBlock, Bottleneck, ResNet

__all__ = ["create", "list_models"]

_DEEP = {"stem_width": 32, "stem_type": "deep", "avg_down": True}  # timm's `d` variants
_V2 = partial(ConvNeXt, conv_mlp=True)  # timm's small ConvNeXt V2s: 1x1 convolutions in the MLP

MODELS: dict[str, Callable[..., ResNet | ConvNeXt]] = {
    "resnet18": partial(ResNet, BasicBlock, (2, 2, 2, 2)),
    "resnet18d": partial(ResNet, BasicBlock, (2, 2, 2, 2), **_DEEP),
    "resnet50": partial(ResNet, Bottleneck, (3, 4, 6, 3)),
    "resnet50d": partial(ResNet, Bottleneck, (3, 4, 6, 3), **_DEEP),
    "convnextv2_atto": partial(_V2, depths=(2, 2, 6, 2), dims=(40, 80, 160, 320)),
    "convnextv2_femto": partial(_V2, depths=(2, 2, 6, 2), dims=(48, 96, 192, 384)),
    "convnextv2_pico": partial(_V2, depths=(2, 2, 6, 2), dims=(64, 128, 256, 512)),
    "convnextv2_nano": partial(_V2, depths=(2, 2, 8, 2), dims=(80, 160, 320, 640)),
    "convnextv2_tiny": partial(ConvNeXt, depths=(3, 3, 9, 3), dims=(96, 192, 384, 768)),
    "convnextv2_base": partial(ConvNeXt, depths=(3, 3, 27, 3), dims=(128, 256, 512, 1024)),
}


def list_models(pattern: str = "*") -> list[str]:
    """The names `create` takes, sorted, those matching the shell-style `pattern` only."""
    return sorted(fnmatch.filter(MODELS, pattern))


def create(
    name: str,
    *,
    num_classes: int = 1000,
    in_chans: int = 3,
    pretrained: str | os.PathLike | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    rngs: nnx.Rngs | None = None,
    **kwargs: Any,
) -> ResNet | ConvNeXt:
    """The model timm names `name` as a Flax NNX module taking NHWC images, with
    `num_classes` outputs (0: pooled features) and `in_chans` input channels.

    `pretrained` is a weight file or directory (PyTorch or timm names and layouts, as
    `nitro.weights.read` reads them) or a Hugging Face Hub id (`"timm/resnet18.a1_in1k"`;
    `revision=` pins it, `cache_dir=` places its cache, `HF_HUB_OFFLINE=1` keeps to the
    cache). A classifier of another size than the checkpoint's starts from its initial
    values; a first convolution for other than 3 channels is fitted as timm fits it.
    `kwargs` go to the model's class (`drop_rate=`, `drop_path_rate=`); `rngs` seeds the
    initial values (default `nnx.Rngs(0)`).
    """
    if name not in MODELS:
        raise ValueError(
            f"no model named {name!r} in nitro.models.{did_you_mean(name, MODELS)} "
            f"nitro.models.list_models() lists the {len(MODELS)} it builds"
        )
    model = MODELS[name](
        num_classes=num_classes, in_chans=in_chans, rngs=rngs or nnx.Rngs(0), **kwargs
    )
    if pretrained is not None:
        from nitro.models.pretrained import load_pretrained

        load_pretrained(
            model, pretrained, in_chans=in_chans, revision=revision, cache_dir=cache_dir
        )
    elif revision is not None:
        raise ValueError(f"revision={revision!r} pins pretrained weights; give pretrained= too")
    return model
