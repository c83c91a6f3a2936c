"""A Vision Transformer (Dosovitskiy et al. 2021), as big_vision's ``vit.py`` and Hugging
Face's ``ViTModel`` compute it.

Images are cut into ``patch_size`` squares by a strided convolution, a learned
[CLS] token goes in front, learned position embeddings (the CLS token's too, as
Hugging Face's) are added, then pre-LayerNorm encoder blocks (bidirectional
multi-head self-attention with one fused q/k/v projection, an exact-erf GELU MLP,
each inside a residual), a final LayerNorm, and a linear head on the CLS token.
The head starts at zero (big_vision's ``head_zeroinit``), so a fine-tune starts
from uniform predictions.

Inputs are the classify experiment's float images in [0, 1]: the model maps them
to [-1, 1] (Hugging Face's ``ViTImageProcessor`` mean = std = 0.5, big_vision's
``value_range(-1, 1)``), resizes them (bilinear) to ``image_size`` where they
differ (big_vision's ``resize`` step), and repeats a grayscale channel to
``num_channels`` when a model of RGB weights sees grayscale scans.

Every parameter carries logical axis names (`nn.with_logical_partitioning`), the
LM's (`experiments.lm.layers`): ``embed`` for the width, ``heads`` and ``kv``
(the head width) for attention, ``mlp`` for the MLP's hidden width, None where a
dimension is never split; the default rules shard them as they shard the LM.

`resize_position_embedding` is the resampling of the position table to another
grid that `experiments.classify.hf` applies to a checkpoint of another image
size: bicubic, as Hugging Face's ``interpolate_pos_encoding`` (PyTorch's).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import promote_dtype

from replicator.errors import ConfigError
from replicator.parallel.activations import constrain

EMBED, MLP, HEADS, KV = "embed", "mlp", "heads", "kv"
ACTIVATION_BxTxE = ("activation_batch", "activation_length", "activation_embed")


def _normal(names: tuple[str | None, ...], stddev: float = 0.02) -> Any:
    return nn.with_logical_partitioning(nn.initializers.normal(stddev), names)


def _zeros(names: tuple[str | None, ...]) -> Any:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def _ones(names: tuple[str | None, ...]) -> Any:
    return nn.with_logical_partitioning(nn.initializers.ones_init(), names)


def _layer_norm(eps: float, dtype: Any, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=eps, dtype=dtype, scale_init=_ones((EMBED,)), bias_init=_zeros((EMBED,)), name=name
    )


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention: ``qkv_kernel [E, 3, H, D]`` (+ ``qkv_bias``),
    ``out_kernel [H, D, E]`` + ``out_bias [E]``."""

    num_heads: int
    qkv_bias: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        E, H = x_BxTxE.shape[-1], self.num_heads
        D = E // H
        kernel = self.param("qkv_kernel", _normal((EMBED, None, HEADS, KV)), (E, 3, H, D))
        x, kernel = promote_dtype(x_BxTxE, kernel, dtype=self.dtype)
        qkv_BxTx3xHxD = jnp.einsum("bte,ekhd->btkhd", x, kernel)
        if self.qkv_bias:
            bias = self.param("qkv_bias", _zeros((None, HEADS, KV)), (3, H, D))
            qkv_BxTx3xHxD = qkv_BxTx3xHxD + jnp.asarray(bias, qkv_BxTx3xHxD.dtype)
        q, k, v = (qkv_BxTx3xHxD[:, :, i] for i in range(3))
        out_BxTxHxD = jax.nn.dot_product_attention(q, k, v)  # every token sees every token
        out_kernel = self.param("out_kernel", _normal((HEADS, KV, EMBED)), (H, D, E))
        out_bias = self.param("out_bias", _zeros((EMBED,)), (E,))
        out_BxTxHxD, out_kernel, out_bias = promote_dtype(
            out_BxTxHxD, out_kernel, out_bias, dtype=self.dtype
        )
        return jnp.einsum("bthd,hde->bte", out_BxTxHxD, out_kernel) + out_bias


class FeedForward(nn.Module):
    """``proj(gelu(fc(x)))``, the exact (erf) GELU: Hugging Face's ``"gelu"``."""

    mlp_dim: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        E = x_BxTxE.shape[-1]
        fc = nn.Dense(self.mlp_dim, dtype=self.dtype, kernel_init=_normal((EMBED, MLP)),
                      bias_init=_zeros((MLP,)), name="fc")  # fmt: skip
        proj = nn.Dense(E, dtype=self.dtype, kernel_init=_normal((MLP, EMBED)),
                        bias_init=_zeros((EMBED,)), name="proj")  # fmt: skip
        return proj(nn.gelu(fc(x_BxTxE), approximate=False))


