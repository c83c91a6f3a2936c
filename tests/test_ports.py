"""Ports of public programs onto replicator, each checked against its single-device original.

A researcher moving a program to replicator keeps the model and rewrites only
the step: ``lax.pmean(grads)`` becomes ``repl.wrap_optimizer``, ``jnp.mean`` of
the loss becomes ``rp.compute_average_loss``, ``axis_name="batch"`` becomes
``repl.axis_name``, ``strategy.run``/``strategy.reduce`` become
``repl.run``/``repl.reduce``. The invariant each test checks is the one the
port promises: N replicas train exactly like the original on one device.

* flax's ImageNet example (``examples/imagenet``): ResNet V1 with cross-replica
  BatchNorm, SGD with Nesterov momentum, L2 weight penalty; and pmap's
  per-device BatchNorm statistics; and BatchNorm under gradient accumulation.
* TF-Replicator's GAN: generator and discriminator, two optimizers, one step.
* TensorFlow's "Custom training with tf.distribute.Strategy" tutorial.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import replicator as rp
from tests.programs.resnet import ResNet, cross_entropy, weight_penalty

TOL = 1e-5  # fp32: only the order of the reductions differs


def assert_trees_close(actual: Any, expected: Any, what: str = "", tol: float = TOL) -> None:
    """Every leaf of ``actual`` matches ``expected`` in shape and value."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected), what

    def check(path, a, e):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(e), rtol=tol, atol=tol,
            err_msg=f"{what}{jax.tree_util.keystr(path)}",
        )  # fmt: skip

    jax.tree_util.tree_map_with_path(check, actual, expected)


def shapes(tree: Any) -> Any:
    return jax.tree.map(np.shape, tree)


# ------------------------------------------------ flax ImageNet example: ResNet

RESNET = {"stage_sizes": (1, 1), "num_classes": 10, "num_filters": 8}
GLOBAL_BATCH = 32
IMAGE_SHAPE = (16, 16, 3)


def image_batch(step: int, size: int = GLOBAL_BATCH, shape=IMAGE_SHAPE) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {
        "image": rng.normal(size=(size, *shape)).astype(np.float32),
        "label": rng.integers(0, 10, size).astype(np.int32),
    }


@functools.cache
def init_resnet() -> tuple[Any, Any]:
    """Parameters and batch statistics of the original (single-device) model."""
    init = jax.jit(functools.partial(ResNet(**RESNET).init, train=False))
    variables = init(jax.random.key(0), jnp.zeros((1, *IMAGE_SHAPE)))
    return variables["params"], variables["batch_stats"]


def imagenet_optimizer() -> optax.GradientTransformation:
    return optax.sgd(0.1, momentum=0.9, nesterov=True)


def make_original_train_step(model: nn.Module, tx: optax.GradientTransformation):
    """The example's train step on one device: mean loss, no collectives."""

    @jax.jit
    def train_step(params, opt_state, batch_stats, batch):
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": batch_stats},
                batch["image"],
                mutable=["batch_stats"],
            )
            loss = jnp.mean(cross_entropy(logits, batch["label"])) + weight_penalty(params)
            return loss, updates["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, batch_stats, loss

    return train_step


def make_train_step(model: nn.Module, tx: optax.GradientTransformation):
    """The same step ported: written once for `run` and `compile`."""

    def train_step(state: rp.TrainState, batch):
        def loss_fn(params, model_state, batch):
            logits, new_model_state = model.apply(
                {"params": params, **model_state}, batch["image"], mutable=["batch_stats"]
            )
            loss = rp.compute_average_loss(cross_entropy(logits, batch["label"]))
            return loss + rp.scale_regularization_loss(weight_penalty(params)), new_model_state

        (loss, new_model_state), grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx, model_state=new_model_state), loss

    return train_step


