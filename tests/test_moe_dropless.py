"""Dropless experts (`rp.moe` with ``capacity_factor=None``, `replicator.parallel.dropless`).

The invariants: the layer equals a dense per-token reference (every token through
each of its ``k`` experts by a plain einsum, gated as its convention says), forward
and gradient, on one device and with its experts split over ``expert`` beside
``fsdp`` (the exchange by ragged all-to-all), inside a ``shard_map`` too; no
token is dropped at any imbalance (every token to one expert, or to one device's
experts); the CPU stand-in for `jax.lax.ragged_all_to_all` computes its documented
example; and a checkpoint moves between capacity and dropless layouts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.compiled import hlo as hlo
from replicator.parallel import dropless as dropless
from replicator.parallel import moe as moe
from tests.test_lm_parallel import MOE, _assert_trains_alike, _train, batches  # noqa: F401

E, D, F, S = 8, 8, 16, 8  # experts, width, hidden width, length


def _inputs(batch=8, gated=True, seed=0):
    key_p, key_x = jax.random.split(jax.random.key(seed))
    params = moe.init_moe_params(key_p, embed_dim=D, mlp_dim=F, num_experts=E, gated=gated)
    params["router"] = params["router"] * 3  # uneven loads
    return jax.device_get((params, jax.random.normal(key_x, (batch, S, D))))


def _reference(params, x, k, routing):
    """Every token through each of its ``k`` experts, one einsum per expert: the top
    ``k`` of the router's softmax, renormalised unless Switch's."""
    probs = jax.nn.softmax(jnp.einsum("bsd,de->bse", x, params["router"]))
    gates, chosen = jax.lax.top_k(probs, k)
    if routing != "switch":
        gates = gates / jnp.sum(gates, -1, keepdims=True)
    y = jnp.zeros_like(x)
    for e in range(E):
        h = jnp.einsum("bsd,df->bsf", x, params["wi"][e])
        if "wi_gate" in params:
            h = jax.nn.gelu(jnp.einsum("bsd,df->bsf", x, params["wi_gate"][e])) * h
        else:
            h = jax.nn.gelu(h)
        out = jnp.einsum("bsf,fd->bsd", h, params["wo"][e])
        weight = jnp.sum(jnp.where(chosen == e, gates, 0.0), axis=-1)  # 0 where not chosen
        y = y + weight[..., None] * out
    return y


def _value_and_grad(layer):
    def loss(params, x):
        y = layer(params, x)
        return jnp.mean(y**2 + y), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _dropless_layer(k, routing):
    def layer(params, x):
        return moe.moe_layer(
            params, x, num_experts=E, experts_per_token=k, capacity_factor=None, routing=routing
        )[0]

    return layer


def _close(actual, expected, atol=2e-5):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=atol, rtol=2e-5), actual, expected
    )


def _mesh(expert=2, fsdp=4):
    return jax.make_mesh((fsdp, expert), ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2)


def _placed(mesh, params, x):
    weights = {
        name: jax.device_put(w, NamedSharding(mesh, P(None if name == "router" else "expert")))
        for name, w in params.items()
    }
    return weights, jax.device_put(x, NamedSharding(mesh, P(("fsdp", "expert"))))


@pytest.mark.parametrize(
    "k, routing, mesh",
    [
        (2, "mixtral", None),
        pytest.param(4, "switch", None, marks=pytest.mark.slow),  # norm_topk_prob=False
        (2, "mixtral", (2, 4)),
        (4, "switch", (2, 4)),
        pytest.param(2, "gshard", (4, 2), marks=pytest.mark.slow),
    ],
)
def test_dropless_equals_the_dense_reference(k, routing, mesh):
    params, x = _inputs()
    expected = _value_and_grad(lambda p, x: _reference(p, x, k, routing))(params, x)
    grad = _value_and_grad(_dropless_layer(k, routing))
    if mesh is None:
        got = grad(params, x)
    else:
        mesh = _mesh(*mesh)
        with jax.set_mesh(mesh):
            got = grad(*_placed(mesh, params, x))
    _close(got, expected)


def test_the_program_sends_tokens_and_never_gathers_an_expert():
    """Over ``expert``: the pairs and their counts go by all-to-all; nothing is gathered."""
    params, x = _inputs()
    mesh = _mesh()
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(_dropless_layer(2, None)(p, x) ** 2)))
    with jax.set_mesh(mesh):
        text = grad.lower(*_placed(mesh, params, x)).compile().as_text()
    report = hlo.analyze(text, mesh)
    kinds = {(c.kind, c.axes) for c in report.collectives}
    assert ("all-to-all", ("expert",)) in kinds, kinds
    assert not [c for c in report.collectives if c.kind == "all-gather" and "expert" in c.axes]


@pytest.mark.parametrize(
    "tokens, weights",
    [
        (("fsdp", "expert"), "expert"),  # each device's own tokens: the ragged exchange
        ("fsdp", "expert"),  # every expert device holds them alike: its experts' run
        pytest.param(("fsdp", "expert"), None, marks=pytest.mark.slow),  # every expert here
    ],
)
def test_inside_a_shard_map_over_expert_it_equals_the_reference(tokens, weights):
    """As under `Replicator.run`: manual over ``fsdp`` and ``expert`` already."""
    params, x = _inputs()
    mesh = _mesh()
    specs = {name: P() if name == "router" else P(weights) for name in params}
    inner = jax.shard_map(
        _dropless_layer(2, None), mesh=mesh, in_specs=(specs, P(tokens)), out_specs=P(tokens)
    )
    with jax.set_mesh(mesh):
        got = _value_and_grad(inner)(params, x)
    _close(got, _value_and_grad(lambda p, x: _reference(p, x, 2, "mixtral"))(params, x))


@pytest.mark.parametrize("hot", [pytest.param([0], marks=pytest.mark.slow), [6, 7]])
def test_no_token_is_dropped_at_any_imbalance(hot):
    """Every token's first choice expert 0, or every choice one device's experts (6, 7
    of 8 over ``expert=4``): nothing drops, where any capacity below ``E / k`` would."""
    params, x = _inputs()
    bias = np.full(E, -30.0)
    bias[hot] = 30.0
    x = np.array(x)
    x[..., 0] = 1.0  # the router's first row carries the bias
    params["router"] = np.concatenate([bias[None], params["router"][1:] * 0.1])
    probs = jax.nn.softmax(jnp.einsum("bsd,de->bse", x, params["router"]))
    assert set(np.asarray(jnp.argmax(probs, -1)).ravel()) <= set(hot)
    mesh = _mesh(expert=4, fsdp=2)
    with jax.set_mesh(mesh):
        got = _value_and_grad(_dropless_layer(2, None))(*_placed(mesh, params, x))
    _close(got, _value_and_grad(lambda p, x: _reference(p, x, 2, "mixtral"))(params, x))
    capacity = jax.jit(
        lambda p, x: moe.moe_layer(p, x, num_experts=E, experts_per_token=2, capacity_factor=1.0)
    )
    assert float(capacity(params, x)[1].dropped_fraction) > 0.3


def test_the_cpu_ragged_all_to_all_is_the_documented_one():
    """`jax.lax.ragged_all_to_all`'s docstring example, on its stand-in for XLA:CPU."""
    mesh = jax.make_mesh((2,), ("x",), (AxisType.Auto,), devices=jax.devices()[:2])
    args = {
        "operand": [[1, 2, 2], [3, 4, 0]],
        "input_offsets": [[0, 1], [0, 1]],
        "send_sizes": [[1, 2], [1, 1]],
        "output_offsets": [[0, 0], [1, 2]],
        "recv_sizes": [[1, 1], [2, 1]],
    }
    flat = {name: jnp.asarray(v, jnp.int32).reshape(-1) for name, v in args.items()}

    def per_device(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
        output = jax.lax.pcast(jnp.zeros(4, jnp.int32), ("x",), to="varying")
        return dropless.ragged_all_to_all_by_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
            axis_name="x",
        )  # fmt: skip

    program = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with jax.set_mesh(mesh):
        got = program(*flat.values())
    assert got.reshape(2, 4).tolist() == [[1, 3, 0, 0], [2, 2, 4, 0]]