class EncoderBlock(nn.Module):
    """Pre-LayerNorm: ``x + attention(ln(x))``, then ``x + mlp(ln(x))``."""

    num_heads: int
    mlp_dim: int
    norm_eps: float
    qkv_bias: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        attention = SelfAttention(self.num_heads, self.qkv_bias, self.dtype, name="attention")
        x = x_BxTxE + attention(_layer_norm(self.norm_eps, self.dtype, "ln_attention")(x_BxTxE))
        x = constrain(x, ACTIVATION_BxTxE)
        x = x + FeedForward(self.mlp_dim, self.dtype, name="mlp")(
            _layer_norm(self.norm_eps, self.dtype, "ln_mlp")(x)
        )
        return constrain(x, ACTIVATION_BxTxE)


class ViT(nn.Module):
    """The Vision Transformer: patches, [CLS], positions, encoder blocks, head on [CLS].

    Attributes:
      num_classes: size of the head.
      image_size: the side of the (square) images the model sees; inputs of another
        size are resized to it. Sets the position table: ``1 + (image_size //
        patch_size)**2`` rows.
      patch_size: the side of a patch; must divide ``image_size``.
      embed_dim: the width (Hugging Face's ``hidden_size``).
      num_layers: encoder blocks.
      num_heads: attention heads; must divide ``embed_dim``.
      mlp_dim: the MLP's hidden width (``intermediate_size``).
      norm_eps: the LayerNorms' epsilon (big_vision 1e-6; Hugging Face 1e-12).
      qkv_bias: biases on the q/k/v projections.
      num_channels: the patch embedding's input channels (Hugging Face's default, 3:
        RGB); a grayscale image (1 channel) is repeated to them.
      dtype: compute dtype; None computes in the inputs' and parameters' dtype
        (the precision policy's).

    >>> vit = ViT(num_classes=3, image_size=8, patch_size=4, embed_dim=16, num_layers=1,
    ...           num_heads=2, mlp_dim=32, num_channels=1)
    >>> images = jnp.zeros((2, 8, 8, 1))
    >>> variables = jax.eval_shape(vit.init, jax.random.key(0), images)  # shapes only
    >>> jax.eval_shape(vit.apply, variables, images).shape
    (2, 3)
    >>> variables["params"]["position_embedding"].value.shape  # [CLS] + a 2x2 grid
    (5, 16)
    """

    num_classes: int
    image_size: int
    patch_size: int = 16
    embed_dim: int = 768
    num_layers: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    norm_eps: float = 1e-6
    qkv_bias: bool = True
    num_channels: int = 3
    dtype: Any = None

    def setup(self):
        check_shape(self.image_size, self.patch_size, self.embed_dim, self.num_heads)
        E, grid = self.embed_dim, self.image_size // self.patch_size
        p = self.patch_size
        self.patch_embedding = nn.Conv(
            E, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype,
            kernel_init=_normal((None, None, None, EMBED)), bias_init=_zeros((EMBED,)),
        )  # fmt: skip
        self.cls_token = self.param("cls_token", _normal((EMBED,)), (E,))
        self.position_embedding = self.param(
            "position_embedding", _normal((None, EMBED)), (1 + grid * grid, E)
        )
        block = (self.num_heads, self.mlp_dim, self.norm_eps, self.qkv_bias, self.dtype)
        self.blocks = [EncoderBlock(*block, name=f"block_{i}") for i in range(self.num_layers)]
        self.ln_final = _layer_norm(self.norm_eps, self.dtype, "ln_final")
        self.head = nn.Dense(
            self.num_classes, dtype=self.dtype, kernel_init=_zeros((EMBED, None)),
            bias_init=_zeros((None,)),
        )  # fmt: skip

    def encode(self, images_BxHxWxC: jax.Array) -> jax.Array:
        """The final LayerNorm's tokens ``[B, 1 + N, E]``, the [CLS] token's first (Hugging
        Face's ``last_hidden_state``)."""
        x = self._pixels(images_BxHxWxC)
        patches_BxGxGxE = self.patch_embedding(x)
        B, E = patches_BxGxGxE.shape[0], patches_BxGxGxE.shape[-1]
        patches_BxNxE = patches_BxGxGxE.reshape(B, -1, E)  # row-major: HF's flatten(2)
        cls, positions = promote_dtype(self.cls_token, self.position_embedding, dtype=self.dtype)
        cls_Bx1xE = jnp.broadcast_to(cls.astype(patches_BxNxE.dtype), (B, 1, E))
        x_BxTxE = jnp.concatenate([cls_Bx1xE, patches_BxNxE], axis=1) + positions
        x_BxTxE = constrain(x_BxTxE, ACTIVATION_BxTxE)
        for block in self.blocks:
            x_BxTxE = block(x_BxTxE)
        return self.ln_final(x_BxTxE)

    def __call__(self, images_BxHxWxC: jax.Array) -> jax.Array:
        """Logits ``[B, num_classes]`` from the [CLS] token."""
        return self.head(self.encode(images_BxHxWxC)[:, 0])

    def _pixels(self, images_BxHxWxC: jax.Array) -> jax.Array:
        """[0, 1] images -> [-1, 1], at ``image_size``, with ``num_channels`` channels."""
        x = images_BxHxWxC * 2.0 - 1.0
        B, H, W, C = x.shape
        if (H, W) != (self.image_size, self.image_size):
            x = jax.image.resize(x, (B, self.image_size, self.image_size, C), "bilinear")
        if C != self.num_channels:
            if C != 1:
                raise ConfigError(
                    f"config.model.num_channels={self.num_channels}, but "
                    f"the images have {C} channels; only grayscale is repeated to fit"
                )
            x = jnp.repeat(x, self.num_channels, axis=-1)
        return x