def make_eval_step(model: nn.Module):
    def eval_step(state: rp.TrainState, batch):
        logits = model.apply(
            {"params": state.params, **state.model_state}, batch["image"], train=False
        )
        return logits, rp.compute_average_loss(cross_entropy(logits, batch["label"]))

    return eval_step


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_resnet_cross_replica_batchnorm_8_replicas_equal_1_device_and_compile():
    repl = rp.Replicator()
    params, batch_stats = init_resnet()
    batches = [image_batch(step) for step in range(3)]

    # The original on one device, on the whole global batch.
    original = ResNet(**RESNET)
    tx = imagenet_optimizer()
    original_step = make_original_train_step(original, tx)
    one = {"params": params, "opt_state": tx.init(params), "batch_stats": batch_stats}
    losses_one = []
    for batch in batches:
        *updated, loss = original_step(*one.values(), batch)
        one = dict(zip(one, updated))
        losses_one.append(loss)

    # The port: BatchNorm over repl.axis_name, the step written once.
    model = ResNet(**RESNET, axis_name=repl.axis_name)
    wrapped = repl.wrap_optimizer(imagenet_optimizer())
    train_step = make_train_step(model, wrapped)
    compiled_step = repl.compile(train_step)

    def fresh_state():
        state = rp.TrainState.create(
            params, wrapped, jax.random.key(0), model_state={"batch_stats": batch_stats}
        )
        return repl.replicate(state)

    run_state, compiled_state = fresh_state(), fresh_state()
    for step, batch in enumerate(batches):
        global_batch = repl.shard_batch(batch)
        run_state, run_losses = repl.run(train_step, run_state, global_batch)
        compiled_state, compiled_loss = compiled_step(compiled_state, global_batch)
        assert run_losses.shape == (repl.num_replicas,)  # per-replica shares of the loss
        run_loss = repl.reduce(rp.ReduceOp.SUM, run_losses)
        assert_trees_close(run_loss, losses_one[step], f"run loss, step {step}")
        assert_trees_close(compiled_loss, losses_one[step], f"compile loss, step {step}")

    moved = jax.tree.map(lambda a, b: not np.allclose(a, b), one["batch_stats"], batch_stats)
    assert all(jax.tree.leaves(moved)), "the statistics should have moved from their init"
    for path, state in (("run", run_state), ("compile", compiled_state)):
        assert int(state.step) == len(batches)
        # Cross-replica statistics are the same on every replica: mirrored, not stacked.
        assert shapes(state.model_state["batch_stats"]) == shapes(batch_stats), path
        assert_trees_close(state.params, one["params"], f"{path} params")
        assert_trees_close(state.model_state["batch_stats"], one["batch_stats"], f"{path} stats")

    # Evaluation with the running averages agrees across the three.
    batch = image_batch(100)
    logits_one = jax.jit(functools.partial(original.apply, train=False))(
        {"params": one["params"], "batch_stats": one["batch_stats"]}, batch["image"]
    )
    loss_one = jnp.mean(cross_entropy(logits_one, batch["label"]))
    eval_step = make_eval_step(model)
    global_batch = repl.shard_batch(batch)
    logits_run, losses_run = repl.run(eval_step, run_state, global_batch)
    logits_compiled, loss_compiled = repl.compile(eval_step)(compiled_state, global_batch)
    assert logits_run.shape == (repl.num_replicas, GLOBAL_BATCH // repl.num_replicas, 10)
    assert_trees_close(np.reshape(logits_run, (GLOBAL_BATCH, 10)), logits_one, "run logits")
    assert_trees_close(logits_compiled, logits_one, "compile logits")
    assert_trees_close(repl.reduce(rp.ReduceOp.SUM, losses_run), loss_one, "run eval loss")
    assert_trees_close(loss_compiled, loss_one, "compile eval loss")


@pytest.mark.slow  # make test-slow; keeps make test under 15 minutes on CI
def test_resnet_per_device_batchnorm_statistics_round_trip():
    """pmap's idiom: BatchNorm without axis_name keeps statistics of its own per device."""
    repl = rp.Replicator()
    replicas = repl.num_replicas
    params, batch_stats = init_resnet()
    model = ResNet(**RESNET)  # no axis_name: each replica normalizes by its own slice
    wrapped = repl.wrap_optimizer(imagenet_optimizer())
    train_step = make_train_step(model, wrapped)
    # Like flax.jax_utils.replicate: every device starts from a copy of the statistics.
    stacked = jax.tree.map(lambda x: np.stack([x] * replicas), batch_stats)
    state = repl.replicate(rp.TrainState.create(params, wrapped, jax.random.key(0)))
    state = state.replace(model_state=rp.PerReplica({"batch_stats": stacked}))

    # One device: the same model applied to each replica's slice with that slice's statistics.
    tx = imagenet_optimizer()

    @jax.jit
    def sliced_step(params, opt_state, stats_R, batch):
        slices = jax.tree.map(lambda x: x.reshape(replicas, -1, *x.shape[1:]), batch)

        def loss_fn(params):
            def one_slice(stats, batch):
                logits, updates = model.apply(
                    {"params": params, "batch_stats": stats},
                    batch["image"],
                    mutable=["batch_stats"],
                )
                return jnp.mean(cross_entropy(logits, batch["label"])), updates["batch_stats"]

            losses_R, new_stats_R = jax.vmap(one_slice)(stats_R, slices)
            return jnp.mean(losses_R) + weight_penalty(params), new_stats_R

        (loss, stats_R), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats_R, loss

    one = {"params": params, "opt_state": tx.init(params), "stats_R": stacked}
    for step in range(5):
        batch = image_batch(step)
        state, losses = repl.run(train_step, state, repl.shard_batch(batch))
        *updated, loss_one = sliced_step(*one.values(), batch)
        one = dict(zip(one, updated))
        stats = state.model_state["batch_stats"]
        assert shapes(stats) == shapes(stacked), f"step {step}: statistics changed shape"
        assert_trees_close(stats, one["stats_R"], f"step {step}: per-replica stats")
        assert_trees_close(repl.reduce(rp.ReduceOp.SUM, losses), loss_one, f"step {step}: loss")
    rows = np.asarray(stats["bn_init"]["mean"])
    assert len({tuple(row) for row in rows}) == replicas, "each replica has statistics of its own"
    assert_trees_close(state.params, one["params"], "params")
    # The example's sync_batch_stats before evaluation: the mean over the devices.
    synced = repl.reduce(rp.ReduceOp.MEAN, stats)
    assert_trees_close(synced, jax.tree.map(lambda x: x.mean(0), one["stats_R"]), "synced")


# --------------------------------------- BatchNorm under gradient accumulation


class BatchNormClassifier(nn.Module):
    """Dense -> BatchNorm -> ReLU -> Dense: the statistics are checkable by hand."""

    axis_name: Any = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dense(8, name="hidden")(x)
        h = nn.BatchNorm(
            use_running_average=not train, momentum=0.9, epsilon=1e-5,
            axis_name=self.axis_name, name="bn",
        )(h)  # fmt: skip
        return nn.Dense(10, name="head")(nn.relu(h))


@pytest.mark.parametrize("path", ["run", "compile"])
def test_batchnorm_statistics_average_over_accumulated_microbatches(path):
    repl = rp.Replicator()
    replicas, microbatches = repl.num_replicas, 2
    model = BatchNormClassifier(axis_name=repl.axis_name)
    variables = jax.jit(functools.partial(BatchNormClassifier().init, train=False))(
        jax.random.key(1), jnp.zeros((1, 6))
    )
    wrapped = repl.wrap_optimizer(optax.sgd(0.1))
    state = repl.replicate(
        rp.TrainState.create(
            variables["params"], wrapped, jax.random.key(0),
            model_state={"batch_stats": variables["batch_stats"]},
            grad_accum_steps=microbatches,
        )
    )  # fmt: skip
    train_step = make_train_step(model, wrapped)
    call = functools.partial(repl.run, train_step) if path == "run" else repl.compile(train_step)

    for step in range(2):
        rng = np.random.default_rng(step)
        host = {
            "image": (rng.normal(size=(GLOBAL_BATCH, 6)) + 1.0).astype(np.float32),
            "label": rng.integers(0, 10, GLOBAL_BATCH).astype(np.int32),
        }
        old = jax.device_get(state)
        state, _ = call(state, repl.shard_batch(host))
        hidden = old.params["hidden"]
        h = host["image"] @ np.asarray(hidden["kernel"]) + np.asarray(hidden["bias"])
        if path == "run":  # microbatch j: the j-th part of every replica's slice
            h_MxBxC = (
                h.reshape(replicas, microbatches, -1, 8).swapaxes(0, 1).reshape(microbatches, -1, 8)
            )
        else:  # one replica holding the global batch: its j-th part
            h_MxBxC = h.reshape(microbatches, -1, 8)
        old_stats = old.model_state["batch_stats"]["bn"]
        expected = {
            "mean": 0.9 * old_stats["mean"] + 0.1 * h_MxBxC.mean(1).mean(0),
            "var": 0.9 * old_stats["var"] + 0.1 * h_MxBxC.var(1).mean(0),
        }
        new_stats = state.model_state["batch_stats"]["bn"]
        summed = 0.9 * microbatches * old_stats["mean"] + 0.1 * h_MxBxC.mean(1).sum(0)
        assert not np.allclose(new_stats["mean"], summed, atol=1e-3), (
            f"{path}, step {step}: statistics were summed over the microbatches"
        )
        assert_trees_close(new_stats, expected, f"{path}, step {step}: ", tol=1e-5)


# ---------------------------------------------------------- TF-Replicator's GAN

NOISE, DATA, GAN_BATCH = 4, 2, 16
NOISE_KEY = 42


class Generator(nn.Module):
    axis_name: Any = None

    @nn.compact
    def __call__(self, z, train: bool = True):
        h = nn.Dense(16)(z)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(h)
        return nn.Dense(DATA)(nn.relu(h))


class Discriminator(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.leaky_relu(nn.Dense(16)(x), 0.2))[..., 0]


def gan_batch(step: int) -> dict[str, np.ndarray]:
    """Real samples from four Gaussians, and each example's global index."""
    rng = np.random.default_rng(1000 + step)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    real = centers[rng.integers(0, 4, GAN_BATCH)] + 0.1 * rng.normal(size=(GAN_BATCH, DATA))
    index = step * GAN_BATCH + np.arange(GAN_BATCH)
    return {"real": real.astype(np.float32), "index": index.astype(np.int32)}


def noise_for(index: jax.Array) -> jax.Array:
    """Each example's noise depends on its index only: the same on 1 device and on 8."""
    key = jax.random.key(NOISE_KEY)
    return jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(key, i), (NOISE,)))(index)


