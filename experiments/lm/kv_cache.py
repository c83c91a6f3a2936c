"""A key/value cache for decoding the LM one token at a time (`experiments.lm.sample`).

The cache is an explicit pytree passed into the model and returned by it
(``model.apply(variables, tokens, cache=cache) -> (logits, cache)``), not a
mutable Flax collection: a decode step stays a pure function whose cache can be
given shardings, donated and counted like any other argument.

Layout. Keys and values are stacked over layers, ``[layers, batch, slots, kv_heads,
head_dim]`` whether the blocks are scanned or not (the scan slices a layer's part,
the unrolled loop indexes it), and hold ``num_kv_heads`` heads, not ``num_heads``:
grouped-query attention caches ``K`` heads and the ``H / K`` queries of a group
read the same one. ``index`` is the number of slots written (every row writes the
same slot at each step) and ``start`` each row's first real slot: prompts of
different lengths are left-padded to one length, so that one dynamic-update-slice
writes the whole batch's new tokens, and a row's positions count from its own
start (``slot - start``), so each row computes exactly what it would alone.

Sliding windows (Gemma's local layers, `attention_mask`'s ``window``): every layer keeps
all its slots and a local layer masks those more than ``window - 1`` before each query.
One stack for local and global layers alike is what a scan over the layers slices (the
kinds alternate, Gemma 3's five local to one global); a ring of ``window`` slots per
local layer would hold less (for Gemma 3 at 32k tokens and a 1k window, about a sixth of
the cache) but needs a second stack and per-kind indexing: not done yet.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

_MASKED = -1e30  # a score no softmax weighs (finite: a fully masked row stays NaN-free)


@flax.struct.dataclass
class KVCache:
    """The keys and values of every layer for the slots written so far.

    Attributes:
      k, v: ``[layers, batch, slots, kv_heads, head_dim]``.
      index: int32 ``[]``: slots written; the next token goes to slot ``index``.
      start: int32 ``[batch]``: each row's first real slot (left padding before it).
    """

    k: jax.Array
    v: jax.Array
    index: jax.Array
    start: jax.Array

    @property
    def length(self) -> int:
        """How many slots the cache holds."""
        return self.k.shape[2]


def cache_dims(model: Any) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a `experiments.lm.model.Transformer`.

    >>> from experiments.lm.model import Transformer
    >>> cache_dims(Transformer(num_layers=2, num_heads=4, embed_dim=32))
    (2, 4, 8)
    """
    heads = model.num_heads
    kv_heads = getattr(model, "num_kv_heads", None) or heads
    head_dim = getattr(model, "head_dim", None) or model.embed_dim // heads
    return model.num_layers, kv_heads, head_dim


def init_cache(model: Any, start_B: Any, length: int, dtype: Any = jnp.float32) -> KVCache:
    """An empty cache of ``length`` slots for ``len(start_B)`` rows of ``model``.

    Args:
      model: the `Transformer` (its layers, kv heads and head width).
      start_B: int ``[batch]``: each row's first real slot (its left padding).
      length: slots: the longest prompt plus the tokens to generate.
      dtype: the keys' and values' dtype (the model's compute dtype).

    >>> from experiments.lm.model import Transformer
    >>> model = Transformer(num_layers=2, num_heads=4, embed_dim=32)
    >>> init_cache(model, jnp.zeros(3, jnp.int32), 10).k.shape
    (2, 3, 10, 4, 8)
    """
    layers, kv_heads, head_dim = cache_dims(model)
    start_B = jnp.asarray(start_B, jnp.int32)
    shape = (layers, start_B.shape[0], length, kv_heads, head_dim)
    zeros = jnp.zeros(shape, dtype)
    return KVCache(zeros, zeros, jnp.zeros((), jnp.int32), start_B)


def cache_bytes(model: Any, batch: int, length: int, dtype: Any = jnp.float32) -> int:
    """The bytes of a cache of ``batch`` rows and ``length`` slots (keys and values).

    >>> from experiments.lm.model import Transformer
    >>> cache_bytes(Transformer(num_layers=2, num_heads=4, embed_dim=32), 1, 10)
    5120
    """
    layers, kv_heads, head_dim = cache_dims(model)
    return 2 * layers * batch * length * kv_heads * head_dim * np.dtype(dtype).itemsize


