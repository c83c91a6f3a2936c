"""The Replicator contract: N replicas train exactly like one device, on both paths."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import io_callback

import replicator as rp
from tests.compare import assert_trained_alike

GLOBAL_BATCH = 24  # divides 8 replicas and 4x2, not a power of two


def init_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (5, 16)) * 0.5,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 3)) * 0.5,
    }


def per_example_loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def make_batches(steps, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(GLOBAL_BATCH, 5)).astype(np.float32),
            "y": rng.integers(0, 3, size=GLOBAL_BATCH).astype(np.int32),
        }
        for _ in range(steps)
    ]


def make_train_step(tx):
    """The step a user writes once, for one device."""

    def train_step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            return rp.compute_average_loss(per_example_loss(p, batch))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return train_step


def train_single_device(make_tx, batches):
    tx = make_tx()
    params = init_params()
    state = (params, tx.init(params))

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: per_example_loss(p, batch).mean())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    losses = []
    for b in batches:
        state, loss = step(state, b)
        losses.append(float(loss))
    return state[0], losses


OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5), "adam": lambda: optax.adam(0.05)}


def assert_params_alike(opt, params, expected):
    """SGD's parameters element by element; Adam's with its rare amplified rounding
    (tests/compare.py) of up to its learning rate."""
    if opt == "adam":
        return assert_trained_alike(params, expected, atol=1e-6, worst=0.05)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, expected
    )


MESHES = {"data8": {"data": -1}, "data4_fsdp2": {"data": 4, "fsdp": 2}}


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("mesh", MESHES)
def test_run_equals_one_device(opt, mesh):
    batches = make_batches(5)
    expected, expected_losses = train_single_device(OPTIMIZERS[opt], batches)

    repl = rp.Replicator(mesh=MESHES[mesh])
    assert repl.num_replicas == 8
    tx = repl.wrap_optimizer(OPTIMIZERS[opt]())
    params = init_params()
    state = repl.replicate((params, tx.init(params)))
    step = make_train_step(tx)
    losses = []
    for b in batches:
        state, per_replica_loss = repl.run(step, state, repl.shard_batch(b), donate_argnums=(0,))
        assert per_replica_loss.shape == (8,)
        losses.append(float(repl.reduce(rp.ReduceOp.SUM, per_replica_loss)))

    params = state[0]
    assert params["w1"].shape == (5, 16)  # mirrored outputs keep their own shape
    assert params["w1"].sharding.is_fully_replicated
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_params_alike(opt, params, expected)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_compile_equals_one_device_with_the_same_step(opt):
    batches = make_batches(5)
    expected, expected_losses = train_single_device(OPTIMIZERS[opt], batches)

    repl = rp.Replicator(mesh={"data": 4, "fsdp": 2})
    tx = repl.wrap_optimizer(OPTIMIZERS[opt]())  # a no-op wrapper on this path
    params = init_params()
    state = repl.replicate((params, tx.init(params)))
    step = repl.compile(make_train_step(tx), donate_argnums=(0,))
    losses = []
    for b in batches:
        state, loss = step(state, repl.shard_batch(b))
        assert loss.shape == ()
        losses.append(float(loss))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_params_alike(opt, state[0], expected)
    assert step.jitted._cache_size() == 1


def test_an_extra_psum_would_be_caught():
    """Summing the already-summed gradient again is off by num_replicas under SGD."""
    repl = rp.Replicator()
    batches = make_batches(1)
    expected, _ = train_single_device(OPTIMIZERS["sgd"], batches)
    tx = optax.sgd(0.5)
    params = init_params()

    def wrong_step(state, batch):
        params, opt_state = state
        grads = jax.grad(lambda p: rp.compute_average_loss(per_example_loss(p, batch)))(params)
        grads = jax.lax.psum(grads, repl.axis_name)  # the classic mistake
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = repl.run(
        wrong_step, repl.replicate((params, tx.init(params))), repl.shard_batch(batches[0])
    )
    assert not np.allclose(state[0]["w1"], expected["w1"], rtol=1e-3)


@pytest.mark.filterwarnings("ignore:repl.run traced")  # no loss here at all
def test_varying_gradients_are_summed_by_the_wrapper():
    # A gradient computed per replica (not through autodiff of a mirrored input)
    # still varies, and the wrapper must all-reduce it.
    repl = rp.Replicator()
    tx = repl.wrap_optimizer(optax.sgd(1.0))
    w = jnp.zeros(())

    def step(w, x):
        updates, _ = tx.update(jnp.sum(x), tx.init(w), w)
        return optax.apply_updates(w, updates)

    new_w = repl.run(step, repl.replicate(w), repl.shard_batch(np.arange(8.0, dtype=np.float32)))
    assert new_w.shape == ()
    assert float(new_w) == -28.0


def test_outputs_mirrored_or_stacked():
    repl = rp.Replicator()

    def step(params, batch):
        return {
            "params": params * 2,
            "per_replica": batch.sum(),
            "rows": batch,
            "mean": repl.reduce(rp.ReduceOp.MEAN, batch.sum()),
        }

    out = repl.run(
        step,
        repl.replicate(jnp.ones(3)),
        repl.shard_batch(np.arange(16.0, dtype=np.float32).reshape(16, 1)),
    )
    assert out["params"].shape == (3,)
    np.testing.assert_allclose(out["per_replica"], np.arange(16.0).reshape(8, 2).sum(1))
    assert out["rows"].shape == (8, 2, 1)
    assert out["mean"].shape == () and float(out["mean"]) == pytest.approx(120.0 / 8)


def test_one_compile_per_step_function():
    repl = rp.Replicator()
    traces = []

    def step(w, b):
        traces.append(1)
        return w + repl.reduce(rp.ReduceOp.MEAN, b.mean())  # mirrored, so w keeps its shape

    w = repl.replicate(jnp.zeros(()))
    for _ in range(4):
        w = repl.run(step, w, repl.shard_batch(np.ones(8, np.float32)))
    assert len(repl._run_cache) == 1
    ((jitted, _),) = repl._run_cache.values()
    assert jitted._cache_size() == 1
    assert len(traces) == 2  # one probe of which outputs vary, one real trace


def test_steps_in_flight_are_bounded():
    repl = rp.Replicator(max_steps_in_flight=2)
    finished = []
    lock = threading.Lock()

    def slow(x):
        time.sleep(0.05)
        with lock:
            finished.append(1)
        return x

    def step(x):
        return io_callback(slow, jax.ShapeDtypeStruct((), jnp.float32), x.sum(), ordered=False)

    step = repl.compile(step)
    x = repl.shard_batch(np.ones(8, np.float32))
    for dispatched in range(1, 11):
        step(x)
        assert dispatched - len(finished) <= 2
    repl.wait()
    assert len(finished) == 10


def test_distribute_prefetches_and_reraises():
    repl = rp.Replicator()
    batches = [np.full((8, 2), i, np.float32) for i in range(5)]
    got = [np.asarray(b) for b in repl.distribute(iter(batches))]
    assert len(got) == 5 and all((g == b).all() for g, b in zip(got, batches))

    def broken():
        yield np.zeros((8,), np.float32)
        raise OSError("disk gone")

    it = repl.distribute(broken())
    next(it)
    with pytest.raises(OSError, match="disk gone"):
        next(it)


def test_context_activates_the_mesh():
    repl = rp.Replicator(mesh={"data": 4, "tensor": 2})
    with repl.context():
        assert jax.sharding.get_abstract_mesh().axis_names == ("data", "fsdp", "tensor")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"devices": []}, "empty"),
        ({"mesh": {"data": 3}}, "3 devices but 8"),
        ({"mesh": {"data": -1, "tensor": 3}}, "multiply to 3.*8 devices"),
        ({"mesh": {"dat": -1}}, "Unknown mesh axes"),
        ({"mesh": {"data": -1, "fsdp": -1}}, "Only one mesh axis"),
        ({"precision": "fp8"}, "Unknown precision"),
    ],
)
def test_bad_construction_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rp.Replicator(**kwargs)


def test_indivisible_batch_names_the_numbers():
    repl = rp.Replicator()
    with pytest.raises(ValueError, match="12 examples.*8 replicas"):
        repl.shard_batch(np.zeros((12, 3)))
    with pytest.raises(ValueError, match="same leading"):
        repl.shard_batch({"a": np.zeros((8, 3)), "b": np.zeros((16,))})


def test_reduce_rejects_mirrored_values():
    repl = rp.Replicator()
    with pytest.raises(ValueError, match="leading axis of size 8"):
        repl.reduce(rp.ReduceOp.SUM, jnp.ones(3))
