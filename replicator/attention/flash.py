"""Flash attention in XLA's operations: a block of queries against a block of keys,
a chunk of each at a time.

The ``"xla"`` implementation of the kernel interface (`replicator.attention.blocks`):
queries ``[B, Tq, K, G, D]`` (``K`` key heads, ``G`` queries per key head) attend to
keys and values ``[B, Tk, K, D]`` through one ``[B, c, K, G, c]`` block of float32
scores at a time, folded into an online softmax (the running maximum, the sum of
exponentials and the weighted values, Dao et al.'s flash attention); `attend`
returns the output and its log-sum-exp, and `block_grads`, given the output and
log-sum-exp of every block the queries saw (not this block's alone), this block's
share of the gradients, recomputing its probabilities from them. A chunk as long
as the block is one plain block of scores.

Which pairs of chunks are computed is static, given by a layout: any hashable
object with ``size`` (positions per chunk) and ``groups()``, a list of
``(pairs [n, 2] of (query chunk, key chunk), causal)``: every pair of a group is
computed alike, all visible or (``causal``) under the causal triangle of a chunk
with itself. Pairs left out are not computed at all. `Chunks` lays out a block
whose mask is causal (by positions) or none.

Packed documents add segment ids (``(query ids [B, Tq], key ids [B, Tk])``): a
query sees a key only where their ids are equal, a mask made inside each pair
from the two chunks' ids. Blocks where nothing is visible cost their compute but
change nothing: a row with no visible key has an output of zero and a log-sum-exp
of ``-inf``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from replicator.runtime import compat
from replicator.spmd.context import vary

_F32 = jnp.float32
Segments = tuple[jax.Array, jax.Array] | None  # (query ids [B, Tq], key ids [B, Tk])


@dataclasses.dataclass(frozen=True)
class Chunks:
    """A block of ``q_len`` queries and ``k_len`` keys in chunks of ``size``: all visible
    (``causal=False``), or a query at position ``offset + i`` seeing the keys at
    positions ``0 .. offset + i`` (the queries start ``offset`` after the keys).

    >>> [(p.tolist(), c) for p, c in Chunks(4, 4, causal=True, offset=0, size=2).groups()]
    [([[1, 0]], False), ([[0, 0], [1, 1]], True)]
    """

    q_len: int
    k_len: int
    causal: bool
    offset: int
    size: int

    def groups(self) -> list[tuple[np.ndarray, bool]]:
        """``(pairs [n, 2] of (query chunk, key chunk), causal)``: the pairs whose queries
        start after their keys (all visible), then those that start together (causal
        within); those that start before are hidden and left out."""
        rows = self.offset + np.arange(0, self.q_len, self.size)
        cols = np.arange(0, self.k_len, self.size)
        if not self.causal:
            return [(np.argwhere(np.ones((rows.size, cols.size), bool)).astype(np.int32), False)]
        after, level = rows[:, None] > cols[None, :], rows[:, None] == cols[None, :]
        return [
            (np.argwhere(x).astype(np.int32), causal)
            for x, causal in ((after, False), (level, True))
        ]


def chunks(q_len: int, k_len: int, *, causal: bool, offset: int, target: int) -> Chunks:
    """`Chunks` of the largest size up to ``target`` that divides both lengths and the
    offset: every pair of chunks is then all visible, all hidden, or cut by its diagonal.

    >>> chunks(12, 8, causal=False, offset=0, target=512).size
    4
    """
    common = math.gcd(q_len, k_len, offset)
    size = max(c for c in range(1, min(common, target) + 1) if common % c == 0)
    return Chunks(q_len, k_len, causal, offset, size)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, layout: Any, segments: Segments = None, into=None
) -> tuple[jax.Array, jax.Array]:
    """``q [B, Tq, K, G, D]``'s attention to ``k``, ``v`` ``[B, Tk, K, D]`` over
    ``layout``'s pairs of chunks: no ``[Tq, Tk]`` scores.

    Args:
      q, k, v: queries, keys and values.
      layout: the static pairs of chunks (see the module docstring).
      segments: None, or ``(query ids, key ids)``: a query sees only keys of its id.
      into: None, or ``(out, lse)`` of the queries' attention to other keys, which
        the block is folded into (an online softmax with a sum of one).

    Returns:
      ``(out, lse)``: the float32 output shaped like ``q`` and its log-sum-exp
      ``[B, Tq, K, G]``.

    >>> x = jax.random.normal(jax.random.key(0), (1, 4, 1, 1, 8))
    >>> out, lse = attend(x, x[:, :, :, 0], x[:, :, :, 0], Chunks(4, 4, True, 0, 2))
    >>> plain = jax.nn.dot_product_attention(x[:, :, 0], x[:, :, 0], x[:, :, 0], is_causal=True)
    >>> bool(jnp.allclose(out[:, :, 0], plain, atol=1e-6))
    True
    """
    if into is None:
        return finish(fold(empty(q, k, v), q, k, v, layout, segments))
    out, lse = into
    return finish(fold((out, lse, jnp.ones_like(lse)), q, k, v, layout, segments))


def block_grads(
    q, k, v, out, lse, d_out, layout: Any, segments: Segments = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Flash attention's backward over ``layout``'s pairs of chunks: float32 gradients of
    ``q``, ``k`` and ``v``, given the output ``out``, its log-sum-exp ``lse`` (over
    every key the queries saw) and the output's cotangent ``d_out``."""
    delta = jnp.sum(d_out * out, axis=-1)  # rowsum(dO * O), flash attention's D
    return fold_grads(q, d_out, lse, delta, k, v, layout, segments)


