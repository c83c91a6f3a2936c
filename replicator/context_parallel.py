"""Context parallelism: causal attention over a sequence split on the mesh axis ``context``.

Each of the ``CP`` devices along ``context`` holds a contiguous ``1 / CP`` of the
sequence of every query, key and value (``[batch, time, heads, head_dim]``), and
`context_attention` computes for its queries the causal attention over the whole
sequence, by one of two strategies:

* ``"gather"`` (MaxText's default, ``all_gather`` context parallelism): the keys
  and values are all-gathered over ``context``, and each device attends from its
  queries to all of them under the causal mask of their global positions (the
  hidden scores are computed and masked). One collective per call (a
  reduce-scatter of their gradients back); every device holds the whole
  sequence's keys and values.
* ``"ring"`` (ring attention, Liu et al. 2023): the key/value blocks go round the
  ring of devices with ``ppermute`` (``CP - 1`` hops), each device folding every
  block into a running softmax (the maximum, the sum and the weighted values, as
  flash attention does), so no device holds more than the block it works on and
  the one arriving, never the whole sequence's keys and values. Its backward
  pass is a second trip round the ring (a custom VJP): the blocks go round again
  with their gradients, and the saved state is only this device's queries, keys,
  values, output and log-sum-exp.

Either way a device works through its queries and the keys it holds in chunks
(``chunk`` positions, 512 by default) as flash attention does: one
``[batch, chunk, heads, chunk]`` block of float32 scores at a time, never a
``[T / CP, T]`` one, forward and backward (flash attention's backward, which
recomputes the probabilities from the saved log-sum-exp). Under ``"ring"`` the
pairs of chunks the causal mask hides entirely are known from the hop and are
not computed at all; under ``"gather"``, whose queries' positions depend on the
shard, they are computed and masked.

With a causal mask a plain split is uneven: the device holding the end of the
sequence attends to all of it, the first only to its own block. `load_balance`
reorders a sequence once, where the data is made, into ``2 * CP`` chunks of which
shard ``i`` holds chunks ``i`` and ``2 * CP - 1 - i``; called with
``load_balanced=True`` the attention knows those positions and every device
does the same work (under ``"ring"``, half a block's worth per hop).
`restore_order` undoes it; `context_positions` gives the original position of
every element, for what depends on it (rotary embeddings, position tables).
Reorder the targets with the tokens and a per-token loss is unchanged.

`context_attention` runs in the global view (`Replicator.compile`, or
``jax.jit`` under ``jax.set_mesh``), where it goes manual over ``context`` and
the axes the batch is split over in a ``jax.shard_map`` and leaves every other
axis (``tensor``'s heads) to the compiler; inside a ``shard_map`` where ``context``
is manual already it runs the per-device program on the local block (or, where
JAX's ``check_vma`` shows the inputs are the same on every device along
``context``, as a `Replicator.run` step's are unless it splits them, attends over
that whole sequence on each); with no ``context`` axis, or one of size 1, it is
`replicator.attention.causal_attention`. The numbers are the same in every case:
a model built on it runs, saves and restores the same on any number of context
shards.

A `Replicator.run` step (every axis manual, no ``tensor`` axis) receives each
replica's whole sequences on every ``context`` device: `split_sequence` takes this
device's block, `sequence_positions` names its positions, and `gather_sequence`
puts a per-token output back together (invariant over ``context``, so a loss made
from it counts every token once), so that a device holds ``1 / CP`` of the
activations there too.

Inside a ``shard_map`` manual over other axes (`Replicator.run` with a ``tensor``
axis: ``data`` manual, ``context`` left to the compiler) its ``shard_map`` is
nested in that one, which JAX 0.10 cannot differentiate as it is; there the
backward pass is a ``shard_map`` of its own that recomputes the forward first.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from replicator import attention as attention_lib
from replicator.context import vary

CONTEXT_AXIS = "context"
STRATEGIES = ("gather", "ring")
CHUNK = 512  # positions of queries and keys per block of scores
_F32 = jnp.float32


def context_attention(
    q_BxTxHxD: jax.Array,
    k_BxTxKxD: jax.Array,
    v_BxTxKxD: jax.Array,
    *,
    strategy: str = "gather",
    load_balanced: bool = False,
    axis: str = CONTEXT_AXIS,
    implementation: str = "auto",
    chunk: int = CHUNK,
) -> jax.Array:
    """Causal multi-head attention of a sequence split over the mesh axis ``axis``.

    Equal to ``causal_attention(q, k, v)`` of the whole sequence (in its original
    order when it was reordered with `load_balance`), for any size of ``axis``.

    Args:
      q_BxTxHxD: queries ``[batch, time, heads, head_dim]``: the whole sequence in
        the global view, this device's block of it where ``axis`` is manual (under
        ``check_vma``, inputs that do not vary over ``axis`` are taken as the whole
        sequence on every device).
      k_BxTxKxD, v_BxTxKxD: keys and values, the same but with ``K`` heads, where
        ``K`` divides ``H`` (grouped-query attention when ``K < H``).
      strategy: ``"gather"`` (all-gather the keys and values) or ``"ring"`` (pass
        them round the ring); see the module docstring.
      load_balanced: the sequence is in `load_balance`'s order (shard ``i`` holds
        chunks ``i`` and ``2 * CP - 1 - i``), not the original one.
      axis: the mesh axis the sequence is split over.
      implementation: `replicator.attention.causal_attention`'s kernel where the
        sequence is not split (no ``axis``, or size 1). A split sequence's blocks
        are XLA's matrix products: ``"auto"`` or ``"xla"`` there.
      chunk: where the sequence is split, queries and keys are taken this many
        positions at a time (the largest number up to it that divides a shard's
        block, or its halves when load balanced): a device holds one
        ``[batch, chunk, heads, chunk]`` block of float32 scores at a time, and
        computes only the pairs of chunks that the causal mask leaves visible.

    Returns:
      The attention output, shaped and split like ``q``, in ``q``'s dtype.

    Raises:
      ValueError: an unknown strategy, mismatched shapes, a length that does not
        split into ``CP`` blocks (``2 * CP`` chunks when load balanced), or a
        fused kernel asked for a split sequence; each one line.

    >>> x = jax.random.normal(jax.random.key(0), (2, 8, 2, 4))
    >>> y = context_attention(x, x, x, strategy="ring")  # no context axis: one device's
    >>> bool(jnp.allclose(y, attention_lib.causal_attention(x, x, x)))
    True
    """
    _check_inputs(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, strategy)
    cp = context_size(axis)
    if cp == 1:
        return attention_lib.causal_attention(
            q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, implementation=implementation
        )
    if implementation not in ("auto", "xla"):
        raise ValueError(
            f"context_attention: implementation={implementation!r} is a kernel for a whole "
            f"sequence, but {axis!r} splits it over {cp} devices, whose blocks XLA computes; "
            f"use implementation='auto'."
        )
    local = functools.partial(
        _local_attention, strategy=strategy, balanced=load_balanced, axis=axis, chunk=chunk
    )
    length = q_BxTxHxD.shape[1]
    if _is_manual(axis):
        whole = _whole_on_every_shard(axis, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD)
        _check_length(length * (1 if whole else cp), cp, load_balanced, "context_attention")
        return local(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, whole=whole)
    _check_length(length, cp, load_balanced, "context_attention")
    return _split_program(local, axis, q_BxTxHxD.shape[0])(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD)


def _split_program(local, axis: str, batch: int):
    """``local`` in a ``shard_map`` manual over ``axis`` and the batch's axes."""
    mesh = jax.sharding.get_abstract_mesh()
    rows = _batch_axes(mesh, axis, batch)
    spec = P(rows or None, axis)
    program = functools.partial(
        jax.shard_map, mesh=mesh, axis_names=frozenset({axis, *rows}), check_vma=True
    )
    if AxisType.Manual in mesh.axis_types:  # inside a shard_map over other axes (run's)
        return _nested(local, program, spec)
    return program(local, in_specs=(spec, spec, spec), out_specs=spec)


