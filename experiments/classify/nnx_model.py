"""The CNN of Flax's NNX MNIST tutorial, sized from its input images."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
from flax import nnx


class CNN(nnx.Module):
    """Conv 3x3, BatchNorm, dropout, relu, avg-pool 2, twice; Linear, dropout, relu; Linear.

    The tutorial's model (28x28 MNIST: 32 and 64 channels, 256 hidden units,
    dropout 0.025), with the first linear layer's input size computed from the
    image shape, so 8x8 digits fit too.

    Args:
      image_shape: ``(height, width, channels)`` of one image.
      num_classes: size of the output layer.
      conv_features: channels of the two convolutions.
      hidden_features: width of the hidden linear layer.
      dropout_rate: the two dropout layers' rate.
      axis_name: BatchNorm's ``axis_name``: ``repl.axis_name`` averages the
        statistics over all replicas under ``run`` (the global batch under
        ``compile``).
      rngs: initialises the parameters; dropout draws from the ``rngs`` given
        to each call (``nnx.Rngs(dropout=key)``), so the module holds no RNG state.
    """

    def __init__(
        self,
        image_shape: Sequence[int],
        *,
        num_classes: int = 10,
        conv_features: Sequence[int] = (32, 64),
        hidden_features: int = 256,
        dropout_rate: float = 0.025,
        axis_name: str | tuple[str, ...] | None = None,
        rngs: nnx.Rngs,
    ):
        height, width, channels = image_shape
        c1, c2 = conv_features
        self.conv1 = nnx.Conv(channels, c1, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(c1, axis_name=axis_name, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=dropout_rate)
        self.conv2 = nnx.Conv(c1, c2, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(c2, axis_name=axis_name, rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear((height // 4) * (width // 4) * c2, hidden_features, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=dropout_rate)
        self.linear2 = nnx.Linear(hidden_features, num_classes, rngs=rngs)

    def __call__(self, images_BxHxWxC: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = self.dropout1(self.conv1(images_BxHxWxC), rngs=rngs)
        x = self.avg_pool(nnx.relu(self.batch_norm1(x)))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        logits_BxC = self.linear2(x)
        return logits_BxC
