"""Inside a per-replica step: per-replica values, the axis name, replica keys, errors."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp

MESHES = {"data8": {"data": -1}, "data4_fsdp2": {"data": 4, "fsdp": 2}}


def ema_step(ema, count, batch):
    """Per-device state, as pmap programs keep it: each replica's EMA of its own data."""
    return 0.5 * ema + 0.5 * jnp.mean(batch["x"], axis=0), count + 1


def host_batches(steps, size=16, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(size, 3)).astype(np.float32)} for _ in range(steps)]


@pytest.mark.parametrize("mesh", MESHES)
def test_per_replica_values_round_trip(mesh):
    repl = rp.Replicator(mesh=MESHES[mesh])
    n = repl.num_replicas
    ema = rp.PerReplica(np.zeros((n, 3), np.float32))  # each replica: shape (3,)
    count = rp.PerReplica(np.zeros((n,), np.int32))  # each replica: a scalar
    expected = np.zeros((n, 3), np.float32)
    for step, batch in enumerate(host_batches(5), 1):
        ema, count = repl.run(ema_step, ema, count, repl.shard_batch(batch))
        assert ema.shape == (n, 3) and count.shape == (n,)  # nothing grows
        rows = batch["x"].reshape(n, -1, 3)  # replica i's slice of the batch
        expected = 0.5 * expected + 0.5 * rows.mean(axis=1)
        np.testing.assert_allclose(ema, expected, rtol=1e-6)  # each row evolves on its own
        np.testing.assert_array_equal(count, np.full((n,), step))
    assert len(repl._run_cache) == 1  # marked and returned values compile the same


def test_a_mirrored_value_that_starts_varying_comes_back_per_replica():
    repl = rp.Replicator()
    ema, count = repl.replicate((jnp.zeros(3), jnp.int32(0)))  # the same on every replica
    for batch in host_batches(3):
        ema, count = repl.run(ema_step, ema, count, repl.shard_batch(batch))
        assert ema.shape == (8, 3)  # varies now: stacked, and it stays that way
        assert count.shape == ()  # never varied: mirrored


def test_reduce_accepts_marked_values():
    repl = rp.Replicator()
    values = np.arange(8, dtype=np.float32)
    assert float(repl.reduce(rp.ReduceOp.SUM, rp.PerReplica(values))) == 28.0
    assert float(repl.reduce(rp.ReduceOp.MEAN, rp.PerReplica(values))) == 3.5


def test_per_replica_value_for_another_replica_count_is_an_error():
    ema, count = rp.Replicator().run(
        ema_step,
        rp.PerReplica(np.zeros((8, 3), np.float32)),
        rp.PerReplica(np.zeros(8, np.int32)),
        rp.Replicator().shard_batch(host_batches(1)[0]),
    )
    four = rp.Replicator(devices=jax.devices()[:4])
    batch = four.shard_batch(host_batches(1)[0])
    with pytest.raises(ValueError, match=r"per-replica value with 8 rows.* 4 replicas"):
        four.run(ema_step, ema, count, batch)
    with pytest.raises(ValueError, match=r"leading axis of size 4, got shape \(8, 3\)"):
        four.run(ema_step, rp.PerReplica(np.zeros((8, 3))), rp.PerReplica(np.zeros(4)), batch)


def test_value_that_could_be_a_batch_or_per_replica_is_an_error():
    repl = rp.Replicator()
    unknown = jax.device_put(jnp.zeros((8, 3)), repl.batch_sharding)  # e.g. made outside run
    with pytest.raises(ValueError, match=r"args\[0\].*cannot tell.*rp.PerReplica"):
        batch = repl.shard_batch(host_batches(1)[0])
        repl.run(ema_step, unknown, rp.PerReplica(np.zeros(8)), batch)
    # A per-replica output copied to the host and passed back unmarked would be taken as
    # mirrored and grow an axis every step (pmap's idiom through numpy): an error instead.
    batch = repl.shard_batch(host_batches(1)[0])
    ema, count = repl.run(ema_step, rp.PerReplica(np.zeros((8, 3))), np.zeros(8), batch)
    for copy in (np.asarray(ema), jax.device_get(ema), jax.device_put(np.asarray(ema))):
        with pytest.raises(ValueError, match=r"args\[0\].*rp.PerReplica.*repl.replicate"):
            repl.run(ema_step, copy, count, batch)
    assert repl.run(ema_step, rp.PerReplica(np.asarray(ema)), count, batch)[0].shape == (8, 3)
    assert repl.run(ema_step, repl.replicate(np.asarray(ema)), count, batch)[0].shape == (8, 8, 3)
    # A host constant of one row per replica that does not grow is mirrored as ever.
    weights = np.arange(8.0)
    out = repl.run(lambda w, b: jnp.sum(w) + b["x"].sum(), weights, batch)
    assert out.shape == (8,)
    assert repl.run(lambda w, b: w * 2, weights, batch).shape == (8,)
    # A batch of exactly one example per replica made by shard_batch is known to be a batch.
    batch = repl.shard_batch({"x": np.ones((8, 3), np.float32)})
    out = repl.run(lambda b: jnp.sum(b["x"]), batch)
    np.testing.assert_array_equal(out, np.full(8, 3.0))