def positions(cache: KVCache, length: int) -> jax.Array:
    """int32 ``[batch, length]``: the positions of the next ``length`` tokens, each row's
    counted from its own start (a padding slot's clipped to 0: it is masked anyway)."""
    slots_T = cache.index + jnp.arange(length, dtype=jnp.int32)
    return jnp.maximum(slots_T[None, :] - cache.start[:, None], 0)


def attention_mask(cache: KVCache, length: int, window: int | None = None) -> jax.Array:
    """bool ``[batch, length, slots]``: which slots each of the next ``length`` tokens
    attends to: its row's real slots up to its own (causal), never the padding, and
    with a sliding ``window`` only the ``window - 1`` before its own (a row's positions
    and slots differ by its start alone, so the distance is the same in both)."""
    slots_S = jnp.arange(cache.length, dtype=jnp.int32)
    query_T = cache.index + jnp.arange(length, dtype=jnp.int32)
    distance_TxS = query_T[:, None] - slots_S[None, :]
    causal_TxS = distance_TxS >= 0
    if window is not None:
        causal_TxS = causal_TxS & (distance_TxS < window)
    real_BxS = slots_S[None, :] >= cache.start[:, None]
    return causal_TxS[None] & real_BxS[:, None, :]


def attend(
    q_BxTxHxD: jax.Array,
    k_BxTxKxD: jax.Array,
    v_BxTxKxD: jax.Array,
    layer: tuple[jax.Array, jax.Array],
    index: jax.Array,
    mask_BxTxS: jax.Array,
    softcap: float | None = None,
) -> jax.Array:
    """Attention of the new tokens' queries over one layer's cache with their own keys
    and values written in at slot ``index`` (a local copy: the caller writes the
    cache once for all layers, `write`), ``softmax(q k^T / sqrt(D))`` in float32.

    Args:
      q_BxTxHxD: the new tokens' queries (rotated already where positions are rotary).
      k_BxTxKxD, v_BxTxKxD: their keys and values, ``K`` heads (``H`` divides by it).
      layer: this layer's cached keys and values, ``[batch, slots, K, D]`` each.
      index: the slot of the first new token.
      mask_BxTxS: `attention_mask`.
      softcap: None, or the scores become ``softcap * tanh(score / softcap)`` (Gemma 2).

    Returns:
      ``[batch, T, H, D]`` in ``q``'s dtype.
    """
    batch, length, heads, head_dim = q_BxTxHxD.shape
    kv_heads = k_BxTxKxD.shape[2]
    at = (0, index, 0, 0)
    k_BxSxKxD = jax.lax.dynamic_update_slice(layer[0], k_BxTxKxD.astype(layer[0].dtype), at)
    v_BxSxKxD = jax.lax.dynamic_update_slice(layer[1], v_BxTxKxD.astype(layer[1].dtype), at)
    # Query head h reads kv head h // (H / K): HF's repeat_kv grouping.
    q_BxTxKxGxD = q_BxTxHxD.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum(
        "btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD.astype(q_BxTxHxD.dtype),
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    scores = scores / np.sqrt(head_dim).astype(np.float32)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask_BxTxS[:, None, None], scores, _MASKED)
    weights = jax.nn.softmax(scores, axis=-1).astype(q_BxTxHxD.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, v_BxSxKxD.astype(q_BxTxHxD.dtype))
    return out.reshape(batch, length, heads, head_dim)


def write(cache: KVCache, k_LxBxTxKxD: jax.Array, v_LxBxTxKxD: jax.Array) -> KVCache:
    """``cache`` with every layer's new keys and values at slot ``index`` (in place
    where the caller donates the cache) and ``index`` advanced past them."""
    at = (0, 0, cache.index, 0, 0)
    k = jax.lax.dynamic_update_slice(cache.k, k_LxBxTxKxD.astype(cache.k.dtype), at)
    v = jax.lax.dynamic_update_slice(cache.v, v_LxBxTxKxD.astype(cache.v.dtype), at)
    return cache.replace(k=k, v=v, index=cache.index + k_LxBxTxKxD.shape[2])
