"""DiLoCo (`rp.DiLoCo`): islands that train apart and meet every H steps.

The invariants of the issue: H=1 with SGD inside and a plain outer SGD step is
data parallelism; one island with outer SGD(lr=1) is the inner optimizer alone;
after every sync all islands hold the outer parameters bitwise; parameter-sized
traffic crosses islands only inside the sync.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.parallel import diloco as diloco
from tests.compare import assert_trained_alike


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name="fc1")(x))
        x = nn.relu(nn.Dense(32, name="fc2")(x))
        return nn.Dense(4, name="head")(x)


def loss_fn(params, batch):
    out = MLP().apply({"params": params}, batch["x"])
    return rp.compute_average_loss(jnp.mean((out - batch["y"]) ** 2, axis=-1))


def batches(n, size=32, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(size, 16)).astype(np.float32),
            "y": rng.normal(size=(size, 4)).astype(np.float32),
        }
        for _ in range(n)
    ]


def train(mesh, inner, sync=None, steps=4, grad_accum_steps=1, every=None):
    """Trains the MLP with ``repl.run``; returns the final state (and ``every(i, state)``)."""
    repl = rp.Replicator(mesh=mesh)
    tx = repl.wrap_optimizer(inner, sync=sync)

    def step(state, batch):
        loss, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx), loss

    params = MLP().init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    state = repl.replicate(
        rp.TrainState.create(params, tx, jax.random.key(0), grad_accum_steps=grad_accum_steps)
    )
    for i, batch in enumerate(batches(steps)):
        state, _ = repl.run(step, state, repl.shard_batch(batch), donate_argnums=(0,))
        if every is not None:
            every(i + 1, state)
    return state


def close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


ISLANDS = {"data": 4, "fsdp": 2}  # 4 islands of 2 replicas


def test_one_inner_step_and_a_plain_outer_step_is_data_parallelism():
    sync = rp.DiLoCo(inner_steps=1, outer_optimizer=optax.sgd(1.0))
    got = train(ISLANDS, optax.sgd(0.1), sync)
    want = train(ISLANDS, optax.sgd(0.1))
    close(got.opt_state.outer_params, want.params, atol=1e-6)
    for row in range(4):  # every island restarts from the outer parameters
        close([x[row] for x in jax.tree.leaves(got.params)], want.params, atol=1e-6)


def test_one_island_with_outer_sgd_is_the_inner_optimizer_alone():
    mesh = {"data": 1, "fsdp": 8}
    sync = rp.DiLoCo(inner_steps=3, outer_optimizer=optax.sgd(1.0))
    got = train(mesh, optax.adam(1e-2), sync, steps=5)
    want = train(mesh, optax.adam(1e-2), steps=5)
    # The outer step's rounding reaches the gradients: Adam may amplify it (tests/compare.py).
    assert_trained_alike(got.params, want.params, atol=1e-6, worst=1e-2)
    close(got.opt_state.inner, want.opt_state, atol=1e-6)  # the inner state is kept


def test_islands_hold_the_outer_parameters_bitwise_after_every_sync():
    seen = {}

    def every(i, state):
        outer = state.opt_state.outer_params
        rows_equal = [
            all(np.array_equal(np.asarray(p[r]), np.asarray(o))
                for p, o in zip(jax.tree.leaves(state.params), jax.tree.leaves(outer)))
            for r in range(4)
        ]  # fmt: skip
        seen[i] = (all(rows_equal), bool(state.opt_state.synced[0]))

    train(ISLANDS, optax.adam(1e-2), rp.DiLoCo(inner_steps=3), steps=7, every=every)
    assert seen == {
        1: (False, False), 2: (False, False), 3: (True, True),
        4: (False, False), 5: (False, False), 6: (True, True), 7: (False, False),
    }  # fmt: skip


def test_gradient_accumulation_equals_one_big_batch():
    sync = rp.DiLoCo(inner_steps=2)
    got = train(ISLANDS, optax.sgd(0.1), sync, steps=4, grad_accum_steps=2)
    want = train(ISLANDS, optax.sgd(0.1), sync, steps=4)
    close(got.params, want.params, atol=1e-6)
    close(got.opt_state.outer_params, want.opt_state.outer_params, atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_islands(precision):
    """Under a bf16/fp16 policy the model computes in 16 bits, the parameters, the
    outer parameters and the sync stay float32, and fp16's loss scale is one for all."""
    repl = rp.Replicator(mesh=ISLANDS, precision=precision)
    tx = repl.wrap_optimizer(optax.adam(1e-2), sync=rp.DiLoCo(inner_steps=2))
    model = repl.apply_policy(MLP())

    def step(state, batch):
        def loss(params, batch):
            out = model.apply({"params": params}, batch["x"]).astype(jnp.float32)
            return rp.compute_average_loss(jnp.mean((out - batch["y"]) ** 2, axis=-1))

        value, grads = state.value_and_grad(loss, batch)
        return state.apply_gradients(grads, tx), value

    params = MLP().init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    state = repl.replicate(
        rp.TrainState.create(params, tx, jax.random.key(0), policy=repl.precision)
    )
    for batch in batches(4):
        state, loss = repl.run(step, state, repl.shard_batch(batch), donate_argnums=(0,))
    assert np.isfinite(np.asarray(loss)).all()
    for tree in (state.params, state.opt_state.outer_params):
        assert {x.dtype for x in jax.tree.leaves(tree)} == {jnp.dtype(jnp.float32)}
    for p, o in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state.outer_params)):
        for row in range(4):  # step 4 synced: every island holds the outer parameters
            np.testing.assert_array_equal(np.asarray(p[row]), np.asarray(o))
    if precision == "fp16":
        assert np.shape(state.loss_scale.scale) == ()  # one scale, agreed by all islands


