"""ZeRO inside `repl.run`: sharded parameters and optimizer state stay sharded, and a
step equals the same step on one device (SGD and Adam: an extra psum would show)."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.parallel import sharding as sh
from tests.compare import assert_trained_alike

RULES = [("embed", "fsdp"), ("mlp", "tensor")]
MESHES = {
    "cube": {"data": 2, "fsdp": 2, "tensor": 2},
    "fsdp8": {"data": 1, "fsdp": 8},
    "data4_fsdp2": {"data": 4, "fsdp": 2},
    "data4_tensor2": {"data": 4, "tensor": 2},  # split over tensor only: mirrored to run
}
KERNEL_SPECS = {
    "cube": P("fsdp", "tensor"),
    "fsdp8": P("fsdp"),
    "data4_fsdp2": P("fsdp"),
    "data4_tensor2": P(None, "tensor"),
}


class MLP(nn.Module):
    """128 -> 512 -> 128 -> 128, annotated; the last kernel is square (shapes collide)."""

    @nn.compact
    def __call__(self, x):
        kernel = lambda *names: nn.with_logical_partitioning(  # noqa: E731
            nn.initializers.lecun_normal(), names
        )
        h = nn.Dense(512, kernel_init=kernel("embed", "mlp"), name="fc")(x)
        h = nn.Dense(128, kernel_init=kernel("mlp", "embed"), name="proj")(nn.gelu(h))
        return nn.Dense(128, kernel_init=kernel("embed", "out"), name="head")(h)


def loss_fn(params, batch):
    out = MLP().apply({"params": params}, batch["x"])
    return rp.compute_average_loss(jnp.mean((out - batch["y"]) ** 2, axis=-1))


def batches(n, size=16):
    rng = np.random.default_rng(0)
    for _ in range(n):
        yield {
            "x": rng.normal(size=(size, 128)).astype(np.float32),
            "y": rng.normal(size=(size, 128)).astype(np.float32),
        }


def one_device(tx, steps, grad_accum_steps=1):
    """The same training on one device, plain optax, a mean over the global batch."""

    def step(state, batch):
        def loss(p):
            out = MLP().apply({"params": p}, batch["x"])
            return jnp.mean(jnp.mean((out - batch["y"]) ** 2, axis=-1))

        grads = jax.grad(loss)(state.params)
        return state.apply_gradients(grads, tx)

    state = make_state(tx, jax.random.key(0))
    for batch in batches(steps):
        state = jax.jit(step)(state, batch)
    return state


def make_state(tx, key, grad_accum_steps=1):
    params = MLP().init(key, jnp.zeros((1, 128)))["params"]
    return rp.TrainState.create(params, tx, key, grad_accum_steps=grad_accum_steps)


# Adam turns the last bits of a near-zero gradient into a step of up to its learning
# rate (tests/compare.py); SGD keeps them small, and is the one an extra psum (N times
# the step) fails.
OPTIMIZERS = {"sgd": (lambda: optax.sgd(0.1), False), "adam": (lambda: optax.adam(1e-2), True)}
# make test runs every mesh and both optimizers (the rest: make test-slow).
SLOW_CASES = {("sgd", "cube"), ("sgd", "data4_tensor2"), ("adam", "data4_fsdp2"),
              ("adam", "data4_tensor2")}  # fmt: skip
assert all(t in OPTIMIZERS and m in MESHES for t, m in SLOW_CASES), SLOW_CASES  # none stale


@pytest.mark.parametrize(
    "tx_name, mesh_name",
    [
        pytest.param(t, m, marks=[pytest.mark.slow] if (t, m) in SLOW_CASES else [])
        for t in OPTIMIZERS
        for m in MESHES
    ],
)
def test_run_keeps_the_state_sharded_and_equals_one_device(tx_name, mesh_name):
    make_tx, adam = OPTIMIZERS[tx_name]
    repl = rp.Replicator(mesh=MESHES[mesh_name], rules=RULES)
    tx = repl.wrap_optimizer(make_tx())
    state = repl.init(lambda key: make_state(tx, key), jax.random.key(0))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    kernel = state.params["fc"]["kernel"].value.sharding
    assert kernel.spec == KERNEL_SPECS[mesh_name]
    for moment in ("mu", "nu"):  # Adam's moments follow their parameters
        if hasattr(state.opt_state[0], moment):
            assert getattr(state.opt_state[0], moment)["fc"]["kernel"].value.sharding == kernel

    def step(state, batch):
        loss, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx), loss

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to a whole-leaf update
        for batch in batches(3):
            state, _ = repl.run(step, state, repl.shard_batch(batch), donate_argnums=(0,))
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
        assert x.sharding == s  # every parameter and optimizer-state leaf, as it came in
    assert sh.bytes_per_device(state) < 0.6 * sh.bytes_per_device(jax.device_get(state))
    want = one_device(make_tx(), 3)
    numbers = lambda tree: [  # noqa: E731
        np.asarray(x) for x in jax.tree.leaves(tree)
        if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    ]  # fmt: skip
    if adam:  # 3 steps of at most the learning rate each, in a rare element
        assert_trained_alike(numbers(state), numbers(want), atol=1e-5, worst=3e-2)
    else:
        for a, b in zip(numbers(state), numbers(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_one_replica_with_tensor_parallelism_runs_whole_with_a_warning():
    """data=1, fsdp=1, tensor=8: XLA cannot partition a manual subgroup of one replica,
    so run computes the step whole on every tensor device, says so, stays exact,
    and the state keeps its tensor sharding between steps."""
    repl = rp.Replicator(mesh={"data": 1, "fsdp": 1, "tensor": 8}, rules=RULES)
    state = train_expecting_a_warning(repl, lambda: optax.sgd(0.1), "one replica", atol=1e-6)
    assert state.params["fc"]["kernel"].value.sharding.spec == P(None, "tensor")


def train_expecting_a_warning(repl, make_tx, match, atol, steps=2):
    """``steps`` steps of the test MLP under ``repl.run``, which warns ``match``: the state
    keeps its shardings and the parameters equal one device's."""
    tx = repl.wrap_optimizer(make_tx())
    state = repl.init(lambda key: make_state(tx, key), jax.random.key(0))
    shardings = jax.tree.map(lambda x: x.sharding, state)

    def step(state, batch):
        loss, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx), loss

    with pytest.warns(UserWarning, match=match):
        for batch in batches(steps):
            state, _ = repl.run(step, state, repl.shard_batch(batch))
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
        assert x.sharding == s
    want = one_device(make_tx(), steps)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=atol)
    return state