def test_a_checkpoint_moves_between_capacity_and_dropless(tmp_path):
    """The same parameters either way: saved by a capacity layer on one mesh, restored
    for a dropless one on another, equal to the saved arrays and computing the reference."""
    _, x = _inputs()
    rules = [("exp", "expert"), ("embed", "fsdp")]

    def module(capacity_factor):
        return moe.MoEFeedForward(
            num_experts=E, experts_per_token=2, mlp_dim=F, gated=True,
            capacity_factor=capacity_factor,
        )  # fmt: skip

    def init(repl, capacity_factor):
        return repl.init(lambda x: module(capacity_factor).init(jax.random.key(0), x), x)

    saver = rp.Replicator(mesh={"fsdp": 4, "expert": 2}, rules=rules, min_size=0)
    saved = init(saver, 1.25)
    with rp.Checkpoints(tmp_path / "capacity", saver) as ckpt:
        ckpt.save(1, saved)
    reader = rp.Replicator(mesh={"fsdp": 2, "expert": 4}, rules=rules, min_size=0)
    like = jax.tree.map(jnp.zeros_like, init(reader, None))
    with rp.Checkpoints(tmp_path / "capacity", reader, read_only=True) as ckpt:
        restored = ckpt.restore(like)
    _close(jax.device_get(restored), jax.device_get(saved), atol=0)
    y, _ = reader.compile(module(None).apply)(restored, reader.shard_batch(np.asarray(x)))
    params = jax.device_get(saved)["params"]
    expected = _reference({n: np.asarray(getattr(w, "value", w)) for n, w in params.items()},
                          x, 2, "mixtral")  # fmt: skip
    _close(y, expected)