def test_bfloat16_parameters_keep_a_float32_outer_state():
    repl = rp.Replicator(mesh=ISLANDS)
    tx = repl.wrap_optimizer(optax.sgd(0.1), sync=rp.DiLoCo(inner_steps=2))

    def step(state, batch):
        _, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx)

    params = MLP().init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    state = repl.replicate(rp.TrainState.create(params, tx, jax.random.key(0)))
    for batch in batches(4):
        state = repl.run(step, state, repl.shard_batch(batch), donate_argnums=(0,))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state.opt_state.outer)} == {jnp.dtype(jnp.float32)}


def test_fragments_sync_in_turn():
    sync = rp.DiLoCo(inner_steps=4, fragments=2, outer_optimizer=optax.sgd(1.0))
    log = {}

    def every(i, state):
        groups = diloco.fragment_leaves(state.opt_state.outer_params, 2)
        params, outer = jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state.outer_params)
        equal = [
            all(np.array_equal(np.asarray(params[j][r]), np.asarray(outer[j]))
                for j in g for r in range(4))
            for g in groups
        ]  # fmt: skip
        log[i] = (list(np.asarray(state.opt_state.synced)), equal)

    train(ISLANDS, optax.sgd(0.1), sync, steps=4, every=every)
    assert log[1] == ([False, False], [False, False])
    assert log[2] == ([False, True], [False, True])  # fragment 1, H/2 steps early
    assert log[3] == ([False, False], [False, False])
    assert log[4] == ([True, False], [True, False])


def test_fragments_split_the_leaves_evenly():
    params = {"a": np.zeros(100), "b": np.zeros(10), "c": np.zeros(90), "d": np.zeros(5)}
    assert diloco.fragment_leaves(params, 1) == [[0, 1, 2, 3]]
    assert diloco.fragment_leaves(params, 2) == [[0, 1], [2, 3]]  # 110 and 95
    assert diloco.fragment_leaves(params, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="only 4 leaves"):
        diloco.fragment_leaves(params, 5)


def test_overlapped_outer_gradient_lands_later_and_mixes():
    sync = rp.DiLoCo(inner_steps=2, overlap_steps=1, outer_optimizer=optax.sgd(1.0), mix=0.5)
    outer = {}

    def every(i, state):
        outer[i] = jax.device_get(jax.tree.leaves(state.opt_state.outer_params))

    train(ISLANDS, optax.sgd(0.1), sync, steps=4, every=every)
    unchanged = lambda a, b: all(np.array_equal(x, y) for x, y in zip(outer[a], outer[b]))
    assert unchanged(1, 2)  # sent at step 2 ...
    assert not unchanged(2, 3)  # ... applied at step 3
    assert unchanged(3, 4)


def test_narrow_outer_gradient_is_close_to_float32():
    wide = train(ISLANDS, optax.adam(1e-2), rp.DiLoCo(inner_steps=2))
    narrow = train(ISLANDS, optax.adam(1e-2), rp.DiLoCo(inner_steps=2, outer_dtype="bfloat16"))
    close(narrow.opt_state.outer_params, wide.opt_state.outer_params, atol=2e-3)


# ------------------------------------------------------------------- the HLO