def check_shape(image_size: Any, patch_size: int, embed_dim: int, num_heads: int) -> None:
    """Raises a one-line `ConfigError` unless the patches tile the image and the heads the
    width.

    >>> check_shape(8, 3, 32, 2)
    Traceback (most recent call last):
    ...
    replicator.errors.ConfigError: config.model.patch_size=3 does not divide image_size=8
    """
    if not isinstance(image_size, int) or image_size <= 0:
        raise ConfigError(
            f"config.model.image_size={image_size!r}: the ViT needs the side of its square "
            "images (8 for digits, 32 for cifar10)"
        )
    if patch_size <= 0 or image_size % patch_size:
        raise ConfigError(
            f"config.model.patch_size={patch_size} does not divide image_size={image_size}"
        )
    if num_heads <= 0 or embed_dim % num_heads:
        raise ConfigError(
            f"config.model.num_heads={num_heads} does not divide config.model.embed_dim={embed_dim}"
        )


def resize_position_embedding(table_TxE: np.ndarray, grid: int) -> np.ndarray:
    """A position table ``[1 + G*G, E]`` ([CLS] first) resampled to ``[1 + grid*grid, E]``.

    The [CLS] row stays; the ``G x G`` grid is resampled bicubically as PyTorch's
    ``interpolate(mode="bicubic", align_corners=False)`` does it (Hugging Face's
    ``ViTEmbeddings.interpolate_pos_encoding``), in float64 on the host.

    Args:
      table_TxE: the checkpoint's table, [CLS] row first, square grid after.
      grid: the new grid's side (``image_size // patch_size``).

    Returns:
      The resampled table, in the input's dtype.

    >>> table = np.arange(10.0).reshape(5, 2)  # [CLS] + a 2x2 grid
    >>> resize_position_embedding(table, 2) is table, resize_position_embedding(table, 1).shape
    (True, (2, 2))
    """
    rows, E = table_TxE.shape
    side = math.isqrt(rows - 1)
    if side * side != rows - 1:
        raise ConfigError(f"a position table of {rows - 1} patch rows is no square grid")
    if side == grid:
        return table_TxE
    grid_GxGxE = np.asarray(table_TxE[1:], np.float64).reshape(side, side, E)
    weights = _bicubic_matrix(side, grid)
    resized = np.einsum("ih,jw,hwe->ije", weights, weights, grid_GxGxE).reshape(-1, E)
    return np.concatenate([np.asarray(table_TxE[:1], np.float64), resized]).astype(table_TxE.dtype)


def _bicubic_matrix(size_in: int, size_out: int, a: float = -0.75) -> np.ndarray:
    """``[size_out, size_in]`` weights of PyTorch's 1-D bicubic resampling (Keys' kernel,
    a = -0.75, half-pixel centres, borders clamped, no antialiasing)."""

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    matrix = np.zeros((size_out, size_in))
    for i in range(size_out):
        source = (i + 0.5) * size_in / size_out - 0.5
        start = min(math.floor(source), size_in - 1)
        t = min(max(source - start, 0.0), 1.0)
        for offset, w in zip((-1, 0, 1, 2), (far(t + 1), near(t), near(1 - t), far(2 - t))):
            matrix[i, min(max(start + offset, 0), size_in - 1)] += w
    return matrix