def pair_loop(layout: Any, compute, carry):
    """``carry`` through ``compute(carry, i, j, mask)`` for every pair of chunks (query
    chunk ``i``, key chunk ``j``) of ``layout``'s groups, ``mask`` being None (all
    visible) or the causal triangle. One ``lax.scan`` per group of pairs.

    The pairs are static on purpose: a per-pair ``lax.cond`` (or a mask computed
    per pair from traced positions), inside a custom VJP's forward under a scan of
    layers, made JAX 0.10 stack every pair's scores or masks as residuals when the
    model was differentiated (32 GiB for lm_1b's gather at 64k on a v5e-16)."""
    tri = np.tri(layout.size, dtype=bool)
    for pairs, causal in layout.groups():
        if not len(pairs):
            continue

        def step(c, pair, mask=tri if causal else None):
            return compute(c, *pair, mask), None

        carry = jax.lax.scan(step, carry, jnp.asarray(pairs))[0]
    return carry


def _chunk(x, c, size):
    """Chunk ``c`` (traced) of ``x``'s sequence (axis 1)."""
    return jax.lax.dynamic_slice_in_dim(x, c * size, size, 1)


def _put_chunk(x, c, size, value):
    return jax.lax.dynamic_update_slice_in_dim(x, value, c * size, 1)


def _pair_mask(mask, segments: Segments, i, j, size, tie):
    """``mask`` (None or a static ``[c, c]``) and, with segments, where query chunk
    ``i``'s ids equal key chunk ``j``'s: ``[B, c, c]``.

    The ids are tied to ``tie`` (this pair's queries) by an optimization barrier. The
    mask depends only on the ids, which a scan of layers holds constant: without the
    tie, differentiating that scan hoists every pair's mask out of it (JAX's
    loop-invariant residuals) and stacks them all, as it did the positions' masks."""
    if segments is None:
        return mask
    q_ids, k_ids, _ = jax.lax.optimization_barrier((*segments, tie))
    same = _chunk(q_ids, i, size)[:, :, None] == _chunk(k_ids, j, size)[:, None, :]
    return same if mask is None else same & mask


def fold(acc, q, k, v, layout: Any, segments: Segments = None):
    """``acc`` (`empty`'s ``(o, m, l)``) with ``q``'s attention to ``k``, ``v`` folded
    in, one pair of ``layout``'s chunks at a time (a ``[B, c, K, G, c]`` block of
    scores), masked by ``segments`` (None: none)."""
    size = layout.size
    axes = varying(*acc, q, k, v)

    def compute(acc, i, j, mask):
        part, q_i = tuple(_chunk(x, i, size) for x in acc), _chunk(q, i, size)
        mask = _pair_mask(mask, segments, i, j, size, tie=q_i)
        new = _attend(part, q_i, _chunk(k, j, size), _chunk(v, j, size), mask)
        return tuple(_put_chunk(x, i, size, vary(y, axes)) for x, y in zip(acc, new))

    acc = tuple(vary(x, axes) for x in acc)
    return pair_loop(layout, compute, acc)


