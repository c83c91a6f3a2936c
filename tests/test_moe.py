"""Mixture of experts (`replicator.parallel.moe`) over the mesh axis ``expert``.

The invariants: the layer equals an independent reference (every expert applied
to every token, the over-capacity pairs found by a plain loop in position order)
on one device, under each routing convention (Switch, GShard, Mixtral); split over
2, 4 and 8 ``expert`` devices beside ``data`` it equals one device (outputs,
auxiliary losses, gradients), in the global view and inside a ``shard_map``
already manual over ``expert``; its program sends tokens with all-to-alls and
never gathers an expert's weights. The conventions themselves against hand
computations: Switch's top-1 router learns from the main loss, GShard's first
choices take capacity before second choices and its balancing loss counts first
choices only.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.attention.context import context_positions
from replicator.compiled import hlo as hlo
from replicator.parallel import moe as moe

E, K, D, F, S = 8, 2, 8, 16, 8  # experts, experts per token, width, hidden width, length


@functools.cache
def _random(batch, gated):
    key_p, key_x = jax.random.split(jax.random.key(0))
    params = moe.init_moe_params(key_p, embed_dim=D, mlp_dim=F, num_experts=E, gated=gated)
    params["router"] = params["router"] * 3  # uneven loads, so that a capacity drops some
    return jax.device_get((params, jax.random.normal(key_x, (batch, S, D))))


def _inputs(batch=16, gated=False):
    params, x = _random(batch, gated)
    return dict(params), x


def _layer(params, x, capacity_factor, k=K, **kw):
    return moe.moe_layer(
        params, x, num_experts=E, experts_per_token=k, capacity_factor=capacity_factor, **kw
    )


def _loss(capacity_factor, **kw):
    def loss(params, x):
        y, aux = _layer(params, x, capacity_factor, **kw)
        total = jnp.mean(y**2) + 1e-2 * aux.load_balance_loss + 1e-3 * aux.router_z_loss
        return total, (y, aux)

    return loss


def _kept(logits, capacity, k=K, by_rank=False):
    """Which token-choice pairs an expert takes: a loop over each sequence's positions,
    a token's ``k`` choices together, or (``by_rank``) all first choices, then all second."""
    experts = np.argsort(-np.asarray(logits), axis=-1, kind="stable")[..., :k]
    kept = np.ones(experts.shape, bool)
    if capacity is not None:
        B, S_ = experts.shape[:2]
        queue = [(s, j) for s in range(S_) for j in range(k)]
        if by_rank:
            queue = [(s, j) for j in range(k) for s in range(S_)]
        for b in range(B):
            load = np.zeros(E, int)
            for s, j in queue:
                load[experts[b, s, j]] += 1
                kept[b, s, j] = load[experts[b, s, j]] <= capacity
    return experts, kept


def _reference(params, x, capacity_factor, routing="mixtral", k=K):
    """Every expert on every token, the pairs over capacity masked out; ``routing``:
    Switch's raw gate, or the gates renormalised (GShard's queue by rank and balancing
    loss over first choices, or Mixtral's queue by token and loss over every pair)."""
    logits = np.einsum("bsd,de->bse", x, params["router"])
    capacity = None
    if capacity_factor is not None:
        capacity = moe.expert_capacity(S, E, k, capacity_factor)
    experts, kept = _kept(logits, capacity, k, by_rank=routing == "gshard")
    counted = experts[..., :1] if routing == "gshard" else experts
    fraction = np.bincount(counted.reshape(-1), minlength=E) / counted.size

    def loss(params, x):
        logits = jnp.einsum("bsd,de->bse", x, params["router"])
        probs = jax.nn.softmax(logits)
        gates = jnp.take_along_axis(probs, experts, axis=-1)
        if routing != "switch":
            gates = gates / jnp.sum(gates, -1, keepdims=True)
        gates = gates * kept
        hidden = jnp.einsum("bsd,edf->ebsf", x, params["wi"])
        if "wi_gate" in params:
            hidden = jax.nn.gelu(jnp.einsum("bsd,edf->ebsf", x, params["wi_gate"])) * hidden
        else:
            hidden = jax.nn.gelu(hidden)
        every = jnp.einsum("ebsf,efd->bsed", hidden, params["wo"])
        chosen = jnp.take_along_axis(every, experts[..., None], 2)
        y = jnp.einsum("bskd,bsk->bsd", chosen, gates)
        aux = moe.MoEAux(
            E * jnp.sum(fraction * jnp.mean(probs, axis=(0, 1))),
            jnp.mean(jax.nn.logsumexp(logits, -1) ** 2),
            jnp.asarray(1 - kept.mean(), jnp.float32),
        )
        total = jnp.mean(y**2) + 1e-2 * aux.load_balance_loss + 1e-3 * aux.router_z_loss
        return total, (y, aux)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)


