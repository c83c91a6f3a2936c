"""Mixture of experts (`rp.moe`): a top-k routed feed-forward layer over the axis ``expert``.

`moe_layer` replaces a transformer's MLP with ``E`` expert MLPs whose weights are
stacked ``[E, ...]``; each token goes to ``k`` of them (Switch, GShard, Mixtral):

* **Router.** ``logits = x @ router`` (in float32), ``probs = softmax(logits)``;
  the ``k`` largest probabilities pick the experts. ``routing`` names how the
  gates, the capacity queues and the balancing loss follow from them (`ROUTINGS`):

  - ``"switch"`` (any ``k``; the default for ``k = 1``): each gate is its expert's
    router probability, not renormalised over the ``k`` chosen, so the router learns
    from the main loss (Switch Transformer, Fedus et al. 2021, arXiv:2101.03961,
    section 2.1: ``y = p_i(x) E_i(x)``; for ``k >= 2``, Qwen3-MoE's
    ``norm_topk_prob=False``); its queues and balancing loss are ``"mixtral"``'s.
  - ``"gshard"`` (``k >= 2``): the ``k`` gates renormalised to sum to 1 before
    any drop; every token's first choice queues for capacity before any token's
    second (then third ...); the balancing loss counts first choices only (GShard,
    Lepikhin et al. 2020, arXiv:2006.16668, section 2.2, Algorithm 1, for ``k = 2``;
    flaxformer's priority by rank for larger ``k``). Every second choice within
    capacity is kept: GShard's random dispatch of the second expert is not done.
  - ``"mixtral"`` (any ``k``; the default for ``k >= 2``): the ``k`` gates
    renormalised to sum to 1 (Mixtral, Jiang et al. 2024, arXiv:2401.04088,
    section 2.1: a softmax over the top-``k`` logits); a token's ``k`` choices
    queue together, earlier tokens first (MaxText); the balancing loss counts every
    pair. With ``k = 1`` every gate is 1 and the router learns only from the
    auxiliary losses.
* **Capacity.** Each expert takes at most ``C = ceil(capacity_factor * S * k / E)``
  tokens of each sequence of length ``S`` (MaxText's per-sequence capacity, so
  which tokens drop never depends on how the batch is sharded). The token-choice
  pairs of a sequence queue in position order, as ``routing`` says; those past ``C``
  are dropped: their share of the output is 0 (the caller's residual carries them).
  ``capacity_factor >= E / k`` drops nothing, but every expert still computes its
  ``C`` slots, the empty ones included (padding: ``1 - S k / (E C)`` of its FLOPs
  at the least, `padding_fraction`).
* **Dropless** (``capacity_factor=None``): no capacity, nothing dropped, no FLOPs on
  padding: the pairs sorted by expert, each expert's group through a grouped matmul
  (`jax.lax.ragged_dot`), with a ragged all-to-all to the experts' devices over
  ``expert`` (`replicator.parallel.dropless`, which says what it costs). The same
  parameters as with a capacity: a checkpoint moves between the two.
* **Auxiliary losses** (`MoEAux`), over the tokens of the call: the load-balancing
  loss ``E * sum_e f_e * P_e`` (Switch's section 2.2, eq. 4, without its ``alpha``; GShard's
  ``l_aux`` times ``E ** 2``): ``f_e`` the fraction of the counted token-choice
  pairs (every pair, or first choices under ``"gshard"``) routed to expert ``e``
  before any drop, so the ``f_e`` sum to 1, and ``P_e`` the mean router
  probability of ``e``; 1 when balanced. The router z-loss
  ``mean(logsumexp(logits) ** 2)`` (ST-MoE); and the fraction of pairs dropped.

With a mesh axis ``expert`` of size ``X``, each device holds ``E / X`` experts'
weights (the logical axis ``'exp'``, rule ``('exp', 'expert')``) and the tokens
go to their experts and back with two ``all_to_all``s over ``expert`` per layer
(ragged ones when dropless): no expert weight is ever gathered. The batch is
split over ``expert`` as over the data axes beside it (MaxText treats ``expert``
as a data-like axis outside the experts). In the global view
(`Replicator.compile`, or ``jax.jit`` under ``jax.set_mesh``) the layer goes
manual over ``expert`` and the batch's axes in a ``shard_map`` (so each device
routes its own rows: a sort is never left to the partitioner); inside a
``shard_map`` already manual over ``expert`` (`Replicator.run`) it runs there
directly: tokens split over ``expert`` go by all-to-all, tokens every device of
``expert`` holds alike go to that device's experts and the partial outputs are
summed over ``expert``; with no ``expert`` axis the experts are local.
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
from jax.sharding import PartitionSpec as P

from replicator.errors import ConfigError
from replicator.parallel import axes as mesh_axes
from replicator.parallel.activations import current_axes
from replicator.parallel.dropless import dropless_experts
from replicator.spmd.context import get_replica_context, vary, varying_axes

EXPERT_AXIS = "expert"
EXPERT_WEIGHTS = ("wi", "wi_gate", "wo")  # the stacked ``[E, ...]`` leaves of the parameters

Params = dict[str, jax.Array]


class MoEAux(NamedTuple):
    """What a mixture-of-experts layer reports besides its output (scalars, float32).

    Attributes:
      load_balance_loss: ``E * sum_e f_e * P_e`` (Switch's; GShard's ``l_aux`` times
        ``E ** 2``, its ``f_e`` over first choices); 1 when the load is even. Add
        ``~1e-2`` times it to the training loss.
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


