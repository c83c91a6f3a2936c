"""Dropless experts (`rp.moe` with ``capacity_factor=None``): grouped matmuls, ragged exchange.

Every token-choice pair goes through its expert exactly once, whatever the load:

1. **Sorted by expert.** A device's ``N = tokens * k`` pairs are sorted by their
   expert (stable), so each expert's pairs are one contiguous group, and the
   group sizes are counted (``[E]``).
2. **Sent to the experts' devices** (a mesh axis ``expert`` of size ``X``, each
   device holding ``L = E / X`` experts). The sorted pairs split into ``X``
   contiguous chunks, one per device; a ragged all-to-all sends each its chunk
   (`jax.lax.ragged_all_to_all`: only the real rows travel, ``N (X - 1) / X`` of
   them on average; sizes and offsets first go by three all-to-alls of ``X``
   integers). The receiver's buffer has room for ``X * N`` rows, the most it can
   get (every device's every pair for its experts): as MaxText's, what makes
   routing dropless under static shapes, at ``X`` times the memory of an even load.
   XLA:CPU has no ragged all-to-all: there (``jax.lax.platform_dependent``) the
   same exchange is a dense ``all_to_all`` of each device's ``X`` chunks, each
   padded to ``N`` rows, with the same result: ``X`` times the ragged one's bytes
   at an even load, and no FLOPs.
3. **Grouped by local expert.** The buffer holds the senders' chunks one after the
   other, each sorted by expert; one more sort groups the rows by local expert
   (the empty rows last), and `jax.lax.ragged_dot` applies each expert's MLP to its
   group: no FLOPs on the empty rows where ragged_dot skips them (TPU, GPU; XLA:CPU
   computes it densely, with the same numbers).
4. **Back** by the reverse ragged all-to-all, unsorted, weighted by the gates.

Where every device of ``expert`` holds the same tokens (``Replicator.run``'s
replicas, a batch that does not split), nothing travels: each device applies its
``L`` experts to their contiguous run of its sorted pairs (moved to the front, the
rest ignored), and the partial outputs add up over ``expert``. Without an
``expert`` axis the experts are local and step 2 is skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from replicator.runtime.compat import varying_manual_axes
from replicator.spmd.context import vary

Params = dict[str, jax.Array]


def grouped_mlp(
    experts: Params, rows_Nxd: jax.Array, group_sizes: jax.Array, activation: Callable
) -> jax.Array:
    """Each expert's MLP on its contiguous group of ``rows_Nxd`` (`jax.lax.ragged_dot`);
    rows past the groups' sum come out 0.

    >>> w = {"wi": jnp.ones((2, 1, 1)), "wo": jnp.stack([jnp.ones((1, 1)), -jnp.ones((1, 1))])}
    >>> grouped_mlp(w, jnp.ones((3, 1)), jnp.array([1, 1]), jax.nn.relu)[:, 0].tolist()
    [1.0, -1.0, 0.0]
    """
    h = jax.lax.ragged_dot(rows_Nxd, experts["wi"], group_sizes)
    if "wi_gate" in experts:
        h = activation(jax.lax.ragged_dot(rows_Nxd, experts["wi_gate"], group_sizes)) * h
    else:
        h = activation(h)
    out = jax.lax.ragged_dot(h, experts["wo"], group_sizes)
    used = jnp.arange(rows_Nxd.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(used[:, None], out, 0)  # the rows past the groups: 0 on every backend


def dropless_experts(
    experts: Params,
    x_BxSxd: jax.Array,
    experts_BxSxk: jax.Array,
    gates_BxSxk: jax.Array,
    *,
    num_experts: int,
    activation: Callable,
    axis: str | None = None,
    tokens_split: bool = True,
) -> jax.Array:
    """``[B, S, d]``: each token's ``k`` experts' outputs, weighted by its gates, none dropped.

    Args:
      experts: ``wi`` (``wi_gate``) ``[E', d, f]`` and ``wo`` ``[E', f, d]``: all
        ``E`` experts, or (inside a ``shard_map`` manual over ``axis``) this device's
        ``E / X``, the ``i``-th device's experts ``i * E / X ...``.
      x_BxSxd: this device's tokens.
      experts_BxSxk, gates_BxSxk: each token's chosen experts and their gates (`route`).
      num_experts: ``E``.
      activation: the MLP's nonlinearity.
      axis: the manual mesh axis the experts are split over, None: every expert local.
      tokens_split: whether this device's tokens are its own along ``axis`` (else
        every device of ``axis`` holds them alike, and the outputs add up over it).

    Returns:
      The weighted sum of each token's experts' outputs.
    """
    B, S, d = x_BxSxd.shape
    k = experts_BxSxk.shape[-1]
    chosen = experts_BxSxk.reshape(-1)
    order = jnp.argsort(chosen, stable=True)  # the pairs, sorted by expert
    rows = x_BxSxd.reshape(B * S, d)[order // k]
    sizes = jnp.bincount(chosen, length=num_experts).astype(jnp.int32)
    local = experts["wi"].shape[0]
    if axis is None or local == num_experts:
        out = grouped_mlp(experts, rows, sizes, activation)
    elif tokens_split:
        out = _exchanged(experts, rows, sizes, activation, axis)
    else:
        out = _local_run(experts, rows, sizes, activation, axis)
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(B, S, k, d)
    y = jnp.einsum("bskd,bsk->bsd", out, gates_BxSxk.astype(out.dtype))
    if axis is not None and local != num_experts and not tokens_split:
        y = jax.lax.psum(y, axis)
    return y


def _local_run(experts: Params, rows_Nxd, sizes_E, activation, axis: str) -> jax.Array:
    """Every device holds the same sorted pairs: each applies its ``L`` experts to
    their contiguous run, rolled to the front; the other rows come out 0."""
    N, L = rows_Nxd.shape[0], experts["wi"].shape[0]
    first = jax.lax.axis_index(axis) * L
    start = jnp.sum(jnp.where(jnp.arange(sizes_E.shape[0]) < first, sizes_E, 0))
    mine = jax.lax.dynamic_slice_in_dim(sizes_E, first, L)
    index = (jnp.arange(N) + start) % N
    out = grouped_mlp(experts, vary(rows_Nxd, (axis,))[index], mine, activation)
    return jnp.zeros_like(out).at[index].set(out, unique_indices=True)


def _exchanged(experts: Params, rows_Nxd, sizes_E, activation, axis: str) -> jax.Array:
    """Each device's sorted pairs to their experts' devices and back (module docstring)."""
    N, L = rows_Nxd.shape[0], experts["wi"].shape[0]
    X = sizes_E.shape[0] // L
    to_a2a = lambda v: jax.lax.all_to_all(v, axis, 0, 0, tiled=True)  # noqa: E731
    send_sizes = jnp.sum(sizes_E.reshape(X, L), axis=1)
    send_offsets = _exclusive_cumsum(send_sizes)
    counts_XxL = to_a2a(sizes_E.reshape(X, L))  # each sender's pairs for each of my experts
    recv_sizes = jnp.sum(counts_XxL, axis=1)
    recv_offsets = _exclusive_cumsum(recv_sizes)  # where each sender's chunk lands here
    buffer = _ragged_exchange(
        rows_Nxd, X * N, send_offsets, send_sizes, to_a2a(recv_offsets), recv_sizes, axis
    )
    # The buffer: each sender's chunk sorted by expert. Grouped by local expert, the
    # empty rows last (key L).
    ends = jnp.cumsum(counts_XxL.reshape(-1))  # of each (sender, expert) run
    segment = jnp.cumsum(jnp.zeros(X * N + 1, jnp.int32).at[ends].add(1))[:-1]  # a row's run
    by_expert = jnp.argsort(jnp.where(segment < X * L, segment % L, L), stable=True)
    out = grouped_mlp(experts, buffer[by_expert], jnp.sum(counts_XxL, axis=0), activation)
    out = jnp.zeros_like(out).at[by_expert].set(out, unique_indices=True)
    return _ragged_exchange(
        out, N, recv_offsets, recv_sizes, to_a2a(send_offsets), send_sizes, axis
    )


def _exclusive_cumsum(sizes: jax.Array) -> jax.Array:
    return jnp.cumsum(sizes) - sizes


def _ragged_exchange(operand, rows, input_offsets, send_sizes, output_offsets, recv_sizes, axis):
    """`jax.lax.ragged_all_to_all` into a zero buffer of ``rows`` rows; on XLA:CPU,
    which lacks it, `ragged_all_to_all_by_all_to_all` (the same result)."""
    axes = tuple(varying_manual_axes(operand) | {axis})
    output = vary(jnp.zeros((rows, *operand.shape[1:]), operand.dtype), axes)
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)

    def ragged(*args):
        return jax.lax.ragged_all_to_all(*args, axis_name=axis)

    def dense(*args):
        return ragged_all_to_all_by_all_to_all(*args, axis_name=axis)

    return jax.lax.platform_dependent(*args, cpu=dense, default=ragged)


def ragged_all_to_all_by_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
) -> jax.Array:
    """`jax.lax.ragged_all_to_all`'s result (one slice per device) by a dense
    ``all_to_all``: each slice padded to ``operand``'s rows, sent whole, and the
    received ones written at their offsets. ``X`` times the bytes where the slices
    are even; for backends without the ragged collective (XLA:CPU)."""
    X, N = send_sizes.shape[0], operand.shape[0]
    t = jnp.arange(N)
    index = jnp.clip(input_offsets[:, None] + t, 0, N - 1)  # [X, N]
    valid = (t < send_sizes[:, None]).reshape(X, N, *([1] * (operand.ndim - 1)))
    chunks = jnp.where(valid, operand[index], 0).reshape(X * N, *operand.shape[1:])
    received = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)
    landing = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    rows = jnp.where(t < recv_sizes[:, None], landing[:, None] + t, output.shape[0])
    return output.at[rows.reshape(-1)].set(received, mode="drop")
