"""ResNet, ported from timm's `timm.models.resnet` to Flax NNX, images NHWC.

Attribute names mirror timm's `state_dict` keys (`layer1.0.conv1`, `layer2.0.downsample.1`,
`fc`), so a timm checkpoint loads by `nitro.weights.load`'s default names. The stem is timm's
7x7 convolution, or with `stem_type="deep"` its three 3x3 convolutions (the `d` variants,
with `avg_down`: the shortcut pools before its 1x1 convolution).

>>> from flax import nnx
>>> import jax.numpy as jnp
>>> model = ResNet(BasicBlock, (1, 1, 1, 1), channels=(8, 16, 32, 64), num_classes=3,
...                rngs=nnx.Rngs(0))
>>> model(jnp.zeros((2, 32, 32, 3))).shape
(2, 3)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx

from nitro.models.features import take_indices

__all__ = ["BasicBlock", "BatchNorm", "Bottleneck", "ResNet"]

# timm's `kaiming_normal_(mode="fan_out", nonlinearity="relu")`
_CONV_INIT = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")
# PyTorch's default `nn.Linear` weight: uniform in +-1/sqrt(fan_in)
_LINEAR_INIT = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform")


class BatchNorm(nnx.BatchNorm):
    """PyTorch's `BatchNorm2d`: as `nnx.BatchNorm`, but the running variance takes the batch's
    unbiased variance (n / (n - 1) times the one it normalizes by), as PyTorch keeps it."""

    def __init__(self, num_features: int, *, rngs: nnx.Rngs, **kwargs: Any) -> None:
        kwargs = {"momentum": 0.9, "epsilon": 1e-5, "use_fast_variance": False, **kwargs}
        super().__init__(num_features, rngs=rngs, **kwargs)

    def __call__(self, x: jax.Array, use_running_average: bool | None = None, **_: Any):
        running = self.use_running_average if use_running_average is None else use_running_average
        if running:
            return super().__call__(x, use_running_average=True)
        axes = tuple(range(x.ndim - 1))
        mean, var = x.mean(axes), x.var(axes)
        count = x.size // x.shape[-1]
        keep = self.momentum
        self.mean[...] = jax.lax.stop_gradient(keep * self.mean[...] + (1 - keep) * mean)
        unbiased = var * count / max(count - 1, 1)
        self.var[...] = jax.lax.stop_gradient(keep * self.var[...] + (1 - keep) * unbiased)
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon)
        if self.scale is not None:
            y = y * self.scale[...]
        return y if self.bias is None else y + self.bias[...]


def _conv(cin: int, cout: int, size: int, stride: int, rngs: nnx.Rngs) -> nnx.Conv:
    pad = size // 2
    return nnx.Conv(
        cin,
        cout,
        (size, size),
        strides=stride,
        padding=((pad, pad), (pad, pad)),
        use_bias=False,
        kernel_init=_CONV_INIT,
        rngs=rngs,
    )


def _run(layers: Sequence[Any], x: jax.Array) -> jax.Array:
    for layer in layers:
        if layer is not None:  # a layer without weights where timm has one (pooling)
            x = layer(x)
    return x


def _avg_pool_ceil(x: jax.Array) -> jax.Array:
    """PyTorch's `AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)`."""
    padding = ((0, x.shape[1] % 2), (0, x.shape[2] % 2))
    # flax annotates `padding` by its default, "VALID"; it takes (low, high) pairs too
    return linen.avg_pool(x, (2, 2), (2, 2), padding, False)  # pyright: ignore[reportArgumentType]


def _max_pool(x: jax.Array) -> jax.Array:
    return linen.max_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1)))  # pyright: ignore[reportArgumentType]


def _downsample(cin: int, cout: int, stride: int, avg_down: bool, rngs: nnx.Rngs) -> nnx.List:
    if avg_down:
        pool = _avg_pool_ceil if stride > 1 else None
        return nnx.List([pool, _conv(cin, cout, 1, 1, rngs), BatchNorm(cout, rngs=rngs)])
    return nnx.List([_conv(cin, cout, 1, stride, rngs), BatchNorm(cout, rngs=rngs)])