def d_loss_of(real_logits, fake_logits):
    return jax.nn.softplus(-real_logits) + jax.nn.softplus(fake_logits)


def make_original_gan_step(gen, disc, g_tx, d_tx):
    """One device: a discriminator update, then a generator update against the new D."""

    @jax.jit
    def gan_step(g_params, g_stats, g_opt, d_params, d_opt, batch):
        noise = noise_for(batch["index"])
        g_vars = {"params": g_params, "batch_stats": g_stats}
        fake = jax.lax.stop_gradient(gen.apply(g_vars, noise, mutable=["batch_stats"])[0])

        def d_loss_fn(d_params):
            logits = lambda x: disc.apply({"params": d_params}, x)
            return jnp.mean(d_loss_of(logits(batch["real"]), logits(fake)))

        d_loss, d_grads = jax.value_and_grad(d_loss_fn)(d_params)
        updates, d_opt = d_tx.update(d_grads, d_opt, d_params)
        d_params = optax.apply_updates(d_params, updates)

        def g_loss_fn(g_params):
            fake, updates = gen.apply(
                {"params": g_params, "batch_stats": g_stats}, noise, mutable=["batch_stats"]
            )
            logits = disc.apply({"params": d_params}, fake)
            return jnp.mean(jax.nn.softplus(-logits)), updates["batch_stats"]

        (g_loss, g_stats), g_grads = jax.value_and_grad(g_loss_fn, has_aux=True)(g_params)
        updates, g_opt = g_tx.update(g_grads, g_opt, g_params)
        g_params = optax.apply_updates(g_params, updates)
        return (g_params, g_stats, g_opt, d_params, d_opt), (d_loss, g_loss)

    return gan_step


