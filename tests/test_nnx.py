"""Flax NNX programs through run and compile: the NNX MNIST tutorial's step, ported."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import replicator as rp


class CNN(nnx.Module):
    """The Flax NNX MNIST tutorial's CNN, on 8x8 images."""

    def __init__(self, *, rngs: nnx.Rngs, axis_name=None, dropout=0.025):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(8, axis_name=axis_name, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=dropout)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(16, axis_name=axis_name, rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(64, 32, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=dropout)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x, rngs=None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def make_train_step(average):
    """The tutorial's step: updates in place and returns nothing but the loss."""

    def train_step(model, optimizer, metrics, rngs, batch):
        def loss_fn(model, rngs, batch):
            logits = model(batch["image"], rngs)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
            return average(per_example), (logits, per_example)

        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, (logits, per_example)), grads = grad_fn(model, rngs, batch)
        metrics.update(loss=per_example, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)
        return loss

    return train_step


def batches(steps, size=32, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.normal(size=(size, 8, 8, 1)).astype(np.float32),
            "label": rng.integers(0, 10, size).astype(np.int32),
        }
        for _ in range(steps)
    ]


def make_objects(axis_name=None, dropout=0.0, wrap=lambda tx: tx):
    model = CNN(rngs=nnx.Rngs(0), axis_name=axis_name, dropout=dropout)
    optimizer = nnx.Optimizer(model, wrap(optax.sgd(0.1)), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
    return model, optimizer, metrics, nnx.Rngs(dropout=1)


def train_original(data):
    """The tutorial as written, on one device with nnx.jit and a mean loss."""
    objects = make_objects()
    step = nnx.jit(make_train_step(jnp.mean))
    for batch in data:
        step(*objects, batch)
    return objects


def params_and_stats(model):
    return nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat)


@pytest.mark.parametrize("path", [pytest.param("run", marks=pytest.mark.slow), "compile"])
def test_tutorial_on_8_replicas_equals_one_device(path):
    data = batches(20)
    model0, optimizer0, metrics0, _ = train_original(data)

    repl = rp.Replicator()
    objects = make_objects(repl.axis_name, wrap=repl.wrap_optimizer)
    model, optimizer, metrics, rngs = repl.replicate(objects)
    step = make_train_step(rp.compute_average_loss)
    compiled = repl.compile(step)
    for batch in data:
        args = (model, optimizer, metrics, rngs, repl.shard_batch(batch))
        loss = repl.run(step, *args) if path == "run" else compiled(*args)
    assert loss.shape == ((8,) if path == "run" else ())
    assert int(optimizer.step.get_value()) == 20  # updated in place, not a silent no-op
    assert model.batch_norm1.mean.get_value().shape == (8,)  # never grows
    for ours, original in zip(params_and_stats(model), params_and_stats(model0)):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), ours, original
        )
    for name, value in metrics0.compute().items():  # totals and counts summed exactly
        np.testing.assert_allclose(metrics.compute()[name], value, rtol=1e-5)


def test_dropout_differs_per_replica_and_is_deterministic():
    repl = rp.Replicator()

    def masks(rngs, batch):
        return nnx.Dropout(0.5)(batch["image"], rngs=rngs)[0, :, :, 0] != 0

    def draw():
        rngs = repl.replicate(nnx.Rngs(dropout=1))
        batch = repl.shard_batch({"image": np.ones((8, 8, 8, 1), np.float32)})
        first = repl.run(masks, rngs, batch)
        assert int(rngs.dropout.count.get_value()) == 1  # the counter moved, in place
        return first, repl.run(masks, rngs, batch)

    (a, a_next), (b, _) = draw(), draw()
    assert a.shape == (8, 8, 8)
    assert len({m.tobytes() for m in np.asarray(a)}) == 8  # every replica its own mask
    np.testing.assert_array_equal(a, b)  # deterministic
    assert not np.array_equal(a, a_next)  # and the stream advances
    same = repl.run(
        masks,
        repl.replicate(nnx.Rngs(dropout=1)),
        repl.shard_batch({"image": np.ones((8, 8, 8, 1), np.float32)}),
        replica_rngs=False,
    )
    assert len({m.tobytes() for m in np.asarray(same)}) == 1  # opted out: one stream


def test_statistics_that_differ_per_replica_are_an_error_not_growth():
    repl = rp.Replicator()
    model, optimizer, metrics, rngs = repl.replicate(make_objects(axis_name=None))
    batch = repl.shard_batch(batches(1)[0])
    with pytest.raises(ValueError, match=r"args\[0\]\.batch_norm1\.mean \(BatchStat\)"):
        repl.run(make_train_step(rp.compute_average_loss), model, optimizer, metrics, rngs, batch)
    assert model.batch_norm1.mean.get_value().shape == (8,)  # nothing half-written


def test_foreign_axis_name_is_a_clear_error():
    repl = rp.Replicator()
    objects = repl.replicate(make_objects(axis_name="batch"))
    batch = repl.shard_batch(batches(1)[0])
    for call in (repl.run, lambda f, *a: repl.compile(f)(*a)):
        with pytest.raises(rp.AxisNameError, match=r"'batch'.*args\[0\]\.batch_norm1 \("):
            call(make_train_step(rp.compute_average_loss), *objects, batch)