def _close(actual, expected, atol=1e-5):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=atol, rtol=1e-5), actual, expected
    )


def _mesh(experts):
    return jax.make_mesh(
        (8 // experts, experts), ("data", "expert"), axis_types=(AxisType.Auto,) * 2
    )


# --------------------------------------------------------------- one device


@pytest.mark.parametrize(
    "routing, k, capacity_factor, gated",
    [
        ("mixtral", K, None, False),
        ("mixtral", K, None, True),
        ("mixtral", K, 0.5, False),
        ("mixtral", K, 1.0, True),
        ("mixtral", K, E, False),
        ("gshard", K, 0.5, False),
        ("gshard", 3, 1.0, True),
        ("switch", 1, 1.0, True),
        ("switch", 1, None, False),
        ("switch", 4, 1.0, True),  # Qwen3-MoE's norm_topk_prob=False
        ("switch", K, None, False),
    ],
)
def test_the_layer_is_the_reference_on_one_device(routing, k, capacity_factor, gated):
    params, x = _inputs(batch=3, gated=gated)
    loss = _loss(capacity_factor, k=k, routing=routing)
    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    _close(jax.jit(grad)(params, x), _reference(params, x, capacity_factor, routing, k))


def test_top_1_routing_trains_the_router_through_the_main_loss():
    """Switch's gate is the router's probability (the default for ``k = 1``), so the
    main loss alone reaches the router; renormalised, a lone gate is always 1 and the
    router learns only from the auxiliary losses."""
    params, x = _inputs(batch=3)

    def main_loss_grads(**kw):
        main = lambda p: jnp.mean(_layer(p, x, 1.0, k=1, **kw)[0] ** 2)  # noqa: E731
        return jax.jit(jax.grad(main))(params)

    switch, renormalised = main_loss_grads(), main_loss_grads(routing="mixtral")
    scale = np.abs(switch["wo"]).max()  # what the main loss gives the experts
    assert np.abs(switch["router"]).max() > 1e-2 * scale, (switch["router"], scale)
    assert np.abs(renormalised["router"]).max() < 1e-5 * scale


def _two_experts_two_choices():
    """4 tokens, each choosing both of 2 experts: first choices 0, 1, 0, 1."""
    return jnp.log(jnp.array([[[0.7, 0.3], [0.4, 0.6], [0.8, 0.2], [0.1, 0.9]]]))


def test_gshard_queues_every_first_choice_before_any_second():
    """Capacity 2 for 8 token-choice pairs. GShard: the 4 first choices take every
    slot, every second choice drops. Mixtral (a token's choices together): expert 0
    fills with token 0's first and token 1's second choice, so token 2's first drops."""
    logits, C = _two_experts_two_choices(), 2
    slots = {}
    for routing in ("gshard", "mixtral"):
        route = functools.partial(moe.route, experts_per_token=2, capacity=C, routing=routing)
        slots[routing] = jax.jit(route)(logits).slots[0].tolist()
    dropped = 2 * C  # the out-of-range slot; expert e's slots are e * C + position
    assert slots["gshard"] == [[0, dropped], [2, dropped], [1, dropped], [3, dropped]]
    assert slots["mixtral"] == [[0, 2], [3, 1], [dropped, dropped], [dropped, dropped]]


def test_the_balancing_loss_counts_what_each_convention_says():
    """By hand, 2 tokens over 3 experts with probabilities (0.5, 0.3, 0.2) and (0.1,
    0.6, 0.3): mean probabilities P = (0.3, 0.45, 0.25). GShard counts first choices,
    f = (1/2, 1/2, 0): 3 * (0.15 + 0.225) = 1.125, which is its paper's
    l_aux = 1/E sum_e (c_e / S) m_e = 0.125 times E ** 2. Mixtral counts all 4 pairs,
    f = (1/4, 2/4, 1/4): 3 * (0.075 + 0.225 + 0.0625) = 1.0875. Switch (k = 1): the
    gate is the top probability; GShard's two gates are renormalised to sum to 1."""
    logits = jnp.log(jnp.array([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]]))

    def routed(k, routing):
        route = functools.partial(moe.route, experts_per_token=k, capacity=None, routing=routing)
        return jax.jit(route)(logits)

    gshard, mixtral, switch = routed(2, "gshard"), routed(2, "mixtral"), routed(1, "switch")
    l_aux = 1 / 3 * (1 / 2 * 0.3 + 1 / 2 * 0.45 + 0 * 0.25)
    assert float(gshard.aux.load_balance_loss) == pytest.approx(3**2 * l_aux, rel=1e-6)
    assert float(gshard.aux.load_balance_loss) == pytest.approx(1.125, rel=1e-6)
    assert float(mixtral.aux.load_balance_loss) == pytest.approx(1.0875, rel=1e-6)
    gates = [[0.5 / 0.8, 0.3 / 0.8], [0.6 / 0.9, 0.3 / 0.9]]
    np.testing.assert_allclose(gshard.gates[0], gates, rtol=1e-6)
    np.testing.assert_allclose(switch.gates[0], [[0.5], [0.6]], rtol=1e-6)


