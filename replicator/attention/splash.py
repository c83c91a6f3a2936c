"""Pallas's splash attention (the TPU kernel MaxText uses): one device's program.

Splash works on blocks of the scores in VMEM, never writes the scores or the
probabilities to HBM, and skips the blocks its mask hides. Off a TPU it runs in
Pallas's interpreter: slow, but the same program, so its numbers can be checked
anywhere. Two uses:

* `whole_sequence`: causal attention over a whole sequence
  (`replicator.attention.kernels.causal_attention`'s ``"splash"``), differentiated by
  splash's backward kernels against its output and log-sum-exp, which a remat policy
  can keep by name (``context``).
* `attend_block` / `block_grads`: the kernel interface of
  `replicator.attention.blocks`. The forward is the public kernel asked to keep its
  residuals (``save_residuals=True``: the output and its log-sum-exp); the backward
  is splash's own backward kernels (``dq``, ``dkv``) given the log-sum-exp and
  output of every block the queries saw, which JAX's public API does not expose (its
  VJP only takes the kernel's own residuals): `replicator.runtime.compat.splash_backward`.

Queries are scaled by ``1 / sqrt(head_dim)`` before the kernel (which scales
nothing), keys and values of ``K`` heads serve ``G`` query heads each (splash's
multi-query kernel, mapped over the key heads and the batch).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from replicator.runtime import compat

BLOCKS = (512, 256, 128)  # the kernel's tile sizes, largest first


def block_size(*lengths: int) -> int | None:
    """The largest of `BLOCKS` that divides every one of ``lengths`` (None: none does,
    and splash cannot run them).

    >>> block_size(1024, 384), block_size(100)
    (128, None)
    """
    return next((b for b in BLOCKS if all(n % b == 0 for n in lengths)), None)


def _kernel(
    q_len, k_len, heads, *, causal, offset, mqa, interpret, residuals=False, window=None,
    softcap=None,
):  # fmt: skip
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    bq, bk = block_size(q_len), block_size(k_len)
    sizes = splash.BlockSizes(
        block_q=bq, block_kv=bk, block_kv_compute=bk,
        block_q_dkv=bq, block_kv_dkv=bk, block_kv_dkv_compute=bk,
        block_q_dq=bq, block_kv_dq=bk,
    )  # fmt: skip
    shape = (q_len, k_len)
    if window is not None:  # a query sees itself and the window - 1 keys before it
        mask = splash.LocalMask(shape, (window - 1, 0), offset)
    else:
        mask = splash.CausalMask(shape, offset) if causal else splash.FullMask(shape)
    make = splash.make_splash_mqa if mqa else splash.make_splash_mha
    return make(
        splash.MultiHeadMask([mask] * heads),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        save_residuals=residuals,
        attn_logits_soft_cap=softcap,
        interpret=interpret,
    )


def whole_sequence(
    q_BxHxTxD: jax.Array,
    k_BxHxTxD: jax.Array,
    v_BxHxTxD: jax.Array,
    segment_ids_BxT: jax.Array | None = None,
    *,
    interpret: bool,
    window: int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """One device's causal splash attention over its whole batch and heads, in ``q``'s
    dtype; differentiable by splash's own backward kernels. ``window``: a sliding
    window (splash's ``LocalMask``: a query sees itself and the ``window - 1`` keys
    before it; the tiles left of the band are skipped too); ``softcap``: the scores
    soft-capped, ``softcap * tanh(score / softcap)`` (splash's ``attn_logits_soft_cap``).

    The forward's output and log-sum-exp, all the backward needs besides ``q``, ``k``
    and ``v``, are named ``context`` (``checkpoint_name``): a remat policy that keeps
    the attention's output (``minimal_with_context``) keeps them, and the backward
    pass runs no second forward kernel. The public kernel's own VJP hides them
    from the policy, so under remat its forward always ran twice.
    """
    head_dim = q_BxHxTxD.shape[-1]
    q = q_BxHxTxD * jnp.asarray(1 / math.sqrt(head_dim), q_BxHxTxD.dtype)
    ids = None if segment_ids_BxT is None else (segment_ids_BxT, segment_ids_BxT)
    options = _Options(interpret, window, softcap)
    return _attention(q, k_BxHxTxD, v_BxHxTxD, ids, options).astype(q_BxHxTxD.dtype)


class _Options(NamedTuple):
    """What a whole sequence's kernel is made with (static, hashable)."""

    interpret: bool
    window: int | None = None
    softcap: float | None = None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, ids, options):
    return _attention_fwd(q, k, v, ids, options)[0]