def _nested(local, program, spec):
    """``local`` under ``program`` (a ``shard_map`` inside another's manual axes), with a
    backward pass that is a ``shard_map`` of its own, recomputing the forward.

    JAX 0.10 cannot differentiate a ``shard_map`` nested in one with ``check_vma``:
    the residuals it passes between the two halves name the outer manual axes, which
    the verifier refuses. Saving only the inputs avoids those residuals."""

    @jax.custom_vjp
    def attend(q, k, v):
        return program(local, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)

    def backward(saved, d_out):
        def local_grads(q, k, v, d_out):
            return jax.vjp(local, q, k, v)[1](d_out)

        return program(local_grads, in_specs=(spec,) * 4, out_specs=(spec,) * 3)(*saved, d_out)

    attend.defvjp(lambda q, k, v: (attend(q, k, v), (q, k, v)), backward)
    return attend


def context_size(axis: str = CONTEXT_AXIS) -> int:
    """The size of ``axis`` in the mesh being traced for (1 without one).

    >>> context_size()
    1
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        return 1
    return mesh.shape[axis]


# ------------------------------------------------------------ a per-replica step's sequences


def split_sequence(x, axis: str = CONTEXT_AXIS, dim: int = 1):
    """This device's block of ``x``'s sequence (dimension ``dim``) where ``axis`` is
    manual and ``x`` is the same on every device along it, as a `Replicator.run`
    step's whole sequences are; ``x`` itself anywhere else (the global view splits a
    sequence by sharding, `replicator.activations`).

    A model that splits its input here and calls `gather_sequence` on its per-token
    output holds only ``1 / CP`` of the sequence's activations per device, and
    `context_attention` attends across the blocks. Block ``i`` is the ``i``-th of
    ``CP`` equal ones (in `load_balance`'s order if the sequence was reordered).

    Raises:
      ValueError: the length does not split into ``CP`` blocks (one line).
    """
    cp = context_size(axis)
    if cp == 1 or not _is_manual(axis) or not _whole_on_every_shard(axis, x):
        return x
    _check_length(x.shape[dim], cp, False, "split_sequence")
    size = x.shape[dim] // cp
    start = jax.lax.axis_index(axis) * size
    return jax.lax.dynamic_slice_in_dim(vary(x, (axis,)), start, size, dim)


def gather_sequence(x, axis: str = CONTEXT_AXIS, dim: int = 1):
    """The inverse of `split_sequence`: the whole sequence, the same on every device
    along ``axis``, where ``x`` is this device's block of it; ``x`` itself elsewhere.

    The result does not vary over ``axis`` (a ``psum`` of each block in its place),
    so a loss made from it counts every token once: its gradient reaches each block
    once, not ``CP`` times."""
    if not _split_here(x, axis):
        return x
    cp, size = context_size(axis), x.shape[dim]
    shape = (*x.shape[:dim], size * cp, *x.shape[dim + 1 :])
    start = jax.lax.axis_index(axis) * size
    whole = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, x.dtype), x, start, dim)
    return jax.lax.psum(whole, axis)


def sequence_positions(x, load_balanced: bool = False, axis: str = CONTEXT_AXIS, dim: int = 1):
    """The original positions (int32 ``[T]``) of ``x``'s sequence elements: this
    device's block's where `split_sequence` split it, else the whole sequence's as
    laid out (in `load_balance`'s order when ``load_balanced``).

    >>> sequence_positions(jnp.zeros((1, 4))).tolist()
    [0, 1, 2, 3]
    """
    cp, length = context_size(axis), x.shape[dim]
    if _split_here(x, axis):
        shard = jax.lax.axis_index(axis)
        return context_positions(length * cp, cp, load_balanced, shard=shard)
    if cp > 1 and load_balanced:
        return context_positions(length, cp, load_balanced=True)
    return np.arange(length, dtype=np.int32)


# ------------------------------------------------------------ load balancing


def load_balance(x, cp: int, axis: int = 1):
    """``x`` with its ``axis`` reordered so that context shard ``i`` holds chunks ``i``
    and ``2 * cp - 1 - i`` of ``2 * cp`` equal chunks (the causal work then splits
    evenly). A NumPy array stays one (do it where the batch is made).

    Args:
      x: a NumPy or JAX array, e.g. tokens ``[batch, time]``.
      cp: the number of context shards (1: ``x`` unchanged).
      axis: the sequence axis.

    Returns:
      ``x`` reordered along ``axis``; `restore_order` undoes it.

    Raises:
      ValueError: the length does not split into ``2 * cp`` chunks (one line).

    >>> load_balance(np.arange(8)[None], 2).tolist()
    [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    return _reorder(x, cp, axis, inverse=False)


def restore_order(x, cp: int, axis: int = 1):
    """The inverse of `load_balance`: ``x`` back in its original order along ``axis``.

    >>> restore_order(load_balance(np.arange(8), 2, axis=0), 2, axis=0).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    return _reorder(x, cp, axis, inverse=True)


def context_positions(length: int, cp: int, load_balanced: bool = False, shard=None):
    """Global positions (0 to ``length - 1``) of a sequence split over ``cp`` shards.

    Rotary embeddings, position tables and anything else that depends on where a
    token sits in the original sequence read them.

    Args:
      length: the whole sequence's length.
      cp: the number of context shards.
      load_balanced: the sequence is in `load_balance`'s order.
      shard: None for the whole sequence as laid out (the global view's
        ``[length]``, a NumPy array), or a shard's index (an int, or traced, as
        ``jax.lax.axis_index("context")`` inside a ``shard_map``) for that shard's
        ``[length // cp]``.

    Returns:
      int32 positions, in the order the elements are laid out.

    >>> context_positions(8, 2, load_balanced=True).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    >>> context_positions(8, 2, load_balanced=True, shard=1).tolist()
    [2, 3, 4, 5]
    """
    chunks = 2 * cp if load_balanced else cp
    _check_length(length, cp, load_balanced, "context_positions")
    size = length // chunks
    within = np.arange(size, dtype=np.int32)
    if shard is None:
        order = _chunk_order(cp, load_balanced)
        return (order[:, None] * size + within).reshape(-1).astype(np.int32)
    xp = np if isinstance(shard, (int, np.integer)) else jnp
    first = shard * size + within
    if not load_balanced:
        return xp.asarray(first, dtype=np.int32)
    second = (2 * cp - 1 - shard) * size + within
    return xp.concatenate([first, second]).astype(np.int32)


def _chunk_order(cp: int, balanced: bool) -> np.ndarray:
    """The chunks in the order they are laid out: 0, 2cp-1, 1, 2cp-2, ... when balanced."""
    if not balanced:
        return np.arange(cp)
    return np.stack([np.arange(cp), 2 * cp - 1 - np.arange(cp)], axis=1).reshape(-1)


def _reorder(x, cp: int, axis: int, *, inverse: bool):
    if cp == 1:
        return x
    axis = axis % np.ndim(x)
    length = np.shape(x)[axis]
    name = "restore_order" if inverse else "load_balance"
    _check_length(length, cp, True, name)
    order = _chunk_order(cp, True)
    if inverse:
        order = np.argsort(order)
    shape = np.shape(x)
    chunked = x.reshape(*shape[:axis], 2 * cp, length // (2 * cp), *shape[axis + 1 :])
    return chunked[(slice(None),) * axis + (order,)].reshape(shape)


# ------------------------------------------------------------ one device's program


def _local_attention(q, k, v, *, strategy, balanced, axis, chunk, whole=False) -> jax.Array:
    """With ``axis`` manual: this device's queries attending to the whole sequence
    (``whole``: the device holds all of it, as every device along ``axis`` does)."""
    cp = context_size(axis)
    q, k, v = (vary(x, _varying(q, k, v)) for x in (q, k, v))
    batch, length, heads, head_dim = q.shape
    if whole and balanced:  # attend in the original order, where chunks are contiguous
        q, k, v = (restore_order(x, cp) for x in (q, k, v))
    q5 = q.reshape(batch, length, k.shape[2], heads // k.shape[2], head_dim)  # B,T,K,G,D
    total = length if whole else length * cp
    kind = "whole" if whole else strategy
    pieces = 1 if whole else 2 * cp if balanced else cp
    layout = _Layout(kind, total, cp, balanced and not whole, axis,
                     _chunk_size(total // pieces, chunk))  # fmt: skip
    if kind == "ring":
        out = _ring_attention(q5, k, v, layout)
    elif kind == "gather":
        k, v = (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
        out = _gathered_attention(q5, k, v, layout)
    else:
        out = _blocked_attention(q5, k, v, layout)
    out = out.reshape(q.shape).astype(q.dtype)
    return load_balance(out, cp) if whole and balanced else out


def _chunk_size(piece: int, target: int) -> int:
    """The largest length up to ``target`` that divides ``piece``: a shard's block, or
    its halves when load balanced, whose positions are consecutive. So are a chunk's,
    and a pair of chunks is all visible, all hidden, or split by the diagonal."""
    return max(c for c in range(1, min(piece, target) + 1) if piece % c == 0)


# How a pair of chunks (queries starting at position a, keys at b) is computed.
_HIDDEN, _DIAGONAL, _VISIBLE = 0, 1, 2  # a < b, a == b (causal within), a > b


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Which positions a device's queries and keys hold, and the chunks it works in.

    ``kind``: ``"whole"`` (the whole sequence in order on both sides), or for the
    keys of one shard (a ring hop's, or one shard's of the gathered keys) those of
    the same shard (``"diagonal"``), an earlier one (``"before"``) or a later one
    (``"after"``). ``"ring"`` and ``"gather"`` name the strategy before a hop's
    case is known. A case's mask depends only on which of the three it is, so each
    is laid out as shards 0 and 1 stand to each other: static positions, and static
    lists of the pairs of chunks to compute."""

    kind: str
    total: int  # the whole sequence's length
    cp: int
    balanced: bool
    axis: str
    size: int  # positions per chunk

    def starts(self):
        """The first position of each chunk of the queries and of the keys."""
        if self.kind == "whole":
            rows = cols = np.arange(self.total, dtype=np.int32)
        else:
            q_shard, k_shard = {"diagonal": (0, 0), "before": (1, 0), "after": (0, 1)}[self.kind]
            rows, cols = (
                context_positions(self.total, self.cp, self.balanced, shard=s)
                for s in (q_shard, k_shard)
            )
        return rows[:: self.size], cols[:: self.size]

    def groups(self) -> list[tuple[np.ndarray, int]]:
        """``(pairs [n, 2] of (query chunk, key chunk), how)``: the pairs computed
        alike, ``_VISIBLE`` or ``_DIAGONAL`` (the hidden ones are left out)."""
        rows, cols = self.starts()
        how = (rows[:, None] >= cols[None, :]).astype(int) + (rows[:, None] > cols[None, :])
        return [(np.argwhere(how == h).astype(np.int32), h) for h in (_VISIBLE, _DIAGONAL)]


def _pair_loop(layout: _Layout, compute, carry):
    """``carry`` through ``compute(carry, i, j, mask)`` for every pair of chunks (query
    chunk ``i``, key chunk ``j``) that ``layout`` leaves visible, ``mask`` being None
    (all visible) or the causal triangle. One ``lax.scan`` per group of pairs.

    The pairs are static on purpose: a per-pair ``lax.cond`` (or a mask computed
    per pair from traced positions), inside a custom VJP's forward under a scan of
    layers, made JAX 0.10 stack every pair's scores or masks as residuals when the
    model was differentiated (32 GiB for lm_1b's gather at 64k on a v5e-16)."""
    tri = np.tri(layout.size, dtype=bool)
    for pairs, how in layout.groups():
        if not len(pairs):
            continue

        def step(c, pair, mask=None if how == _VISIBLE else tri):
            return compute(c, *pair, mask), None

        carry = jax.lax.scan(step, carry, jnp.asarray(pairs))[0]
    return carry


def _chunk(x, c, size):
    """Chunk ``c`` (traced) of ``x``'s sequence (axis 1)."""
    return jax.lax.dynamic_slice_in_dim(x, c * size, size, 1)


def _put_chunk(x, c, size, value):
    return jax.lax.dynamic_update_slice_in_dim(x, value, c * size, 1)


def _fold(acc, q, k, v, layout: _Layout):
    """``acc`` (`_empty`'s ``(o, m, l)``) with ``q``'s attention to ``k``, ``v`` folded
    in, one pair of chunks at a time (a ``[B, c, K, G, c]`` block of scores)."""
    size = layout.size
    axes = _varying(*acc, q, k, v)

    def compute(acc, i, j, mask):
        part = tuple(_chunk(x, i, size) for x in acc)
        new = _attend(part, _chunk(q, i, size), _chunk(k, j, size), _chunk(v, j, size), mask)
        return tuple(_put_chunk(x, i, size, vary(y, axes)) for x, y in zip(acc, new))

    acc = tuple(vary(x, axes) for x in acc)
    return _pair_loop(layout, compute, acc)


def _grads(q, d_out, lse, delta, k, v, layout: _Layout):
    """Flash attention's backward over ``layout``'s visible pairs of chunks: float32
    gradients of ``q``, ``k`` and ``v``."""
    size = layout.size
    axes = _varying(q, d_out, lse, k, v)

    def compute(grads, i, j, mask):
        rows = [_chunk(x, i, size) for x in (q, d_out, lse, delta)]
        parts = _block_grads(*rows, _chunk(k, j, size), _chunk(v, j, size), mask)
        return tuple(
            _put_chunk(g, c, size, _chunk(g, c, size) + vary(p, axes))
            for g, c, p in zip(grads, (i, j, j), parts)
        )

    return _pair_loop(layout, compute, _zero_grads((q, k, v), d_out, lse))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blocked_attention(q, k, v, layout: _Layout) -> jax.Array:
    """``q [B, Tq, K, G, D]``'s attention to ``k``, ``v`` (float32 output), chunk by
    chunk, with flash attention's backward: no ``[Tq, Tk]`` scores in either."""
    return _blocked_forward(q, k, v, layout)[0]


def _blocked_forward(q, k, v, layout):
    out, lse = _normalized(_fold(_empty(q, k, v), q, k, v, layout))
    return out, (q, k, v, out, lse)


def _blocked_backward(layout, saved, d_out):
    q, k, v, out, lse = saved
    delta = jnp.sum(d_out * out, axis=-1)  # rowsum(dO * O), flash attention's D
    grads = _grads(q, d_out, lse, delta, k, v, layout)
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))


_blocked_attention.defvjp(_blocked_forward, _blocked_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gathered_attention(q, k_all, v_all, layout: _Layout) -> jax.Array:
    """This shard's ``q [B, T/CP, K, G, D]`` attending to the gathered ``k_all``,
    ``v_all`` (float32 output): shard by shard of the keys, each laid out as a ring
    hop's (`_by_case`), so that only visible pairs of chunks are computed."""
    return _gathered_forward(q, k_all, v_all, layout)[0]


def _source_blocks(fn, carry, k_all, v_all, layout: _Layout):
    """``carry = fn(carry, j, k_j, v_j, hop)`` over the key shards ``j = s - t`` for
    ``t = 0 .. CP - 1``, as the ring meets them (`_by_case`)."""
    s, length = jax.lax.axis_index(layout.axis), k_all.shape[1] // layout.cp

    def step(carry, t):
        j = (s - t) % layout.cp
        k_j, v_j = (jax.lax.dynamic_slice_in_dim(x, j * length, length, 1) for x in (k_all, v_all))
        return _by_case(lambda hop: fn(carry, j, k_j, v_j, hop), t, s, layout)

    carry = step(carry, 0)
    return jax.lax.scan(lambda c, t: (step(c, t), None), carry, jnp.arange(1, layout.cp))[0]


def _gathered_forward(q, k_all, v_all, layout):
    def fold(acc, j, k_j, v_j, hop):
        return _fold(acc, q, k_j, v_j, hop)

    out, lse = _normalized(_source_blocks(fold, _empty(q, k_all, v_all), k_all, v_all, layout))
    return out, (q, k_all, v_all, out, lse)


def _gathered_backward(layout, saved, d_out):
    q, k_all, v_all, out, lse = saved
    delta = jnp.sum(d_out * out, axis=-1)  # rowsum(dO * O), flash attention's D
    length = k_all.shape[1] // layout.cp

    def pull(grads, j, k_j, v_j, hop):
        gq, gk, gv = _grads(q, d_out, lse, delta, k_j, v_j, hop)
        d_q, d_k, d_v = grads
        put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=j * length, axis=1)
        return d_q + gq, put(d_k, gk), put(d_v, gv)

    zeros = _zero_grads((q, k_all, v_all), d_out, lse)
    grads = _source_blocks(pull, zeros, k_all, v_all, layout)
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k_all, v_all)))