def collective_bytes(hlo: str, op: str) -> int:
    """The bytes a compiled program's ``op`` collectives (all-gather, all-reduce,
    reduce-scatter) produce: the size of their results."""
    total = 0
    for line in hlo.splitlines():
        found = re.search(rf" = (.*?) {op}(?:-start)?\(", line)
        if found:
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", found.group(1)):
                size = np.dtype({"f32": "float32", "bf16": "bfloat16"}.get(dtype, "int32"))
                total += size.itemsize * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_zero_gathers_parameters_once_and_reduce_scatters_gradients(grad_accum_steps):
    """ZeRO's traffic inside run's step on fsdp=8: the parameters all-gathered once for
    the forward pass; their gradients reduce-scattered (each device receives 1/8),
    once per step even with microbatches; Adam's moments and the updates never
    gathered; only the small replicated biases all-reduced."""
    repl = rp.Replicator(mesh=MESHES["fsdp8"], rules=RULES)
    tx = repl.wrap_optimizer(optax.adam(1e-2))
    state = repl.init(lambda key: make_state(tx, key, grad_accum_steps), jax.random.key(0))

    def step(state, batch):
        loss, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx), loss

    batch = repl.shard_batch(next(batches(1)))
    hlo = repl.lower(step, state, batch, donate_argnums=(0,)).compile().as_text()
    leaves = jax.tree.leaves(state.params)
    sharded = [x for x in leaves if not x.sharding.is_fully_replicated]
    whole_bytes = sum(x.size * 4 for x in sharded)
    assert len(sharded) == 3  # the kernels
    assert collective_bytes(hlo, "all-gather") == whole_bytes  # once, for the forward pass
    assert collective_bytes(hlo, "reduce-scatter") == whole_bytes // 8  # the gradients' slices
    replicated = sum(x.size * 4 for x in leaves if x.sharding.is_fully_replicated)
    assert collective_bytes(hlo, "all-reduce") <= replicated + 8  # biases, the finite flag