class BasicBlock(nnx.Module):
    """Two 3x3 convolutions and a shortcut (ResNet-18 and -34)."""

    expansion = 1

    def __init__(
        self, cin: int, planes: int, stride: int, downsample, drop_path: float, *, rngs
    ) -> None:
        self.conv1 = _conv(cin, planes, 3, stride, rngs)
        self.bn1 = BatchNorm(planes, rngs=rngs)
        self.conv2 = _conv(planes, planes, 3, 1, rngs)
        # timm's zero_init_last: each block starts as the identity
        self.bn2 = BatchNorm(planes, scale_init=nnx.initializers.zeros, rngs=rngs)
        self.downsample = downsample
        self.drop_path = nnx.Dropout(drop_path, broadcast_dims=(1, 2, 3), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        shortcut = x if self.downsample is None else _run(self.downsample, x)
        y = jax.nn.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return jax.nn.relu(self.drop_path(y) + shortcut)


class Bottleneck(nnx.Module):
    """1x1, 3x3 and 1x1 convolutions, four times wider out, and a shortcut (ResNet-50 on)."""

    expansion = 4

    def __init__(
        self, cin: int, planes: int, stride: int, downsample, drop_path: float, *, rngs
    ) -> None:
        out = planes * self.expansion
        self.conv1 = _conv(cin, planes, 1, 1, rngs)
        self.bn1 = BatchNorm(planes, rngs=rngs)
        self.conv2 = _conv(planes, planes, 3, stride, rngs)
        self.bn2 = BatchNorm(planes, rngs=rngs)
        self.conv3 = _conv(planes, out, 1, 1, rngs)
        self.bn3 = BatchNorm(out, scale_init=nnx.initializers.zeros, rngs=rngs)
        self.downsample = downsample
        self.drop_path = nnx.Dropout(drop_path, broadcast_dims=(1, 2, 3), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        shortcut = x if self.downsample is None else _run(self.downsample, x)
        y = jax.nn.relu(self.bn1(self.conv1(x)))
        y = jax.nn.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return jax.nn.relu(self.drop_path(y) + shortcut)


class ResNet(nnx.Module):
    """timm's `ResNet` with its stem variants, NHWC: `(batch, height, width, in_chans)` in,
    logits `(batch, num_classes)` out (pooled features when `num_classes=0`).

    `forward_features` gives the last stage's map, `forward_intermediates` the stem's and
    every stage's (`nitro.models.features`), `forward_head` the logits from a map. `drop_rate`
    drops pooled features before `fc`, `drop_path_rate` whole residual branches, rising
    linearly to the last block; both act in `.train()` mode only.
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: Sequence[int],
        *,
        num_classes: int = 1000,
        in_chans: int = 3,
        channels: Sequence[int] = (64, 128, 256, 512),
        stem_width: int = 64,
        stem_type: str = "",
        avg_down: bool = False,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        rngs: nnx.Rngs,
    ) -> None:
        if stem_type not in ("", "deep", "deep_tiered"):
            raise ValueError(f"stem_type={stem_type!r}: expected '', 'deep' or 'deep_tiered'")
        self.num_classes = num_classes
        self.classifier = "fc"  # timm's names of the classifier and the first convolution
        self.first_conv = "conv1.0" if stem_type else "conv1"
        cin = 64
        if stem_type:
            first = 3 * (stem_width // 4) if stem_type == "deep_tiered" else stem_width
            cin = stem_width * 2
            self.conv1: nnx.Module | nnx.List = nnx.List(
                [
                    _conv(in_chans, first, 3, 2, rngs),
                    BatchNorm(first, rngs=rngs),
                    jax.nn.relu,
                    _conv(first, stem_width, 3, 1, rngs),
                    BatchNorm(stem_width, rngs=rngs),
                    jax.nn.relu,
                    _conv(stem_width, cin, 3, 1, rngs),
                ]
            )
        else:
            self.conv1 = _conv(in_chans, cin, 7, 2, rngs)
        self.bn1 = BatchNorm(cin, rngs=rngs)
        total, done = sum(layers), 0
        stages = []
        for index, (planes, depth) in enumerate(zip(channels, layers, strict=True)):
            stride = 1 if index == 0 else 2
            out = planes * block.expansion
            blocks = []
            for number in range(depth):
                downsample = None
                if number == 0 and (stride != 1 or cin != out):
                    downsample = _downsample(cin, out, stride, avg_down, rngs)
                rate = drop_path_rate * done / max(total - 1, 1)
                blocks.append(
                    block(cin, planes, stride if number == 0 else 1, downsample, rate, rngs=rngs)
                )
                cin, done = out, done + 1
            stages.append(nnx.List(blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.num_features = cin
        self.drop = nnx.Dropout(drop_rate, rngs=rngs)
        self.fc = (
            nnx.Linear(cin, num_classes, kernel_init=_LINEAR_INIT, rngs=rngs)
            if num_classes
            else None
        )

    def _stem(self, x: jax.Array) -> jax.Array:
        x = _run(self.conv1, x) if isinstance(self.conv1, nnx.List) else self.conv1(x)
        return jax.nn.relu(self.bn1(x))

    def forward_intermediates(
        self,
        x: jax.Array,
        indices: int | Sequence[int] | None = None,
    ) -> tuple[jax.Array, list[jax.Array]]:
        """The last stage's map and the feature maps `indices` picks, NHWC, as timm's
        `forward_intermediates` (0: the stem, strides 2; 1 to 4: the stages, 4 to 32)."""
        taken = take_indices(5, indices)
        x = self._stem(x)
        features = [x] if 0 in taken else []
        x = _max_pool(x)
        for number, stage in enumerate((self.layer1, self.layer2, self.layer3, self.layer4), 1):
            x = _run(stage, x)
            if number in taken:
                features.append(x)
        return x, features

    def forward_features(self, x: jax.Array) -> jax.Array:
        """The last stage's feature map, `(batch, height / 32, width / 32, num_features)`."""
        x = _max_pool(self._stem(x))
        return _run([*self.layer1, *self.layer2, *self.layer3, *self.layer4], x)

    def forward_head(self, x: jax.Array, pre_logits: bool = False) -> jax.Array:
        """Pooled features (`pre_logits=True`) or logits from a feature map."""
        x = self.drop(jnp.mean(x, axis=(1, 2)))
        return x if pre_logits or self.fc is None else self.fc(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.forward_head(self.forward_features(x))
