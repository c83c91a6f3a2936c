"""``wrap_optimizer(aggregate=...)``: a function that replaces the cross-replica sum.

It is given each replica's own gradients (not the sum autodiff makes of a mirrored
parameter's) and the sum to call; the default is bitwise today's sum, `rp.narrow_sum`
sends it in bfloat16 (an all-reduce, or ZeRO's reduce-scatter, in bf16 in the
program JAX hands XLA), and a per-replica transform (clipping each replica's
gradient) sees each replica's own.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.compiled import hlo as hlo
from tests.test_grad_clip import (
    GLOBAL_BATCH,
    init_params,
    loss_fn,
    make_batches,
    make_step,
    per_example_loss,
    train,
)

MESHES = {"run": {"data": 8}, "zero": {"data": 2, "fsdp": 4}}
PER_REPLICA_CLIP = 0.02  # each replica's gradient norm is above it, the sum's far above


def identity_sum(grads, cross_replica_sum):
    return cross_replica_sum(grads)


def clip_each_replica(grads, cross_replica_sum):
    clipped, _ = optax.clip_by_global_norm(PER_REPLICA_CLIP).update(grads, optax.EmptyState())
    return cross_replica_sum(clipped)


def assert_equal(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize(
    "mesh, k",
    [(MESHES["run"], 1), (MESHES["zero"], 1), (MESHES["run"], 2)],
    ids=["run", "zero", "accum"],
)
def test_the_default_sum_as_an_aggregator_is_bitwise_todays(mesh, k, opt):
    make_tx = {"sgd": lambda: optax.sgd(0.5), "adam": lambda: optax.adam(0.05)}[opt]
    batches = make_batches(3)
    today = train("run", mesh, k, make_tx, batches)
    got = train("run", mesh, k, make_tx, batches, aggregate=identity_sum)
    assert got.per_replica_grads and not today.per_replica_grads
    assert_equal(got.params, today.params)
    assert_equal(got.opt_state, today.opt_state)


def one_device_per_replica_clip(batches, replicas=8):
    """SGD on one device where each replica's gradient (its rows of the global batch,
    the loss divided by the global batch) is clipped before the sum."""
    params, rows = init_params(), GLOBAL_BATCH // replicas
    for batch in batches:
        total = None
        for r in range(replicas):
            mine = jax.tree.map(lambda x: x[r * rows : (r + 1) * rows], batch)  # noqa: B023
            grads = jax.grad(lambda p: per_example_loss(p, mine).sum() / GLOBAL_BATCH)(params)  # noqa: B023
            assert optax.tree.norm(grads) > 2 * PER_REPLICA_CLIP
            clipped, _ = optax.clip_by_global_norm(PER_REPLICA_CLIP).update(grads, None)
            total = clipped if total is None else jax.tree.map(jnp.add, total, clipped)
        params = jax.tree.map(lambda p, g: p - 0.5 * g, params, total)
    return params


@pytest.mark.parametrize(
    "mesh, k",
    [(MESHES["run"], 1), (MESHES["zero"], 1), (MESHES["run"], 2)],
    ids=["run", "zero", "accum"],
)
def test_a_per_replica_transform_sees_each_replicas_own_gradient(mesh, k):
    batches = make_batches(2)
    want = one_device_per_replica_clip(batches)
    got = train("run", mesh, k, lambda: optax.sgd(0.5), batches, aggregate=clip_each_replica)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # Had it seen the sum (norm far above the clip), it would have clipped that instead.
    seen_sum = train("run", mesh, k, lambda: optax.sgd(0.5), batches, clip_norm=PER_REPLICA_CLIP)
    assert not np.allclose(
        np.asarray(got.params["w1"]), np.asarray(seen_sum.params["w1"]), atol=1e-4
    )


def test_under_compile_the_aggregator_sees_the_global_gradient_as_one_replica():
    """The global view is one replica holding the whole batch: a per-replica clip there
    clips the global batch's gradient, as ``clip_norm`` does."""
    batches = make_batches(2)
    got = train(
        "compile", MESHES["run"], 1, lambda: optax.sgd(0.5), batches, aggregate=clip_each_replica
    )
    want = train(
        "compile", MESHES["run"], 1, lambda: optax.sgd(0.5), batches, clip_norm=PER_REPLICA_CLIP
    )
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def collective_elements(text: str) -> dict[tuple[str, str], int]:
    """(collective, dtype) -> elements in its results, from HLO text."""
    out: dict[tuple[str, str], int] = {}
    for line in text.splitlines():
        found = re.search(r" = (.*?) (all-reduce|reduce-scatter|all-gather)(?:-start)?\(", line)
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", found.group(1)) if found else ():
            size = int(np.prod([int(d) for d in dims.split(",") if d]))
            out[found.group(2), dtype] = out.get((found.group(2), dtype), 0) + size
    return out


