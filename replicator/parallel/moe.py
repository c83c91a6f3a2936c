"""Mixture of experts (`rp.moe`): a top-k routed feed-forward layer over the axis ``expert``.

`moe_layer` replaces a transformer's MLP with ``E`` expert MLPs whose weights are
stacked ``[E, ...]``; each token goes to ``k`` of them (Switch, GShard, Mixtral):

* **Router.** ``logits = x @ router`` (in float32), ``probs = softmax(logits)``;
  the ``k`` largest probabilities pick the experts, and their gates are those
  probabilities renormalised to sum to 1 over the ``k`` (Mixtral's and MaxText's
  convention; ``normalize_gates=False`` keeps the raw probabilities, Switch's
  convention for ``k = 1``, where renormalising would make every gate 1).
* **Capacity.** Each expert takes at most ``C = ceil(capacity_factor * S * k / E)``
  tokens of each sequence of length ``S`` (MaxText's per-sequence capacity, so
  which tokens drop never depends on how the batch is sharded). The token-choice
  pairs of a sequence queue in position order, a token's ``k`` choices together,
  earlier tokens first (MaxText's ``generate_masks``); those past ``C`` are
  dropped: their share of the output is 0 (the caller's residual carries them).
  ``capacity_factor >= E / k`` drops nothing; ``capacity_factor=None`` routes
  without any capacity (dropless, with `jax.lax.ragged_dot`, every expert local).
* **Auxiliary losses** (`MoEAux`), over the tokens of the call: Switch's
  load-balancing loss ``E * sum_e f_e * P_e`` (``f_e``: the fraction of the
  token-choice pairs routed to expert ``e`` before any drop, so the ``f_e`` sum to
  1; ``P_e``: the mean router probability of ``e``), 1 when balanced; the router
  z-loss ``mean(logsumexp(logits) ** 2)`` (ST-MoE); and the fraction of pairs dropped.

With a mesh axis ``expert`` of size ``X``, each device holds ``E / X`` experts'
weights (the logical axis ``'exp'``, rule ``('exp', 'expert')``) and the tokens
go to their experts and back with two ``all_to_all``s over ``expert`` per layer:
no expert weight is ever gathered. The batch is split over ``expert`` as over
the data axes beside it (MaxText treats ``expert`` as a data-like axis outside
the experts). In the global view (`Replicator.compile`, or ``jax.jit`` under
``jax.set_mesh``) the layer goes manual over ``expert`` and the batch's axes in a
``shard_map`` (so each device routes its own rows: a sort is never left to the
partitioner); inside a ``shard_map`` already manual over ``expert`` (`Replicator.run`)
it runs there directly: tokens split over ``expert`` go by all-to-all, tokens every
device of ``expert`` holds alike go to that device's experts and the partial
outputs are summed over ``expert``; with no ``expert`` axis the experts are local.
All of them compute the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from replicator.errors import ConfigError
from replicator.spmd.context import get_replica_context, vary, varying_axes

EXPERT_AXIS = "expert"
EXPERT_WEIGHTS = ("wi", "wi_gate", "wo")  # the stacked ``[E, ...]`` leaves of the parameters

Params = dict[str, jax.Array]


class MoEAux(NamedTuple):
    """What a mixture-of-experts layer reports besides its output (scalars, float32).

    Attributes:
      load_balance_loss: Switch's ``E * sum_e f_e * P_e``; 1 when the load is even.
        Add ``~1e-2`` times it to the training loss.
      router_z_loss: ``mean(logsumexp(logits) ** 2)`` over the tokens (ST-MoE);
        add ``~1e-3`` times it to keep the router's logits small.
      dropped_fraction: the fraction of the token-choice pairs over capacity, in [0, 1].
    """

    load_balance_loss: jax.Array
    router_z_loss: jax.Array
    dropped_fraction: jax.Array


class Routing(NamedTuple):
    """Where each of a batch's ``[B, S]`` tokens goes (`route`).

    Attributes:
      experts: ``[B, S, k]`` int32, the ``k`` chosen experts, most probable first.
      gates: ``[B, S, k]`` float32, the weights of their outputs.
      slots: ``[B, S, k]`` int32, ``expert * C + position`` in the expert's buffer of
        its sequence, or ``E * C`` (out of range) where dropped; None when dropless.
      aux: the auxiliary losses and the dropped fraction.
    """

    experts: jax.Array
    gates: jax.Array
    slots: jax.Array | None
    aux: MoEAux


def expert_capacity(
    tokens: int, num_experts: int, experts_per_token: int, capacity_factor: float
) -> int:
    """Tokens each expert takes from a group of ``tokens``: ``ceil(cf * tokens * k / E)``.

    >>> expert_capacity(8, num_experts=4, experts_per_token=2, capacity_factor=1.25)
    5
    """
    # Rounded first so that e.g. 1.1 * 10 / 1 is 11, not 12.
    return max(1, math.ceil(round(capacity_factor * tokens * experts_per_token / num_experts, 6)))


def route(
    logits_BxSxE: jax.Array,
    *,
    experts_per_token: int,
    capacity: int | None,
    normalize_gates: bool = True,
    batch_axes: tuple[str, ...] = (),
    token_order: Any = None,
) -> Routing:
    """Top-k routing of ``[B, S, E]`` router logits with a per-sequence capacity.

    Args:
      logits_BxSxE: the router's logits for each token of each sequence.
      experts_per_token: ``k``.
      capacity: ``C``, how many token-choice pairs each expert takes per sequence
        (pairs queue by position, earlier tokens first); None: no limit.
      normalize_gates: renormalise the ``k`` gates of a token to sum to 1.
      batch_axes: inside a ``shard_map``, the manual mesh axes the batch is split
        over: the auxiliary values then cover the tokens of every device of them.
        Under `Replicator.run` the replica axes the logits vary over are added: the
        auxiliary values are the whole global batch's, as on one device.
      token_order: the sequence position of each of the ``S`` tokens as they are
        stored (a permutation of ``range(S)``, static), when they are not in order
        (`replicator.attention.context.load_balance`): the capacity queues follow the
        positions, so the same tokens drop as in order. None: stored in order.

    Returns:
      A `Routing`.

    >>> logits = jnp.array([[[2.0, 0.0], [1.0, 0.0], [0.0, 3.0]]])  # 3 tokens, 2 experts
    >>> r = jax.jit(lambda z: route(z, experts_per_token=1, capacity=1))(logits)
    >>> r.experts[0, :, 0].tolist(), r.slots[0, :, 0].tolist()  # token 1 over capacity
    ([0, 0, 1], [0, 2, 1])
    >>> round(float(r.aux.dropped_fraction), 4)
    0.3333
    """
    logits = logits_BxSxE.astype(jnp.float32)
    B, S, E = logits.shape
    k = experts_per_token
    probs = jax.nn.softmax(logits, axis=-1)
    gates, experts = jax.lax.top_k(probs, k)
    if normalize_gates:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(experts, E, dtype=jnp.int32)  # [B, S, k, E]
    slots, kept = None, jnp.ones((), jnp.float32) * (B * S * k)
    if capacity is not None:
        order = _checked_order(token_order, S)
        in_order = chosen if order is None else chosen[:, np.argsort(order)]
        queue = in_order.reshape(B, S * k, E)  # position-major: token s's choices before s + 1's
        position = jnp.sum((jnp.cumsum(queue, axis=1) - 1) * queue, axis=-1).reshape(B, S, k)
        if order is not None:
            position = position[:, order]  # back to where the tokens are stored
        slots = jnp.where(position < capacity, experts * capacity + position, E * capacity)
        slots, kept = slots.astype(jnp.int32), jnp.sum(position < capacity, dtype=jnp.float32)
    sums = (
        jnp.sum(chosen, axis=(0, 1, 2), dtype=jnp.float32),  # pairs per expert
        jnp.sum(probs, axis=(0, 1)),
        jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
        kept,
    )
    # The batch's other rows: the automatic axes a library program went manual over,
    # and under `Replicator.run` the replicas the tokens vary over. Summed over them,
    # the losses and the dropped fraction are one device's over the whole batch.
    ctx = get_replica_context()
    replicas = () if ctx is None else varying_axes(logits, ctx.axis_name)
    axes = tuple(batch_axes) + tuple(a for a in replicas if a not in batch_axes)
    if axes:
        sums = jax.lax.psum(jax.tree.map(lambda x: vary(x, axes), sums), axes)
    mesh = jax.sharding.get_abstract_mesh()
    tokens = B * S * math.prod(mesh.shape[a] for a in axes)
    pairs, prob, z_loss, kept = sums
    balance = E * jnp.sum(pairs / (tokens * k) * prob / tokens)  # f_e sums to 1 over e
    aux = MoEAux(balance, z_loss / tokens, 1.0 - kept / (tokens * k))
    return Routing(experts, gates, slots, aux)


def moe_layer(
    params: Params,
    x: jax.Array,
    *,
    num_experts: int,
    experts_per_token: int,
    capacity_factor: float | None = 1.25,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
    normalize_gates: bool = True,
    axis: str = EXPERT_AXIS,
    token_order: Any = None,
) -> tuple[jax.Array, MoEAux]:
    """A mixture-of-experts feed-forward layer, its experts split over the mesh axis ``axis``.

    Equal, for any size of ``axis`` (and without one), to routing every token on one
    device and applying its experts there (up to the order of float sums).

    Args:
      params: ``router`` ``[d, E]``, ``wi`` ``[E, d, f]``, ``wo`` ``[E, f, d]`` and
        optionally ``wi_gate`` ``[E, d, f]`` (a gated MLP: ``act(x @ wi_gate) * (x @ wi)``);
        `init_moe_params` makes them. Inside a ``shard_map`` manual over ``axis`` the
        expert weights may be this device's ``[E / X, ...]`` or all ``[E, ...]``.
      x: ``[batch, length, d]`` (capacity is per sequence), or ``[tokens, d]`` (one sequence).
      num_experts: ``E``.
      experts_per_token: ``k``, at most ``E``.
      capacity_factor: > 0; each expert takes ``ceil(cf * length * k / E)`` tokens of
        a sequence. None: dropless (every expert must be local: no ``axis`` above 1
        unless the weights are whole inside a ``shard_map``).
      activation: the MLP's nonlinearity.
      normalize_gates: renormalise a token's ``k`` gates to sum to 1.
      axis: the mesh axis the experts are split over.
      token_order: where each token of a sequence stands in it, if not in order
        (`route`'s ``token_order``).

    Returns:
      ``(y, aux)``: ``y`` shaped like ``x``; aux a `MoEAux` over the tokens of the
      call (in the global view and under `Replicator.run` the whole batch; inside a
      ``shard_map`` of your own, this device's).

    Raises:
      ValueError: ``E`` not divisible by the size of ``axis``, ``k`` not in ``[1, E]``,
        a capacity factor <= 0, dropless routing over split experts, or parameters
        whose shapes disagree with ``E`` (each one line).

    >>> params = init_moe_params(jax.random.key(0), embed_dim=4, mlp_dim=8, num_experts=4)
    >>> layer = jax.jit(
    ...     lambda p, x: moe_layer(p, x, num_experts=4, experts_per_token=2, capacity_factor=1.0)
    ... )
    >>> y, aux = layer(params, jnp.ones((2, 3, 4)))  # 3 tokens all for the same 2 experts,
    >>> y.shape, round(float(aux.dropped_fraction), 4)  # each of which takes 2 of them
    ((2, 3, 4), 0.3333)
    """
    shards = expert_shards(axis)
    _check(params, num_experts, experts_per_token, capacity_factor, shards, axis)
    x_BxSxd = x.reshape(-1, *x.shape[-2:])
    capacity = None
    if capacity_factor is not None:
        capacity = expert_capacity(
            x_BxSxd.shape[1], num_experts, experts_per_token, capacity_factor
        )
    split = shards > 1 and not _is_manual(axis)  # this call goes manual over ``axis``
    if capacity is None:
        _check_dropless(params["wi"], num_experts, shards, axis, split)
    layer = _Layer(
        num_experts,
        experts_per_token,
        capacity,
        activation,
        normalize_gates,
        axis,
        shards,
        token_order,
    )
    mesh = jax.sharding.get_abstract_mesh()
    rows = () if mesh.empty else _token_axes(mesh, axis if split else None, x_BxSxd.shape[0])
    if rows or split:
        y, aux = _in_shard_map(layer, params, x_BxSxd, rows, split)
    else:
        y, aux = layer(params, x_BxSxd)
    return y.reshape(x.shape).astype(x.dtype), aux


def init_moe_params(
    key: jax.Array,
    *,
    embed_dim: int,
    mlp_dim: int,
    num_experts: int,
    gated: bool = False,
    dtype: Any = jnp.float32,
) -> Params:
    """Parameters for `moe_layer`: ``router`` ``[d, E]``, ``wi`` (and ``wi_gate``) ``[E, d, f]``,
    ``wo`` ``[E, f, d]``, each kernel normal with variance 1 / fan-in (per expert).

    >>> p = init_moe_params(jax.random.key(0), embed_dim=4, mlp_dim=8, num_experts=2)
    >>> {name: w.shape for name, w in p.items()}
    {'router': (4, 2), 'wi': (2, 4, 8), 'wo': (2, 8, 4)}
    """
    shapes = {
        "router": (embed_dim, num_experts),
        "wi": (num_experts, embed_dim, mlp_dim),
        **({"wi_gate": (num_experts, embed_dim, mlp_dim)} if gated else {}),
        "wo": (num_experts, mlp_dim, embed_dim),
    }
    # One draw sliced into the kernels: each random draw costs its own compile on CPU.
    sizes = [math.prod(shape) for shape in shapes.values()]
    draw = jax.random.normal(key, (sum(sizes),), jnp.float32)
    params, start = {}, 0
    for (name, shape), size in zip(shapes.items(), sizes):
        fan_in = shape[-2]
        params[name] = (draw[start : start + size].reshape(shape) / math.sqrt(fan_in)).astype(dtype)
        start += size
    return params


_EXPERT_INIT = nn.initializers.variance_scaling(
    1.0, "fan_in", "normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
)
_INIT = {
    "router": nn.initializers.variance_scaling(1.0, "fan_in", "normal"),
    "wi": _EXPERT_INIT,
    "wi_gate": _EXPERT_INIT,
    "wo": _EXPERT_INIT,
}
_LOGICAL_AXES = {
    "router": ("embed", None),  # every device routes its own tokens: whole over 'exp'
    "wi": ("exp", "embed", "mlp"),
    "wi_gate": ("exp", "embed", "mlp"),
    "wo": ("exp", "mlp", "embed"),
}


class MoEFeedForward(nn.Module):
    """`moe_layer` as a Flax linen module: ``y, aux = MoEFeedForward(...)(x)``.

    Its parameters carry the logical axes ``('exp', 'embed', 'mlp')`` (``wo``:
    ``('exp', 'mlp', 'embed')``; the router ``('embed', None)``), so a rule
    ``('exp', 'expert')`` places the experts on the mesh axis ``expert``.

    Attributes:
      num_experts, experts_per_token, capacity_factor, activation, normalize_gates,
      axis: as for `moe_layer`.
      mlp_dim: each expert's hidden width.
      gated: a gated MLP (``wi_gate``), as in SwiGLU.
      param_dtype: the parameters' dtype.

    >>> module = MoEFeedForward(num_experts=4, experts_per_token=2, mlp_dim=8)
    >>> abstract = jax.eval_shape(module.init, jax.random.key(0), jnp.ones((2, 3, 4)))
    >>> tuple(nn.get_partition_spec(abstract)["params"]["wi"])
    ('exp', 'embed', 'mlp')
    """

    num_experts: int
    experts_per_token: int
    mlp_dim: int
    capacity_factor: float | None = 1.25
    gated: bool = False
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu
    normalize_gates: bool = True
    axis: str = EXPERT_AXIS
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, token_order: Any = None) -> tuple[jax.Array, MoEAux]:
        d, E, f = x.shape[-1], self.num_experts, self.mlp_dim
        shapes = {"router": (d, E), "wi": (E, d, f), "wo": (E, f, d)}
        if self.gated:
            shapes["wi_gate"] = (E, d, f)
        params = {
            name: self.param(
                name,
                nn.with_logical_partitioning(_INIT[name], _LOGICAL_AXES[name]),
                shape,
                self.param_dtype,
            )
            for name, shape in shapes.items()
        }
        return moe_layer(
            params, x, num_experts=E, experts_per_token=self.experts_per_token,
            capacity_factor=self.capacity_factor, activation=self.activation,
            normalize_gates=self.normalize_gates, axis=self.axis, token_order=token_order,
        )  # fmt: skip


def expert_shards(axis: str = EXPERT_AXIS) -> int:
    """The size of ``axis`` in the mesh being traced for (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        return 1
    return mesh.shape[axis]


# ------------------------------------------------------------- one device's work


class _Layer:
    """One device's part of the layer: its tokens routed, put in ``[E, C]`` buffers, those
    sent to their experts' devices, the experts' MLPs, and the results back, weighted."""

    def __init__(
        self, num_experts, experts_per_token, capacity, activation, normalize, axis, X, order=None
    ):
        self.E, self.k, self.C = num_experts, experts_per_token, capacity
        self.activation, self.normalize, self.axis, self.X = activation, normalize, axis, X
        self.order = order

    def __call__(self, params: Params, x_BxSxd, batch_axes=()) -> tuple[jax.Array, MoEAux]:
        """``params``' experts: ``[E, ...]``, or this device's ``[E / X, ...]`` (``axis``
        manual); ``batch_axes``: the manual axes ``x`` is split over."""
        logits = jnp.einsum(
            "bsd,de->bse", x_BxSxd.astype(jnp.float32), params["router"].astype(jnp.float32)
        )
        routing = route(
            logits, experts_per_token=self.k, capacity=self.C,
            normalize_gates=self.normalize, batch_axes=batch_axes, token_order=self.order,
        )  # fmt: skip
        experts = {name: params[name] for name in EXPERT_WEIGHTS if name in params}
        if self.C is None:
            return _dropless(experts, x_BxSxd, routing, self.activation), routing.aux
        return self.apply_experts(experts, x_BxSxd, routing.slots, routing.gates), routing.aux

    def apply_experts(self, experts: Params, x_BxSxd, slots_BxSxk, gates_BxSxk) -> jax.Array:
        E, C, X = self.E, self.C, self.X
        B, _, d = x_BxSxd.shape
        buffer = _dispatch(x_BxSxd, slots_BxSxk, E * C).reshape(B, E, C, d)
        if X == 1:
            out = self.mlp(experts, buffer)
            return _combine(out.reshape(B, E * C, d), slots_BxSxk, gates_BxSxk)
        first = jax.lax.axis_index(self.axis) * (E // X)
        experts = {
            name: w if w.shape[0] == E // X else jax.lax.dynamic_slice_in_dim(w, first, E // X)
            for name, w in experts.items()
        }
        if not self._tokens_split(x_BxSxd):
            # Every device of ``axis`` holds these tokens: each applies its own experts
            # to them, and the partial outputs add up over ``axis``.
            mine = self.mlp(experts, jax.lax.dynamic_slice_in_dim(buffer, first, E // X, 1))
            out = jax.lax.dynamic_update_slice_in_dim(
                vary(jnp.zeros_like(buffer), (self.axis,)), mine, first, 1
            )
            y = _combine(out.reshape(B, E * C, d), slots_BxSxk, gates_BxSxk)
            return jax.lax.psum(y, self.axis)
        # [B, E, C, d] -> [X * B, E / X, C, d]: every device's tokens for this device's experts.
        received = jax.lax.all_to_all(buffer, self.axis, 1, 0, tiled=True)
        out = self.mlp(experts, received)
        returned = jax.lax.all_to_all(out, self.axis, 0, 1, tiled=True)  # back: [B, E, C, d]
        return _combine(returned.reshape(B, E * C, d), slots_BxSxk, gates_BxSxk)

    def mlp(self, experts: Params, buffer_NxExCxd: jax.Array) -> jax.Array:
        """Each expert's MLP on its slots of every row of the buffer."""
        N, E, C, d = buffer_NxExCxd.shape
        h_ExTxd = jnp.swapaxes(buffer_NxExCxd, 0, 1).reshape(E, N * C, d)
        h = jnp.einsum("etd,edf->etf", h_ExTxd, experts["wi"])
        if "wi_gate" in experts:
            h = self.activation(jnp.einsum("etd,edf->etf", h_ExTxd, experts["wi_gate"])) * h
        else:
            h = self.activation(h)
        out = jnp.einsum("etf,efd->etd", h, experts["wo"])
        return jnp.swapaxes(out.reshape(E, N, C, d), 0, 1)

    def _tokens_split(self, x: jax.Array) -> bool:
        """Whether this device's tokens are its own along ``axis`` (or might be: with
        ``check_vma=False`` nothing says, and the all-to-all is right either way)."""
        typed = varying_axes(jax.lax.axis_index(self.axis), (self.axis,))
        return not typed or bool(varying_axes(x, (self.axis,)))


def _dispatch(x_BxSxd: jax.Array, slots_BxSxk: jax.Array, num_slots: int) -> jax.Array:
    """``[B, num_slots, d]``: each kept token-choice pair's token at its slot, 0 elsewhere."""
    B, S, d = x_BxSxd.shape
    k = slots_BxSxk.shape[-1]
    tokens = jnp.broadcast_to(x_BxSxd[:, :, None], (B, S, k, d)).reshape(B, S * k, d)
    rows = jnp.arange(B)[:, None]
    buffer = jnp.zeros((B, num_slots, d), x_BxSxd.dtype)
    # Kept slots are distinct, so adding is placing; dropped ones (out of range) vanish.
    return buffer.at[rows, slots_BxSxk.reshape(B, S * k)].add(tokens, mode="drop")


def _combine(out_BxNxd: jax.Array, slots_BxSxk: jax.Array, gates_BxSxk: jax.Array) -> jax.Array:
    """``[B, S, d]``: each token's expert outputs, read from their slots, weighted by the gates."""
    rows = jnp.arange(out_BxNxd.shape[0])[:, None, None]
    got = out_BxNxd.at[rows, slots_BxSxk].get(mode="fill", fill_value=0)  # [B, S, k, d]
    return jnp.einsum("bskd,bsk->bsd", got, gates_BxSxk.astype(got.dtype))


def _dropless(experts: Params, x_BxSxd: jax.Array, routing: Routing, activation) -> jax.Array:
    """Every token-choice pair through its expert: the pairs sorted by expert and the
    experts applied to their contiguous groups with `jax.lax.ragged_dot`."""
    B, S, d = x_BxSxd.shape
    E = experts["wi"].shape[0]
    k = routing.experts.shape[-1]
    chosen = routing.experts.reshape(-1)
    order = jnp.argsort(chosen, stable=True)
    tokens = x_BxSxd.reshape(B * S, d)[order // k]
    sizes = jnp.bincount(chosen, length=E).astype(jnp.int32)
    h = jax.lax.ragged_dot(tokens, experts["wi"], sizes)
    if "wi_gate" in experts:
        h = activation(jax.lax.ragged_dot(tokens, experts["wi_gate"], sizes)) * h
    else:
        h = activation(h)
    out = jax.lax.ragged_dot(h, experts["wo"], sizes)
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(B, S, k, d)
    return jnp.einsum("bskd,bsk->bsd", out, routing.gates.astype(out.dtype))


# ------------------------------------------------------------- the global view


def _in_shard_map(layer: _Layer, params: Params, x_BxSxd, rows, split: bool):
    """`_Layer` in a ``shard_map`` manual over the batch's axes ``rows`` (each device
    routes its own rows) and, where ``split``, over ``axis`` (each its ``E / X`` experts)."""
    spec = P(rows or None)
    weights = {name: P(layer.axis) if split and name != "router" else P() for name in params}
    program = jax.shard_map(
        lambda params, x: layer(params, x, batch_axes=rows),
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(weights, spec),
        out_specs=(spec, P()),
        axis_names=frozenset({*rows, *([layer.axis] if split else [])}),
        check_vma=True,
    )
    return program(params, x_BxSxd)


def _token_axes(mesh, axis: str | None, batch: int) -> tuple[str, ...]:
    """The automatic mesh axes the batch is split over in the layer: the activation
    rules' batch axes, then ``axis`` (MaxText's ``('data', 'fsdp', 'expert')``), as many
    of them as divide the batch; without ``axis``, every device of it holds the tokens."""
    from replicator.parallel.activations import current_axes

    auto = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Auto}
    names = (*current_axes("activation_batch"), *([axis] if axis else []))
    rows = []
    for name in dict.fromkeys(names):  # in order, once each
        if name in auto and mesh.shape[name] > 1:
            if batch % (math.prod(mesh.shape[a] for a in rows) * mesh.shape[name]) == 0:
                rows.append(name)
    return tuple(rows)


def _checked_order(token_order: Any, length: int) -> np.ndarray | None:
    """``token_order`` as an index array, checked to be a permutation of ``range(length)``."""
    if token_order is None:
        return None
    order = np.asarray(token_order)
    if order.shape != (length,) or not np.array_equal(np.sort(order), np.arange(length)):
        raise ValueError(
            f"token_order must be a permutation of the {length} positions of a sequence, "
            f"got shape {order.shape}."
        )
    return order


def _is_manual(axis: str) -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return dict(zip(mesh.axis_names, mesh.axis_types))[axis] == AxisType.Manual


# ------------------------------------------------------------- errors


def _check(params, num_experts, experts_per_token, capacity_factor, shards, axis) -> None:
    if not 1 <= experts_per_token <= num_experts:
        raise ConfigError(
            f"moe: experts_per_token={experts_per_token} must be between 1 and "
            f"num_experts={num_experts}."
        )
    if capacity_factor is not None and not capacity_factor > 0:
        raise ConfigError(
            f"moe: capacity_factor={capacity_factor} must be > 0, or None for dropless routing."
        )
    if num_experts % shards:
        raise ConfigError(
            f"moe: {num_experts} experts do not split over the {shards} devices of mesh "
            f"axis {axis!r}; choose a number of experts divisible by {shards}."
        )
    missing = {"router", "wi", "wo"} - set(params)
    if missing:
        raise ValueError(f"moe: params lack {sorted(missing)}; make them with init_moe_params.")
    if params["router"].shape[-1] != num_experts:
        raise ValueError(
            f"moe: the router has {params['router'].shape[-1]} outputs for "
            f"num_experts={num_experts}."
        )
    held = sorted({params[n].shape[0] for n in EXPERT_WEIGHTS if n in params})
    allowed = {num_experts} | (
        {num_experts // shards} if shards > 1 and _is_manual(axis) else set()
    )
    if len(held) != 1 or held[0] not in allowed:
        raise ValueError(
            f"moe: the expert weights' leading axes are {held}; they must all be "
            f"num_experts={num_experts} (or {num_experts // shards}, this device's, inside "
            f"a shard_map over {axis!r})."
        )


def _check_dropless(wi: jax.Array, num_experts: int, shards: int, axis: str, split: bool):
    if split or (shards > 1 and wi.shape[0] != num_experts):
        raise ValueError(
            f"moe: dropless routing (capacity_factor=None) needs every expert on each "
            f"device, but mesh axis {axis!r} splits them {shards} ways; give a "
            f"capacity_factor."
        )
