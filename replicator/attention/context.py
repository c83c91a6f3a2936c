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

Packed documents: with ``segment_ids`` a query attends only to the keys of its own
segment. The ids of a block of keys travel with it (gathered with it, or round
the ring beside it), and each computed pair of chunks masks its scores by them
(`replicator.attention.flash`, which holds the chunked flash attention both strategies
share); the pairs computed stay those the causal mask decides, statically.

`context_attention` runs in the global view (`Replicator.compile`, or
``jax.jit`` under ``jax.set_mesh``), where it goes manual over ``context`` and
the axes the batch is split over in a ``jax.shard_map`` and leaves every other
axis (``tensor``'s heads) to the compiler; inside a ``shard_map`` where ``context``
is manual already it runs the per-device program on the local block (or, where
JAX's ``check_vma`` shows the inputs are the same on every device along
``context``, as a `Replicator.run` step's are unless it splits them, attends over
that whole sequence on each); with no ``context`` axis, or one of size 1, it is
`replicator.attention.kernels.causal_attention`. The numbers are the same in every case:
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

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from replicator.attention import flash as flash
from replicator.attention import kernels as attention_lib
from replicator.spmd.context import vary

CONTEXT_AXIS = "context"
STRATEGIES = ("gather", "ring")
CHUNK = 512  # positions of queries and keys per block of scores


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
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal multi-head attention of a sequence split over the mesh axis ``axis``.

    Equal to ``causal_attention(q, k, v, segment_ids=segment_ids)`` of the whole
    sequence (in its original order when it was reordered with `load_balance`), for
    any size of ``axis``.

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
      implementation: `replicator.attention.kernels.causal_attention`'s kernel where the
        sequence is not split (no ``axis``, or size 1). A split sequence's blocks
        are XLA's matrix products: ``"auto"`` or ``"xla"`` there.
      chunk: where the sequence is split, queries and keys are taken this many
        positions at a time (the largest number up to it that divides a shard's
        block, or its halves when load balanced): a device holds one
        ``[batch, chunk, heads, chunk]`` block of float32 scores at a time, and
        computes only the pairs of chunks that the causal mask leaves visible.
      segment_ids: None, or int32 ``[batch, time]``, aligned and split like ``q``
        (packed documents): a query attends only to keys of its own id. The key
        blocks' ids travel with them (gathered, or round the ring), and mask the
        scores inside each pair of chunks that is computed.

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
    _check_inputs(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, strategy, segment_ids)
    cp = context_size(axis)
    if cp == 1:
        return attention_lib.causal_attention(
            q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, implementation=implementation,
            segment_ids=segment_ids,
        )  # fmt: skip
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
    args = (q_BxTxHxD, k_BxTxKxD, v_BxTxKxD)
    if segment_ids is not None:  # an optional fourth argument all the way down
        args += (jnp.asarray(segment_ids, jnp.int32),)
    if _is_manual(axis):
        whole = _whole_on_every_shard(axis, *args)
        _check_length(length * (1 if whole else cp), cp, load_balanced, "context_attention")
        return local(*args, whole=whole)
    _check_length(length, cp, load_balanced, "context_attention")
    return _split_program(local, axis, q_BxTxHxD.shape[0], len(args))(*args)


def _split_program(local, axis: str, batch: int, count: int):
    """``local`` of ``count`` arguments (``q``, ``k``, ``v`` and maybe segment ids) in a
    ``shard_map`` manual over ``axis`` and the batch's axes."""
    mesh = jax.sharding.get_abstract_mesh()
    rows = _batch_axes(mesh, axis, batch)
    spec = P(rows or None, axis)
    program = functools.partial(
        jax.shard_map, mesh=mesh, axis_names=frozenset({axis, *rows}), check_vma=True
    )
    if AxisType.Manual in mesh.axis_types:  # inside a shard_map over other axes (run's)
        return _nested(local, program, spec, count)
    return program(local, in_specs=(spec,) * count, out_specs=spec)


def _nested(local, program, spec, count: int):
    """``local`` under ``program`` (a ``shard_map`` inside another's manual axes), with a
    backward pass that is a ``shard_map`` of its own, recomputing the forward.

    JAX 0.10 cannot differentiate a ``shard_map`` nested in one with ``check_vma``:
    the residuals it passes between the two halves name the outer manual axes, which
    the verifier refuses. Saving only the inputs avoids those residuals."""

    @jax.custom_vjp
    def attend(*args):
        return program(local, in_specs=(spec,) * count, out_specs=spec)(*args)

    def backward(saved, d_out):
        def local_grads(d_out, q, k, v, *ids):
            return jax.vjp(lambda q, k, v: local(q, k, v, *ids), q, k, v)[1](d_out)

        specs = dict(in_specs=(spec,) * (count + 1), out_specs=(spec,) * 3)
        return (*program(local_grads, **specs)(d_out, *saved), *[None] * (count - 3))

    attend.defvjp(lambda *args: (attend(*args), args), backward)
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
    sequence by sharding, `replicator.parallel.activations`).

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


