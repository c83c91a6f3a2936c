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
shard, they are skipped at run time (``lax.cond``).

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
    q5 = q.reshape(batch, length, k.shape[2], heads // k.shape[2], head_dim)  # B,T,K,G,D
    total = length if whole else length * cp
    kind = "whole" if whole else strategy
    pieces = 1 if whole else 2 * cp if balanced else cp  # what a chunk should not straddle
    layout = _Layout(kind, total, cp, balanced, axis, _chunk_size(total // pieces, chunk))
    if kind == "ring":
        out = _ring_attention(q5, k, v, layout)
    else:
        if kind == "gather":
            k, v = (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
        out = _blocked_attention(q5, k, v, layout)
    return out.reshape(q.shape).astype(q.dtype)


def _chunk_size(piece: int, target: int) -> int:
    """The largest length up to ``target`` that divides ``piece`` (a shard's block, or
    its halves when load balanced: a chunk within one piece is skipped or computed
    whole)."""
    return max(c for c in range(1, min(piece, target) + 1) if piece % c == 0)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Which positions a device's queries and keys hold, and the chunks it works in.

    ``kind``: ``"whole"`` (the whole sequence, as laid out, on both sides),
    ``"gather"`` (this shard's queries, every key), or for one hop of the ring a
    block of keys from the same shard (``"diagonal"``), an earlier one
    (``"before"``) or a later one (``"after"``). A hop's mask depends only on
    which of the three it is, so each is laid out as shards 0 and 1 stand to each
    other: static positions, and a static list of the chunk pairs it leaves
    visible. Only ``"gather"``'s query positions are traced (the shard's index)."""

    kind: str
    total: int  # the whole sequence's length
    cp: int
    balanced: bool
    axis: str
    size: int  # positions per chunk

    def positions(self):
        whole = context_positions(self.total, self.cp, self.balanced)
        if self.kind == "whole":
            return whole, whole
        if self.kind == "gather":
            shard = jax.lax.axis_index(self.axis)
            return context_positions(self.total, self.cp, self.balanced, shard=shard), whole
        q_shard, k_shard = {"diagonal": (0, 0), "before": (1, 0), "after": (0, 1)}[self.kind]
        return tuple(
            context_positions(self.total, self.cp, self.balanced, shard=s)
            for s in (q_shard, k_shard)
        )

    def pairs(self, rows, cols) -> np.ndarray:
        """``[n, 2]`` (query chunk, key chunk) pairs to compute: those where some query
        sees some key (all of them where the positions are traced)."""
        size = self.size
        nq, nk = len(rows) // size, len(cols) // size
        if not isinstance(rows, np.ndarray):
            return np.argwhere(np.ones((nq, nk), bool)).astype(np.int32)
        first_key = cols.reshape(nk, size).min(1)
        last_query = rows.reshape(nq, size).max(1)
        return np.argwhere(last_query[:, None] >= first_key[None, :]).astype(np.int32)


def _blocks(layout: _Layout):
    """``(pairs, chunk(x, c, axis), mask(i, j), visible(i, j))`` of ``layout``:
    chunk ``c`` of an array's sequence, the causal mask of query chunk ``i`` and key
    chunk ``j``, and whether to compute it (a run-time test where traced)."""
    rows, cols = layout.positions()
    pairs, size = layout.pairs(rows, cols), layout.size
    traced = not isinstance(rows, np.ndarray)
    rows, cols = jnp.asarray(rows), jnp.asarray(cols)

    def chunk(x, c, axis=1):
        return jax.lax.dynamic_slice_in_dim(x, c * size, size, axis)

    def mask(i, j):
        return chunk(rows, i, 0)[:, None] >= chunk(cols, j, 0)[None, :]

    def visible(i, j):
        return chunk(rows, i, 0).max() >= chunk(cols, j, 0).min() if traced else None

    return pairs, chunk, mask, visible


def _add_chunk(x, c, size, value):
    start = c * size
    old = jax.lax.dynamic_slice_in_dim(x, start, size, 1)
    return jax.lax.dynamic_update_slice_in_dim(x, old + value, start, 1)


def _fold(acc, q, k, v, layout: _Layout):
    """``acc`` (`_empty`'s ``(o, m, l)``) with ``q``'s attention to ``k``, ``v`` folded
    in, one visible pair of chunks at a time (a ``[B, c, K, G, c]`` block of scores)."""
    pairs, chunk, mask, visible = _blocks(layout)
    if not len(pairs):
        return acc

    def body(acc, pair):
        i, j = pair[0], pair[1]
        args = [tuple(chunk(x, i) for x in acc), chunk(q, i), chunk(k, j), chunk(v, j), mask(i, j)]
        test = visible(i, j)
        if test is None:
            new = _attend(*args)
        else:
            axes = _varying(*args[0], *args[1:])
            new = jax.lax.cond(
                test, lambda: _attend(*args), lambda: tuple(vary(x, axes) for x in args[0])
            )
        start = i * layout.size
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(x, y, start, 1) for x, y in zip(acc, new)
        ), None

    return jax.lax.scan(body, acc, jnp.asarray(pairs))[0]


def _grads(q, d_out, lse, delta, k, v, layout: _Layout):
    """Flash attention's backward over ``layout``'s visible chunk pairs: float32
    gradients of ``q``, ``k`` and ``v``."""
    pairs, chunk, mask, visible = _blocks(layout)
    axes = _varying(q, d_out, lse, k, v)
    zeros = tuple(vary(jnp.zeros(x.shape, _F32), axes) for x in (q, k, v))
    if not len(pairs):
        return zeros

    def body(grads, pair):
        i, j = pair[0], pair[1]
        args = [chunk(x, i) for x in (q, d_out, lse, delta)] + [chunk(k, j), chunk(v, j)]
        args.append(mask(i, j))
        test = visible(i, j)
        if test is None:
            gq, gk, gv = _block_grads(*args)
        else:
            hidden = tuple(
                vary(jnp.zeros(x.shape, _F32), _varying(*args)) for x in args[:1] + args[4:6]
            )
            gq, gk, gv = jax.lax.cond(test, lambda: _block_grads(*args), lambda: hidden)
        dq, dk, dv = grads
        size = layout.size
        return (_add_chunk(dq, i, size, gq), _add_chunk(dk, j, size, gk),
                _add_chunk(dv, j, size, gv)), None  # fmt: skip

    return jax.lax.scan(body, zeros, jnp.asarray(pairs))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blocked_attention(q, k, v, layout: _Layout) -> jax.Array:
    """``q [B, Tq, K, G, D]``'s attention to ``k``, ``v`` (float32 output), chunk by
    chunk, with flash attention's backward: no ``[Tq, Tk]`` scores in either."""
    return _blocked_forward(q, k, v, layout)[0]


def _blocked_forward(q, k, v, layout):
    o, m, total = _fold(_empty(q, k, v), q, k, v, layout)
    out = o / total[..., None]
    return out, (q, k, v, out, m + jnp.log(total))


def _blocked_backward(layout, saved, d_out):
    q, k, v, out, lse = saved
    delta = jnp.sum(d_out * out, axis=-1)  # rowsum(dO * O), flash attention's D
    grads = _grads(q, d_out, lse, delta, k, v, layout)
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))


_blocked_attention.defvjp(_blocked_forward, _blocked_backward)


# Online softmax over blocks of keys: ``(o, m, l)`` per query row, the weighted sum
# of values, the running maximum score and the sum of ``exp(score - m)``.


def _empty(q, *others):
    axes = _varying(q, *others)
    zeros = vary(jnp.zeros(q.shape[:-1], _F32), axes)
    return vary(jnp.zeros(q.shape, _F32), axes), zeros - jnp.inf, zeros


def _varying(*xs) -> tuple[str, ...]:
    return tuple(sorted(set().union(*(jax.typeof(x).manual_axis_type.varying for x in xs))))


def _scores(q, k, mask):
    """``q k^T / sqrt(D)`` in float32 ``[B, Tq, K, G, Tk]``, -inf where ``mask`` hides."""
    scores = jnp.einsum("bqkgd,bskd->bqkgs", q, k, preferred_element_type=_F32)
    scores = scores * (1 / math.sqrt(q.shape[-1]))
    return jnp.where(mask[None, :, None, None, :], scores, -jnp.inf)


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

    o, m, total = _ring_loop(step, _empty(q, k, v), (k, v), layout.axis, layout.cp)
    out = o / total[..., None]
    lse = m + jnp.log(total)
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

    axes = _varying(q, d_out, lse, k, v)
    zeros = tuple(vary(jnp.zeros(x.shape, _F32), axes) for x in (q, k, v))
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
