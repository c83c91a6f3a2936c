"""`replicator.compiled.hlo.analyze` against programs whose counts are known by hand, on 8 CPU
devices: FLOPs with loop trip counts, collectives by kind and mesh axis, HBM bytes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.compiled import hlo as hlo
from replicator.compiled import replica_groups as replica_groups

L, M, K, N = 5, 64, 128, 256  # layers; rows, contraction, columns of each matmul


def abstract(shape, mesh=None, spec=None, dtype=jnp.float32):
    sharding = None if mesh is None else NamedSharding(mesh, spec or P())
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def scanned(x, w):
    return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]


def compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


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


# XLA:GPU hands matrix products to libraries as custom calls; their text as XLA:GPU
# prints it (the formats of XLA's own gemm-rewriter, conv-rewriter and fused-attention
# tests): a cuBLAS GEMM with its workspace, cuDNN's flash attention forward and
# backward (q, k, v as [batch, time, heads, head_dim], JAX's layout), and a cuDNN
# convolution with both of its backward kinds.
_DOT = (
    '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
    '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}'
)
_BMM = (
    '"bmm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],'
    '"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","2"],'
    '"rhs_batch_dimensions":["0","2"]},"bmm2_dot_dimension_numbers":{'
    '"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["1"],'
    '"lhs_batch_dimensions":["0","1"],"rhs_batch_dimensions":["0","2"]}'
)
_BMM_GRAD = (
    '"bmm1_grad_gemm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],'
    '"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0","1"],'
    '"rhs_batch_dimensions":["0","2"]},"bmm2_grad_gemm2_dot_dimension_numbers":{'
    '"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],'
    '"lhs_batch_dimensions":["0","2"],"rhs_batch_dimensions":["0","2"]}'
)
GPU_PROGRAM = f"""HloModule gpu_step, entry_computation_layout={{()->f32[]}}

ENTRY %main (a: bf16[64,128], b: bf16[128,256], q: bf16[2,512,4,64], k: bf16[2,512,4,64], v: bf16[2,512,4,64], x: f32[8,28,28,1], w: f32[3,3,1,32], g: f32[8,28,28,32]) -> f32[] {{
  %a = bf16[64,128]{{1,0}} parameter(0)
  %b = bf16[128,256]{{1,0}} parameter(1)
  %gemm = (bf16[64,256]{{1,0}}, s8[4194304]{{0}}) custom-call(bf16[64,128]{{1,0}} %a, bf16[128,256]{{1,0}} %b), custom_call_target="__cublas$gemm", backend_config={{"operation_queue_id":"0","gemm_backend_config":{{"alpha_real":1,"beta":0,{_DOT},"epilogue":"DEFAULT"}}}}
  %q = bf16[2,512,4,64]{{3,2,1,0}} parameter(2)
  %k = bf16[2,512,4,64]{{3,2,1,0}} parameter(3)
  %v = bf16[2,512,4,64]{{3,2,1,0}} parameter(4)
  %fmha = (bf16[2,512,4,64]{{3,2,1,0}}, f32[2,4,512]{{2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={{"cudnn_fmha_backend_config":{{"fmha_scale":0.125,"is_flash_attention":true,"mask_type":"CAUSAL",{_BMM}}}}}
  %fmha_bwd = (bf16[2,512,4,64]{{3,2,1,0}}, bf16[2,512,4,64]{{3,2,1,0}}, bf16[2,512,4,64]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v, %q), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={{"cudnn_fmha_backend_config":{{"is_flash_attention":true,{_BMM_GRAD}}}}}
  %x = f32[8,28,28,1]{{3,2,1,0}} parameter(5)
  %w = f32[3,3,1,32]{{3,2,1,0}} parameter(6)
  %g = f32[8,28,28,32]{{3,2,1,0}} parameter(7)
  %conv = (f32[8,28,28,32]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%x, %w), window={{size=3x3 pad=1_1x1_1}}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convForward"
  %dx = (f32[8,28,28,1]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%g, %w), window={{size=3x3 pad=1_1x1_1}}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convBackwardInput"
  %dw = (f32[3,3,1,32]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%x, %g), window={{size=3x3 pad=1_1x1_1}}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convBackwardFilter"
  ROOT %r = f32[] constant(0)
}}
"""  # noqa: E501  (XLA's lines, as printed)


def test_gpu_library_calls_count_as_the_products_they_compute():
    gemm = 2 * 64 * 256 * 128
    attention = 2 * (2 * 4) * 512 * 512 * 64  # one product: batch x heads, queries x keys x d
    same = (
        8
        * 32
        * 1
        * sum(  # a 3x3 SAME convolution: the window positions on input
            min(i + 1, 28 - 1) - max(i - 1, 0) + 1 for i in range(28)
        )
        ** 2
        * 2
    )
    expected = gemm + 2 * attention + 5 * attention + 3 * same
    assert hlo.analyze(GPU_PROGRAM).flops == expected


def test_a_conv_counted_as_a_gpu_library_call_equals_the_same_convolution_on_cpu():
    x, k = abstract((8, 28, 28, 1)), abstract((3, 3, 1, 32))
    conv = lambda x, k: jax.lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    cpu = hlo.analyze(compiled_text(conv, x, k)).flops
    gpu = hlo.analyze(GPU_PROGRAM.replace('"__cudnn$convBackward', '"other$')).flops
    gemm, attention = 2 * 64 * 256 * 128, 2 * 8 * 512 * 512 * 64
    assert gpu - gemm - 7 * attention == cpu
