"""The CNN of the tf.distribute custom-training tutorial."""

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class CNN(nn.Module):
    """Conv 32 3x3 relu, max-pool 2, Conv 64 3x3 relu, max-pool 2, Dense 64 relu, Dense C.

    Attributes:
      num_classes: size of the output layer.
      conv_features: channels of the convolutions.
      dense_features: width of the hidden dense layer.
      padding: convolution padding; the tutorial's 28x28 model uses "VALID", 8x8
        digits need "SAME" to survive two poolings.
      dtype: compute dtype; None (the default) computes in the dtype of the inputs
        and parameters, which is how replicator's precision policy sets it.
    """

    num_classes: int = 10
    conv_features: Sequence[int] = (32, 64)
    dense_features: int = 64
    padding: str = "SAME"
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, images_BxHxWxC: jax.Array) -> jax.Array:
        x = images_BxHxWxC
        for features in self.conv_features:
            x = nn.Conv(features, (3, 3), padding=self.padding, dtype=self.dtype)(x)
            x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.dense_features, dtype=self.dtype)(x))
        logits_BxC = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return logits_BxC