def padding_fraction(
    tokens: int, num_experts: int, experts_per_token: int, capacity_factor: float | None
) -> float:
    """The share of the experts' FLOPs spent on empty slots when nothing drops:
    ``1 - S k / (E C)`` for sequences of ``tokens`` (more where tokens drop, as the
    slots they leave are empty too); 0 when dropless (``capacity_factor=None``).

    >>> round(padding_fraction(4096, 8, 2, 1.25), 6), padding_fraction(4096, 8, 2, None)
    (0.2, 0.0)
    """
    if capacity_factor is None:
        return 0.0
    slots = num_experts * expert_capacity(tokens, num_experts, experts_per_token, capacity_factor)
    return max(0.0, 1.0 - tokens * experts_per_token / slots)


ROUTINGS = ("switch", "gshard", "mixtral")  # the conventions `route` follows (module docstring)


class _Convention(NamedTuple):
    normalize: bool  # a token's k gates renormalised to sum to 1
    by_rank: bool  # capacity queues: every first choice before any second (else token by token)
    first_only: bool  # the balancing loss's f_e counts first choices only (else every pair)


_CONVENTIONS = {
    "switch": _Convention(normalize=False, by_rank=False, first_only=False),
    "gshard": _Convention(normalize=True, by_rank=True, first_only=True),
    "mixtral": _Convention(normalize=True, by_rank=False, first_only=False),
}


def resolve_routing(routing: str | None, experts_per_token: int, key: str = "routing") -> str:
    """The routing convention (one of `ROUTINGS`) that ``routing`` names for ``k`` experts a token.

    Args:
      routing: ``"switch"``, ``"gshard"``, ``"mixtral"``, or None: ``"switch"`` for
        ``k = 1``, ``"mixtral"`` above.
      experts_per_token: ``k``.
      key: the name the error messages give ``routing`` (a config key, say).

    Returns:
      The convention's name.

    Raises:
      ConfigError: an unknown name, or ``"gshard"`` with ``k = 1`` (each one line).

    >>> resolve_routing(None, 1), resolve_routing(None, 2), resolve_routing("switch", 8)
    ('switch', 'mixtral', 'switch')
    """
    if routing is None:
        return "switch" if experts_per_token == 1 else "mixtral"
    if routing not in ROUTINGS:
        raise ConfigError(f"moe: {key}={routing!r}: use one of {ROUTINGS}, or None.")
    if routing == "gshard" and experts_per_token == 1:
        raise ConfigError(
            f"moe: {key}='gshard' is top-2 routing; with experts_per_token=1 its one gate "
            "would always be 1: use 'switch' (the gate is the router's probability)."
        )
    return routing