def step_hlo(sync, optimized=True):
    repl = rp.Replicator(mesh=ISLANDS)
    tx = repl.wrap_optimizer(optax.sgd(0.1), sync=sync)

    def step(state, batch):
        loss, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx), loss

    params = MLP().init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    state = repl.replicate(rp.TrainState.create(params, tx, jax.random.key(0)))
    batch = repl.shard_batch(batches(1)[0])
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    lowered = repl.lower(step, state, batch)
    hlo = lowered.compile().as_text() if optimized else lowered.as_text(dialect="hlo")
    return hlo, param_bytes, repl.mesh


def test_parameter_sized_traffic_crosses_islands_only_in_the_sync():
    hlo, param_bytes, mesh = step_hlo(rp.DiLoCo(inner_steps=8))
    got = diloco.traffic(hlo, mesh, "data")
    ring = 2 * param_bytes * 3 / 4  # one all-reduce of the parameters' size over 4 islands
    # Outside the sync, only scalars cross (the agreed "all finite").
    assert got["every_step"] <= 16
    assert got["in_branches"] == pytest.approx(ring, rel=0.01)
    # Data parallelism all-reduces the gradients across everything, every step.
    dp, _, _ = step_hlo(None)
    assert diloco.traffic(dp, mesh, "data")["every_step"] >= ring
    # bfloat16 outer gradients: half the bytes (as lowered: XLA:CPU computes bfloat16
    # in float32, collectives included; GPUs and TPUs send it as it is).
    narrow, _, _ = step_hlo(rp.DiLoCo(inner_steps=8, outer_dtype="bfloat16"), optimized=False)
    got = diloco.traffic(narrow, mesh, "data")["in_branches"]
    assert got == pytest.approx(ring / 2, rel=0.02)


# ------------------------------------------------------------------- errors


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="inner_steps"):
        rp.DiLoCo(inner_steps=0)
    with pytest.raises(ValueError, match="fragments"):
        rp.DiLoCo(inner_steps=4, fragments=5)
    with pytest.raises(ValueError, match="overlap_steps"):
        rp.DiLoCo(inner_steps=4, overlap_steps=4)
    repl = rp.Replicator(mesh=ISLANDS)
    with pytest.raises(ValueError, match="replica axes"):
        repl.wrap_optimizer(optax.sgd(0.1), sync=rp.DiLoCo(inner_steps=2, axis="tensor"))
    with pytest.raises(TypeError, match="rp.DiLoCo"):
        repl.wrap_optimizer(optax.sgd(0.1), sync="diloco")


def test_compile_equals_run():
    """Under compile each island's step is the global view of its batch (one program
    manual over the island axis): the same training as per replica under run."""

    def train_on(path):
        repl = rp.Replicator(mesh=ISLANDS)
        tx = repl.wrap_optimizer(optax.adam(1e-2), sync=rp.DiLoCo(inner_steps=2))

        def regularized(params, batch):  # an L2 term counts once, on both paths
            l2 = sum(jnp.sum(p**2) for p in jax.tree.leaves(params))
            return loss_fn(params, batch) + rp.scale_regularization_loss(1e-2 * l2)

        def step(state, batch):
            loss, grads = state.value_and_grad(regularized, batch)
            return state.apply_gradients(grads, tx), repl.reduce(rp.ReduceOp.SUM, loss)

        params = MLP().init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
        state = repl.replicate(rp.TrainState.create(params, tx, jax.random.key(0)))
        compiled = repl.compile(step, donate_argnums=(0,))
        losses = []
        for batch in batches(5):
            batch = repl.shard_batch(batch)
            if path == "compile":
                state, loss = compiled(state, batch)
            else:
                state, loss = repl.run(step, state, batch, donate_argnums=(0,))
            losses.append(float(loss))
        return state, losses

    (a, loss_a), (b, loss_b) = train_on("run"), train_on("compile")
    assert jax.tree.leaves(b.params)[0].shape[0] == 4  # one row per island, as under run
    close(a.params, b.params, atol=1e-6)
    close(a.opt_state.outer_params, b.opt_state.outer_params, atol=1e-6)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)


def test_a_step_compiled_before_the_optimizer_was_wrapped_still_runs_per_island():
    repl = rp.Replicator(mesh=ISLANDS)
    txs = []

    def step(state, batch):
        _, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, txs[0])

    compiled = repl.compile(step, donate_argnums=(0,))  # before wrap_optimizer(sync=...)
    txs.append(repl.wrap_optimizer(optax.sgd(0.1), sync=rp.DiLoCo(inner_steps=1)))
    params = MLP().init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    state = repl.replicate(rp.TrainState.create(params, txs[0], jax.random.key(0)))
    state = compiled(state, repl.shard_batch(batches(1)[0]))
    assert jax.tree.leaves(state.params)[0].shape[0] == 4  # one row per island
    for p, o in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state.outer_params)):
        np.testing.assert_array_equal(np.asarray(p[1]), np.asarray(o))  # synced (H=1)


