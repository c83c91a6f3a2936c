"""SN-GAN in miniature: a DCGAN-shaped generator and a spectrally normalised discriminator.

The shapes of the seed's GAN (TF-Replicator trained SN-GAN on CIFAR-10 and
ImageNet) scaled to 8x8 grayscale digits: the generator upsamples a latent
vector with BatchNorm + ReLU blocks and ends in ``tanh``; every layer of the
discriminator has its weight divided by its largest singular value
(Miyato et al. 2018), estimated by one step of power iteration per update.
"""

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

SPECTRAL = "spectral"  # the variable collection of the power-iteration state


class Generator(nn.Module):
    """Dense -> BN -> ReLU -> 4x4 -> ConvTranspose stride 2 -> BN -> ReLU -> 3x3 conv -> tanh.

    Attributes:
      features: channels of the 4x4 map and of the 8x8 map.
      channels: channels of the generated image.
      axis_name: the replica axes (``repl.axis_name``): BatchNorm then uses the
        statistics of the global batch, under `Replicator.run` as under `compile`.
      dtype: compute dtype; None computes in the dtype of inputs and parameters
        (how replicator's precision policy sets it).
    """

    features: Sequence[int] = (64, 32)
    channels: int = 1
    axis_name: Any = None
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, noise_BxZ: jax.Array, train: bool = True) -> jax.Array:
        batch_norm = lambda: nn.BatchNorm(
            use_running_average=not train, momentum=0.9, axis_name=self.axis_name, dtype=self.dtype
        )
        coarse, fine = self.features
        x = nn.Dense(4 * 4 * coarse, dtype=self.dtype)(noise_BxZ)
        x = nn.relu(batch_norm()(x)).reshape(-1, 4, 4, coarse)
        x = nn.ConvTranspose(fine, (4, 4), strides=(2, 2), padding="SAME", dtype=self.dtype)(x)
        x = nn.relu(batch_norm()(x))
        x = nn.Conv(self.channels, (3, 3), padding="SAME", dtype=self.dtype)(x)
        images_BxHxWxC = jnp.tanh(x)
        return images_BxHxWxC


class Discriminator(nn.Module):
    """Spectrally normalised convolutions with leaky ReLU, then a spectrally normalised logit.

    Attributes:
      features: channels of the convolutions; the first keeps the resolution,
        the others halve it.
      dtype: compute dtype, as for `Generator`.
    """

    features: Sequence[int] = (32, 64, 128)
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, images_BxHxWxC: jax.Array, update_stats: bool = False) -> jax.Array:
        def normalised(layer: nn.Module) -> nn.Module:
            return nn.SpectralNorm(layer, collection_name=SPECTRAL)

        x = images_BxHxWxC
        for i, features in enumerate(self.features):
            stride = 1 if i == 0 else 2
            kernel = (3, 3) if stride == 1 else (4, 4)
            conv = nn.Conv(features, kernel, strides=stride, padding="SAME", dtype=self.dtype)
            x = nn.leaky_relu(normalised(conv)(x, update_stats=update_stats), 0.1)
        x = x.reshape(x.shape[0], -1)
        logits_B = normalised(nn.Dense(1, dtype=self.dtype))(x, update_stats=update_stats)
        return logits_B[:, 0]