def test_a_capacity_factor_of_num_experts_drops_nothing():
    params, x = _inputs()
    y, aux = jax.jit(lambda p, x: _layer(p, x, float(E)))(params, x)
    dropless, _ = jax.jit(lambda p, x: _layer(p, x, None))(params, x)
    assert float(aux.dropped_fraction) == 0.0
    _close(y, dropless)


def test_a_small_capacity_drops_the_later_tokens_deterministically():
    params, x = _inputs()
    logits = np.einsum("bsd,de->bse", x, params["router"])
    capacity = moe.expert_capacity(S, E, K, 0.5)  # 1 pair per expert and sequence
    _, kept = _kept(logits, capacity)
    routing = jax.jit(lambda z: moe.route(z, experts_per_token=K, capacity=capacity))(logits)
    np.testing.assert_array_equal(np.asarray(routing.slots) < E * capacity, kept)
    loads = np.apply_along_axis(np.bincount, -1, routing.experts.reshape(16, -1), minlength=E)
    over = np.maximum(loads - capacity, 0).sum()  # what the experts cannot take
    assert over > 0
    layer = jax.jit(lambda p, x: _layer(p, x, 0.5)[1].dropped_fraction)
    assert float(layer(params, x)) == pytest.approx(over / (16 * S * K))
    assert float(layer(params, x + 0)) == float(layer(params, x))


def test_tokens_stored_out_of_order_drop_what_they_drop_in_order():
    """Capacity queues follow ``token_order`` (each stored token's position, as
    `context_parallel.load_balance` leaves them): the layer on the permuted sequence is
    the layer on the sequence in order, permuted, the same pairs dropped."""
    params, x = _inputs()
    order = context_positions(S, 2, load_balanced=True)
    stored = x[:, order]  # position order[i] stored at i
    y, aux = jax.jit(lambda p, x: _layer(p, x, 0.5))(params, x)
    y_stored, aux_stored = jax.jit(lambda p, x: _layer(p, x, 0.5, token_order=order))(
        params, stored
    )
    assert 0 < float(aux.dropped_fraction) < 1
    _close((y_stored, aux_stored), (y[:, order], aux))
    blind = jax.jit(lambda p, x: _layer(p, x, 0.5)[0])(params, stored)  # the order ignored
    assert not np.allclose(blind, y[:, order], atol=1e-5)
    with pytest.raises(ValueError, match="permutation of the 8 positions"):
        moe.route(jnp.zeros((1, S, E)), experts_per_token=K, capacity=1, token_order=[0, 0])


# --------------------------------------------------------------- expert parallel


@pytest.mark.parametrize(
    "experts, batch, capacity_factor, routing, k",
    [
        (2, 16, 1.0, None, K),
        (4, 16, 1.0, None, K),
        (8, 16, 0.5, None, K),
        (4, 16, 0.5, "gshard", K),
        (8, 16, 1.0, None, 1),  # Switch's
        pytest.param(4, 6, 1.0, None, K, marks=pytest.mark.slow),  # batch not split over expert
        pytest.param(8, 16, float(E), None, K, marks=pytest.mark.slow),
    ],
)
def test_experts_split_over_the_mesh_equal_one_device(experts, batch, capacity_factor, routing, k):
    params, x = _inputs(batch)
    loss = _loss(capacity_factor, k=k, routing=routing)
    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    expected = jax.jit(grad)(params, x)
    mesh = _mesh(experts)
    with jax.set_mesh(mesh):
        placed = {
            name: jax.device_put(w, NamedSharding(mesh, P(None if name == "router" else "expert")))
            for name, w in params.items()
        }
        got = jax.jit(grad)(placed, jax.device_put(x, NamedSharding(mesh, P("data"))))
    _close(got, expected)


