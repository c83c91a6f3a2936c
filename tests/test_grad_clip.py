"""``wrap_optimizer(clip_norm=..., track_norm=...)``: the global norm of the *summed*
gradient (the global batch's), so N replicas clip exactly as one device clips the
same batch, on every path: run, compile, ZeRO (from the reduce-scattered slices),
gradient accumulation, DiLoCo islands (each island's own norm).

SGD is the optimizer that shows a norm N times too large or too small (Adam's
normalisation hides a scale); both run on every path.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.compiled import hlo as hlo
from replicator.step.optim import GradNormState
from tests.compare import assert_trained_alike

GLOBAL_BATCH = 48  # 6 per replica on 8: microbatches of 3
CLIP = 0.05  # below every gradient norm of these steps, so every step clips


def init_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (8, 32)) * 0.5,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 4)) * 0.5,
    }


def per_example_loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2, axis=-1)


def loss_fn(params, batch):
    return rp.compute_average_loss(per_example_loss(params, batch))


def make_batches(steps, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(GLOBAL_BATCH, 8)).astype(np.float32),
            "y": rng.normal(size=(GLOBAL_BATCH, 4)).astype(np.float32),
        }
        for _ in range(steps)
    ]


OPTIMIZERS = {"sgd": (lambda: optax.sgd(0.5), 1e-6), "adam": (lambda: optax.adam(0.05), 1e-5)}
PATHS = {  # path, mesh, grad_accum_steps
    "run": ("run", {"data": 8}, 1),
    "compile": ("compile", {"data": 8}, 1),
    "zero": ("run", {"data": 2, "fsdp": 4}, 1),
    "accum": ("run", {"data": 8}, 2),
    "zero_accum": ("run", {"fsdp": 8}, 2),
}


def one_device(make_tx, batches, clip=CLIP):
    """optax on one device: the global batch's mean loss, clip_by_global_norm, the
    optimizer. Returns the parameters and each step's gradient norm."""
    tx = make_tx() if clip is None else optax.chain(optax.clip_by_global_norm(clip), make_tx())
    params = init_params()
    opt_state, norms = tx.init(params), []
    for batch in batches:
        grads = jax.grad(lambda p, b: per_example_loss(p, b).mean())(params, batch)
        norms.append(float(optax.tree.norm(grads)))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, norms


def make_step(tx):
    def step(state, batch):
        loss, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx), loss

    return step


def train(path, mesh, grad_accum_steps, make_tx, batches, **wrap):
    repl = rp.Replicator(mesh=mesh, min_size=0)  # min_size=0: ZeRO shards even these
    tx = repl.wrap_optimizer(make_tx(), **wrap)
    state = repl.init(
        lambda key: rp.TrainState.create(init_params(), tx, key, grad_accum_steps=grad_accum_steps),
        jax.random.key(0),
    )
    step = make_step(tx)
    compiled = repl.compile(step, donate_argnums=(0,)) if path == "compile" else None
    for batch in batches:
        if compiled is None:
            state, _ = repl.run(step, state, repl.shard_batch(batch), donate_argnums=(0,))
        else:
            state, _ = compiled(state, repl.shard_batch(batch))
    return state


def assert_close(got, want, atol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=atol)


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("name", PATHS)
def test_clip_equals_one_device_clip_of_the_global_batch(name, opt):
    path, mesh, k = PATHS[name]
    make_tx, atol = OPTIMIZERS[opt]
    batches = make_batches(3)
    want, norms = one_device(make_tx, batches)
    assert min(norms) > 2 * CLIP  # every step clips
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # under ZeRO: no fallback to a whole-leaf update
        state = train(path, mesh, k, make_tx, batches, clip_norm=CLIP)
    if name.startswith("zero"):
        assert not state.params["w1"].sharding.is_fully_replicated
    if opt == "adam":  # its rare amplified rounding, up to the learning rate (tests/compare.py)
        assert_trained_alike(state.params, want, atol=atol, worst=0.05)
    else:
        assert_close(state.params, want, atol)
    assert isinstance(state.opt_state, GradNormState)
    np.testing.assert_allclose(rp.grad_norm(state), norms[-1], rtol=1e-5)  # before clipping
    unclipped, _ = one_device(make_tx, batches, clip=None)
    with pytest.raises(AssertionError):  # the clip changed the result
        assert_close(state.params, unclipped, atol)