def _local_attention(q, k, v, ids=None, *, strategy, balanced, axis, chunk, whole=False):
    """With ``axis`` manual: this device's queries (segment ``ids``, or None) attending
    to the whole sequence (``whole``: the device holds all of it, as every device
    along ``axis`` does)."""
    cp = context_size(axis)
    axes = flash.varying(q, k, v, *([] if ids is None else [ids]))
    q, k, v = (vary(x, axes) for x in (q, k, v))
    ids = None if ids is None else vary(ids, axes)
    batch, length, heads, head_dim = q.shape
    if whole and balanced:  # attend in the original order, where chunks are contiguous
        q, k, v = (restore_order(x, cp) for x in (q, k, v))
        ids = None if ids is None else restore_order(ids, cp)
    q5 = q.reshape(batch, length, k.shape[2], heads // k.shape[2], head_dim)  # B,T,K,G,D
    total = length if whole else length * cp
    kind = "whole" if whole else strategy
    pieces = 1 if whole else 2 * cp if balanced else cp
    layout = _Layout(kind, total, cp, balanced and not whole, axis,
                     _chunk_size(total // pieces, chunk))  # fmt: skip
    kv = (k, v) if ids is None else (k, v, ids)  # a block of keys and their ids
    if kind == "ring":
        out = _ring_attention(q5, kv, ids, layout)
    elif kind == "gather":
        kv = tuple(jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in kv)
        out = _gathered_attention(q5, kv, ids, layout)
    else:
        out = flash.blocked_attention(q5, k, v, None if ids is None else (ids, ids), layout)
    out = out.reshape(q.shape).astype(q.dtype)
    return load_balance(out, cp) if whole and balanced else out


def _chunk_size(piece: int, target: int) -> int:
    """The largest length up to ``target`` that divides ``piece``: a shard's block, or
    its halves when load balanced, whose positions are consecutive. So are a chunk's,
    and a pair of chunks is all visible, all hidden, or split by the diagonal."""
    return max(c for c in range(1, min(piece, target) + 1) if piece % c == 0)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Which positions a device's queries and keys hold, and the chunks it works in.

    ``kind``: ``"whole"`` (the whole sequence in order on both sides), or for the
    keys of one shard (a ring hop's, or one shard's of the gathered keys) those of
    the same shard (``"diagonal"``), an earlier one (``"before"``) or a later one
    (``"after"``). ``"ring"`` and ``"gather"`` name the strategy before a hop's
    case is known. A case's mask depends only on which of the three it is, so each
    is laid out as shards 0 and 1 stand to each other: static positions, and static
    lists of the pairs of chunks to compute (`replicator.attention.flash`'s layout)."""

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

    def groups(self) -> list[tuple[np.ndarray, bool]]:
        """``(pairs [n, 2] of (query chunk, key chunk), causal)``: the pairs whose
        queries start after their keys (all visible), then those that start together
        (causal within); those that start before are hidden and left out."""
        rows, cols = self.starts()
        after, level = rows[:, None] > cols[None, :], rows[:, None] == cols[None, :]
        return [
            (np.argwhere(x).astype(np.int32), causal)
            for x, causal in ((after, False), (level, True))
        ]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gathered_attention(q, kv_all, ids, layout: _Layout) -> jax.Array:
    """This shard's ``q [B, T/CP, K, G, D]`` (segment ``ids`` or None) attending to the
    gathered keys and values ``kv_all`` (and their ids; float32 output): shard by
    shard of the keys, each laid out as a ring hop's (`_by_case`), so that only
    visible pairs of chunks are computed."""
    return _gathered_forward(q, kv_all, ids, layout)[0]


def _segments(ids, kv):
    """`replicator.attention.flash`'s segments: the queries' ids and those that came with ``kv``."""
    return None if ids is None else (ids, kv[2])


def _source_blocks(fn, carry, kv_all, layout: _Layout):
    """``carry = fn(carry, j, kv_j, hop)`` over the key shards ``j = s - t`` for
    ``t = 0 .. CP - 1``, as the ring meets them (`_by_case`)."""
    s, length = jax.lax.axis_index(layout.axis), kv_all[0].shape[1] // layout.cp

    def step(carry, t):
        j = (s - t) % layout.cp
        kv_j = tuple(jax.lax.dynamic_slice_in_dim(x, j * length, length, 1) for x in kv_all)
        return _by_case(lambda hop: fn(carry, j, kv_j, hop), t, s, layout)

    carry = step(carry, 0)
    return jax.lax.scan(lambda c, t: (step(c, t), None), carry, jnp.arange(1, layout.cp))[0]


def _gathered_forward(q, kv_all, ids, layout):
    def fold(acc, j, kv_j, hop):
        return flash.fold(acc, q, *kv_j[:2], hop, _segments(ids, kv_j))

    empty = flash.empty(q, *kv_all[:2])
    out, lse = flash.finish(_source_blocks(fold, empty, kv_all, layout))
    return out, (q, kv_all, ids, out, lse)


def _gathered_backward(layout, saved, d_out):
    q, kv_all, ids, out, lse = saved
    delta = jnp.sum(d_out * out, axis=-1)  # rowsum(dO * O), flash attention's D
    length = kv_all[0].shape[1] // layout.cp

    def pull(grads, j, kv_j, hop):
        segments = _segments(ids, kv_j)
        gq, gk, gv = flash.fold_grads(q, d_out, lse, delta, *kv_j[:2], hop, segments)
        d_q, d_k, d_v = grads
        put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=j * length, axis=1)
        return d_q + gq, put(d_k, gk), put(d_v, gv)

    zeros = flash.zero_grads((q, *kv_all[:2]), d_out, lse)
    d_q, d_k, d_v = _source_blocks(pull, zeros, kv_all, layout)
    d_kv = (d_k.astype(kv_all[0].dtype), d_v.astype(kv_all[1].dtype), *[None] * len(kv_all[2:]))
    return d_q.astype(q.dtype), d_kv, None


_gathered_attention.defvjp(_gathered_forward, _gathered_backward)


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
def _ring_attention(q, kv, ids, layout: _Layout) -> jax.Array:
    """Ring attention of this shard's ``q [B, T, K, G, D]`` (segment ``ids`` or None)
    to every shard's keys and values ``kv`` (their ids with them); float32 output."""
    return _ring_forward(q, kv, ids, layout)[0]


def _ring_forward(q, kv, ids, layout):
    s = jax.lax.axis_index(layout.axis)

    def step(acc, kv, t):
        fold = lambda hop: flash.fold(acc, q, *kv[:2], hop, _segments(ids, kv))  # noqa: E731
        return _by_case(fold, t, s, layout)

    acc = _ring_loop(step, flash.empty(q, *kv[:2]), kv, layout.axis, layout.cp)
    out, lse = flash.finish(acc)
    return out, (q, kv, ids, out, lse)


def _ring_backward(layout, saved, d_out):
    """The gradients: the key/value blocks go round again, each with the gradient its
    keys and values gathered so far, which a last hop takes home."""
    q, kv, ids, out, lse = saved
    axis, cp = layout.axis, layout.cp
    delta = jnp.sum(d_out * out, axis=-1)  # rowsum(dO * O), flash attention's D
    s = jax.lax.axis_index(axis)

    def step(carry, kv, t):
        d_q, d_kv = carry
        if not (isinstance(t, int) and t == 0):
            d_kv = _send(d_kv, axis, cp)  # with the block that arrived for this hop
        segments = _segments(ids, kv)
        pull = lambda hop: flash.fold_grads(q, d_out, lse, delta, *kv[:2], hop, segments)  # noqa: E731
        gq, gk, gv = _by_case(pull, t, s, layout)
        return d_q + gq, (d_kv[0] + gk, d_kv[1] + gv)

    zeros = flash.zero_grads((q, *kv[:2]), d_out, lse)
    d_q, d_kv = _ring_loop(step, (zeros[0], zeros[1:]), kv, axis, cp)
    d_k, d_v = _send(d_kv, axis, cp)
    d_kv = (d_k.astype(kv[0].dtype), d_v.astype(kv[1].dtype), *[None] * len(kv[2:]))
    return d_q.astype(q.dtype), d_kv, None


_ring_attention.defvjp(_ring_forward, _ring_backward)


# ------------------------------------------------------------ checks and axes


def _batch_axes(mesh, axis: str, batch: int) -> tuple[str, ...]:
    """The automatic mesh axes the activation rules split the batch over, where it
    divides over them: the program is manual over those too, so each device works on
    its own rows (``replicator.parallel.pipelining`` does the same)."""
    from replicator.parallel.activations import batch_axes

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


def _check_inputs(q, k, v, strategy: str, segment_ids) -> None:
    if segment_ids is not None and tuple(jnp.shape(segment_ids)) != tuple(q.shape[:2]):
        raise ValueError(
            f"context_attention: segment_ids {jnp.shape(segment_ids)}: expected [batch, time] "
            f"= {tuple(q.shape[:2])}, aligned and split like the queries."
        )
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
