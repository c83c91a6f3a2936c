"""Context parallelism: causal attention over a sequence split on the mesh axis ``context``.

Each of the ``CP`` devices along ``context`` holds a contiguous ``1 / CP`` of the
sequence of every query, key and value (``[batch, time, heads, head_dim]``), and
`context_attention` computes for its queries the causal attention over the whole
sequence, by one of two strategies:

* ``"gather"`` (MaxText's default, ``all_gather`` context parallelism): the keys
  and values are all-gathered over ``context``, and each device attends from its
  queries to all of them under the causal mask of their global positions, shard
  by shard of the keys. One collective per call (a reduce-scatter of their
  gradients back); every device holds the whole sequence's keys and values.
* ``"ring"`` (ring attention, Liu et al. 2023): the key/value blocks go round the
  ring of devices with ``ppermute`` (``CP - 1`` hops), each device folding every
  block into a running softmax (the maximum, the sum and the weighted values, as
  flash attention does), so no device holds more than the block it works on and
  the one arriving, never the whole sequence's keys and values. Its backward
  pass is a second trip round the ring (a custom VJP): the blocks go round again
  with their gradients, and the saved state is only this device's queries, keys,
  values, output and log-sum-exp.

Either way a device's queries attend block by block, through the attention
room's kernel interface (`replicator.attention.blocks`): each block of this
device's queries against a block of keys gives its output and log-sum-exp, and
the blocks are combined by their log-sum-exps (as flash attention combines its
tiles); the backward pass gives each block its share of the gradients against the
combined output and log-sum-exp (flash attention's backward). The pairs of blocks
the causal mask hides entirely are known from the hop (or from which shard's keys
a gathered block holds) and are not computed at all. What computes a block is
the backend's kernel (``implementation``, `blocks.choose_kernel`): on TPU Pallas's
splash kernels (forward and backward fused; blocks of a multiple of 128
positions), elsewhere flash attention in XLA's operations, ``chunk`` positions of
queries and keys at a time (one ``[batch, chunk, heads, chunk]`` block of float32
scores, never a ``[T / CP, T]`` one). cuDNN gives no log-sum-exp a block could be
combined by (see `blocks`), so a GPU's blocks are XLA's.

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
the ring beside it), and each block computed masks its scores by them; the blocks
computed stay those the causal mask decides, statically.

`context_attention` runs in the global view (`Replicator.compile`, or
``jax.jit`` under ``jax.set_mesh``), where it goes manual over ``context`` and
the axes the batch is split over in a ``jax.shard_map`` and leaves every other
axis (``tensor``'s heads) to the compiler (with splash's blocks, which XLA cannot
partition, manual over those too); inside a ``shard_map`` where ``context``
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
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from replicator.attention import blocks as blocks
from replicator.attention import flash as flash
from replicator.attention import kernels as attention_lib
from replicator.errors import ConfigError
from replicator.parallel import axes as mesh_axes
from replicator.parallel.activations import batch_axes
from replicator.runtime import compat
from replicator.spmd.context import vary

CONTEXT_AXIS = "context"
STRATEGIES = ("gather", "ring")
CHUNK = blocks.CHUNK  # XLA's blocks: positions of queries and keys per block of scores
_UNSPLIT = "the context strategies do not compute them yet; drop the axis (or set it to 1)"


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
    window: int | None = None,
    softcap: float | None = None,
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
      implementation: one of `replicator.attention.kernels.IMPLEMENTATIONS`: the
        whole sequence's kernel where it is not split (no ``axis``, or size 1), each
        block's where it is (`replicator.attention.blocks.choose_kernel`: ``"auto"``
        is splash on TPU in the global view, XLA's elsewhere; ``"cudnn"`` is XLA's).
      chunk: XLA's blocks take queries and keys this many positions at a time (the
        largest up to it dividing a block): one ``[batch, chunk, heads, chunk]`` of scores.
      segment_ids: None, or int32 ``[batch, time]``, aligned and split like ``q``
        (packed documents): a query attends only to keys of its own id. The key
        blocks' ids travel with them (gathered, or round the ring).
      window, softcap: `causal_attention`'s, where ``axis`` is of size 1 only (as yet).

    Returns:
      The attention output, shaped and split like ``q``, in ``q``'s dtype.

    Raises:
      ConfigError: a length that does not split into ``CP`` blocks (``2 * CP`` when
        load balanced), or a window or soft cap over a split sequence; one line.
      ValueError: an unknown strategy or kernel, mismatched shapes, or splash asked
        for where it cannot run; one line.

    >>> x = jax.random.normal(jax.random.key(0), (2, 8, 2, 4))
    >>> y = context_attention(x, x, x, strategy="ring")  # no context axis: one device's
    >>> bool(jnp.allclose(y, attention_lib.causal_attention(x, x, x)))
    True
    """
    _check_inputs(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, strategy, segment_ids, window, softcap, axis)
    cp = context_size(axis)
    if cp == 1:
        return attention_lib.causal_attention(
            q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, implementation=implementation,
            segment_ids=segment_ids, window=window, softcap=softcap,
        )  # fmt: skip
    args = (q_BxTxHxD, k_BxTxKxD, v_BxTxKxD)
    if segment_ids is not None:  # an optional fourth argument all the way down
        args += (jnp.asarray(segment_ids, jnp.int32),)
    manual = mesh_axes.is_manual(axis)
    whole = manual and _whole_on_every_shard(axis, *args)
    length = q_BxTxHxD.shape[1] * (cp if manual and not whole else 1)
    _check_length(length, cp, load_balanced, "context_attention", axis)
    pieces = 1 if whole else 2 * cp if load_balanced else cp
    kernel = blocks.choose_kernel(implementation, length // pieces, chunk=chunk)
    local = functools.partial(
        _local_attention, strategy=strategy, balanced=load_balanced, axis=axis, kernel=kernel
    )
    if manual:
        return checkpoint_name(local(*args, whole=whole), "context")
    out = _split_program(local, axis, k_BxTxKxD.shape, len(args), kernel)(*args)
    return checkpoint_name(out, "context")  # for remat policies keeping it, as a whole one's


def _split_program(local, axis: str, shape: tuple[int, ...], count: int, kernel):
    """``local`` of ``count`` arguments (``q``, ``k``, ``v`` and maybe segment ids) in a
    ``shard_map`` manual over ``axis`` and the batch's axes (``shape``: the keys').

    A splash kernel is one device's program, which XLA never partitions: the program
    is manual over every automatic axis then, the key heads split over the activation
    rules' head axes where they divide, and unchecked (Pallas's kernels carry no
    ``check_vma`` types)."""
    mesh = jax.sharding.get_abstract_mesh()
    rows = batch_axes(mesh, shape[0], exclude=axis)  # each device works on its own rows
    names, heads, splash = {axis, *rows}, (), kernel.implementation == "splash"
    if splash:
        heads = attention_lib.kernel_axes(mesh, shape[0], shape[2])[1]
        heads = tuple(a for a in heads if a not in names)
        names = set(mesh_axes.auto_axes(mesh))
    spec, ids = P(rows or None, axis, heads or None), P(rows or None, axis)
    specs = dict(in_specs=(spec,) * 3 + (ids,) * (count - 3), out_specs=spec)
    program = functools.partial(
        jax.shard_map, mesh=mesh, axis_names=frozenset(names), check_vma=not splash
    )
    if mesh_axes.manual_axes(mesh):  # inside a shard_map over other axes (run's)
        return _nested(local, program, specs)
    return program(local, **specs)


def _nested(local, program, specs):
    """``local`` under ``program`` (a ``shard_map`` inside another's manual axes, with
    ``specs``), with a backward pass that is a ``shard_map`` of its own, recomputing
    the forward.

    JAX 0.10 cannot differentiate a ``shard_map`` nested in one with ``check_vma``:
    the residuals it passes between the two halves name the outer manual axes, which
    the verifier refuses. Saving only the inputs avoids those residuals."""

    @jax.custom_vjp
    def attend(*args):
        return program(local, **specs)(*args)

    def backward(saved, d_out):
        def local_grads(d_out, q, k, v, *ids):
            return jax.vjp(lambda q, k, v: local(q, k, v, *ids), q, k, v)[1](d_out)

        spec, ins = specs["out_specs"], specs["in_specs"]
        grads = program(local_grads, in_specs=(spec, *ins), out_specs=(spec,) * 3)
        return (*grads(d_out, *saved), *[None] * (len(saved) - 3))

    attend.defvjp(lambda *args: (attend(*args), args), backward)
    return attend


def context_size(axis: str = CONTEXT_AXIS) -> int:
    """The number of context shards: the size of ``axis`` in the mesh being traced for
    (`replicator.parallel.axes.size`; 1 without one).

    >>> context_size()
    1
    """
    return mesh_axes.size(axis)


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
      ConfigError: the length does not split into ``CP`` blocks (one line).
    """
    cp = context_size(axis)
    if cp == 1 or not mesh_axes.is_manual(axis) or not _whole_on_every_shard(axis, x):
        return x
    _check_length(x.shape[dim], cp, False, "split_sequence", axis)
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
      ConfigError: the length does not split into ``2 * cp`` chunks (one line).

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


def _local_attention(q, k, v, ids=None, *, strategy, balanced, axis, kernel, whole=False):
    """With ``axis`` manual: this device's queries (segment ``ids``, or None) attending
    to the whole sequence (``whole``: the device holds all of it, as every device
    along ``axis`` does), block by block through ``kernel``."""
    cp = context_size(axis)
    axes = flash.varying(q, k, v, *([] if ids is None else [ids]))
    q, k, v = (vary(x, axes) for x in (q, k, v))
    ids = None if ids is None else vary(ids, axes)
    batch, length, heads, head_dim = q.shape
    if whole and balanced:  # attend in the original order, where chunks are contiguous
        q, k, v = (restore_order(x, cp) for x in (q, k, v))
        ids = None if ids is None else restore_order(ids, cp)
    q5 = q.reshape(batch, length, k.shape[2], heads // k.shape[2], head_dim)  # B,T,K,G,D
    plan = _Plan(cp, balanced, axis, kernel)
    kv = (k, v) if ids is None else (k, v, ids)  # a block of keys and their ids
    if whole:
        out = blocks.causal_block(q5, k, v, None if ids is None else (ids, ids), kernel)
    elif strategy == "ring":
        out = _ring_attention(q5, kv, ids, plan)
    else:
        kv = tuple(jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in kv)
        out = _gathered_attention(q5, kv, ids, plan)
    out = out.reshape(q.shape).astype(q.dtype)
    return load_balance(out, cp) if whole and balanced else out


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a strategy's custom VJP keeps static: ``cp`` shards along ``axis``, in
    `load_balance`'s order or not, their blocks computed by ``kernel``."""

    cp: int
    balanced: bool
    axis: str
    kernel: blocks.Kernel


def _pieces(case: str, length: int, balanced: bool):
    """The blocks this shard's ``length`` queries compute against one shard's keys:
    ``((query start, stop), (key start, stop), causal)`` each.

    ``case``: the keys are this shard's own (``"diagonal"``), an earlier shard's
    (``"before"``) or a later one's (``"after"``). In order, they are all visible
    before, hidden after, causal on the diagonal. Load balanced, each shard holds two
    halves (chunks ``i`` and ``2 CP - 1 - i``): all its queries see the first half of
    an earlier shard's keys, the second half of its queries all of a later shard's,
    and on the diagonal each half is causal with itself, the second seeing the first."""
    every = (0, length)
    if not balanced:
        return {"diagonal": [(every, every, True)], "before": [(every, every, False)],
                "after": []}[case]  # fmt: skip
    first, second = (0, length // 2), (length // 2, length)
    return {
        "diagonal": [(first, first, True), (second, first, False), (second, second, True)],
        "before": [(every, first, False)],
        "after": [(second, every, False)],
    }[case]


def _fold_hop(acc, q, kv, ids, case: str, plan: _Plan):
    """``acc`` (``(out, lse)`` of this shard's queries ``q``) with their attention to
    one shard's keys and values ``kv`` (and their ids) merged in, a block at a time."""
    axes = flash.varying(*acc, q, *kv)
    for rows, cols, causal in _pieces(case, q.shape[1], plan.balanced):
        segments = None if ids is None else (_part(ids, rows), _part(kv[2], cols))
        k, v = (_part(x, cols) for x in kv[:2])
        part = blocks.attend_block(
            plan.kernel, _part(q, rows), k, v, causal=causal, segments=segments,
            into=tuple(_part(x, rows) for x in acc),
        )  # fmt: skip
        acc = tuple(_put(x, rows, vary(p, axes)) for x, p in zip(acc, part))
    return tuple(vary(x, axes) for x in acc)


def _part(x, span):
    """Positions ``span`` (start, stop) of ``x``'s sequence (``x`` itself for all)."""
    start, stop = span
    return x if (start, stop) == (0, x.shape[1]) else x[:, start:stop]


def _put(x, span, value):
    start, stop = span
    return value if (start, stop) == (0, x.shape[1]) else x.at[:, start:stop].set(value)


def _add(x, span, value):
    start, stop = span
    return x + value if (start, stop) == (0, x.shape[1]) else x.at[:, start:stop].add(value)


def _pull_hop(q, kv, ids, saved, case: str, plan: _Plan):
    """The gradients of this shard's queries ``q`` and of one shard's keys and values
    ``kv`` from the blocks they computed, given ``saved``: the queries' output, its
    log-sum-exp and the output's cotangent. (Fresh sums, not added to the running
    ones: a conditional that passed those through failed libtpu's copy insertion.)"""
    axes = flash.varying(q, *kv, *saved)
    pieces, every = _pieces(case, q.shape[1], plan.balanced), (0, q.shape[1])
    alone = [piece[:2] for piece in pieces] == [(every, every)]  # one block, the whole hop
    grads = None if alone else flash.zero_grads((q, *kv[:2]), *saved)
    for rows, cols, causal in pieces:
        segments = None if ids is None else (_part(ids, rows), _part(kv[2], cols))
        parts = blocks.block_grads(
            plan.kernel, _part(q, rows), *(_part(x, cols) for x in kv[:2]),
            *(_part(x, rows) for x in saved), causal=causal, segments=segments,
        )  # fmt: skip
        parts = tuple(vary(p, axes) for p in parts)
        spans = (rows, cols, cols)
        grads = parts if alone else tuple(_add(g, s, p) for g, s, p in zip(grads, spans, parts))
    return tuple(vary(x, axes) for x in grads)


def _by_case(fn, t, s):
    """``fn(case)`` for hop ``t`` (the keys of shard ``s - t``): the diagonal's at
    ``t = 0`` (a Python int), else by whether that shard comes before ``s``."""
    if isinstance(t, int) and t == 0:
        return fn("diagonal")
    # 1 <= t < CP: shard s - t comes before s unless it wrapped round.
    return jax.lax.cond(t <= s, lambda: fn("before"), lambda: fn("after"))


def _empty(q, *others):
    """``(out, lse)`` of attention to no keys yet: zeros and ``-inf``."""
    out, lse, _ = flash.empty(q, *others)
    return out, lse


# ------------------------------------------------------------ all-gathered keys


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gathered_attention(q, kv_all, ids, plan: _Plan) -> jax.Array:
    """This shard's ``q [B, T/CP, K, G, D]`` (segment ``ids`` or None) attending to the
    gathered keys and values ``kv_all`` (and their ids; float32 output): shard by
    shard of the keys, as the ring meets them, so that only visible blocks are
    computed."""
    return _gathered_forward(q, kv_all, ids, plan)[0]


def _source_blocks(fn, carry, kv_all, plan: _Plan):
    """``carry = fn(carry, j, kv_j, case)`` over the key shards ``j = s - t`` for
    ``t = 0 .. CP - 1``, as the ring meets them (`_by_case`)."""
    s, length = jax.lax.axis_index(plan.axis), kv_all[0].shape[1] // plan.cp

    def step(carry, t):
        j = (s - t) % plan.cp
        kv_j = tuple(jax.lax.dynamic_slice_in_dim(x, j * length, length, 1) for x in kv_all)
        return _by_case(lambda case: fn(carry, j, kv_j, case), t, s)

    carry = step(carry, 0)
    return jax.lax.scan(lambda c, t: (step(c, t), None), carry, jnp.arange(1, plan.cp))[0]


def _gathered_forward(q, kv_all, ids, plan):
    def fold(acc, j, kv_j, case):
        return _fold_hop(acc, q, kv_j, ids, case, plan)

    out, lse = _source_blocks(fold, _empty(q, *kv_all[:2]), kv_all, plan)
    return out, (q, kv_all, ids, out, lse)


def _gathered_backward(plan, saved, d_out):
    q, kv_all, ids, out, lse = saved
    length = kv_all[0].shape[1] // plan.cp

    def pull(grads, j, kv_j, case):
        d_q, d_k, d_v = grads
        g_q, g_k, g_v = _pull_hop(q, kv_j, ids, (out, lse, d_out), case, plan)
        put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=j * length, axis=1)
        return d_q + g_q, put(d_k, g_k), put(d_v, g_v)

    zeros = flash.zero_grads((q, *kv_all[:2]), d_out, lse)
    d_q, d_k, d_v = _source_blocks(pull, zeros, kv_all, plan)
    d_kv = (d_k.astype(kv_all[0].dtype), d_v.astype(kv_all[1].dtype), *[None] * len(kv_all[2:]))
    return d_q.astype(q.dtype), d_kv, None


_gathered_attention.defvjp(_gathered_forward, _gathered_backward)


# ------------------------------------------------------------ the ring


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
def _ring_attention(q, kv, ids, plan: _Plan) -> jax.Array:
    """Ring attention of this shard's ``q [B, T, K, G, D]`` (segment ``ids`` or None)
    to every shard's keys and values ``kv`` (their ids with them); float32 output."""
    return _ring_forward(q, kv, ids, plan)[0]


def _ring_forward(q, kv, ids, plan):
    s = jax.lax.axis_index(plan.axis)

    def step(acc, kv, t):
        return _by_case(lambda case: _fold_hop(acc, q, kv, ids, case, plan), t, s)

    out, lse = _ring_loop(step, _empty(q, *kv[:2]), kv, plan.axis, plan.cp)
    return out, (q, kv, ids, out, lse)


def _ring_backward(plan, saved, d_out):
    """The gradients: the key/value blocks go round again, each with the gradient its
    keys and values gathered so far, which a last hop takes home."""
    q, kv, ids, out, lse = saved
    axis, cp = plan.axis, plan.cp
    s = jax.lax.axis_index(axis)

    def step(carry, kv, t):
        d_q, d_kv = carry
        if not (isinstance(t, int) and t == 0):
            d_kv = _send(d_kv, axis, cp)  # with the block that arrived for this hop
        pull = lambda case: _pull_hop(q, kv, ids, (out, lse, d_out), case, plan)  # noqa: E731
        g_q, g_k, g_v = _by_case(pull, t, s)
        return d_q + g_q, (d_kv[0] + g_k, d_kv[1] + g_v)

    zeros = flash.zero_grads((q, *kv[:2]), d_out, lse)
    d_q, d_kv = _ring_loop(step, (zeros[0], zeros[1:]), kv, axis, cp)
    d_k, d_v = _send(d_kv, axis, cp)
    d_kv = (d_k.astype(kv[0].dtype), d_v.astype(kv[1].dtype), *[None] * len(kv[2:]))
    return d_q.astype(q.dtype), d_kv, None


_ring_attention.defvjp(_ring_forward, _ring_backward)


# ------------------------------------------------------------ checks and axes


def _whole_on_every_shard(axis: str, *xs) -> bool:
    """Whether ``xs`` are known to be the same on every device along the manual ``axis``
    (a step under `Replicator.run` whose inputs are not split over it): where JAX
    tracks what varies (``check_vma``), nothing of theirs varies over ``axis``."""
    if not compat.varying_manual_axes(jax.lax.axis_index(axis)):
        return False  # not tracked: the caller's blocks, as documented
    return not any(axis in compat.varying_manual_axes(x) for x in xs)


def _split_here(x, axis: str) -> bool:
    """Whether ``x`` is this device's block of a sequence split over the manual ``axis``
    (it varies over it, as `split_sequence`'s output does)."""
    return (
        context_size(axis) > 1
        and mesh_axes.is_manual(axis)
        and axis in compat.varying_manual_axes(x)
    )


def _check_inputs(q, k, v, strategy: str, segment_ids, window, softcap, axis: str) -> None:
    if (window is not None or softcap is not None) and context_size(axis) > 1:
        raise ConfigError(f"a sliding window or soft cap over mesh axis {axis!r}: {_UNSPLIT}")
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


def _check_length(length: int, cp: int, balanced: bool, name: str, axis: str = CONTEXT_AXIS):
    chunks = 2 * cp if balanced else cp
    if length % chunks:
        two = ", two each (load balanced)" if balanced else ""
        raise ConfigError(
            f"{name}: a sequence of {length} tokens does not split into {chunks} equal "
            f"chunks over mesh axis {axis!r} of {cp}{two}; use a length divisible by "
            f"{chunks}, or another {axis!r} size."
        )
