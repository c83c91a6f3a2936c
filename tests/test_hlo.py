"""`replicator.hlo.analyze` against programs whose counts are known by hand, on 8 CPU
devices: FLOPs with loop trip counts, collectives by kind and mesh axis, HBM bytes."""

import doctest
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replicator import hlo, replica_groups

L, M, K, N = 5, 64, 128, 256  # layers; rows, contraction, columns of each matmul


def abstract(shape, mesh=None, spec=None, dtype=jnp.float32):
    sharding = None if mesh is None else NamedSharding(mesh, spec or P())
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def scanned(x, w):
    return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]


def compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_the_doctests():
    assert doctest.testmod(hlo).failed == 0
    assert doctest.testmod(replica_groups).failed == 0


def test_a_scanned_matmul_counts_every_trip():
    x, w = abstract((M, K)), abstract((L, K, K))
    text = compiled_text(scanned, x, w)
    analysis = hlo.analyze(text)
    assert analysis.flops == L * 2 * M * K * K
    assert analysis.notes == ()
    # XLA's own count sees the body once (plus elementwise work): about L times fewer.
    xla = jax.jit(scanned).lower(x, w).compile().cost_analysis()["flops"]
    assert xla < analysis.flops / (L - 1)


def test_the_trip_count_is_read_off_the_condition_without_xlas_note():
    text = compiled_text(scanned, abstract((M, K)), abstract((L, K, K)))
    assert '"known_trip_count"' in text
    bare = re.sub(r', backend_config=\{"dynamic_variables".*', "", text)
    assert '"known_trip_count"' not in bare
    assert hlo.analyze(bare).flops == L * 2 * M * K * K


def test_gradients_of_a_scan_count_forward_and_both_backward_products():
    def loss(w, x):
        return scanned(x, w).sum()

    text = compiled_text(jax.grad(loss, argnums=(0, 1)), abstract((L, K, K)), abstract((M, K)))
    assert hlo.analyze(text).flops == 3 * L * 2 * M * K * K


def test_a_loop_inside_a_loop_multiplies_the_trip_counts():
    def nested(x, w):
        return jax.lax.fori_loop(0, 3, lambda i, c: scanned(c, w), x)

    text = compiled_text(nested, abstract((M, K)), abstract((L, K, K)))
    assert hlo.analyze(text).flops == 3 * L * 2 * M * K * K


def test_a_conditional_costs_its_dearest_branch():
    def step(p, x, w):
        return jax.lax.cond(p, lambda: jnp.tanh(x @ w), lambda: x)

    text = compiled_text(step, abstract((), dtype=jnp.bool_), abstract((M, K)), abstract((K, K)))
    assert " conditional(" in text
    assert hlo.analyze(text).flops == 2 * M * K * K


def conv(x, k, padding):
    return jax.lax.conv_general_dilated(
        x, k, (1, 1), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def test_a_convolution_counts_the_window_positions_that_read_input():
    x, k = abstract((8, 16, 16, 3)), abstract((3, 3, 3, 32))
    valid = hlo.analyze(compiled_text(lambda x, k: conv(x, k, "VALID"), x, k)).flops
    assert valid == 2 * (8 * 14 * 14 * 32) * (3 * 3 * 3)
    # SAME: the window hangs over the edge at the borders, on padding (16 x 3 - 2 per axis).
    same = hlo.analyze(compiled_text(lambda x, k: conv(x, k, "SAME"), x, k)).flops
    assert same == 2 * 8 * 32 * 3 * (16 * 3 - 2) ** 2


@pytest.fixture
def mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "fsdp"))


def test_a_psum_over_data_is_an_all_reduce_on_data(mesh):
    def step(x):
        return jax.lax.psum(x, "data")

    sharded = jax.shard_map(step, mesh=mesh, in_specs=P("data", "fsdp"), out_specs=P(None, "fsdp"))
    x = abstract((4 * 16, 2 * 32), mesh, P("data", "fsdp"))
    (reduce,) = hlo.analyze(compiled_text(sharded, x), mesh).collectives
    local = 16 * 32 * 4
    assert (reduce.kind, reduce.axes, reduce.dcn, reduce.count) == (
        "all-reduce",
        ("data",),
        False,
        1,
    )
    assert reduce.bytes == 2 * local * 3 / 4


def test_fsdp_gathers_over_fsdp_and_scatters_gradients_over_it(mesh):
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    w = abstract((K, N), mesh, P("fsdp", None))
    x = abstract((8 * M, K), mesh, P(("data", "fsdp"), None))
    step = jax.jit(jax.grad(loss), out_shardings=NamedSharding(mesh, P("fsdp", None)))
    analysis = hlo.analyze(step.lower(w, x).compile().as_text(), mesh)
    kinds = {(c.kind, c.axes) for c in analysis.collectives}
    assert ("all-gather", ("fsdp",)) in kinds
    reduced = [c for c in analysis.collectives if c.kind in ("reduce-scatter", "all-reduce")]
    assert reduced and {a for c in reduced for a in c.axes} == {"data", "fsdp"}
    assert analysis.flops == 2 * 2 * M * K * N  # forward and weight gradient, per device
    assert analysis.collective_bytes() == sum(c.bytes for c in analysis.collectives)


def test_replica_groups_written_as_mesh_axes():
    line = (
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
        "{'axis_0'}, dimensions={1}"
    )
    assert replica_groups.of(line) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups.of("replica_groups=mesh['a'=8,'b'=1] {'a'}, x") == [list(range(8))]
    halves = replica_groups.of(
        "replica_groups=mesh['a'=8] {'a':(2)2}"
    )  # the middle factor of 2x2x2
    assert halves == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert replica_groups.of("replica_groups={{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert replica_groups.of("replica_groups=[2,2]<=[4]") == [[0, 1], [2, 3]]


def test_hbm_bytes_of_an_elementwise_step():
    x = abstract((1024, 256))
    analysis = hlo.analyze(compiled_text(lambda x: jnp.tanh(x) * 2.0, x))
    size = 1024 * 256 * 4
    assert analysis.hbm_bytes == pytest.approx(2 * size)  # read once, written once
    assert analysis.collectives == () and analysis.flops == 0


def test_a_stacked_buffer_sliced_in_a_loop_counts_its_slices():
    x, w = abstract((M, K)), abstract((L, K, K))
    analysis = hlo.analyze(compiled_text(scanned, x, w))
    layer, carry = K * K * 4, M * K * 4
    # Each trip copies one layer's weights out of the stack (read, write), the matmul
    # reads the carry and the layer and writes the carry, tanh reads and writes it;
    # the carry is copied in once. Reading the whole stack each trip would add L x stack.
    per_trip = 2 * layer + (carry + layer + carry) + 2 * carry
    assert analysis.hbm_bytes == pytest.approx(L * per_trip + 2 * carry, rel=0.01)