def route(
    logits_BxSxE: jax.Array,
    *,
    experts_per_token: int,
    capacity: int | None,
    routing: str | None = None,
    batch_axes: tuple[str, ...] = (),
    token_order: Any = None,
) -> Routing:
    """Top-k routing of ``[B, S, E]`` router logits with a per-sequence capacity.

    Args:
      logits_BxSxE: the router's logits for each token of each sequence.
      experts_per_token: ``k``.
      capacity: ``C``, how many token-choice pairs each expert takes per sequence
        (pairs queue by position, earlier tokens first, in the order ``routing``
        says); None: no limit.
      routing: the convention, one of `ROUTINGS` (the module docstring says each),
        or None: ``"switch"`` for ``k = 1``, ``"mixtral"`` above.
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
    >>> round(float(r.aux.dropped_fraction), 4), round(float(r.gates[0, 0, 0]), 4)  # Switch's
    (0.3333, 0.8808)
    """
    logits = logits_BxSxE.astype(jnp.float32)
    B, S, E = logits.shape
    k = experts_per_token
    convention = _CONVENTIONS[resolve_routing(routing, k)]
    probs = jax.nn.softmax(logits, axis=-1)
    gates, experts = jax.lax.top_k(probs, k)
    if convention.normalize:  # before any drop: a kept gate keeps its share
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(experts, E, dtype=jnp.int32)  # [B, S, k, E]
    slots, kept = None, jnp.ones((), jnp.float32) * (B * S * k)
    if capacity is not None:
        order = _checked_order(token_order, S)
        position = _queue_positions(chosen, convention.by_rank, order)
        slots = jnp.where(position < capacity, experts * capacity + position, E * capacity)
        slots, kept = slots.astype(jnp.int32), jnp.sum(position < capacity, dtype=jnp.float32)
    counted = chosen[:, :, :1] if convention.first_only else chosen  # the pairs f_e counts
    sums = (
        jnp.sum(counted, axis=(0, 1, 2), dtype=jnp.float32),  # counted pairs per expert
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
    balance = E * jnp.sum(pairs / (tokens * counted.shape[2]) * prob / tokens)  # sum_e f_e = 1
    aux = MoEAux(balance, z_loss / tokens, 1.0 - kept / (tokens * k))
    return Routing(experts, gates, slots, aux)


def _queue_positions(chosen_BxSxkxE: jax.Array, by_rank: bool, order) -> jax.Array:
    """``[B, S, k]``: each token-choice pair's place in its expert's queue of its sequence.

    The queue follows the positions (``order``: each stored token's, None: in order);
    a token's ``k`` choices queue together, or (``by_rank``) every token's first
    choice before any token's second, and so on."""
    B, S, k, E = chosen_BxSxkxE.shape
    queue = chosen_BxSxkxE if order is None else chosen_BxSxkxE[:, np.argsort(order)]
    if by_rank:
        queue = jnp.swapaxes(queue, 1, 2)  # [B, k, S, E]
    queue = queue.reshape(B, S * k, E)
    position = jnp.sum((jnp.cumsum(queue, axis=1) - 1) * queue, axis=-1)
    if by_rank:
        position = jnp.swapaxes(position.reshape(B, k, S), 1, 2)
    position = position.reshape(B, S, k)
    return position if order is None else position[:, order]  # back to where tokens are stored


def moe_layer(
    params: Params,
    x: jax.Array,
    *,
    num_experts: int,
    experts_per_token: int,
    capacity_factor: float | None = 1.25,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
    routing: str | None = None,
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
        a sequence. None: dropless (every token's ``k`` experts, none dropped, no
        FLOPs on padding: `replicator.parallel.dropless`).
      activation: the MLP's nonlinearity.
      routing: the routing convention, one of `ROUTINGS` (gates, capacity queues,
        balancing loss: the module docstring), or None: ``"switch"`` for ``k = 1``
        (the gate is the router's probability), ``"mixtral"`` above.
      axis: the mesh axis the experts are split over.
      token_order: where each token of a sequence stands in it, if not in order
        (`route`'s ``token_order``).

    Returns:
      ``(y, aux)``: ``y`` shaped like ``x``; aux a `MoEAux` over the tokens of the
      call (in the global view and under `Replicator.run` the whole batch; inside a
      ``shard_map`` of your own, this device's).

    Raises:
      ValueError: ``E`` not divisible by the size of ``axis``, ``k`` not in ``[1, E]``,
        a capacity factor <= 0, a ``routing`` that is not one of `ROUTINGS` or does
        not take ``k`` experts, or parameters
        whose shapes disagree with ``E`` (each one line).

    >>> params = init_moe_params(jax.random.key(0), embed_dim=4, mlp_dim=8, num_experts=4)
    >>> layer = jax.jit(
    ...     lambda p, x: moe_layer(p, x, num_experts=4, experts_per_token=2, capacity_factor=1.0)
    ... )
    >>> y, aux = layer(params, jnp.ones((2, 3, 4)))  # 3 tokens all for the same 2 experts,
    >>> y.shape, round(float(aux.dropped_fraction), 4)  # each of which takes 2 of them
    ((2, 3, 4), 0.3333)
    """
    shards = mesh_axes.size(axis)
    _check(params, num_experts, experts_per_token, capacity_factor, shards, axis)
    x_BxSxd = x.reshape(-1, *x.shape[-2:])
    capacity = None if capacity_factor is None else expert_capacity(
        x_BxSxd.shape[1], num_experts, experts_per_token, capacity_factor
    )  # fmt: skip
    split = shards > 1 and not mesh_axes.is_manual(axis)  # this call goes manual over ``axis``
    routing = resolve_routing(routing, experts_per_token)
    layer = _Layer(
        num_experts, experts_per_token, capacity, activation, routing, axis, shards, token_order
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
      num_experts, experts_per_token, capacity_factor, activation, routing, axis: as
        for `moe_layer`.
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
    routing: str | None = None
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
            routing=self.routing, axis=self.axis, token_order=token_order,
        )  # fmt: skip


# ------------------------------------------------------------- one device's work


class _Layer:
    """One device's part of the layer: its tokens routed, put in ``[E, C]`` buffers, those
    sent to their experts' devices, the experts' MLPs, and the results back, weighted."""

    def __init__(
        self, num_experts, experts_per_token, capacity, activation, routing, axis, X, order=None
    ):
        self.E, self.k, self.C = num_experts, experts_per_token, capacity
        self.activation, self.routing, self.axis, self.X = activation, routing, axis, X
        self.order = order

    def __call__(self, params: Params, x_BxSxd, batch_axes=()) -> tuple[jax.Array, MoEAux]:
        """``params``' experts: ``[E, ...]``, or this device's ``[E / X, ...]`` (``axis``
        manual); ``batch_axes``: the manual axes ``x`` is split over."""
        logits = jnp.einsum(
            "bsd,de->bse", x_BxSxd.astype(jnp.float32), params["router"].astype(jnp.float32)
        )
        routing = route(
            logits, experts_per_token=self.k, capacity=self.C,
            routing=self.routing, batch_axes=batch_axes, token_order=self.order,
        )  # fmt: skip
        experts = {name: params[name] for name in EXPERT_WEIGHTS if name in params}
        if self.C is None:
            split = self.X > 1 and experts["wi"].shape[0] != self.E  # else every expert here
            y = dropless_experts(
                experts, x_BxSxd, routing.experts, routing.gates, num_experts=self.E,
                activation=self.activation, axis=self.axis if split else None,
                tokens_split=split and self._tokens_split(x_BxSxd),
            )  # fmt: skip
            return y, routing.aux
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
    names = (*current_axes("activation_batch"), *([axis] if axis else []))
    return mesh_axes.split_over(mesh, names, batch)


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
        {num_experts // shards} if shards > 1 and mesh_axes.is_manual(axis) else set()
    )
    if len(held) != 1 or held[0] not in allowed:
        raise ValueError(
            f"moe: the expert weights' leading axes are {held}; they must all be "
            f"num_experts={num_experts} (or {num_experts // shards}, this device's, inside "
            f"a shard_map over {axis!r})."
        )