@pytest.mark.parametrize("grad_accum_steps", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_what_the_step_reads_is_what_it_reads_unsharded(grad_accum_steps):
    """The optimizer reduce-scatters unsummed gradients, yet the step still reads the
    summed whole gradient (its norm), and a value of the parameters alone comes
    back mirrored, not per replica: sharded equals unsharded."""

    def train(mesh):
        repl = rp.Replicator(mesh=mesh, rules=RULES)
        tx = repl.wrap_optimizer(optax.sgd(0.1))

        def step(state, batch):
            def loss(params, batch):
                return loss_fn(params, batch), optax.global_norm(params)

            (loss, weight_norm), grads = state.value_and_grad(loss, batch, has_aux=True)
            return state.apply_gradients(grads, tx), optax.global_norm(grads), weight_norm

        state = repl.init(lambda key: make_state(tx, key, grad_accum_steps), jax.random.key(0))
        return repl.run(step, state, repl.shard_batch(next(batches(1))))

    out = {name: train(mesh) for name, mesh in [("cube", MESHES["cube"]), ("data8", {"data": 8})]}
    (state, grad_norm, weight_norm), (want, want_grad_norm, want_weight_norm) = out.values()
    assert grad_norm.shape == weight_norm.shape == ()  # mirrored, as unsharded
    np.testing.assert_allclose(grad_norm, want_grad_norm, rtol=1e-5)
    np.testing.assert_allclose(weight_norm, want_weight_norm, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_updates_inside_a_cond_branch_and_after_it():
    """The reduce-scattered gradients belong to the update that made them: an update
    traced inside a ``lax.cond`` branch (once in each branch, and again after the
    cond) never hands its slices to another (they would be tracers of the wrong
    trace)."""

    def step(state, batch):
        loss, grads = state.value_and_grad(loss_fn, batch)
        pick = lambda s: s.apply_gradients(grads, tx)  # noqa: E731
        state = jax.lax.cond(loss > 0, pick, lambda s: pick(s).replace(rng=s.rng), state)
        return state.apply_gradients(grads, tx), loss

    out = []
    for mesh in (MESHES["data4_fsdp2"], {"data": 8}):
        repl = rp.Replicator(mesh=mesh, rules=RULES)
        tx = repl.wrap_optimizer(optax.sgd(0.1))
        state = repl.init(lambda key: make_state(tx, key), jax.random.key(0))  # noqa: B023
        out.append(repl.run(step, state, repl.shard_batch(next(batches(1))))[0])
    for a, b in zip(jax.tree.leaves(out[0].params), jax.tree.leaves(out[1].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_non_elementwise_optimizer_is_exact_with_a_warning():
    """A global-norm clip over slices would clip by a slice's norm; the update runs whole."""
    make_tx = lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))  # noqa: E731
    repl = rp.Replicator(mesh=MESHES["cube"], rules=RULES)
    train_expecting_a_warning(repl, make_tx, "not elementwise per parameter", atol=2e-4)


def test_gradient_accumulation_on_a_sharded_mesh_equals_one_big_batch():
    repl = rp.Replicator(mesh=MESHES["cube"], rules=RULES)
    tx = repl.wrap_optimizer(optax.sgd(0.1))
    states = {
        k: repl.init(lambda key, k=k: make_state(tx, key, k), jax.random.key(0)) for k in (1, 2)
    }

    def step(state, batch):
        loss, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx), loss

    (batch,) = batches(1, size=32)
    out = {k: repl.run(step, s, repl.shard_batch(batch)) for k, s in states.items()}
    for a, b in zip(jax.tree.leaves(out[1][0].params), jax.tree.leaves(out[2][0].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.sum(out[1][1]), np.sum(out[2][1]), rtol=1e-5)


def test_a_parameter_sharded_over_fsdp_alone_is_not_taken_for_a_batch():
    """On data=1, fsdp=8 a kernel split on its first axis looks like a batch's layout."""
    repl = rp.Replicator(mesh={"data": 1, "fsdp": 8})
    assert repl.axis_name == ("fsdp",)
    w = repl.init(lambda: {"w": jnp.arange(256 * 128.0).reshape(256, 128)})["w"]
    assert w.sharding.spec == P("fsdp")
    x = repl.shard_batch(np.ones((8, 256), np.float32))
    rows = repl.run(lambda w, x: (x @ w)[:, 0], w, x)  # each replica: its row, the whole w
    column = np.arange(256 * 128.0).reshape(256, 128)[:, 0]
    np.testing.assert_allclose(np.asarray(rows).reshape(-1), np.full(8, column.sum()))


def test_a_parameter_split_over_all_replicas_like_a_batch_is_not_taken_for_one(tmp_path):
    """A rule may split a parameter's first axis over ("data", "fsdp"), exactly as a
    batch is split: what `repl.init` made is known to be a parameter, and so is
    what run returns for it and a checkpoint restores into it."""
    repl = rp.Replicator(mesh={"data": 2, "fsdp": 4}, rules=[("w", (("data", "fsdp"), None))])
    tx = repl.wrap_optimizer(optax.sgd(0.1))
    state = repl.init(lambda: {"w": jnp.arange(256 * 128.0).reshape(256, 128) / 1e4})
    assert state["w"].sharding.spec == P(("data", "fsdp"))

    def step(params, x):
        grads = jax.grad(lambda p: rp.compute_average_loss(jnp.sum(x @ p["w"], -1)))(params)
        return optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])

    x = repl.shard_batch(np.ones((16, 256), np.float32))
    once = repl.run(step, state, x)
    with rp.Checkpoints(tmp_path, repl) as checkpoints:
        checkpoints.save(1, once)
        checkpoints.wait()
        once = checkpoints.restore(like=once)
    twice = repl.run(step, once, x)
    assert twice["w"].sharding.spec == P(("data", "fsdp"))
    np.testing.assert_allclose(
        np.asarray(twice["w"]), np.asarray(state["w"]) - 0.2, rtol=1e-5, atol=1e-6
    )