def test_replicate_keeps_shared_references_and_donation_works():
    repl = rp.Replicator()

    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(2, 2, rngs=rngs)
            self.b = self.a  # shared

    model = repl.replicate(Tied(nnx.Rngs(0)))
    assert model.a is model.b
    assert model.a.kernel.get_value().sharding.is_fully_replicated

    def step(model, x):
        total = repl.reduce(rp.ReduceOp.SUM, jnp.sum(x))  # the same on every replica
        model.a.kernel.set_value(model.a.kernel.get_value() + total)

    # Of a copy: a NumPy view of the kernel itself would keep its buffer from being donated.
    before = np.asarray(model.a.kernel.get_value() + 0)
    for n, call in enumerate((repl.run, lambda f, *a, **k: repl.compile(f, **k)(*a)), 1):
        old, x = model.a.kernel.get_value(), repl.shard_batch(np.ones((8,), np.float32))
        call(step, model, x, donate_argnums=(0,))
        # (of a copy too: since JAX 0.11 a NumPy view outlives the check on CPU)
        np.testing.assert_allclose(model.b.kernel.get_value() + 0, before + 8.0 * n)
        assert old.is_deleted() and not x.is_deleted()  # donated, and only what was
        assert not model.a.kernel.get_value().is_deleted()


def test_a_forgotten_compute_average_loss_is_pointed_out():
    repl = rp.Replicator()
    objects = repl.replicate(make_objects(repl.axis_name, wrap=repl.wrap_optimizer))
    batch = repl.shard_batch(batches(1)[0])

    def tutorial_step_with_mean(*args):
        return make_train_step(jnp.mean)(*args)

    with pytest.warns(UserWarning, match=r"tutorial_step_with_mean.*rp.compute_average_loss"):
        repl.run(tutorial_step_with_mean, *objects, batch)

    def ported_step(*args):
        return make_train_step(rp.compute_average_loss)(*args)

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        repl.run(ported_step, *objects, batch)
        repl.compile(tutorial_step_with_mean)(*objects, batch)  # global view: mean is right


def test_objects_placed_on_other_devices_are_named():
    repl = rp.Replicator(devices=jax.devices()[:4])
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    model.kernel.set_value(jax.device_put(model.kernel.get_value(), jax.devices()[7]))

    def step(model, x):
        return jnp.sum(model(x))

    x = repl.shard_batch(np.ones((4, 2), np.float32))
    for call in (repl.run, lambda f, *a: repl.compile(f)(*a)):
        with pytest.raises(ValueError, match=r"args\[0\]\.kernel.*\[7\].*repl.replicate"):
            call(step, model, x)


@pytest.mark.parametrize("path", ["run", "compile"])
def test_a_later_object_on_some_of_the_devices_is_named(path):
    repl = rp.Replicator()
    step = lambda model, x: jnp.sum(model(x))  # noqa: E731
    compiled = repl.compile(step)
    call = repl.run if path == "run" else lambda f, *a: compiled(*a)
    x = repl.shard_batch(np.ones((8, 2), np.float32))
    call(step, repl.replicate(nnx.Linear(2, 2, rngs=nnx.Rngs(0))), x)  # the layout, checked
    call(step, nnx.Linear(2, 2, rngs=nnx.Rngs(0)), x)  # uncommitted: JAX places it
    model = repl.replicate(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))  # the same layout, then
    model.bias.set_value(jax.device_put(model.bias.get_value(), jax.devices()[3]))
    with pytest.raises(ValueError, match=r"args\[0\]\.bias holds an array on devices \[3\]"):
        call(step, model, x)


def on_path(repl, path):
    """``call(step, *args)`` through ``repl.run`` or a (cached) ``repl.compile``."""
    if path == "run":
        return repl.run
    compiled = {}
    return lambda f, *a: compiled.setdefault(f, repl.compile(f))(*a)


def bump_kernel(model):
    model.kernel.set_value(model.kernel.get_value() + 1.0)