def make_gan_step(gen, disc, g_tx, d_tx):
    """The port: two TrainStates, two wrapped optimizers, both updated in one step."""

    def gan_step(g_state: rp.TrainState, d_state: rp.TrainState, batch):
        noise = noise_for(batch["index"])
        g_vars = {"params": g_state.params, **g_state.model_state}
        fake = jax.lax.stop_gradient(gen.apply(g_vars, noise, mutable=["batch_stats"])[0])

        def d_loss_fn(d_params, examples):
            logits = lambda x: disc.apply({"params": d_params}, x)
            per_example = d_loss_of(logits(examples["real"]), logits(examples["fake"]))
            return rp.compute_average_loss(per_example)

        d_loss, d_grads = d_state.value_and_grad(d_loss_fn, {"real": batch["real"], "fake": fake})
        d_state = d_state.apply_gradients(d_grads, d_tx)

        def g_loss_fn(g_params, model_state, noise):
            fake, new_model_state = gen.apply(
                {"params": g_params, **model_state}, noise, mutable=["batch_stats"]
            )
            logits = disc.apply({"params": d_state.params}, fake)
            return rp.compute_average_loss(jax.nn.softplus(-logits)), new_model_state

        (g_loss, new_model_state), g_grads = g_state.value_and_grad(g_loss_fn, noise)
        g_state = g_state.apply_gradients(g_grads, g_tx, model_state=new_model_state)
        return g_state, d_state, {"d_loss": d_loss, "g_loss": g_loss}

    return gan_step


