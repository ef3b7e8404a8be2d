"""Backbones in Flax NNX, ported from timm with their names and weights' names: ResNet
(`resnet18`, `resnet50` and their deep-stem `d` variants) and ConvNeXt V2 (`convnextv2_atto`
to `convnextv2_base`). Images are NHWC, `(batch, height, width, channels)` (docs/models.md).

- `catalog`: `create(name, num_classes=, pretrained=)` and `list_models()`
- `resnet`: `ResNet`, its blocks, and the `BatchNorm` that keeps PyTorch's running variance
- `convnext`: `ConvNeXt` with ConvNeXt V2's global response norm
- `features`: which feature maps `forward_intermediates(x, indices=)` returns
- `pretrained`: weights from a file or the Hugging Face Hub, fitted and loaded into a model
"""

from nitro.models.catalog import create, list_models
from nitro.models.convnext import ConvNeXt
from nitro.models.features import take_indices
from nitro.models.resnet import BasicBlock, BatchNorm, Bottleneck, ResNet

__all__ = [
    "BasicBlock",
    "BatchNorm",
    "Bottleneck",
    "ConvNeXt",
    "ResNet",
    "create",
    "list_models",
    "take_indices",
]