def _attention_fwd(q, k, v, ids, options):
    kernel = _whole_kernel(q, options, residuals=True)

    def one(q, k, v, ids):  # one example: [H, T, D]
        out, (lse,) = kernel(q, k, v, segment_ids=ids)
        return out, lse

    out, lse = jax.vmap(one)(q, k, v, _segment_ids(ids))
    out, lse = checkpoint_name(out, "context"), checkpoint_name(lse, "context")
    return out, (q, k, v, ids, out, lse)


def _attention_bwd(options, residuals, d_out):
    q, k, v, ids, out, lse = residuals
    kernel = _whole_kernel(q, options, residuals=False)

    def one(q, k, v, ids, out, lse, d_out):
        return compat.splash_backward(kernel, q, k, v, ids, out, lse, d_out)

    d_q, d_k, d_v = jax.vmap(one)(q, k, v, _segment_ids(ids), out, lse, d_out.astype(q.dtype))
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _whole_kernel(q_BxHxTxD, options: _Options, residuals):
    _, heads, length, _ = q_BxHxTxD.shape
    return _kernel(
        length, length, heads, causal=True, offset=0, mqa=False, interpret=options.interpret,
        residuals=residuals, window=options.window, softcap=options.softcap,
    )  # fmt: skip


def _segment_ids(ids):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    return None if ids is None else splash.SegmentIds(q=ids[0], kv=ids[1])


def attend_block(q, k, v, *, causal: bool, offset: int, segments, interpret: bool):
    """The kernel interface's forward (`replicator.attention.blocks.attend_block`):
    ``q [B, Tq, K, G, D]`` against ``k``, ``v`` ``[B, Tk, K, D]``.

    Returns:
      ``(out, lse)`` in float32: ``[B, Tq, K, G, D]`` and ``[B, Tq, K, G]``.
    """
    kernel = _block_kernel(q, k, causal, offset, interpret, residuals=True)
    scaled = _scaled(q)

    def one(q, k, v, ids):  # q [G, Tq, D], k and v [Tk, D]
        out, (lse,) = kernel(q, k, v, segment_ids=ids)
        return out, lse

    out, lse = _over_batch_and_heads(one, segments, *_heads_first(scaled, k, v))
    out = jnp.moveaxis(out, (1, 2, 3), (2, 3, 1)).astype(jnp.float32)  # B, Tq, K, G, D
    return out, jnp.moveaxis(lse, (1, 2, 3), (2, 3, 1)).astype(jnp.float32)


def block_grads(q, k, v, out, lse, d_out, *, causal, offset, segments, interpret):
    """The kernel interface's backward (`replicator.attention.blocks.block_grads`):
    splash's ``dq`` and ``dkv`` kernels given ``out`` and ``lse`` of every block the
    queries saw; float32 gradients of ``q``, ``k`` and ``v``."""
    kernel = _block_kernel(q, k, causal, offset, interpret, residuals=False)
    scale = 1 / math.sqrt(q.shape[-1])

    def one(q, k, v, ids, out, lse, d_out):
        return compat.splash_backward(kernel, q, k, v, ids, out, lse, d_out)

    rows = _heads_first(_scaled(q), out, d_out.astype(q.dtype))
    q_, out_, d_out_ = rows
    lse_ = jnp.moveaxis(lse, (2, 3), (1, 2))  # B, K, G, Tq
    d_q, d_k, d_v = _over_batch_and_heads(
        one, segments, q_, *_heads_first(k, v), out_, lse_, d_out_
    )
    d_q = jnp.moveaxis(d_q, (1, 2, 3), (2, 3, 1)).astype(jnp.float32) * scale
    d_k, d_v = (jnp.moveaxis(g, 1, 2).astype(jnp.float32) for g in (d_k, d_v))
    return d_q, d_k, d_v


def _block_kernel(q, k, causal, offset, interpret, residuals):
    return _kernel(
        q.shape[1], k.shape[1], q.shape[3], causal=causal, offset=offset, mqa=True,
        interpret=interpret, residuals=residuals,
    )  # fmt: skip


def _scaled(q):
    return q * jnp.asarray(1 / math.sqrt(q.shape[-1]), q.dtype)


def _heads_first(*xs):
    """``[B, T, K, (G,) D]`` -> ``[B, K, (G,) T, D]``: splash's layout."""
    return tuple(jnp.moveaxis(x, 1, -2) for x in xs)


def _over_batch_and_heads(fn, segments, q, k, v, *rows):
    """``fn(q, k, v, segment_ids, *rows)`` mapped over the batch and the key heads
    (axes 0 and 1 of every array; the segment ids have no heads)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    ids = None if segments is None else splash.SegmentIds(q=segments[0], kv=segments[1])
    heads = jax.vmap(fn, in_axes=(0, 0, 0, None) + (0,) * len(rows))
    return jax.vmap(heads)(q, k, v, ids, *rows)