@pytest.mark.parametrize(
    "mesh", [None, pytest.param({"data": 4, "fsdp": 2, "tensor": 1}, marks=pytest.mark.slow)]
)
def test_gan_two_optimizers_in_one_step_8_replicas_equal_1_device(mesh):
    repl = rp.Replicator(mesh=mesh)
    gen, disc = Generator(), Discriminator()
    g_vars = jax.jit(gen.init)(jax.random.key(1), jnp.zeros((1, NOISE)))
    d_params = jax.jit(disc.init)(jax.random.key(2), jnp.zeros((1, DATA)))["params"]
    # SGD: a gradient summed once too often would show as a step 8x too long.
    g_tx, d_tx = optax.sgd(0.05), optax.sgd(0.1)

    original_step = make_original_gan_step(gen, disc, g_tx, d_tx)
    one = (g_vars["params"], g_vars["batch_stats"], g_tx.init(g_vars["params"]), d_params,
           d_tx.init(d_params))  # fmt: skip
    losses_one = []
    for step in range(3):
        one, losses = original_step(*one, gan_batch(step))
        losses_one.append(losses)

    g_wrapped, d_wrapped = repl.wrap_optimizer(g_tx), repl.wrap_optimizer(d_tx)
    gan_step = make_gan_step(Generator(axis_name=repl.axis_name), disc, g_wrapped, d_wrapped)
    g_state = rp.TrainState.create(
        g_vars["params"], g_wrapped, jax.random.key(0),
        model_state={"batch_stats": g_vars["batch_stats"]},
    )  # fmt: skip
    d_state = rp.TrainState.create(d_params, d_wrapped, jax.random.key(0))
    g_state, d_state = repl.replicate((g_state, d_state))
    for step in range(3):
        g_state, d_state, losses = repl.run(
            gan_step, g_state, d_state, repl.shard_batch(gan_batch(step))
        )
        d_loss_one, g_loss_one = losses_one[step]
        assert_trees_close(
            repl.reduce(rp.ReduceOp.SUM, losses["d_loss"]), d_loss_one, f"d_loss {step}"
        )
        assert_trees_close(
            repl.reduce(rp.ReduceOp.SUM, losses["g_loss"]), g_loss_one, f"g_loss {step}"
        )

    g_params, g_stats, _, d_params, _ = one
    assert_trees_close(g_state.params, g_params, "generator params")
    assert_trees_close(g_state.model_state["batch_stats"], g_stats, "generator batch_stats")
    assert_trees_close(d_state.params, d_params, "discriminator params")


def test_gan_noise_from_replica_key_differs_per_replica():
    """Noise drawn from one step key: the same on every replica unless `replica_key`."""
    repl = rp.Replicator()
    per_replica = GAN_BATCH // repl.num_replicas

    def draw(key, batch):
        rows = batch["index"].shape[0]
        return {
            "shared": jax.random.normal(key, (rows, NOISE)),
            "own": jax.random.normal(rp.replica_key(key), (rows, NOISE)),
        }

    key = repl.replicate(jax.random.key(7))
    batch = repl.shard_batch(gan_batch(0))
    noise = repl.run(draw, key, batch)
    assert noise["shared"].shape == (per_replica, NOISE)  # identical everywhere: mirrored
    assert noise["own"].shape == (repl.num_replicas, per_replica, NOISE)
    rows = np.asarray(noise["own"]).reshape(repl.num_replicas, -1)
    assert len({tuple(row) for row in rows}) == repl.num_replicas
    np.testing.assert_array_equal(repl.run(draw, key, batch)["own"], noise["own"])  # deterministic
    # Under compile the one replica's key is the key itself.
    compiled = repl.compile(draw)(key, batch)
    np.testing.assert_array_equal(compiled["own"], compiled["shared"])


# ------------------------------------ tf.distribute custom training tutorial

BATCH_SIZE_PER_REPLICA = 4


