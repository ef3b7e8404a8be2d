"""ConvNeXt V2, ported from timm's `timm.models.convnext` to Flax NNX, images NHWC.

Attribute names mirror timm's `state_dict` keys (`stem.0`, `stages.1.downsample.1`,
`stages.0.blocks.1.mlp.grn.weight`, `head.fc`), so a timm checkpoint loads by
`nitro.weights.load`'s default names. The small models (atto to nano) take timm's
`conv_mlp=True`: their MLP is two 1x1 convolutions (`nnx.Conv`), the larger ones two
`nnx.Linear`s; the arithmetic is the same, the checkpoint's shapes differ.

>>> from flax import nnx
>>> import jax.numpy as jnp
>>> model = ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 16, 24, 32), num_classes=3,
...                  rngs=nnx.Rngs(0))
>>> model(jnp.zeros((2, 32, 32, 3))).shape
(2, 3)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nitro.models.features import take_indices

__all__ = ["ConvNeXt", "ConvNeXtBlock", "GlobalResponseNorm", "GlobalResponseNormMlp"]

# timm's trunc_normal_(std=0.02), whose cut at +-2 (absolute) is 100 standard deviations out
_INIT = nnx.initializers.normal(0.02)


def _gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)  # PyTorch's nn.GELU()


def _norm(dim: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(dim, epsilon=1e-6, use_fast_variance=False, rngs=rngs)


class GlobalResponseNorm(nnx.Module):
    """ConvNeXt V2's GRN: each channel scaled by its spatial L2 norm over the channels' mean."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        self.weight = nnx.Param(jnp.zeros((dim,)))
        self.bias = nnx.Param(jnp.zeros((dim,)))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        spatial = jnp.sqrt(jnp.sum(x * x, axis=(1, 2), keepdims=True))
        relative = spatial / (jnp.mean(spatial, axis=-1, keepdims=True) + self.eps)
        return x + self.bias[...] + self.weight[...] * (x * relative)


class GlobalResponseNormMlp(nnx.Module):
    """`fc1`, GELU, GRN, `fc2`: 1x1 convolutions (`conv_mlp`) or linear layers."""

    def __init__(self, dim: int, hidden: int, conv_mlp: bool, *, rngs: nnx.Rngs) -> None:
        if conv_mlp:
            self.fc1 = nnx.Conv(dim, hidden, (1, 1), kernel_init=_INIT, rngs=rngs)
            self.fc2 = nnx.Conv(hidden, dim, (1, 1), kernel_init=_INIT, rngs=rngs)
        else:
            self.fc1 = nnx.Linear(dim, hidden, kernel_init=_INIT, rngs=rngs)
            self.fc2 = nnx.Linear(hidden, dim, kernel_init=_INIT, rngs=rngs)
        self.grn = GlobalResponseNorm(hidden)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.grn(_gelu(self.fc1(x))))