@pytest.mark.parametrize(
    "whole, check_vma",
    [(False, True), (True, True), pytest.param(False, False, marks=pytest.mark.slow)],
)
def test_inside_a_shard_map_over_expert_it_equals_one_device(whole, check_vma):
    """Manual over ``data`` and ``expert``: each device routes its own rows, with its
    share of the experts (or all of them, ``whole``)."""
    params, x = _inputs()
    mesh = _mesh(4)
    weights = P() if whole else P("expert")
    specs = {name: P() if name == "router" else weights for name in params}

    def per_device(params, x):
        y, aux = _layer(params, x, 1.0)
        return y, jax.tree.map(lambda a: a[None], aux)

    def loss(params, x):
        y, aux = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(specs, P(("data", "expert"))),
            out_specs=(P(("data", "expert")), P(("data", "expert"))),
            check_vma=check_vma,
        )(params, x)
        return jnp.mean(y**2), (y, aux)

    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
    (value, (y, aux)), grads = got

    def one_device(params, x):
        y, _ = _layer(params, x, 1.0)
        return jnp.mean(y**2), y

    expected = jax.jit(jax.value_and_grad(one_device, (0, 1), has_aux=True))(params, x)
    _close(((value, y), grads), expected)
    layer = jax.jit(lambda p, x: _layer(p, x, 1.0)[1])
    for device, rows in enumerate(np.split(np.asarray(x), 8)):  # aux: each device's own rows
        _close(jax.tree.map(lambda a, i=device: a[i], aux), layer(params, rows))


def test_the_program_sends_tokens_and_never_gathers_an_expert():
    params, x = _inputs()
    mesh = _mesh(4)
    grad = jax.jit(jax.grad(lambda p, x: _loss(1.0)(p, x)[0]))
    with jax.set_mesh(mesh):
        placed = {
            name: jax.device_put(w, NamedSharding(mesh, P(None if name == "router" else "expert")))
            for name, w in params.items()
        }
        text = grad.lower(placed, jax.device_put(x, NamedSharding(mesh, P("data")))).compile()
    report = hlo.analyze(text.as_text(), mesh)
    kinds = {(c.kind, c.axes) for c in report.collectives}
    assert ("all-to-all", ("expert",)) in kinds, kinds
    assert not [c for c in report.collectives if c.kind == "all-gather" and "expert" in c.axes]


def test_the_module_places_experts_by_the_rules_and_equals_one_device():
    """Under `Replicator.compile`, beside FSDP and tensor parallelism of the experts."""
    module = moe.MoEFeedForward(num_experts=E, experts_per_token=K, mlp_dim=F, gated=True)
    _, x = _inputs()
    rules = [("exp", "expert"), ("embed", "fsdp"), ("mlp", "tensor")]
    mesh = {"fsdp": 2, "expert": 2, "tensor": 2}
    repl = rp.Replicator(mesh=mesh, rules=rules, min_size=0)
    params = repl.init(lambda x: module.init(jax.random.key(0), x), x)
    assert tuple(params["params"]["wi"].value.sharding.spec) == ("expert", "fsdp", "tensor")
    y, aux = repl.compile(module.apply)(params, repl.shard_batch(np.asarray(x)))
    expected = jax.jit(module.apply)(jax.device_get(params), x)
    _close((y, aux), expected)


# --------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "experts, kwargs, message",
    [
        (4, dict(num_experts=6), "6 experts do not split over the 4 devices"),
        (1, dict(experts_per_token=9), "experts_per_token=9 must be between 1 and"),
        (1, dict(capacity_factor=0.0), "capacity_factor=0.0 must be > 0"),
        (1, dict(capacity_factor=-1.0), "capacity_factor=-1.0 must be > 0"),
        (1, dict(routing="top2"), r"routing='top2': use one of \('switch', 'gshard', 'mixtral'\)"),
        (1, dict(routing="gshard", experts_per_token=1), "'gshard' is top-2 routing"),
    ],
)
def test_a_layer_that_cannot_run_is_one_line(experts, kwargs, message):
    params, x = _inputs(batch=8)
    num_experts = kwargs.pop("num_experts", E)
    if num_experts != E:
        params = {name: np.zeros((6, *w.shape[1:])) for name, w in params.items()}
        params["router"] = np.zeros((D, 6))
    kwargs = dict(num_experts=num_experts, experts_per_token=K, capacity_factor=1.0) | kwargs
    with jax.set_mesh(_mesh(experts)), pytest.raises(ValueError, match=message) as error:
        moe.moe_layer(params, x, **kwargs)
    assert "\n" not in str(error.value)