class TutorialCNN(nn.Module):
    """The tutorial's Keras model, shrunk: two conv/pool blocks and two dense layers."""

    @nn.compact
    def __call__(self, x):
        for features in (8, 16):
            x = nn.relu(nn.Conv(features, (3, 3), padding="VALID")(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


def test_tf_distribute_custom_training_tutorial():
    """strategy.run -> repl.run, strategy.reduce(SUM) -> repl.reduce(SUM).

    The tutorial trains with Adam; SGD here, because Adam's normalization would
    hide a gradient summed once too often.
    """
    repl = rp.Replicator()
    global_batch_size = BATCH_SIZE_PER_REPLICA * repl.num_replicas
    model = TutorialCNN()
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 14, 14, 1)))["params"]
    make_tx = functools.partial(optax.sgd, 0.1, momentum=0.9)
    batches = [image_batch(step, global_batch_size, (14, 14, 1)) for step in range(3)]

    # The original on one device (OneDeviceStrategy): a mean over the batch.
    tx = make_tx()

    @jax.jit
    def original_step(params, opt_state, inputs):
        def compute_loss(params):
            logits = model.apply({"params": params}, inputs["image"])
            return jnp.mean(cross_entropy(logits, inputs["label"]))

        loss, grads = jax.value_and_grad(compute_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    one = (params, tx.init(params))
    losses_one = []
    for batch in batches:
        *one, loss = original_step(*one, batch)
        losses_one.append(loss)

    # The port: with strategy.scope() -> repl.replicate; strategy.run -> repl.run.
    wrapped = repl.wrap_optimizer(make_tx())

    def train_step(params, opt_state, inputs):
        def compute_loss(params):
            logits = model.apply({"params": params}, inputs["image"])
            per_example_loss = cross_entropy(logits, inputs["label"])
            return rp.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)

        loss, grads = jax.value_and_grad(compute_loss)(params)
        updates, opt_state = wrapped.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def test_step(params, inputs):
        logits = model.apply({"params": params}, inputs["image"])
        correct = jnp.sum(jnp.argmax(logits, -1) == inputs["label"])
        return {"loss": jnp.sum(cross_entropy(logits, inputs["label"])), "correct": correct}

    params_r, opt_state = repl.replicate((params, wrapped.init(params)))
    for step, batch in enumerate(repl.distribute(batches)):
        params_r, opt_state, per_replica_losses = repl.run(train_step, params_r, opt_state, batch)
        local_results = list(per_replica_losses)  # experimental_local_results
        assert len(local_results) == repl.num_replicas
        assert_trees_close(sum(local_results), losses_one[step], f"local results, step {step}")
        total = repl.reduce(rp.ReduceOp.SUM, per_replica_losses)  # strategy.reduce(SUM, axis=None)
        assert_trees_close(total, losses_one[step], f"reduced loss, step {step}")
    assert_trees_close(params_r, one[0], "params")

    test_batch = image_batch(100, global_batch_size, (14, 14, 1))
    sums = repl.reduce(rp.ReduceOp.SUM, repl.run(test_step, params_r, repl.shard_batch(test_batch)))
    expected = jax.jit(test_step)(one[0], test_batch)
    assert_trees_close(sums, expected, "test metrics")


# ------------------------------------------------------------- replica context


@pytest.mark.parametrize("mesh", [None, {"data": 4, "fsdp": 2, "tensor": 1}])
def test_replica_context_matches_the_shard_each_replica_sees(mesh):
    repl = rp.Replicator(mesh=mesh)
    rows = 3  # per replica
    seen = []

    def where(batch):
        ctx = rp.get_replica_context()
        seen.append(ctx if ctx is None else (ctx.num_replicas, ctx.axis_name))
        replica_id = ctx.replica_id if ctx is not None else jnp.int32(-1)
        return {"replica_id": replica_id, "index": batch["index"]}

    host = {"index": np.arange(rows * repl.num_replicas, dtype=np.int32)}
    batch = repl.shard_batch(host)
    out = repl.run(where, batch)
    assert seen and all(s == (repl.num_replicas, repl.axis_name) for s in seen), seen
    np.testing.assert_array_equal(out["replica_id"], np.arange(repl.num_replicas))
    np.testing.assert_array_equal(out["index"], host["index"].reshape(repl.num_replicas, rows))
    np.testing.assert_array_equal(out["index"][:, 0] // rows, out["replica_id"])

    seen.clear()
    compiled = repl.compile(where)(batch)
    assert seen and all(s is None for s in seen), seen
    assert int(compiled["replica_id"]) == -1
    assert rp.get_replica_context() is None