# ------------------------------------------------------------------ axis name


def make_collectives(axis, gather=True):
    """One step for both paths: collectives over ``repl.axis_name``."""

    def collectives(batch):
        total = jnp.sum(batch["x"])
        out = {
            "psum": jax.lax.psum(total, axis),
            "global_mean": jax.lax.psum(total, axis) / jax.lax.psum(batch["x"].size, axis),
            "pmean_of_means": jax.lax.pmean(jnp.mean(batch["x"]), axis),
            "max": jax.lax.pmax(jnp.max(batch["x"]), axis),
            "first": jax.lax.axis_index(axis) == 0,
        }
        if gather:
            out["gathered"] = jnp.sum(jax.lax.all_gather(total, axis))
        return out

    return collectives


@pytest.mark.parametrize("mesh", MESHES)
def test_collectives_over_axis_name_agree_on_both_paths(mesh):
    repl = rp.Replicator(mesh=MESHES[mesh])
    assert repl.axis_name == (("data",) if mesh == "data8" else ("data", "fsdp"))
    host = host_batches(1)[0]
    batch = repl.shard_batch(host)
    per_replica = repl.run(make_collectives(repl.axis_name), batch)
    expected = {"psum": host["x"].sum(), "max": host["x"].max()}
    expected["global_mean"] = expected["pmean_of_means"] = host["x"].mean()
    for name, value in expected.items():
        np.testing.assert_allclose(per_replica[name], value, rtol=1e-5)
    np.testing.assert_array_equal(per_replica["first"], np.arange(8) == 0)
    np.testing.assert_allclose(per_replica["gathered"], host["x"].sum(), rtol=1e-5)
    # JAX's vmap cannot batch all_gather over two axes: under compile it works over one.
    gather = len(repl.axis_name) == 1
    global_view = repl.compile(make_collectives(repl.axis_name, gather))(batch)  # one replica
    if gather:
        np.testing.assert_allclose(global_view["gathered"], host["x"].sum(), rtol=1e-5)
    else:  # a clear error that says what to do instead
        with pytest.raises(NotImplementedError, match=r"repl.axis_name.*all_gather\(x\) is x"):
            repl.compile(make_collectives(repl.axis_name))(batch)
    for name, value in expected.items():
        np.testing.assert_allclose(global_view[name], value, rtol=1e-5)
    assert bool(global_view["first"])


def test_replica_context():
    repl = rp.Replicator(mesh={"data": 4, "fsdp": 2})
    assert rp.get_replica_context() is None

    def where(batch):
        ctx = rp.get_replica_context()
        assert ctx.num_replicas == 8 and ctx.axis_name == repl.axis_name
        return ctx.replica_id, batch["index"][0] // 2

    replica_id, shard = repl.run(where, repl.shard_batch({"index": np.arange(16)}))
    np.testing.assert_array_equal(replica_id, np.arange(8))
    np.testing.assert_array_equal(replica_id, shard)  # replica i sees shard i
    repl.compile(lambda b: rp.get_replica_context())(repl.shard_batch({"index": np.arange(16)}))


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_replica_keys_differ_per_replica_and_are_deterministic(make_key):
    repl = rp.Replicator()

    def noise(key):
        return jax.random.normal(rp.replica_key(key), (4,))

    key = repl.replicate(make_key(3))
    first, again = repl.run(noise, key), repl.run(noise, key)
    assert first.shape == (8, 4)
    np.testing.assert_array_equal(first, again)
    assert len({tuple(row) for row in np.asarray(first)}) == 8  # every replica its own
    # Outside run and under compile the key is unchanged.
    plain = jax.random.normal(make_key(3), (4,))
    np.testing.assert_array_equal(repl.compile(noise)(key), plain)
    np.testing.assert_array_equal(noise(make_key(3)), plain)