_gathered_attention.defvjp(_gathered_forward, _gathered_backward)


# Online softmax over blocks of keys: ``(o, m, l)`` per query row, the weighted sum
# of values, the running maximum score and the sum of ``exp(score - m)``.


def _empty(q, *others):
    axes = _varying(q, *others)
    zeros = vary(jnp.zeros(q.shape[:-1], _F32), axes)
    return vary(jnp.zeros(q.shape, _F32), axes), zeros - jnp.inf, zeros


def _normalized(acc):
    """A finished online softmax ``(o, m, l)``'s output and log-sum-exp."""
    o, m, total = acc
    return o / total[..., None], m + jnp.log(total)


def _zero_grads(xs, *others):
    """Float32 zeros shaped like ``xs``, varying over every axis ``xs`` and ``others``
    vary over (a gradient accumulator that any block may add to)."""
    axes = _varying(*xs, *others)
    return tuple(vary(jnp.zeros(x.shape, _F32), axes) for x in xs)


def _varying(*xs) -> tuple[str, ...]:
    return tuple(sorted(set().union(*(jax.typeof(x).manual_axis_type.varying for x in xs))))


def _scores(q, k, mask):
    """``q k^T / sqrt(D)`` in float32 ``[B, Tq, K, G, Tk]``, -inf where ``mask`` (None:
    nothing) hides."""
    scores = jnp.einsum("bqkgd,bskd->bqkgs", q, k, preferred_element_type=_F32)
    scores = scores * (1 / math.sqrt(q.shape[-1]))
    if mask is None:
        return scores
    return jnp.where(jnp.asarray(mask)[None, :, None, None, :], scores, -jnp.inf)


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


