"""compute_average_loss / scale_regularization_loss: the tf.distribute semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp


def test_tutorial_example_two_replicas():
    # tf.distribute custom-training tutorial: per-example losses [2, 3] and [4, 5],
    # global batch 4 -> per-replica 1.25 and 2.25, SUM 3.5, MEAN 1.75.
    repl = rp.Replicator(devices=jax.devices()[:2])
    batch = repl.shard_batch(np.array([2.0, 3.0, 4.0, 5.0], np.float32))
    per_replica = repl.run(rp.compute_average_loss, batch)
    np.testing.assert_allclose(per_replica, [1.25, 2.25])
    assert float(repl.reduce(rp.ReduceOp.SUM, per_replica)) == 3.5
    assert float(repl.reduce(rp.ReduceOp.MEAN, per_replica)) == 1.75


def test_outside_run_the_batch_is_global():
    assert float(rp.compute_average_loss(jnp.array([2.0, 3.0, 4.0, 5.0]))) == 3.5
    assert float(rp.compute_average_loss(jnp.array([2.0, 3.0]), global_batch_size=4)) == 1.25


def test_all_axes_are_summed_and_weights_broadcast():
    loss = jnp.arange(6.0).reshape(2, 3)  # [batch, time]
    assert float(rp.compute_average_loss(loss)) == pytest.approx(15.0 / 2)
    weight = jnp.array([1.0, 0.0])[:, None]
    assert float(rp.compute_average_loss(loss, sample_weight=weight)) == pytest.approx(3.0 / 2)


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="rank >= 1"):
        rp.compute_average_loss(jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"sample_weight\[:, None\]"):
        rp.compute_average_loss(jnp.ones((4, 3)), sample_weight=jnp.ones(4))


def test_padded_final_batch_counts_only_real_examples():
    # 5 real examples padded to a global batch of 8 over 8 replicas.
    repl = rp.Replicator()
    losses = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 99.0, 99.0, 99.0], np.float32)
    mask = np.array([1, 1, 1, 1, 1, 0, 0, 0], np.float32)
    batch = repl.shard_batch({"loss": losses, "mask": mask})

    def step(b):
        return rp.compute_average_loss(b["loss"], global_batch_size=5, sample_weight=b["mask"])

    total = repl.reduce(rp.ReduceOp.SUM, repl.run(step, batch))
    assert float(total) == pytest.approx(3.0)  # mean of the 5 real losses


def test_scale_regularization_loss_counts_once_across_replicas():
    repl = rp.Replicator()
    assert float(rp.scale_regularization_loss(jnp.array([1.0, 2.0]))) == 3.0
    batch = repl.shard_batch(np.zeros(8, np.float32))

    def step(b, reg):
        return rp.scale_regularization_loss(reg) + 0 * b.sum()

    per_replica = repl.run(step, batch, jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(per_replica, np.full(8, 3.0 / 8))
    assert float(repl.reduce(rp.ReduceOp.SUM, per_replica)) == pytest.approx(3.0)