def test_gradients_pair_with_their_parameters_by_path_when_shapes_collide():
    """Square kernels sharded on different axes, and an update not told the parameters:
    each gradient still gets its own parameter's slicing (by key path), so no warning."""
    repl = rp.Replicator(
        mesh={"fsdp": 8}, rules=[(r".*a", ("fsdp", None)), (r".*b", (None, "fsdp"))]
    )
    tx = repl.wrap_optimizer(optax.sgd(0.1))
    params = repl.init(lambda: {"a": jnp.ones((128, 128)), "b": jnp.full((128, 128), 2.0)})

    def step(params, x):
        grads = jax.grad(lambda p: rp.compute_average_loss(jnp.sum(x @ p["a"] @ p["b"], -1)))(
            params
        )
        updates, _ = tx.update(grads, tx.init(params))  # no params passed
        return optax.apply_updates(params, updates)

    x = repl.shard_batch(np.ones((8, 128), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = repl.run(step, params, x)
    assert out["a"].sharding.spec == P("fsdp") and out["b"].sharding.spec == P(None, "fsdp")
    plain = jax.grad(lambda p: jnp.mean(jnp.sum(np.ones((8, 128)) @ p["a"] @ p["b"], -1)))(
        jax.device_get(params)
    )
    for key in "ab":
        np.testing.assert_allclose(
            np.asarray(out[key]), np.asarray(params[key]) - 0.1 * plain[key], rtol=1e-5
        )


class Colliding(nn.Module):
    """Two kernels whose fsdp=8 slices share one shape, split on different axes, and a
    kernel left frozen: the optimizer state is no tree of the gradients' shape, so each
    slice is known by its path, not its shape (as LoRA's adapters are)."""

    @nn.compact
    def __call__(self, x):
        def kernel(name, shape, names):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
            return self.param(name, init, shape)

        a = kernel("a", (64, 128), ("embed", None))  # slices [8, 128]
        b = kernel("b", (8, 1024), (None, "embed"))  # slices [8, 128] too
        frozen = kernel("frozen", (128, 8), (None, None))
        return jnp.tanh(x @ a) @ frozen @ b


def test_slices_of_one_shape_split_differently_update_by_their_paths():
    def labels(params):
        return {name: "frozen" if name == "frozen" else "train" for name in params}

    def make_tx():
        return optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()},
                                     labels)  # fmt: skip

    def loss(params, batch):
        out = Colliding().apply({"params": params}, batch["x"])
        return jnp.mean((out - batch["y"]) ** 2, axis=-1)

    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(16, 64)).astype(np.float32),
             "y": rng.normal(size=(16, 1024)).astype(np.float32)} for _ in range(3)]  # fmt: skip
    init = lambda key, tx: rp.TrainState.create(  # noqa: E731
        Colliding().init(key, jnp.zeros((1, 64)))["params"], tx, key
    )
    repl = rp.Replicator(mesh={"data": 1, "fsdp": 8}, rules=[("embed", "fsdp")])
    tx = repl.wrap_optimizer(make_tx())
    state = repl.init(lambda key: init(key, tx), jax.random.key(0))

    def step(state, batch):
        _, grads = state.value_and_grad(lambda p, b: rp.compute_average_loss(loss(p, b)), batch)
        return state.apply_gradients(grads, tx)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to a whole-leaf update
        for batch in data:
            state = repl.run(step, state, repl.shard_batch(batch))
    want, plain = init(jax.random.key(0), make_tx()), make_tx()
    for batch in data:
        grads = jax.grad(lambda p, b=batch: jnp.mean(loss(p, b)))(want.params)
        want = want.apply_gradients(grads, plain)
    got, expected = nn.meta.unbox(state.params), nn.meta.unbox(want.params)
    np.testing.assert_array_equal(got["frozen"], expected["frozen"])
    for name in ("a", "b"):
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-4, atol=1e-5)
