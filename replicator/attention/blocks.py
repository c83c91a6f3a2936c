"""The kernel interface: a block of queries against a block of keys, output and log-sum-exp.

A strategy that splits attention into blocks (`replicator.attention.context`: the
keys gathered over the mesh axis ``context``, or passed round a ring) calls, for each
block of queries ``q [B, Tq, K, G, D]`` (``K`` key heads, ``G`` queries per key head)
and block of keys and values ``k``, ``v`` ``[B, Tk, K, D]``::

    out, lse = attend_block(kernel, q, k, v, causal=..., offset=..., segments=...)

the block's attention output and its log-sum-exp (float32 ``[B, Tq, K, G, D]`` and
``[B, Tq, K, G]``), and combines blocks with `merge`: attention to several blocks of
keys is each block's weighted by ``exp(lse_block - lse_all)``. Its backward pass
calls, per block, with the combined output and log-sum-exp::

    d_q, d_k, d_v = block_grads(kernel, q, k, v, out, lse, d_out, causal=..., ...)

flash attention's backward restricted to the block (the probabilities recomputed
against the combined log-sum-exp), whose sum over the blocks is the whole gradient.

The mask of a block is static: none (``causal=False``: every key visible) or causal
by position, the queries starting ``offset`` positions after the keys (a query at
``offset + i`` sees the keys at ``0 .. offset + i``). Segment ids (``(query ids [B,
Tq], key ids [B, Tk])``, packed documents) hide the keys of other documents too.

The `Kernel` says what computes a block, `choose_kernel` picks one per platform:

* ``"splash"``: Pallas's splash kernels on TPU (`replicator.attention.splash`),
  forward and backward fused, skipping the tiles the mask hides. Needs blocks of a
  multiple of 128 positions; in Pallas's interpreter off a TPU.
* ``"xla"``: flash attention in XLA's operations (`replicator.attention.flash`), a
  ``chunk`` of queries against a ``chunk`` of keys at a time (a chunk as long as
  the block: one plain block of scores).
* cuDNN has no block implementation. JAX 0.10's public
  ``jax.nn.dot_product_attention(..., implementation="cudnn", return_residual=True)``
  returns the log-sum-exp rounded to the output's dtype (in bfloat16 about three
  significant digits, which would weigh the blocks within a few percent only), and
  its backward drops that log-sum-exp's cotangent and takes no combined one, so no
  block's gradient can be formed from it; the GPU's blocks are XLA's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from replicator.attention import flash, kernels, splash
from replicator.parallel import axes as mesh_axes

CHUNK = 512  # the "xla" kernel's positions of queries and keys per block of scores


@dataclasses.dataclass(frozen=True)
class Kernel:
    """What computes a block: ``implementation`` ``"xla"`` (in chunks of ``chunk``
    positions) or ``"splash"`` (``interpret``: in Pallas's interpreter)."""

    implementation: str = "xla"
    chunk: int = CHUNK
    interpret: bool = False


def choose_kernel(requested: str, *lengths: int, chunk: int = CHUNK) -> Kernel:
    """The `Kernel` for blocks of ``lengths`` positions (of queries and of keys) that
    ``requested`` (one of `replicator.attention.kernels.IMPLEMENTATIONS`) stands for.

    ``"auto"``: splash on TPU in the global view where every length is a multiple of
    128, else XLA's; ``"cudnn"``: XLA's (see the module docstring); ``"splash"``: splash,
    or a one-line error where it cannot run.

    >>> choose_kernel("auto", 1024)  # on CPU
    Kernel(implementation='xla', chunk=512, interpret=False)
    """
    if requested not in kernels.IMPLEMENTATIONS:
        raise ValueError(f"attention={requested!r}: use one of {kernels.IMPLEMENTATIONS}.")
    fits = splash.block_size(*lengths) is not None
    per_replica = bool(mesh_axes.manual_axes())
    if requested == "splash" and not fits:
        raise ValueError(
            f"attention='splash' over a split sequence needs blocks of a multiple of 128 "
            f"positions, not {min(lengths)}; use attention='auto' (XLA's blocks there)."
        )
    if requested == "splash" and per_replica:
        raise ValueError(
            "attention='splash' runs in the global view (Replicator.compile, "
            "step_path='compile'), not inside Replicator.run or a shard_map; use "
            "attention='auto' or 'xla' there."
        )
    platform = kernels.target_platform()
    auto_splash = requested == "auto" and platform == "tpu" and fits and not per_replica
    if requested == "splash" or auto_splash:
        interpret = jax.default_backend() != "tpu" and platform != "tpu"
        return Kernel("splash", chunk, interpret)
    return Kernel("xla", chunk)


def attend_block(
    kernel: Kernel, q, k, v, *, causal: bool = False, offset: int = 0, segments=None, into=None
) -> tuple[jax.Array, jax.Array]:
    """One block's attention: ``q [B, Tq, K, G, D]`` to ``k``, ``v`` ``[B, Tk, K, D]``.

    Args:
      kernel: what computes it (`choose_kernel`).
      q, k, v: the block's queries, keys and values.
      causal: mask by position (the queries start ``offset`` after the keys), or none.
      offset: a static int; with ``causal``, the queries' first position minus the
        keys' first.
      segments: None, or ``(query ids [B, Tq], key ids [B, Tk])``.
      into: None, or ``(out, lse)`` of the same queries' attention to other keys:
        the result is then `merge`'s of the two (XLA's kernel folds the block into
        them, holding no second output).

    Returns:
      ``(out, lse)``: float32 ``[B, Tq, K, G, D]`` and ``[B, Tq, K, G]``; a row that
      sees no key has a weight of zero in `merge` (its log-sum-exp ``-inf``, or
      splash's masked score).

    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 1, 1, 4))
    >>> k = x[:, :, :, 0]
    >>> parts = [attend_block(Kernel(), x, k[:, :4], k[:, :4], causal=True),
    ...          attend_block(Kernel(), x, k[:, 4:], k[:, 4:], causal=True, offset=-4)]
    >>> out, lse = merge(*parts)
    >>> bool(jnp.allclose(out, attend_block(Kernel(), x, k, k, causal=True)[0], atol=1e-6))
    True
    """
    if kernel.implementation == "splash":
        block = splash.attend_block(
            q, k, v, causal=causal, offset=offset, segments=segments, interpret=kernel.interpret
        )
        return block if into is None else merge(into, block)
    layout = flash.chunks(q.shape[1], k.shape[1], causal=causal, offset=offset,
                          target=kernel.chunk)  # fmt: skip
    return flash.attend(q, k, v, layout, segments, into=into)


def block_grads(
    kernel: Kernel, q, k, v, out, lse, d_out, *, causal=False, offset=0, segments=None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block's share of the gradients of ``q``, ``k`` and ``v`` (float32), given
    the output ``out`` and log-sum-exp ``lse`` of the queries' attention to every
    block (`merge`'s) and the output's cotangent ``d_out``; the other arguments as
    `attend_block`'s."""
    if kernel.implementation == "splash":
        return splash.block_grads(
            q, k, v, out, lse, d_out, causal=causal, offset=offset, segments=segments,
            interpret=kernel.interpret,
        )  # fmt: skip
    layout = flash.chunks(q.shape[1], k.shape[1], causal=causal, offset=offset,
                          target=kernel.chunk)  # fmt: skip
    return flash.block_grads(q, k, v, out, lse, d_out, layout, segments)


def merge(*parts: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of attention to the union of the blocks of keys that ``parts``
    (each ``(out, lse)`` of the same queries) attended to."""
    out, lse = parts[0]
    for other_out, other_lse in parts[1:]:
        total = jnp.logaddexp(lse, other_lse)
        shift = jnp.where(jnp.isfinite(total), total, 0.0)  # rows that saw nothing yet
        out = (out * jnp.exp(lse - shift)[..., None]
               + other_out * jnp.exp(other_lse - shift)[..., None])  # fmt: skip
        lse = total
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def causal_block(q, k, v, segments, kernel: Kernel) -> jax.Array:
    """Causal attention of ``q [B, T, K, G, D]`` to ``k``, ``v`` ``[B, T, K, D]`` of the
    same positions, as one block through ``kernel``, differentiable: float32 output."""
    return attend_block(kernel, q, k, v, causal=True, segments=segments)[0]


def _causal_forward(q, k, v, segments, kernel):
    out, lse = attend_block(kernel, q, k, v, causal=True, segments=segments)
    return out, (q, k, v, segments, out, lse)


def _causal_backward(kernel, saved, d_out):
    q, k, v, segments, out, lse = saved
    grads = block_grads(kernel, q, k, v, out, lse, d_out, causal=True, segments=segments)
    return (*(g.astype(x.dtype) for g, x in zip(grads, (q, k, v))), None)


causal_block.defvjp(_causal_forward, _causal_backward)