@pytest.mark.parametrize("name", ["run", "compile", "zero"])
def test_tracked_norm_without_clipping(name):
    path, mesh, k = PATHS[name]
    make_tx = lambda: optax.sgd(0.5)  # noqa: E731
    batches = make_batches(2)
    want, norms = one_device(make_tx, batches, clip=None)
    state = train(path, mesh, k, make_tx, batches, track_norm=True)
    assert_close(state.params, want, 1e-6)
    np.testing.assert_allclose(rp.grad_norm(state), norms[-1], rtol=1e-5)
    np.testing.assert_allclose(rp.grad_norm(state.opt_state), norms[-1], rtol=1e-5)


def test_untracked_state_is_the_optimizers_own():
    repl = rp.Replicator()
    params = init_params()
    state = rp.TrainState.create(params, repl.wrap_optimizer(optax.adam(0.1)), jax.random.key(0))
    want = optax.adam(0.1).init(params)
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(want)
    assert rp.grad_norm(state) is None


def test_zero_clips_from_the_slices_without_an_all_reduce_of_the_gradients():
    """Under ZeRO the norm comes from each device's reduce-scattered slice of the
    gradients (and a scalar psum): clipping adds no gradient-sized traffic."""
    repl = rp.Replicator(mesh={"fsdp": 8}, min_size=0)
    batch = repl.shard_batch(make_batches(1)[0])

    def step_bytes(**wrap):
        tx = repl.wrap_optimizer(optax.sgd(0.5), **wrap)
        state = repl.init(
            lambda key: rp.TrainState.create(init_params(), tx, key),  # noqa: B023
            jax.random.key(0),
        )
        text = repl.lower(make_step(tx), state, batch).compile().as_text()
        return hlo.traffic(text, repl.mesh, "fsdp")["every_step"], text

    plain, _ = step_bytes()
    clipped, text = step_bytes(clip_norm=CLIP)
    assert "reduce-scatter" in text
    assert plain <= clipped <= plain + 64  # a scalar (XLA may combine it with another)
    gradient_bytes = sum(x.size * 4 for x in jax.tree.leaves(init_params()))
    assert clipped - plain < gradient_bytes // 8


def test_diloco_clips_each_island_by_its_own_norm():
    """Under DiLoCo each island clips by the norm of its own summed gradient: an
    island of 4 replicas trains as one device on its half of each batch."""
    repl = rp.Replicator(mesh={"data": 2, "fsdp": 4})  # 2 islands of 4 replicas
    make_tx = lambda: optax.sgd(0.5)  # noqa: E731
    tx = repl.wrap_optimizer(make_tx(), sync=rp.DiLoCo(inner_steps=10), clip_norm=CLIP)
    state = repl.replicate(rp.TrainState.create(init_params(), tx, jax.random.key(0)))
    step = make_step(tx)
    batches = make_batches(2)
    for batch in batches:
        state, _ = repl.run(step, state, repl.shard_batch(batch))
    half = GLOBAL_BATCH // 2
    norms = rp.grad_norm(state)
    assert norms.shape == (2,)
    for island in range(2):
        mine = [jax.tree.map(lambda x: x[island * half : (island + 1) * half], b) for b in batches]  # noqa: B023
        want, want_norms = one_device(make_tx, mine)
        assert_close(jax.tree.map(lambda x: x[island], state.params), want, 1e-6)  # noqa: B023
        np.testing.assert_allclose(norms[island], want_norms[-1], rtol=1e-5)


def test_bad_clip_norm_is_named():
    with pytest.raises(ValueError, match="clip_norm"):
        rp.Replicator().wrap_optimizer(optax.sgd(0.1), clip_norm=0.0)


def test_an_nnx_optimizer_clips_and_tracks_the_norm_too():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1, self.fc2 = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.fc2(jnp.tanh(self.fc1(x)))

    def per_example(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2, axis=-1)

    def step(model, opt, batch):
        loss_fn = lambda m: rp.compute_average_loss(per_example(m, batch))  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    batch = make_batches(1)[0]
    want_model = MLP(nnx.Rngs(0))
    grads = nnx.grad(lambda m: per_example(m, batch).mean())(want_model)
    want = optax.tree.norm(grads)
    want_opt = nnx.Optimizer(
        want_model, optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(0.5)), wrt=nnx.Param
    )
    want_opt.update(want_model, grads)

    repl = rp.Replicator(mesh={"data": 8})
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, repl.wrap_optimizer(optax.sgd(0.5), clip_norm=CLIP), wrt=nnx.Param)
    model, opt = repl.replicate((model, opt))
    repl.run(step, model, opt, repl.shard_batch(batch))
    np.testing.assert_allclose(rp.grad_norm(opt), want, rtol=1e-5)
    assert want > 2 * CLIP
    assert_close(nnx.state(model, nnx.Param), nnx.state(want_model, nnx.Param), 1e-6)
