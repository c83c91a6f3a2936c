"""Splash attention's FLOPs counted from its shapes (replicator/compiled/kernels_cost.py).

libtpu compiles splash attention for a v5e slice here (no TPU); the count of its
kernels is checked against XLA's own attention, whose matrix products the HLO
shows: forward, the same products on the blocks splash computes; backward, the
recomputed scores on top. Skipped where libtpu cannot be imported.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replicator.compiled import hlo, kernels_cost

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed here"
)


@pytest.mark.parametrize("queries, bq, bk", [(2048, 512, 512), (1024, 512, 256), (768, 256, 512)])
def test_causal_blocks_are_the_blocks_with_an_unmasked_entry(queries, bq, bk):
    causal = np.tril(np.ones((queries, queries), bool))
    rows, columns = -(-queries // bq), -(-queries // bk)
    nonempty = sum(
        causal[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()
        for i in range(rows)
        for j in range(columns)
    )
    assert kernels_cost.causal_blocks(queries, queries, bq, bk) == (nonempty, rows * columns)


def test_a_kernel_it_does_not_know_is_none():
    types = "operand_layout_constraints={f32[8,128]{1,0}, f32[8,128]{1,0}}"
    assert kernels_cost.pallas_flops("my_kernel.3", types) is None
    assert kernels_cost.pallas_flops("splash_mha_fwd_residuals", "no operands") is None


def attention_program(implementation, length, heads=4, grad=False):
    """One v5e chip's compiled HLO of causal attention over [1, length, heads, 128]."""
    import replicator as rp
    from replicator.attention import kernels

    repl = rp.Replicator(devices=rp.topology.devices("v5e-1"), mesh={"data": 1})
    x = jax.ShapeDtypeStruct((1, length, heads, 128), jnp.bfloat16)

    def attend(q, k, v):
        out = kernels.causal_attention(q, k, v, implementation=implementation)
        return jnp.square(out.astype(jnp.float32)).sum()  # a cotangent of its own

    step = jax.grad(attend, argnums=(0, 1, 2)) if grad else attend
    with repl.context():
        return jax.jit(step).lower(x, x, x).compile().as_text()


@needs_libtpu
@pytest.mark.parametrize("length, computed", [(512, 1.0), (1024, 3 / 4)])
def test_splash_forward_counts_xlas_products_on_the_blocks_it_computes(length, computed):
    splash = hlo.analyze(attention_program("splash", length))
    xla = hlo.analyze(attention_program("xla", length))
    products = 4 * 4 * length * length * 128  # QK^T and PV over every block, 4 heads
    assert xla.flops == pytest.approx(products, rel=0.01)
    assert splash.flops == pytest.approx(products * computed, rel=0.01)
    assert any("block-causal" in note for note in splash.notes)
    assert not any("not counted" in note for note in splash.notes)


@needs_libtpu
def test_splash_backward_recomputes_the_scores_twice():
    """Forward 4, dq 6, dkv 8 per block: 18 / 4 of the forward; XLA's backward keeps
    the probabilities and does the 4 products of the gradient: 12 / 4."""
    length = 512  # one block: splash computes what XLA does
    forward = hlo.analyze(attention_program("splash", length)).flops
    splash = hlo.analyze(attention_program("splash", length, grad=True)).flops
    xla = hlo.analyze(attention_program("xla", length, grad=True)).flops
    assert splash == pytest.approx(forward * 18 / 4, rel=0.01)
    assert xla == pytest.approx(forward * 12 / 4, rel=0.02)