def lowered_step(mesh, **wrap):
    repl = rp.Replicator(mesh=mesh, min_size=0)
    tx = repl.wrap_optimizer(optax.sgd(0.5), **wrap)
    state = repl.init(lambda key: rp.TrainState.create(init_params(), tx, key), jax.random.key(0))
    return repl, repl.lower(make_step(tx), state, repl.shard_batch(make_batches(1)[0]))


GRADIENT_ELEMENTS = sum(x.size for x in jax.tree.leaves(init_params()))


@pytest.mark.parametrize("mesh_name, axis", [("run", "data"), ("zero", "fsdp")])
def test_the_narrow_sum_sends_bfloat16(mesh_name, axis):
    """The program JAX hands XLA sums the gradients in bf16: an all-reduce under data
    parallelism, ZeRO's reduce-scatter for sharded parameters; the gradient traffic
    halves. (XLA:CPU itself widens bf16 reductions to f32 when it compiles: its
    collectives have no bf16 sum; GPU and TPU keep them.)"""
    mesh = MESHES[mesh_name]
    _, plain = lowered_step(mesh)
    repl, narrow = lowered_step(mesh, aggregate=rp.narrow_sum())
    got, want = (
        collective_elements(narrow.as_text(dialect="hlo")),
        collective_elements(plain.as_text(dialect="hlo")),
    )
    op = "all-reduce" if mesh_name == "run" else "reduce-scatter"
    assert got.get((op, "bf16"), 0) == want[op, "f32"] >= GRADIENT_ELEMENTS // 8
    assert got.get((op, "f32"), 0) == 0
    traffic_f32 = hlo.traffic(plain.as_text(dialect="hlo"), repl.mesh, axis)
    traffic_bf16 = hlo.traffic(narrow.as_text(dialect="hlo"), repl.mesh, axis)
    # The sum is made once, ahead of the update's non-finite guard (not in its branch).
    assert traffic_bf16["in_branches"] == traffic_f32["in_branches"]
    bytes_f32, bytes_bf16 = traffic_f32["every_step"], traffic_bf16["every_step"]
    if mesh_name == "run":  # all of this step's traffic is the gradients' (and a flag's)
        assert bytes_bf16 == pytest.approx(bytes_f32 / 2, abs=16)
    else:  # the parameters' all-gather stays float32
        assert bytes_bf16 < bytes_f32
    narrow.compile()  # and XLA:CPU compiles it


def test_what_the_step_reads_is_what_it_reads_without_an_aggregator():
    """Per-replica gradients type the parameters varying inside value_and_grad; a value
    of the parameters alone (in aux) still comes back mirrored, and the step reads
    the summed gradient."""
    repl = rp.Replicator(mesh=MESHES["run"])

    def run(**wrap):
        tx = repl.wrap_optimizer(optax.sgd(0.5), **wrap)

        def step(state, batch):
            def loss(params, batch):
                return loss_fn(params, batch), optax.tree.norm(params)

            (loss, weight_norm), grads = state.value_and_grad(loss, batch, has_aux=True)
            return state.apply_gradients(grads, tx), optax.tree.norm(grads), weight_norm

        state = repl.replicate(rp.TrainState.create(init_params(), tx, jax.random.key(0)))
        return repl.run(step, state, repl.shard_batch(make_batches(1)[0]))

    (state, grad_norm, weight_norm), (want, want_grad_norm, want_weight_norm) = (
        run(aggregate=identity_sum),
        run(),
    )
    assert grad_norm.shape == weight_norm.shape == ()  # mirrored
    np.testing.assert_allclose(grad_norm, want_grad_norm, rtol=1e-6)
    np.testing.assert_array_equal(weight_norm, want_weight_norm)
    assert_equal(state.params, want.params)


def test_training_with_the_narrow_sum_stays_within_bf16_of_float32():
    make_tx = lambda: optax.adam(0.02)  # noqa: E731
    batches = make_batches(30, seed=3)

    def losses(**wrap):
        repl = rp.Replicator(mesh=MESHES["run"])
        tx = repl.wrap_optimizer(make_tx(), **wrap)
        state = repl.replicate(rp.TrainState.create(init_params(), tx, jax.random.key(0)))
        out, step = [], make_step(tx)
        for batch in batches:
            state, loss = repl.run(step, state, repl.shard_batch(batch))
            out.append(float(np.sum(loss)))
        return np.array(out), state

    want, want_state = losses()
    got, got_state = losses(aggregate=rp.narrow_sum())
    assert want[-1] < 0.9 * want[0]  # it trains
    np.testing.assert_allclose(got, want, rtol=1e-2)  # bf16 carries 8 bits: ~0.4% a sum
    assert not np.array_equal(got, want)  # and the sum really was rounded
    for a, b in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-2)


