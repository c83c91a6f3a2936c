"""Mixed precision, dynamic loss scaling, non-finite steps and exact gradient accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.step import transforms
from tests.test_replicator import init_params, per_example_loss

BATCH = 32


def make_batch(seed=0, masked=5):
    rng = np.random.default_rng(seed)
    mask = np.ones(BATCH, np.float32)
    mask[rng.choice(BATCH, masked, replace=False)] = 0.0  # uneven across replicas
    return {
        "x": rng.normal(size=(BATCH, 5)).astype(np.float32),
        "y": rng.integers(0, 3, size=BATCH).astype(np.int32),
        "mask": mask,
    }


def make_step(tx, weighted):
    def train_step(state, batch):
        total = rp.global_sum(batch["mask"]) if weighted else None

        def loss_fn(params, mb):
            losses = per_example_loss(params, mb)
            loss = rp.compute_average_loss(
                losses, global_batch_size=total, sample_weight=mb["mask"]
            )
            return loss, {"count": jnp.sum(mb["mask"])}

        (loss, aux), grads = state.value_and_grad(loss_fn, batch, has_aux=True)
        return state.apply_gradients(grads, tx), {"loss": loss, **aux}

    return train_step


def reference(batches, weighted, make_tx):
    """One device, the whole batch, written by hand."""
    tx = make_tx()
    params = init_params()
    opt_state = tx.init(params)
    for b in batches:
        denominator = b["mask"].sum() if weighted else len(b["mask"])
        loss_fn = lambda p, b=b, d=denominator: jnp.sum(per_example_loss(p, b) * b["mask"]) / d
        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("path", ["run", "compile"])
def test_replicas_times_microbatches_equal_one_big_batch(k, weighted, path):
    batches = [make_batch(seed) for seed in range(3)]
    make_tx = lambda: optax.sgd(0.3)
    expected = reference(batches, weighted, make_tx)

    repl = rp.Replicator(mesh={"data": 4, "fsdp": 2})
    tx = repl.wrap_optimizer(make_tx())
    state = repl.replicate(
        rp.TrainState.create(init_params(), tx, jax.random.key(0), grad_accum_steps=k)
    )
    step_fn = make_step(tx, weighted)
    for b in batches:
        if path == "run":
            state, metrics = repl.run(step_fn, state, repl.shard_batch(b), donate_argnums=(0,))
            count = repl.reduce(rp.ReduceOp.SUM, metrics["count"])
        else:
            state, metrics = repl.compile(step_fn, donate_argnums=(0,))(state, repl.shard_batch(b))
            count = metrics["count"]
        assert float(count) == b["mask"].sum()
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), state.params, expected
    )


def test_microbatch_count_must_divide_the_replica_batch():
    repl = rp.Replicator()
    tx = repl.wrap_optimizer(optax.sgd(0.1))
    state = repl.replicate(
        rp.TrainState.create(init_params(), tx, jax.random.key(0), grad_accum_steps=3)
    )
    with pytest.raises(ValueError, match="grad_accum_steps=3 does not divide the per-replica"):
        repl.run(make_step(tx, True), state, repl.shard_batch(make_batch()))


def test_more_microbatches_need_fewer_temporaries():
    """k microbatches keep one microbatch's activations alive, not k: the step's
    temporaries (XLA's memory analysis) fall from 1 to 2 to 4. (A first microbatch run
    ahead of the loop left 2 above 1: XLA unrolled the 1-trip loop and ran both forward
    passes before either backward pass.)"""

    def loss_fn(w, x):
        h, _ = jax.lax.scan(lambda h, layer: (jnp.tanh(h @ layer), None), x, w)
        return jnp.sum(h**2), (jnp.sum(h), None, None)

    w = jax.ShapeDtypeStruct((8, 256, 256), jnp.float32)
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
    grad_fn = jax.grad(loss_fn, has_aux=True)

    def temporaries(k):
        compiled = jax.jit(transforms.accumulate_gradients(grad_fn, k)).lower(w, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one, two, four = temporaries(1), temporaries(2), temporaries(4)
    assert four < two < one, (one, two, four)


def test_bf16_policy_computes_in_bf16_and_stores_fp32():
    from experiments.classify import CNN

    model = rp.apply_policy(CNN(padding="SAME"), "bf16")
    images = jnp.zeros((4, 8, 8, 1), jnp.float32)
    params = model.init(jax.random.key(0), images)["params"]
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, images))(params)
    convs = [e for e in jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(convs) == 2 and len(dots) == 2
    for eqn in convs + dots:
        assert {v.aval.dtype for v in eqn.invars} == {jnp.dtype("bfloat16")}
    assert jaxpr.out_avals[0].dtype == jnp.float32  # logits leave in the output dtype
    grads = jax.grad(lambda p: model.apply({"params": p}, images).sum())(params)
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype("float32")}


def test_fp16_inf_on_one_replica_skips_everywhere_and_halves_the_scale():
    repl = rp.Replicator(precision="fp16")
    tx = repl.wrap_optimizer(optax.adam(0.1))
    model_params = init_params()
    scale = rp.LossScale.create(2.0**10, growth_interval=2, max_scale=2.0**11)
    state = repl.replicate(
        rp.TrainState.create(model_params, tx, jax.random.key(0), loss_scale=scale)
    )
    step_fn = make_step(tx, weighted=True)

    bad = make_batch(masked=0)
    bad["x"][5] = np.inf  # one example on replica 1 of 8
    state, _ = repl.run(step_fn, state, repl.shard_batch(bad))
    assert int(state.skipped_steps) == 1 and int(state.step) == 1
    assert float(state.loss_scale.scale) == 2.0**9
    jax.tree.map(np.testing.assert_array_equal, state.params, model_params)
    opt_before = tx.init(model_params)
    jax.tree.map(np.testing.assert_array_equal, state.opt_state, opt_before)

    scales = []
    for seed in range(6):
        state, _ = repl.run(step_fn, state, repl.shard_batch(make_batch(seed)))
        scales.append(float(state.loss_scale.scale))
    assert scales == [2.0**9, 2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**11]  # grows, capped
    assert int(state.skipped_steps) == 1


@pytest.mark.parametrize("path", ["run", "compile"])
def test_the_guard_is_one_conditional_and_can_be_left_out(path):
    """The non-finite guard is one ``lax.cond`` around the update in the compiled step;
    ``skip_nonfinite=False`` compiles none (and no check), donates the whole state
    all the same, equals the guarded step on finite gradients, and applies a
    non-finite one. A loss scale needs the guard: a clear error."""
    repl = rp.Replicator()
    tx = repl.wrap_optimizer(optax.adam(0.1))

    def make(skip):
        def train_step(state, batch):
            def loss_fn(params, batch):
                return rp.compute_average_loss(per_example_loss(params, batch))

            loss, grads = state.value_and_grad(loss_fn, batch)
            return state.apply_gradients(grads, tx, skip_nonfinite=skip), loss

        return train_step

    def fresh():
        return repl.replicate(rp.TrainState.create(init_params(), tx, jax.random.key(0)))

    batch = repl.shard_batch(make_batch(masked=0))
    out = {}
    for skip in (True, False):
        step = make(skip)
        if path == "run":
            lowered = repl.lower(step, fresh(), batch, donate_argnums=(0,))
            call = lambda s, b, step=step: repl.run(step, s, b, donate_argnums=(0,))  # noqa: E731
        else:
            call = repl.compile(step, donate_argnums=(0,))
            lowered = call.jitted.lower(fresh(), batch)
        hlo = lowered.compile().as_text()
        assert hlo.count(" conditional(") == (1 if skip else 0)
        leaves = len(jax.tree.leaves(fresh()))
        assert hlo.count("may-alias") + hlo.count("must-alias") == leaves  # all donated
        out[skip] = call(fresh(), batch)[0]
    jax.tree.map(np.testing.assert_array_equal, out[True].params, out[False].params)

    bad = make_batch(masked=0)
    bad["x"][5] = np.inf
    state = call(fresh(), repl.shard_batch(bad))[0]  # unguarded
    assert not np.isfinite(np.asarray(state.params["w1"])).all()
    assert int(state.skipped_steps) == 0 and int(state.step) == 1

    scaled = rp.TrainState.create(
        init_params(), tx, jax.random.key(0), loss_scale=rp.LossScale.create()
    )
    with pytest.raises(ValueError, match="loss scal"):
        repl.run(make(False), repl.replicate(scaled), batch)


@pytest.mark.parametrize("path", ["run", "compile"])
def test_on_gpus_the_guard_selects_per_leaf_and_skips_alike(path, monkeypatch):
    """Where XLA runs a conditional by reading its predicate on the host (GPUs), the
    guard is a per-leaf select: no conditional, the whole state donated, and the same
    state as the branch after finite and non-finite steps (fp16's scale included; the
    non-finite step skipped by both)."""
    repl = rp.Replicator(precision="fp16")
    tx = repl.wrap_optimizer(optax.adam(0.1))
    bad = make_batch(masked=0)
    bad["x"][5] = np.inf
    batches = [repl.shard_batch(b) for b in (make_batch(0), bad, make_batch(1))]

    def train(select: bool):
        monkeypatch.setattr(transforms, "select_instead_of_branch", lambda: select)
        step_fn = make_step(tx, weighted=True)  # a new function: traced anew
        scale = rp.LossScale.create(2.0**10)
        fresh = lambda: repl.replicate(  # noqa: E731
            rp.TrainState.create(init_params(), tx, jax.random.key(0), loss_scale=scale)
        )
        if path == "run":
            lowered = repl.lower(step_fn, fresh(), batches[0], donate_argnums=(0,))
            call = lambda s, b: repl.run(step_fn, s, b, donate_argnums=(0,))  # noqa: E731
        else:
            call = repl.compile(step_fn, donate_argnums=(0,))
            lowered = call.jitted.lower(fresh(), batches[0])
        hlo = lowered.compile().as_text()
        state = fresh()
        for batch in batches:
            state = call(state, batch)[0]
        return hlo, state

    branch_hlo, branched = train(False)
    select_hlo, selected = train(True)
    assert branch_hlo.count(" conditional(") == 1 and select_hlo.count(" conditional(") == 0
    leaves = len(jax.tree.leaves(selected))
    assert select_hlo.count("may-alias") + select_hlo.count("must-alias") == leaves
    assert int(selected.skipped_steps) == 1 and int(selected.step) == 3
    data = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    # (the same arithmetic, fused differently around a select: equal to rounding)
    close = lambda a, b: np.testing.assert_allclose(data(a), data(b), rtol=1e-6, atol=1e-7)
    jax.tree.map(close, selected, branched)


def test_loss_scale_survives_a_checkpoint(tmp_path):
    repl = rp.Replicator()
    tx = optax.adam(0.1)
    scale = rp.LossScale.create(1024.0).update(jnp.bool_(False))
    state = rp.TrainState.create(init_params(), tx, jax.random.key(0), loss_scale=scale)
    manager = rp.Checkpoints(str(tmp_path), repl)
    manager.save(1, state)
    manager.close()
    restored = rp.Checkpoints(str(tmp_path), repl, read_only=True).restore(like=state)
    assert float(restored.loss_scale.scale) == 512.0
    assert int(restored.loss_scale.good_steps) == 0
    assert restored.loss_scale.growth_interval == scale.growth_interval


def test_nonfinite_halt_names_the_step_and_records_the_batch(tmp_path, digits_data_dir):
    from replicator import trainer
    from tests.helpers.configs import digits_config

    config = digits_config(
        data_dir=digits_data_dir, learning_rate=1e30, optimizer="sgd", num_train_steps=6
    )
    with pytest.raises(FloatingPointError, match=r"at step (\d+).*recorded in") as info:
        trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    records = list((tmp_path / "nonfinite").iterdir())
    assert len(records) == 1 and records[0].name.startswith("step_")
    assert records[0].name.split("_")[1].split(".")[0] in str(info.value)


def test_nonfinite_skip_keeps_training(tmp_path, digits_data_dir):
    from replicator import trainer
    from tests.helpers.configs import digits_config

    config = digits_config(
        data_dir=digits_data_dir,
        learning_rate=1e30,
        optimizer="sgd",
        num_train_steps=6,
        nonfinite="skip",
    )
    result = trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    assert result["step"] == 6
    assert len(list((tmp_path / "nonfinite").iterdir())) >= 1