class ConvNeXtBlock(nnx.Module):
    """A 7x7 depthwise convolution, LayerNorm, the GRN MLP, and the shortcut."""

    def __init__(
        self, dim: int, kernel_size: int, conv_mlp: bool, drop_path: float, *, rngs: nnx.Rngs
    ) -> None:
        pad = kernel_size // 2
        self.conv_dw = nnx.Conv(
            dim,
            dim,
            (kernel_size, kernel_size),
            padding=((pad, pad), (pad, pad)),
            feature_group_count=dim,
            kernel_init=_INIT,
            rngs=rngs,
        )
        self.norm = _norm(dim, rngs)
        self.mlp = GlobalResponseNormMlp(dim, 4 * dim, conv_mlp, rngs=rngs)
        self.drop_path = nnx.Dropout(drop_path, broadcast_dims=(1, 2, 3), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.drop_path(self.mlp(self.norm(self.conv_dw(x))))


class ConvNeXtStage(nnx.Module):
    """LayerNorm and a 2x2 stride-2 convolution (not in the first stage), then the blocks."""

    def __init__(
        self,
        cin: int,
        cout: int,
        downsample: bool,
        kernel_size: int,
        conv_mlp: bool,
        drop_paths: Sequence[float],
        *,
        rngs: nnx.Rngs,
    ) -> None:
        self.downsample = (
            nnx.List(
                [
                    _norm(cin, rngs),
                    nnx.Conv(
                        cin, cout, (2, 2), strides=2, padding="VALID", kernel_init=_INIT, rngs=rngs
                    ),
                ]
            )
            if downsample
            else None
        )
        self.blocks = nnx.List(
            [ConvNeXtBlock(cout, kernel_size, conv_mlp, rate, rngs=rngs) for rate in drop_paths]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in [*(self.downsample or ()), *self.blocks]:
            x = layer(x)
        return x


class NormMlpClassifierHead(nnx.Module):
    """Global average pooling, LayerNorm, dropout and `fc` (absent when `num_classes=0`)."""

    def __init__(self, dim: int, num_classes: int, drop_rate: float, *, rngs: nnx.Rngs) -> None:
        self.norm = _norm(dim, rngs)
        self.drop = nnx.Dropout(drop_rate, rngs=rngs)
        self.fc = (
            nnx.Linear(dim, num_classes, kernel_init=_INIT, rngs=rngs) if num_classes else None
        )

    def __call__(self, x: jax.Array, pre_logits: bool = False) -> jax.Array:
        x = self.drop(self.norm(jnp.mean(x, axis=(1, 2))))
        return x if pre_logits or self.fc is None else self.fc(x)


class ConvNeXt(nnx.Module):
    """timm's `ConvNeXt` with V2's GRN (its `use_grn=True, ls_init_value=None`), NHWC:
    `(batch, height, width, in_chans)` in, logits `(batch, num_classes)` out (the normalized
    pooled features when `num_classes=0`).

    `forward_features` gives the last stage's map, `forward_intermediates` every stage's
    (`nitro.models.features`), `forward_head` the logits from a map. `drop_rate` drops pooled
    features before `head.fc`, `drop_path_rate` whole residual branches, rising linearly over
    the blocks (timm's stagewise rule); both act in `.train()` mode only.
    """

    def __init__(
        self,
        *,
        depths: Sequence[int] = (3, 3, 9, 3),
        dims: Sequence[int] = (96, 192, 384, 768),
        num_classes: int = 1000,
        in_chans: int = 3,
        kernel_size: int = 7,
        patch_size: int = 4,
        conv_mlp: bool = False,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        rngs: nnx.Rngs,
    ) -> None:
        self.num_classes = num_classes
        self.classifier = "head.fc"  # timm's names of the classifier and the first convolution
        self.first_conv = "stem.0"
        self.stem = nnx.List(
            [
                nnx.Conv(
                    in_chans,
                    dims[0],
                    (patch_size, patch_size),
                    strides=patch_size,
                    padding="VALID",
                    kernel_init=_INIT,
                    rngs=rngs,
                ),
                _norm(dims[0], rngs),
            ]
        )
        rates = np.linspace(0.0, drop_path_rate, sum(depths)).tolist()
        stages, cin, start = [], dims[0], 0
        for number, (depth, dim) in enumerate(zip(depths, dims, strict=True)):
            paths = rates[start : start + depth]
            stages.append(
                ConvNeXtStage(cin, dim, number > 0, kernel_size, conv_mlp, paths, rngs=rngs)
            )
            cin, start = dim, start + depth
        self.stages = nnx.List(stages)
        self.num_features = cin
        self.head = NormMlpClassifierHead(cin, num_classes, drop_rate, rngs=rngs)

    def forward_intermediates(
        self,
        x: jax.Array,
        indices: int | Sequence[int] | None = None,
    ) -> tuple[jax.Array, list[jax.Array]]:
        """The last stage's map and the stages' maps `indices` picks, NHWC, as timm's
        `forward_intermediates` (0 to 3: strides 4, 8, 16, 32)."""
        taken = take_indices(len(self.stages), indices)
        x = self.stem[1](self.stem[0](x))
        features = []
        for number, stage in enumerate(self.stages):
            x = stage(x)
            if number in taken:
                features.append(x)
        return x, features

    def forward_features(self, x: jax.Array) -> jax.Array:
        """The last stage's feature map, `(batch, height / 32, width / 32, num_features)`."""
        x = self.stem[1](self.stem[0](x))
        for stage in self.stages:
            x = stage(x)
        return x

    def forward_head(self, x: jax.Array, pre_logits: bool = False) -> jax.Array:
        """Pooled, normalized features (`pre_logits=True`) or logits from a feature map."""
        return self.head(x, pre_logits)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.forward_head(self.forward_features(x))