def test_a_non_finite_replica_gradient_skips_the_step_for_all():
    batch = make_batches(1)[0]
    batch["x"][GLOBAL_BATCH - 1, 0] = np.nan  # the last replica's rows
    state = train(
        "run", MESHES["zero"], 1, lambda: optax.sgd(0.5), [batch], aggregate=rp.narrow_sum()
    )
    assert int(state.skipped_steps) == 1
    assert_equal(state.params, init_params())


def test_narrow_sum_under_compile_warns_and_changes_nothing():
    batches = make_batches(2)
    want = train("compile", MESHES["run"], 1, lambda: optax.sgd(0.5), batches)
    with pytest.warns(UserWarning, match="under repl.compile"):
        got = train(
            "compile", MESHES["run"], 1, lambda: optax.sgd(0.5), batches, aggregate=rp.narrow_sum()
        )
    assert_equal(got.params, want.params)


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_diloco_islands_aggregate_among_their_own_replicas():
    """Under DiLoCo the aggregator sums within each island (4 replicas here)."""
    repl = rp.Replicator(mesh={"data": 2, "fsdp": 4})

    def final(**wrap):
        tx = repl.wrap_optimizer(optax.sgd(0.5), sync=rp.DiLoCo(inner_steps=2), **wrap)
        state = repl.replicate(rp.TrainState.create(init_params(), tx, jax.random.key(0)))
        for batch in make_batches(3):
            state, _ = repl.run(make_step(tx), state, repl.shard_batch(batch))
        return state, repl.lower(make_step(tx), state, repl.shard_batch(batch))

    want, _ = final()
    got, _ = final(aggregate=identity_sum)
    assert_equal(got.params, want.params)
    assert_equal(got.opt_state.outer_params, want.opt_state.outer_params)
    _, lowered = final(aggregate=rp.narrow_sum())
    groups = [
        line for line in lowered.as_text(dialect="hlo").splitlines()
        if re.search(r"= bf16\[[\d,]+\]\{?[\d,]*\}? all-reduce\(", line)
    ]  # fmt: skip
    # JAX 0.10 lists the groups; 0.11 and later name the mesh axes they span.
    within = ("replica_groups={{0,1,2,3},{4,5,6,7}}", "{'fsdp'}, use_global_device_ids")
    assert groups and all(any(w in g for w in within) for g in groups)


def test_gradients_autodiff_summed_already_are_an_error():
    """A step that differentiates on its own gives the sum of a mirrored parameter's
    gradient, not each replica's: an aggregator cannot see them, and says so."""
    repl = rp.Replicator(mesh=MESHES["run"])
    tx = repl.wrap_optimizer(optax.sgd(0.5), aggregate=identity_sum)
    state = repl.replicate(rp.TrainState.create(init_params(), tx, jax.random.key(0)))

    def step(state, batch):
        grads = jax.grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads, tx)

    with pytest.raises(ValueError, match="value_and_grad"):
        repl.run(step, state, repl.shard_batch(make_batches(1)[0]))


def test_an_aggregator_that_does_not_sum_is_an_error():
    batches = make_batches(1)
    with pytest.raises(ValueError, match="summed across the replicas"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train("run", MESHES["run"], 1, lambda: optax.sgd(0.5), batches, aggregate=lambda g, s: g)


def test_a_parameter_used_twice_is_all_reduced_once():
    """A tied weight (an LM's embedding, used to embed and to read out): `rp.TrainState`
    sums each replica's own gradient once, where autodiff alone would all-reduce it
    once per use."""
    repl = rp.Replicator(mesh={"data": 8})
    params = {"tied": jnp.ones((64, 64))}
    tx = repl.wrap_optimizer(optax.sgd(0.1))
    state = repl.compile(lambda: rp.TrainState.create(params, tx, jax.random.key(0)))()

    def loss(p, batch):  # the weight used twice
        hidden = jnp.tanh(batch["x"] @ p["tied"])
        return rp.compute_average_loss(jnp.sum((hidden @ p["tied"].T) ** 2, axis=-1))

    def step(state, batch):
        value, grads = state.value_and_grad(loss, batch)
        return state.apply_gradients(grads, tx), value

    batch = jax.device_put({"x": np.ones((16, 64), np.float32)}, repl.batch_sharding)
    lowered = repl.lower(step, state, batch)
    traffic = hlo.traffic(lowered.as_text(dialect="hlo"), repl.mesh, "data")
    gradient = 64 * 64 * 4
    ring = 2 * gradient * 7 // 8  # one all-reduce of the gradient over 8 devices
    assert ring <= traffic["every_step"] + traffic["in_branches"] < 2 * ring, traffic
