"""The LM's output: hidden states -> logits, or the per-token cross-entropy in nats.

The head is the tied token embedding or a kernel of its own (`Head`); `token_outputs`
makes the logits whole or, with a ``loss_chunk``, a chunk of the sequence at a time
(`chunked_token_nats`), so that the ``[batch, time, vocab]`` logits never exist at once.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen.dtypes import promote_dtype

from experiments.lm.layers import EMBED, VOCAB, normal


class Head(nn.Module):
    """The output projection's kernel ``[embed, vocab]`` when embeddings are not tied:
    `nn.Dense`'s ``head/kernel`` parameter (no bias), reachable as ``self.kernel``
    so that the logits can be made whole or in chunks (`project`)."""

    features: int
    in_features: int

    def setup(self):
        init = normal(0.02, (EMBED, VOCAB))
        self.kernel = self.param("kernel", init, (self.in_features, self.features))


def project(x_BxTxE: jax.Array, kernel_ExV: jax.Array, dtype: Any = None) -> jax.Array:
    """``x @ kernel`` in ``dtype`` (promoted as flax layers promote): the logits."""
    x_BxTxE, kernel_ExV = promote_dtype(x_BxTxE, kernel_ExV, dtype=dtype)
    return jax.lax.dot_general(x_BxTxE, kernel_ExV, (((x_BxTxE.ndim - 1,), (0,)), ((), ())))


def token_nats(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Per-token cross-entropy ``[B, T]`` in nats, computed in float32 (or wider)."""
    logits_BxTxV = logits_BxTxV.astype(jnp.promote_types(logits_BxTxV.dtype, jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)


def chunked_token_nats(
    x_BxTxE: jax.Array, targets_BxT: jax.Array, logits_fn: Any, chunk: int
) -> jax.Array:
    """`token_nats` of ``logits_fn(x)``, ``chunk`` positions of the sequence at a time.

    Each chunk's logits are made, reduced to nats and dropped, and made again in
    the backward pass (``jax.checkpoint``): the ``[batch, time, vocab]`` logits,
    and their float32 copy, never exist at once. The same numbers as computing
    them whole, for a fraction of the memory when the vocabulary is large.
    """

    @jax.checkpoint
    def nats(x, targets):
        return token_nats(logits_fn(x), targets)

    # A loop (lax.map), so that the chunks run one after another, the backward
    # pass's too; unrolled, XLA may keep every chunk's logits alive at once.
    batch, length = targets_BxT.shape
    whole = length - length % chunk
    x_NxBxCxE = jnp.moveaxis(x_BxTxE[:, :whole].reshape(batch, -1, chunk, x_BxTxE.shape[-1]), 1, 0)
    targets_NxBxC = jnp.moveaxis(targets_BxT[:, :whole].reshape(batch, -1, chunk), 1, 0)
    nats_NxBxC = jax.lax.map(lambda pair: nats(*pair), (x_NxBxCxE, targets_NxBxC))
    pieces = [jnp.moveaxis(nats_NxBxC, 0, 1).reshape(batch, whole)]
    if whole < length:  # the rest, shorter than a chunk
        pieces.append(nats(x_BxTxE[:, whole:], targets_BxT[:, whole:]))
    return jnp.concatenate(pieces, axis=1)


def token_outputs(
    x_BxTxE: jax.Array, targets_BxT: jax.Array | None, logits_fn: Any, loss_chunk: int | None
) -> jax.Array:
    """What the model returns for each token of the final hidden states ``x_BxTxE``.

    Args:
      x_BxTxE: the hidden states after the final norm.
      targets_BxT: the next tokens, or None.
      logits_fn: hidden states -> logits (the head, or the tied embedding).
      loss_chunk: with targets, compute the logits this many positions at a time
        (`chunked_token_nats`); None, 0 or the whole sequence: all at once.

    Returns:
      The logits ``[batch, time, vocab]``, or with targets the per-token
      cross-entropy in nats ``[batch, time]``.
    """
    if targets_BxT is None:
        return logits_fn(x_BxTxE)
    if not loss_chunk or loss_chunk >= x_BxTxE.shape[1]:
        return token_nats(logits_fn(x_BxTxE), targets_BxT)
    return chunked_token_nats(x_BxTxE, targets_BxT, logits_fn, loss_chunk)