# --------------------------------------------------------------- the LM, every parallelism

DROPLESS = dict(MOE, expert_capacity_factor=None)


@pytest.fixture(scope="module")
def one_device_dropless(batches):  # noqa: F811
    return _train(rp.Replicator(devices=jax.devices()[:1]), "compile", batches, DROPLESS)


@pytest.mark.parametrize(
    "path, mesh, options",
    [
        ("compile", {"expert": 2, "fsdp": 2, "tensor": 2}, {"remat_policy": "full"}),
        pytest.param("run", {"expert": 2, "context": 2, "fsdp": 2}, {"remat_policy": "minimal"},
                     marks=pytest.mark.slow),
        pytest.param("compile", {"expert": 2, "fsdp": 4}, {}, marks=pytest.mark.slow),
        pytest.param("run", {"expert": 2, "data": 4}, {}, marks=pytest.mark.slow),
        pytest.param("compile", {"expert": 2, "context": 2, "data": 2},
                     {"context_strategy": "ring", "context_load_balance": True},
                     marks=pytest.mark.slow),
        pytest.param("run", {"expert": 4, "fsdp": 2}, {"remat_policy": "save_dot_except_mlp"},
                     marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_the_dropless_lm_trains_like_one_device(path, mesh, options, batches, one_device_dropless):  # noqa: F811
    """Nothing dropped, on either step path, beside every axis but ``stage`` (the LM runs
    no MoE block in a pipeline). About 30 s each on 2 cores: one runs by default."""
    got = _train(rp.Replicator(mesh=mesh, min_size=0), path, batches, DROPLESS, **options)
    assert [r["dropped_fraction"] for r in got[0]] == [0.0, 0.0, 0.0]
    _assert_trains_alike(got, one_device_dropless, worst=1e-4 if path == "compile" else 1e-3)