# ------------------------------------------------------------ the ring


def _by_case(fn, t, s, layout: _Layout):
    """``fn(layout of the hop)`` for hop ``t`` (the keys of shard ``s - t``): the
    diagonal's at ``t = 0`` (a Python int), else by whether that shard comes before
    ``s``."""

    def hop(kind):
        return lambda: fn(dataclasses.replace(layout, kind=kind))

    if isinstance(t, int) and t == 0:
        return hop("diagonal")()
    # 1 <= t < CP: shard s - t comes before s unless it wrapped round.
    return jax.lax.cond(t <= s, hop("before"), hop("after"))


def _send(tree, axis: str, cp: int):
    """``tree`` passed one shard on round the ring (shard ``j`` gets ``j - 1``'s)."""
    ring = [(j, (j + 1) % cp) for j in range(cp)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis, ring), tree)


def _ring_loop(step, carry, kv, axis: str, cp: int):
    """``carry = step(carry, kv, t)`` for ``t = 0 .. cp - 1``, ``kv`` being shard
    ``s - t``'s; each hop's block is sent on before the step that works on it."""
    ahead = _send(kv, axis, cp)
    carry = step(carry, kv, 0)

    def hop(state, t):
        carry, kv = state
        ahead = _send(kv, axis, cp)
        return (step(carry, kv, t), ahead), None

    if cp > 2:
        (carry, ahead), _ = jax.lax.scan(hop, (carry, ahead), jnp.arange(1, cp - 1))
    return step(carry, ahead, jnp.asarray(cp - 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring_attention(q, k, v, layout: _Layout) -> jax.Array:
    """Ring attention of this shard's ``q [B, T, K, G, D]`` (float32 output)."""
    return _ring_forward(q, k, v, layout)[0]


def _ring_forward(q, k, v, layout):
    s = jax.lax.axis_index(layout.axis)

    def step(acc, kv, t):
        return _by_case(lambda hop: _fold(acc, q, *kv, hop), t, s, layout)

    out, lse = _normalized(_ring_loop(step, _empty(q, k, v), (k, v), layout.axis, layout.cp))
    return out, (q, k, v, out, lse)


def _ring_backward(layout, saved, d_out):
    """The gradients: the key/value blocks go round again, each with the gradient its
    keys and values gathered so far, which a last hop takes home."""
    q, k, v, out, lse = saved
    axis, cp = layout.axis, layout.cp
    delta = jnp.sum(d_out * out, axis=-1)  # rowsum(dO * O), flash attention's D
    s = jax.lax.axis_index(axis)

    def step(carry, kv, t):
        d_q, d_kv = carry
        if not (isinstance(t, int) and t == 0):
            d_kv = _send(d_kv, axis, cp)  # with the block that arrived for this hop
        gq, gk, gv = _by_case(lambda hop: _grads(q, d_out, lse, delta, *kv, hop), t, s, layout)
        return d_q + gq, (d_kv[0] + gk, d_kv[1] + gv)

    zeros = _zero_grads((q, k, v), d_out, lse)
    d_q, d_kv = _ring_loop(step, (zeros[0], zeros[1:]), (k, v), axis, cp)
    d_k, d_v = _send(d_kv, axis, cp)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype)


_ring_attention.defvjp(_ring_forward, _ring_backward)


# ------------------------------------------------------------ checks and axes


def _batch_axes(mesh, axis: str, batch: int) -> tuple[str, ...]:
    """The automatic mesh axes the activation rules split the batch over, where it
    divides over them: the program is manual over those too, so each device works on
    its own rows (``replicator.pipelining`` does the same)."""
    from replicator.activations import batch_axes

    return batch_axes(mesh, batch, exclude=axis)


def _whole_on_every_shard(axis: str, *xs) -> bool:
    """Whether ``xs`` are known to be the same on every device along the manual ``axis``
    (a step under `Replicator.run` whose inputs are not split over it): where JAX
    tracks what varies (``check_vma``), nothing of theirs varies over ``axis``."""
    if not jax.typeof(jax.lax.axis_index(axis)).manual_axis_type.varying:
        return False  # not tracked: the caller's blocks, as documented
    return not any(axis in jax.typeof(x).manual_axis_type.varying for x in xs)


def _split_here(x, axis: str) -> bool:
    """Whether ``x`` is this device's block of a sequence split over the manual ``axis``
    (it varies over it, as `split_sequence`'s output does)."""
    return (
        context_size(axis) > 1
        and _is_manual(axis)
        and axis in jax.typeof(x).manual_axis_type.varying
    )


def _is_manual(axis: str) -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return dict(zip(mesh.axis_names, mesh.axis_types))[axis] == AxisType.Manual


def _check_inputs(q, k, v, strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"context_attention: strategy={strategy!r}; use one of {STRATEGIES}.")
    ok = (
        q.ndim == 4 and k.shape == v.shape and k.ndim == 4 and q.shape[:2] == k.shape[:2]
        and q.shape[3] == k.shape[3] and q.shape[2] % k.shape[2] == 0
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"context_attention: q {q.shape}, k {k.shape}, v {v.shape}: expected "
            f"[batch, time, heads, head_dim] each, k and v alike, with heads dividing q's."
        )


def _check_length(length: int, cp: int, balanced: bool, name: str) -> None:
    chunks = 2 * cp if balanced else cp
    if length % chunks:
        what = f"2 x {cp} context shards" if balanced else f"{cp} context shards"
        raise ValueError(
            f"{name}: a sequence of {length} does not split into {chunks} equal chunks "
            f"({what}); use a length divisible by {chunks}."
        )
