"""The ResNet V1 of flax's ImageNet example, with cross-replica BatchNorm.

As in ``examples/imagenet/models.py`` (google/flax): a 7x7 stem, max pooling,
stages of `ResNetBlock`s (the last BatchNorm of each residual branch starts at
zero scale) and a linear head. ``axis_name=repl.axis_name`` gives cross-replica
BatchNorm under ``repl.run`` and the global batch's statistics under
``repl.compile``; ``None`` is the single-device original. For small images
(CIFAR-10) ``small_inputs`` replaces the stem by a 3x3 convolution without
pooling. The model's ``dtype`` is left to the precision policy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from flax import linen as nn


class ResNetBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (projected when shapes differ)."""

    filters: int
    conv: Callable[..., nn.Module]
    norm: Callable[..., nn.Module]
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = nn.relu(self.norm()(y))
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    """ResNet V1: ``stage_sizes`` blocks per stage, filters doubling per stage."""

    stage_sizes: Sequence[int]
    num_classes: int
    num_filters: int = 8
    axis_name: Any = None
    small_inputs: bool = False

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            axis_name=self.axis_name,
        )
        if self.small_inputs:
            x = nn.relu(norm(name="bn_init")(conv(self.num_filters, (3, 3), name="conv_init")(x)))
        else:
            stem = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3)] * 2, name="conv_init")
            x = nn.relu(norm(name="bn_init")(stem(x)))
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.num_filters * 2**i, conv, norm, strides)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)