def test_the_island_layout_travels_with_the_state_not_the_replicator():
    """wrap_optimizer leaves its Replicator as it was: the state says where its islands
    are, so a Replicator that never wrapped the optimizer trains it the same, bitwise."""
    wrapper = rp.Replicator(mesh=ISLANDS)
    tx = wrapper.wrap_optimizer(optax.adam(1e-2), sync=rp.DiLoCo(inner_steps=2))

    def step(state, batch):
        _, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx)

    params = MLP().init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    finals = []
    for repl in (wrapper, rp.Replicator(mesh=ISLANDS)):
        state = repl.replicate(rp.TrainState.create(params, tx, jax.random.key(0)))
        assert state.opt_state.island_axis == "data"
        compiled = repl.compile(step)
        for i, batch in enumerate(batches(3)):
            batch = repl.shard_batch(batch)
            state = compiled(state, batch) if i == 1 else repl.run(step, state, batch)
        assert jax.tree.leaves(state.params)[0].shape[0] == 4  # one row per island
        finals.append(jax.device_get(state))
    for x, y in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1])):
        if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(x, y)


def test_outer_view_holds_the_outer_parameters():
    state = train(ISLANDS, optax.sgd(0.1), rp.DiLoCo(inner_steps=3), steps=2)
    view = diloco.outer_view(state)
    assert jax.tree.map(jnp.shape, view.params) == jax.tree.map(
        jnp.shape, state.opt_state.outer_params
    )
    assert view.params is state.opt_state.outer_params


# ------------------------------------------------------------- the trainer


def diloco_config(**overrides):
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = f"{root}/configs/digits_cnn_diloco.py"
    spec = importlib.util.spec_from_file_location("digits_cnn_diloco", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    config.update(overrides)
    return config


def final_state(workdir, config):
    from replicator.trainer.setup import setup

    run = setup(config)
    ckpt = rp.Checkpoints(f"{workdir}/checkpoints", run.repl, read_only=True)
    try:
        return ckpt.restore(like=run.abstract_state)
    finally:
        ckpt.close()
        run.close()


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_trainer_resumes_exactly_and_evaluates_the_outer_parameters(tmp_path, digits_data_dir):
    from replicator import trainer

    config = diloco_config(data_dir=digits_data_dir, num_train_steps=6)
    straight = trainer.train_and_evaluate(config, str(tmp_path / "straight"), quiet=True)
    # Stopped at step 2 (a checkpoint between syncs), then resumed to 6.
    part = diloco_config(data_dir=digits_data_dir, num_train_steps=2)
    trainer.train_and_evaluate(part, str(tmp_path / "resumed"), quiet=True)
    resumed = trainer.train_and_evaluate(config, str(tmp_path / "resumed"), quiet=True)
    assert resumed == straight
    a, b = final_state(tmp_path / "straight", config), final_state(tmp_path / "resumed", config)
    data = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(data(x), data(y))
    assert jax.tree.leaves(a.params)[0].shape[0] == 4  # one row per island

    # eval restores only the outer parameters and gets what training reported.
    got = trainer.evaluate(None, str(tmp_path / "straight"))
    assert got["step"] == 6
    assert got["accuracy"] == straight["accuracy"]
    assert got["loss"] == pytest.approx(straight["loss"], rel=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(diloco={"inner_step": 2}), r"unknown keys \['inner_step'\]"),
        (dict(diloco={"axis": "data"}), "needs inner_steps"),
        (dict(diloco={"inner_steps": 0}), r"config.diloco: DiLoCo\(inner_steps=0\)"),
        (dict(diloco={"inner_steps": 2, "elastic": True}), "custom loop"),
    ],
)
def test_bad_diloco_configs_are_named(digits_data_dir, overrides, message):
    from replicator.trainer.setup import setup

    config = diloco_config(data_dir=digits_data_dir)
    for key, value in overrides.items():
        setattr(config, key, value)  # replaces (update would merge into the dict)
    with pytest.raises(ValueError, match=message):
        setup(config)


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_trainer_compile_path_trains_like_the_run_path(tmp_path, digits_data_dir):
    from replicator import trainer

    results = {
        path: trainer.train_and_evaluate(
            diloco_config(data_dir=digits_data_dir, step_path=path), str(tmp_path / path),
            quiet=True,
        )
        for path in ("run", "compile")
    }  # fmt: skip
    assert results["compile"]["loss"] == pytest.approx(results["run"]["loss"], rel=1e-4)
    assert results["compile"]["accuracy"] == pytest.approx(results["run"]["accuracy"], abs=0.01)
