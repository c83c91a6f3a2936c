"""Donation consumes what the Replicator placed, never the caller's own arrays.

``replicate``, ``shard_batch`` and ``distribute`` return arrays that a step with
``donate_argnums`` may consume; the arrays (jax or numpy) they were given stay
alive and unchanged, on one device and on eight.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp


def caller_arrays():
    """What a user passes: a jax array on the default device, a numpy array, a key."""
    return {
        "jax": jnp.arange(16.0).reshape(8, 2),
        "numpy": np.arange(16.0, dtype=np.float32).reshape(8, 2),
        "big": np.ones((8, 32768), np.float32),  # large enough to be placed zero-copy
    }


def placements(repl, tree):
    yield "replicate", repl.replicate(tree)
    yield "shard_batch", repl.shard_batch(tree)
    batches = repl.distribute([tree])
    yield "distribute", next(batches)
    batches.close()


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("path", ["compile", "run"])
def test_a_donating_step_leaves_the_callers_arrays_alone(num_devices, path):
    repl = rp.Replicator(devices=jax.devices()[:num_devices])

    def step(tree):
        return jax.tree.map(lambda x: x * 2 + 1, tree)

    donating = (
        repl.compile(step, donate_argnums=(0,))
        if path == "compile"
        else lambda tree: repl.run(step, tree, donate_argnums=(0,))
    )
    tree = caller_arrays()
    expected = jax.tree.map(np.array, tree)  # copies, to compare against
    for how, placed in placements(repl, tree):
        out = jax.block_until_ready(donating(placed))
        assert all(x.is_deleted() for x in jax.tree.leaves(placed)), how  # it did donate
        for name, x in tree.items():
            assert not (isinstance(x, jax.Array) and x.is_deleted()), (how, name)
            np.testing.assert_array_equal(np.asarray(x), expected[name], err_msg=f"{how} {name}")
        got = np.asarray(out["jax"]).reshape(8, 2)  # run stacks a batch's per-replica rows
        np.testing.assert_array_equal(got, expected["jax"] * 2 + 1)


def test_replicate_copies_only_what_would_alias():
    repl = rp.Replicator()
    placed = repl.replicate(jnp.ones(4))  # on device 0: its buffer would be reused there
    again = repl.replicate(placed)  # already where it belongs: a fresh copy all the same
    pointers = lambda a: {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
    assert not pointers(again) & pointers(placed)
    key = repl.replicate(jax.random.key(0))  # typed keys go through the same placement
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