@pytest.mark.parametrize("path", ["run", "compile"])
def test_axis_name_that_is_not_the_replicas_is_a_clear_error(path):
    repl = rp.Replicator()
    batch = repl.shard_batch({"x": np.ones((8, 3), np.float32)})
    bn = nn.BatchNorm(use_running_average=False, axis_name="batch")  # the pmap program's name
    variables = repl.replicate(bn.init(jax.random.key(0), jnp.ones((2, 3))))

    def step(variables, batch):
        return bn.apply(variables, batch["x"], mutable=["batch_stats"])[1]

    def psum_step(variables, batch):
        return jax.lax.psum(batch["x"], "batch")

    def tuple_step(variables, batch):  # one right name, one wrong
        return jax.lax.psum(batch["x"], ("data", "batch"))

    call = repl.run if path == "run" else lambda f, *a: repl.compile(f)(*a)
    for fn in (step, psum_step, tuple_step):
        with pytest.raises(rp.AxisNameError, match=r"'batch'.*repl.axis_name = \('data',\)"):
            call(fn, variables, batch)

    # A data axis of size 1 (fsdp here) is a collective over one device on both paths.
    def fsdp_step(variables, batch):
        return jax.lax.psum(jnp.sum(batch["x"]), "fsdp")

    np.testing.assert_allclose(
        call(fsdp_step, variables, batch), 24.0 if path == "compile" else 3.0
    )


def test_batchnorm_with_axis_name_runs_unchanged_on_both_paths():
    repl = rp.Replicator()
    bn = nn.BatchNorm(use_running_average=False, momentum=0.5, axis_name=repl.axis_name)
    variables = repl.replicate(bn.init(jax.random.key(0), jnp.ones((2, 3))))
    host = host_batches(1)[0]

    def step(variables, batch):
        y, updates = bn.apply(variables, batch["x"], mutable=["batch_stats"])
        return y, updates["batch_stats"]

    y_run, stats_run = repl.run(step, variables, repl.shard_batch(host))
    y_compiled, stats_compiled = repl.compile(step)(variables, repl.shard_batch(host))
    y_one, stats_one = jax.jit(
        lambda v, x: nn.BatchNorm(use_running_average=False, momentum=0.5).apply(
            v, x, mutable=["batch_stats"]
        )
    )(variables, host["x"])
    stats_one = stats_one["batch_stats"]
    assert stats_run["mean"].shape == (3,)  # mirrored: the same on every replica
    for stats in (stats_run, stats_compiled):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), stats, stats_one)
    np.testing.assert_allclose(np.asarray(y_run).reshape(16, 3), y_one, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y_compiled, y_one, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ precision, rows


def test_precision_policy_reaches_the_users_model_and_state():
    repl = rp.Replicator(precision="bf16")
    model = repl.apply_policy(nn.Dense(4))
    params = model.init(jax.random.key(0), jnp.ones((2, 3)))
    assert jax.tree.leaves(params)[0].dtype == jnp.float32  # stored in fp32
    jaxpr = str(jax.make_jaxpr(model.apply)(params, jnp.ones((2, 3))))
    (matmul,) = [line for line in jaxpr.splitlines() if "dot_general" in line]
    assert "bf16[2,4] = dot_general" in matmul  # computes in bf16
    assert model.apply(params, jnp.ones((2, 3))).dtype == jnp.float32
    tx = optax.sgd(0.1)
    fp16 = rp.TrainState.create(
        params, tx, jax.random.key(0), policy=rp.Replicator(precision="fp16").precision
    )
    assert fp16.loss_scale is not None  # fp16 trains with a dynamic loss scale
    assert rp.TrainState.create(params, tx, jax.random.key(0), policy="bf16").loss_scale is None


@pytest.mark.parametrize("path", ["run", "compile"])
def test_a_precision_the_step_never_applies_is_pointed_out(path):
    repl = rp.Replicator(precision="bf16")
    batch = repl.shard_batch(host_batches(1)[0])
    plain, policed = nn.Dense(2), repl.apply_policy(nn.Dense(2))
    params = repl.replicate(plain.init(jax.random.key(0), jnp.ones((1, 3))))
    tx = repl.wrap_optimizer(optax.sgd(0.1))
    opt_state = repl.replicate(tx.init(params))
    call = repl.run if path == "run" else lambda fn, *args: repl.compile(fn)(*args)

    def train_with(model):
        def loss_fn(params, batch):
            return rp.compute_average_loss(jnp.sum(model.apply(params, batch["x"]), -1))

        def step(params, opt_state, batch):
            grads = jax.grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return step

    ignores_it, applies_it = train_with(plain), train_with(policed)
    ignores_it.__name__ = "ignores_it"
    with pytest.warns(UserWarning, match="precision is 'bf16', but the step 'ignores_it' trains"):
        call(ignores_it, params, opt_state, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per step; silent where the policy applies
        call(ignores_it, params, opt_state, batch)
        call(applies_it, params, opt_state, batch)
        # Steps that do not train (an init, an eval, a reduction) are not told.
        call(lambda params, batch: jnp.sum(plain.apply(params, batch["x"])), params, batch)
        rp.Replicator().run(train_with(plain), params, opt_state, batch)  # fp32


def test_process_rows_in_one_process():
    repl = rp.Replicator()
    assert repl.process_rows(24) == slice(0, 24)
    with pytest.raises(ValueError, match=r"12 rows does not split evenly over 8 replicas"):
        repl.process_rows(12)
