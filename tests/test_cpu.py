"""CPU defaults: the max-pool lowering changes speed, never results."""

import platform

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp
from replicator.spmd import cpu as cpu


def pool_loss(x):
    return jnp.sum(nn.max_pool(x, (2, 2), strides=(2, 2)) * jnp.arange(1.0, 5.0))


def numpy_pool_and_grad(x, weights):
    """Max pool 2x2 / stride 2 and its gradient, the cotangent to each window's first max."""
    n, h, w, c = x.shape
    out = np.zeros((n, h // 2, w // 2, c), x.dtype)
    grad = np.zeros_like(x)
    for b, i, j, k in np.ndindex(out.shape):
        window = x[b, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2, k]
        out[b, i, j, k] = window.max()
        di, dj = np.unravel_index(np.argmax(window), window.shape)  # first max, row-major
        grad[b, 2 * i + di, 2 * j + dj, k] = weights[k]
    return out, grad


def test_max_pool_lowering_matches_xla_semantics_and_avoids_select_and_scatter():
    cpu.install_max_pool_lowering()
    # Integer-valued inputs: many ties inside windows, where routing matters; odd sizes
    # leave a remainder row and column outside every window.
    x = np.random.default_rng(0).integers(0, 3, (2, 9, 7, 4)).astype(np.float32)
    expected_out, expected_grad = numpy_pool_and_grad(x, np.arange(1.0, 5.0, dtype=np.float32))
    lowered = jax.jit(jax.grad(pool_loss)).lower(jnp.asarray(x))
    assert "select_and_scatter" not in lowered.as_text()
    np.testing.assert_array_equal(lowered.compile()(x), expected_grad)
    pooled = jax.jit(lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)))(x)
    np.testing.assert_array_equal(pooled, expected_out)


def test_overlapping_windows_keep_jax_lowering():
    cpu.install_max_pool_lowering()
    x = jnp.arange(2 * 6 * 6 * 1.0).reshape(2, 6, 6, 1)
    loss = lambda x: jnp.sum(nn.max_pool(x, (3, 3), strides=(2, 2)) ** 2)
    text = jax.jit(jax.grad(loss)).lower(x).as_text()
    assert "select_and_scatter" in text


def test_replicator_on_cpu_compiles_convolutions_with_eigen():
    one = rp.Replicator(devices=jax.devices()[:1])
    assert one._compiler_options == cpu.COMPILER_OPTIONS
    several = rp.Replicator()  # 8 devices in this process: the same options, JAX's scheduler
    assert several._compiler_options == cpu.COMPILER_OPTIONS
    assert rp.Replicator(cpu_defaults=False)._compiler_options is None


def test_keep_freed_memory_takes_effect_on_glibc():
    assert cpu.keep_freed_memory() == (
        platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    )