@pytest.mark.parametrize("path", ["run", "compile"])
@pytest.mark.parametrize("wrap", [lambda m: {"ms": [m]}, lambda m: ((m,),)], ids=["dict", "tuple"])
def test_objects_nested_in_containers_are_updated_in_place(path, wrap):
    def step(tree, x):
        bump_kernel(jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, nnx.Module))[0])

    original = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    nnx.jit(step)(wrap(original), jnp.ones(2))  # what nnx.jit does: propagates
    repl = rp.Replicator()
    model = repl.replicate(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    on_path(repl, path)(step, wrap(model), repl.shard_batch(np.ones((8, 2), np.float32)))
    np.testing.assert_array_equal(model.kernel.get_value(), original.kernel.get_value())


@pytest.mark.parametrize("path", ["run", "compile"])
def test_a_bare_variable_is_updated_in_place(path):
    def set_value(v, x):
        v.set_value(v.get_value() + 1.0)

    def set_item(v, x):
        v[...] = v[...] * 2.0

    repl = rp.Replicator()
    call, x = on_path(repl, path), repl.shard_batch(np.ones((8, 2), np.float32))
    model = repl.replicate(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    before = np.asarray(model.kernel.get_value())
    call(set_value, model.kernel, x)
    call(set_item, model.kernel, x)
    np.testing.assert_allclose(model.kernel.get_value(), (before + 1.0) * 2.0)


@pytest.mark.parametrize("path", ["run", "compile"])
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: setattr(m, "flag", True), r"args\[0\]\.flag \(absent -> True\)"),
        (lambda m: setattr(m, "bias", None), r"args\[0\]\.bias \(Param -> None\)"),
        (lambda m: setattr(m, "extra", nnx.Param(jnp.zeros(2))), r"args\[0\]\.extra"),
    ],
    ids=["flag", "removed", "added"],
)
def test_a_structural_change_is_an_error_naming_the_attribute(path, change, message):
    # nnx.jit carries such changes back; replicator writes back values only, so it says so.
    repl = rp.Replicator()
    model = repl.replicate(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))

    def step(model, x):
        change(model)
        return jnp.sum(x)

    x = repl.shard_batch(np.ones((8, 2), np.float32))
    with pytest.raises(ValueError, match=f"structure of its NNX objects: {message}.*outside"):
        on_path(repl, path)(step, model, x)
    assert isinstance(model.bias, nnx.Param) and not hasattr(model, "flag")


def test_a_failed_write_back_is_a_named_error(monkeypatch):
    repl = rp.Replicator()
    model = repl.replicate(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))

    def frozen(*args):
        raise AttributeError("frozen")

    monkeypatch.setattr(nnx, "update", frozen)
    x = repl.shard_batch(np.ones((8, 2), np.float32))
    for path in ("run", "compile"):
        with pytest.raises(ValueError, match=r"cannot be written back: AttributeError: frozen"):
            on_path(repl, path)(lambda m, x: bump_kernel(m), model, x)


def test_dropout_under_compile_equals_nnx_jit_on_one_device():
    def masks(rngs, x):
        return nnx.Dropout(0.5)(x, rngs=rngs)

    x = np.ones((16, 8), np.float32)
    rngs = nnx.Rngs(dropout=1)
    expected = [np.asarray(nnx.jit(masks)(rngs, x)) for _ in range(2)]
    repl = rp.Replicator()
    step, ours = repl.compile(masks), repl.replicate(nnx.Rngs(dropout=1))
    for want in expected:  # the global view: the same draws, the counter advancing alike
        np.testing.assert_array_equal(step(ours, repl.shard_batch(x)), want)
    assert int(ours.dropout.count.get_value()) == int(rngs.dropout.count.get_value()) == 2


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_batch_norm_statistics_keep_their_shape_alternating_run_and_compile():
    class Norm(nnx.Module):
        def __init__(self, axis_name):
            self.norm = nnx.BatchNorm(4, axis_name=axis_name, momentum=0.5, rngs=nnx.Rngs(0))

    def step(model, x):
        model.norm(x)

    data = np.random.default_rng(0).normal(size=(120, 16, 4)).astype(np.float32)
    original = Norm(None)
    for x in data:
        nnx.jit(step)(original, x)
    repl = rp.Replicator()
    model, compiled = repl.replicate(Norm(repl.axis_name)), repl.compile(step)
    for i, x in enumerate(data):
        (repl.run if i % 2 else lambda f, *a: compiled(*a))(step, model, repl.shard_batch(x))
    assert model.norm.mean.get_value().shape == model.norm.var.get_value().shape == (4,)
    np.testing.assert_allclose(model.norm.mean.get_value(), original.norm.mean.get_value(), 1e-5)
    np.testing.assert_allclose(model.norm.var.get_value(), original.norm.var.get_value(), 1e-5)


def guide_example() -> str:
    """The first python block of the guide's section on porting an NNX program."""
    guide = (pathlib.Path(__file__).parent.parent / "docs" / "guide.md").read_text()
    section = guide[guide.index("## Porting a Flax NNX program") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_the_guides_nnx_example_runs_as_printed():
    data = batches(3, size=16)
    namespace = {
        "rp": rp,
        "nnx": nnx,
        "optax": optax,
        "CNN": functools.partial(CNN, dropout=0.2),  # the tutorial's, small, with dropout
        "batches": data,
    }
    exec(guide_example(), namespace)  # its loop: repl.run
    repl, model, optimizer = namespace["repl"], namespace["model"], namespace["optimizer"]
    other = (namespace["metrics"], namespace["rngs"])
    step = repl.compile(namespace["train_step"])  # its comment: repl.compile
    for batch in data:
        step(model, optimizer, *other, repl.shard_batch(batch))
    assert int(optimizer.step.get_value()) == 6
    assert model.batch_norm1.mean.get_value().shape == (8,)
    assert np.isfinite(namespace["metrics"].compute()["loss"])