def fold_grads(q, d_out, lse, delta, k, v, layout: Any, segments: Segments = None):
    """Flash attention's backward over ``layout``'s pairs of chunks, masked by
    ``segments``: float32 gradients of ``q``, ``k`` and ``v``."""
    size = layout.size
    axes = varying(q, d_out, lse, k, v)

    def compute(grads, i, j, mask):
        rows = [_chunk(x, i, size) for x in (q, d_out, lse, delta)]
        mask = _pair_mask(mask, segments, i, j, size, tie=rows[1])
        parts = _block_grads(*rows, _chunk(k, j, size), _chunk(v, j, size), mask)
        return tuple(
            _put_chunk(g, c, size, _chunk(g, c, size) + vary(p, axes))
            for g, c, p in zip(grads, (i, j, j), parts)
        )

    return pair_loop(layout, compute, zero_grads((q, k, v), d_out, lse))


# Online softmax over blocks of keys: ``(o, m, l)`` per query row, the weighted sum
# of values, the running maximum score and the sum of ``exp(score - m)``.


def empty(q, *others):
    """An online softmax with nothing folded in, for ``q``'s rows: ``(o, m, l)``."""
    axes = varying(q, *others)
    zeros = vary(jnp.zeros(q.shape[:-1], _F32), axes)
    return vary(jnp.zeros(q.shape, _F32), axes), zeros - jnp.inf, zeros


def finish(acc):
    """A finished online softmax ``(o, m, l)``'s output and log-sum-exp (a row that saw
    nothing: zeros and ``-inf``)."""
    o, m, total = acc
    seen = total > 0
    return o / jnp.where(seen, total, 1.0)[..., None], jnp.where(seen, m + jnp.log(total), -jnp.inf)


def zero_grads(xs, *others):
    """Float32 zeros shaped like ``xs``, varying over every axis ``xs`` and ``others``
    vary over (a gradient accumulator that any block may add to)."""
    axes = varying(*xs, *others)
    return tuple(vary(jnp.zeros(x.shape, _F32), axes) for x in xs)


def varying(*xs) -> tuple[str, ...]:
    """The manual mesh axes any of ``xs`` varies over (JAX's ``check_vma`` types)."""
    return tuple(sorted(set().union(*(compat.varying_manual_axes(x) for x in xs))))


def _scores(q, k, mask):
    """``q k^T / sqrt(D)`` in float32 ``[B, Tq, K, G, Tk]``, -inf where ``mask`` (None:
    nothing; ``[Tq, Tk]`` or ``[B, Tq, Tk]``) hides."""
    scores = jnp.einsum("bqkgd,bskd->bqkgs", q, k, preferred_element_type=_F32)
    scores = scores * (1 / math.sqrt(q.shape[-1]))
    if mask is None:
        return scores
    mask = jnp.asarray(mask)
    mask = mask[None] if mask.ndim == 2 else mask
    return jnp.where(mask[:, :, None, None, :], scores, -jnp.inf)


def _attend(acc, q, k, v, mask):
    """``acc`` with ``q``'s attention to one block of keys folded in."""
    o, m, total = acc
    scores = _scores(q, k, mask)
    # The maximum only keeps exp() in range: the result does not depend on it.
    m_new = jax.lax.stop_gradient(jnp.maximum(m, scores.max(-1)))
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing visible yet
    p = jnp.exp(scores - shift[..., None])
    fade = jnp.exp(m - shift)
    pv = jnp.einsum("bqkgs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=_F32)
    return o * fade[..., None] + pv, m_new, total * fade + p.sum(-1)


def _block_grads(q, d_out, lse, delta, k, v, mask):
    """Flash attention's backward for one block: the gradients of ``q``, ``k`` and ``v``."""
    p = jnp.exp(_scores(q, k, mask) - lse[..., None])  # the probabilities, 0 where hidden
    scale = 1 / math.sqrt(q.shape[-1])
    d_v = jnp.einsum("bqkgs,bqkgd->bskd", p, d_out, preferred_element_type=_F32)
    d_p = jnp.einsum("bqkgd,bskd->bqkgs", d_out, v, preferred_element_type=_F32)
    d_s = p * (d_p - delta[..., None]) * scale
    d_q = jnp.einsum("bqkgs,bskd->bqkgd", d_s, k, preferred_element_type=_F32)
    d_k = jnp.einsum("bqkgs,bqkgd->bskd", d_s, q, preferred_element_type=_F32)
    return d_q, d_k, d_v
