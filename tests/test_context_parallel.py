"""Context parallelism (`replicator.attention.context`) over the mesh axis ``context``.

The invariant: attention over a sequence split on ``context`` (keys and values
gathered, or passed round a ring; in order or load balanced) computes what one
device's causal attention of the whole sequence computes, values and gradients,
in the global view and inside a ``shard_map``, whichever kernel computes its
blocks (XLA's, or splash's in Pallas's interpreter). The ring's program passes
blocks (``collective-permute``) and never gathers them; the gather's gathers them.
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.attention import blocks as blocks
from replicator.attention import context as cpl
from replicator.compiled import hlo as hlo
from replicator.errors import ConfigError

BATCH, LENGTH, HEADS, HEAD_DIM = 4, 16, 2, 8


@functools.cache
def _inputs(batch=BATCH, kv_heads=HEADS):
    """Host arrays: made under whichever mesh the first test sets, device arrays would
    keep its sharding into the tests that set another."""
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, LENGTH, HEADS, HEAD_DIM))
    k, v = (jax.random.normal(key, (batch, LENGTH, kv_heads, HEAD_DIM)) for key in keys[1:3])
    return tuple(np.asarray(x) for x in (q, k, v, jax.random.normal(keys[3], q.shape)))


@functools.cache
def _reference(batch=BATCH, kv_heads=HEADS):
    """One device's attention of the sequence in its original order, and its gradients."""
    q, k, v, cotangent = _inputs(batch, kv_heads)
    return _attend_and_pull(_plain, cotangent)(q, k, v)


def _plain(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _attend_and_pull(attend, cotangent):
    """A jitted ``(q, k, v) -> (output, gradients of sum(output * cotangent))``."""

    def both(q, k, v):
        out, pull = jax.vjp(attend, q, k, v)
        return out, pull(cotangent)

    return jax.jit(both)


def _mesh(cp):
    return jax.make_mesh((8 // cp, cp), ("data", "context"), axis_types=(AxisType.Auto,) * 2)


def _check(attend, cp, balanced, batch=BATCH, kv_heads=HEADS, place=lambda x: x):
    """``attend`` on the (reordered) sequence equals `_reference`, values and gradients."""
    order = (lambda x: cpl.load_balance(x, cp)) if balanced else (lambda x: x)
    back = (lambda x: cpl.restore_order(x, cp)) if balanced else (lambda x: x)
    expected, expected_grads = _reference(batch, kv_heads)
    q, k, v, cotangent = (place(order(x)) for x in _inputs(batch, kv_heads))
    out, grads = _attend_and_pull(attend, cotangent)(q, k, v)
    np.testing.assert_allclose(back(out), expected, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(back(got), want, atol=1e-5)


CASES = [
    (cp, strategy, balanced)
    for cp in (2, 4)
    for strategy in cpl.STRATEGIES
    for balanced in (False, True)
]


@pytest.mark.parametrize(
    "cp, strategy, balanced",
    [pytest.param(*case, marks=[pytest.mark.slow] if case[0] == 2 else []) for case in CASES],
)  # (CP = 2: the chunked cases below and the LM's tests run it on every make test)
def test_the_global_view_equals_one_device(cp, strategy, balanced):
    mesh = _mesh(cp)

    def attend(q, k, v):
        return cpl.context_attention(q, k, v, strategy=strategy, load_balanced=balanced)

    with jax.set_mesh(mesh):
        _check(attend, cp, balanced, place=lambda x: jax.device_put(x, P("data", "context")))


@pytest.mark.parametrize(
    "balanced, strategy",
    [
        (False, "gather"),
        pytest.param(False, "ring", marks=pytest.mark.slow),
        pytest.param(True, "gather", marks=pytest.mark.slow),
        (True, "ring"),
    ],
)  # (each strategy and each balance runs on every make test)
def test_chunks_smaller_than_a_block_equal_one_device(strategy, balanced):
    # 16 positions over context=2: blocks of 8, chunks of 2 (4 x 4 pairs per block).
    def attend(q, k, v):
        return cpl.context_attention(q, k, v, strategy=strategy, load_balanced=balanced, chunk=2)

    with jax.set_mesh(_mesh(2)):
        _check(attend, 2, balanced, place=lambda x: jax.device_put(x, P("data", "context")))


def test_a_whole_sequence_on_every_shard_is_chunked_too():
    # run's shape without a tensor axis: context manual, the inputs the same on each.
    def attend(q, k, v):
        return jax.shard_map(
            lambda q, k, v: cpl.context_attention(q, k, v, strategy="ring", chunk=4),
            in_specs=(P("data"),) * 3, out_specs=P("data"), check_vma=True,
        )(q, k, v)  # fmt: skip

    with jax.set_mesh(_mesh(2)):
        _check(attend, 2, False)


def _temporaries(strategy, chunk, length=4096):
    """Bytes of temporaries in the compiled gradient of one sequence over context=8."""
    mesh = jax.make_mesh((8,), ("context",), axis_types=(AxisType.Auto,))
    q = jax.ShapeDtypeStruct(
        (1, length, 2, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, "context"))
    )

    def loss(q):
        return jnp.sum(cpl.context_attention(q, q, q, strategy=strategy, chunk=chunk) ** 2)

    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(loss)).lower(q).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("strategy", cpl.STRATEGIES)
def test_a_device_holds_one_chunk_of_scores_not_a_block(strategy):
    # Blocks of 512 positions: 512 x 512 x 2 heads of float32 scores is 2 MiB each;
    # chunks of 64 hold 32 KiB each, and nothing else the program keeps grows with T^2.
    whole, chunked = _temporaries(strategy, 512), _temporaries(strategy, 64)
    assert whole > 2 * 2**20, whole
    assert chunked < whole / 4, (chunked, whole)


@pytest.mark.parametrize(
    "cp, strategy, balanced",
    [
        pytest.param(*case, marks=[pytest.mark.slow] if case[0] == 2 or not case[2] else [])
        for case in CASES
    ],
)  # (CP = 4 balanced, both strategies, on every make test)
def test_inside_a_shard_map_over_data_and_context_equals_one_device(cp, strategy, balanced):
    spec = P("data", "context")

    def attend(q, k, v):
        return jax.shard_map(
            lambda q, k, v: cpl.context_attention(
                q, k, v, strategy=strategy, load_balanced=balanced
            ),
            in_specs=(spec, spec, spec),
            out_specs=spec,
            check_vma=strategy == "ring",  # both kinds of shard_map
        )(q, k, v)

    with jax.set_mesh(_mesh(cp)):
        _check(attend, cp, balanced)


@pytest.mark.parametrize("strategy", ["ring", pytest.param("gather", marks=pytest.mark.slow)])
def test_grouped_heads_and_a_batch_that_does_not_split_over_data(strategy):
    # 3 rows over data=2: the batch is left to the compiler; 1 key/value head for 2.
    def attend(q, k, v):
        return cpl.context_attention(q, k, v, strategy=strategy, load_balanced=True)

    with jax.set_mesh(_mesh(4)):
        _check(attend, 4, True, batch=3, kv_heads=1)


@pytest.mark.parametrize("strategy", cpl.STRATEGIES)
def test_under_a_shard_map_over_data_only_context_is_split_inside(strategy):
    # Replicator.run's shape: data manual (check_vma on), context left automatic.
    def attend(q, k, v):
        return jax.shard_map(
            lambda q, k, v: cpl.context_attention(q, k, v, strategy=strategy),
            in_specs=(P("data"),) * 3,
            out_specs=P("data"),
            axis_names={"data"},
        )(q, k, v)

    with jax.set_mesh(_mesh(2)):
        _check(attend, 2, False)


def test_without_a_context_axis_it_is_causal_attention():
    _check(lambda *x: cpl.context_attention(*x, strategy="ring"), 1, False)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        _check(lambda *x: cpl.context_attention(*x, load_balanced=True), 1, True)


@pytest.mark.parametrize(
    "mesh", [{"data": 2, "context": 4}, {"data": 2, "context": 2, "tensor": 2}]
)
def test_both_replicator_paths_equal_one_device(mesh):
    # run: every axis manual (context unsplit: each device attends over the whole
    # sequence), or data manual beside tensor (context split inside, nested).
    repl = rp.Replicator(mesh=mesh)
    q, k, v, _ = _inputs()
    expected = _reference()[0]
    batch = repl.shard_batch({"q": np.asarray(q), "k": np.asarray(k), "v": np.asarray(v)})

    def step(batch):
        return cpl.context_attention(batch["q"], batch["k"], batch["v"], strategy="ring")

    np.testing.assert_allclose(repl.compile(step)(batch), expected, atol=1e-5)
    per_replica = repl.run(step, batch)
    np.testing.assert_allclose(np.concatenate(list(per_replica)), expected, atol=1e-5)


@functools.cache
def _analysis(strategy, grad):
    """The compiled program (values, or gradients too) on a balanced sequence, CP = 4."""
    mesh = _mesh(4)
    q = jax.device_put(jnp.ones((2, 64, 2, 8)), NamedSharding(mesh, P("data", "context")))

    def attend(q):
        return cpl.context_attention(q, q, q, strategy=strategy, load_balanced=True)

    fn = jax.grad(lambda q: jnp.sum(attend(q) ** 2)) if grad else attend
    with jax.set_mesh(mesh):
        report = hlo.analyze(jax.jit(fn).lower(q).compile().as_text(), mesh)
    kinds = {}
    for c in report.collectives:
        kinds.setdefault(c.kind, set()).add(tuple(c.axes))
    return report.flops, kinds


@pytest.mark.parametrize("strategy", cpl.STRATEGIES)
def test_balanced_attention_computes_only_what_the_mask_leaves_visible(strategy):
    # Per device (1 row, 16 of 64 positions, 2 heads of 8): the diagonal's 3 of 4
    # quarter-blocks and half of every other shard's block, (2 CP + 1) / (4 CP) of the
    # 2 x 2 x 16 x 64 x 2 x 8 FLOPs (q k^T and p v) of masking the whole product.
    assert _analysis(strategy, False)[0] == 4 * 16 * 64 * 2 * 8 * 9 / 16


def test_the_ring_passes_blocks_and_never_gathers_them():
    kinds = _analysis("ring", True)[1]  # backward pass included
    assert ("context",) in kinds.get("collective-permute", set()), kinds
    assert not any("context" in axes for axes in kinds.get("all-gather", set())), kinds


def test_the_gather_strategy_gathers_keys_and_values_over_context():
    kinds = _analysis("gather", False)[1]
    assert ("context",) in kinds.get("all-gather", set()), kinds
    assert "collective-permute" not in kinds, kinds


# ------------------------------------------------------------ the kernel interface


def _dense_block(q, k, v, ids, causal):
    """Queries at positions 128..255 attending to keys at 0..255 (dense, float32)."""
    scores = jnp.einsum("bqkgd,bskd->bqkgs", q, k) / np.sqrt(q.shape[-1])
    visible = ids[:, 128:, None] == ids[:, None, :]
    if causal:
        visible &= (128 + np.arange(128))[:, None] >= np.arange(256)[None, :]
    scores = jnp.where(visible[:, :, None, None], scores, -jnp.inf)
    return jnp.einsum("bqkgs,bskd->bqkgd", jax.nn.softmax(scores, axis=-1), v)


@pytest.mark.parametrize(  # each kernel and each mask in make test; the other two slow
    "implementation, causal",
    [
        ("xla", True),
        ("splash", False),
        pytest.param("xla", False, marks=pytest.mark.slow),
        pytest.param("splash", True, marks=pytest.mark.slow),
    ],
)
def test_blocks_merged_by_their_log_sum_exps_equal_attention_to_all_keys(implementation, causal):
    # 128 queries against two blocks of 128 keys (the first wholly before them when
    # causal), 2 key heads of 2 queries each, documents that cross the blocks; each
    # block's gradients taken against the merged output and log-sum-exp.
    kernel = blocks.Kernel(implementation, chunk=32, interpret=True)
    keys = jax.random.split(jax.random.key(3), 4)
    q, d_out = (jax.random.normal(key, (2, 128, 2, 2, 8)) for key in keys[:2])
    k, v = (jax.random.normal(key, (2, 256, 2, 8)) for key in keys[2:])
    ids = np.cumsum(np.random.default_rng(0).random((2, 256)) < 0.02, axis=1).astype(np.int32)
    halves = [(0, 128, 128), (128, 256, 0)]  # keys [a, b), the queries' offset from a

    @jax.jit
    def attend_and_pull(q, k, v, d_out):
        def each(fn, *args):
            return [
                fn(kernel, q, k[:, a:b], v[:, a:b], *args, causal=causal, offset=offset,
                   segments=(ids[:, 128:], ids[:, a:b]))
                for a, b, offset in halves
            ]  # fmt: skip

        out, lse = blocks.merge(*each(blocks.attend_block))
        grads = each(blocks.block_grads, out, lse, d_out)
        d_q = sum(g[0] for g in grads)
        return out, (d_q, *(jnp.concatenate(g, axis=1) for g in list(zip(*grads))[1:]))

    out, grads = attend_and_pull(q, k, v, d_out)
    want, pull = jax.vjp(lambda q, k, v: _dense_block(q, k, v, ids, causal), q, k, v)
    np.testing.assert_allclose(out, want, atol=1e-5)
    for got, expected in zip(grads, pull(d_out)):
        np.testing.assert_allclose(got, expected, atol=1e-4)


def test_each_platform_has_its_block_kernel():
    assert blocks.choose_kernel("auto", 1024).implementation == "xla"  # on CPU
    assert blocks.choose_kernel("cudnn", 1024).implementation == "xla"  # cuDNN gives no LSE
    assert blocks.choose_kernel("splash", 1024, 512) == blocks.Kernel("splash", 512, True)
    assert blocks.choose_kernel("auto", 1024, chunk=64).chunk == 64


def _splash_inputs():
    keys = jax.random.split(jax.random.key(4), 4)
    q, cotangent = (np.asarray(jax.random.normal(x, (2, 512, 4, 8))) for x in keys[:2])
    k, v = (np.asarray(jax.random.normal(x, (2, 512, 2, 8))) for x in keys[2:])
    return q, k, v, cotangent


@pytest.mark.parametrize("strategy", ["ring", pytest.param("gather", marks=pytest.mark.slow)])
def test_splash_blocks_under_context_equal_one_device(strategy):
    # Pallas's interpreter on CPU: the TPU's splash kernels per block (halves of 128
    # positions, load balanced over context=2), with the key heads split over tensor
    # (the program manual over every axis), values and gradients.
    q, k, v, cotangent = _splash_inputs()
    expected, expected_grads = _attend_and_pull(_plain, cotangent)(q, k, v)
    mesh = jax.make_mesh((2, 2, 2), ("data", "context", "tensor"), axis_types=(AxisType.Auto,) * 3)

    def attend(q, k, v):
        return cpl.context_attention(
            q, k, v, strategy=strategy, load_balanced=True, implementation="splash"
        )

    balance, back = (lambda x: cpl.load_balance(x, 2)), (lambda x: cpl.restore_order(x, 2))
    with jax.set_mesh(mesh):
        place = lambda x: jax.device_put(balance(x), P("data", "context", "tensor"))  # noqa: E731
        out, grads = _attend_and_pull(attend, balance(cotangent))(*map(place, (q, k, v)))
    np.testing.assert_allclose(back(out), expected, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(back(got), want, atol=1e-5)


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed here: pip install -e '.[tpu]' (make install does)",
)
def test_a_split_sequence_compiles_to_splash_blocks_for_a_tpu():
    # libtpu compiles for a v5e-4 from this CPU host: "auto" picks splash for the
    # blocks of the ring there, forward (with its log-sum-exp) and backward.
    from replicator.compiled import topology as topology

    devices = np.array(topology.devices("v5e-4")).reshape(2, 2)
    mesh = jax.sharding.Mesh(devices, ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    x = jax.ShapeDtypeStruct(
        (2, 1024, 2, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", "context"))
    )

    def loss(x):
        out = cpl.context_attention(x, x, x, strategy="ring", load_balanced=True)
        return jnp.sum(out.astype(jnp.float32))

    with jax.set_mesh(mesh):
        assert blocks.choose_kernel("auto", 256) == blocks.Kernel("splash", interpret=False)
        text = jax.jit(jax.grad(loss)).lower(x).compile().as_text()
    for kernel in ("fwd_residuals", "dq", "dkv"):
        assert f"splash_mqa_{kernel}" in text, kernel


# ------------------------------------------------------------ load balancing


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_load_balance_round_trips_exactly(cp):
    x = np.arange(3 * 16 * 2).reshape(3, 16, 2)
    balanced = cpl.load_balance(x, cp)
    assert isinstance(balanced, np.ndarray)
    np.testing.assert_array_equal(cpl.restore_order(balanced, cp), x)
    np.testing.assert_array_equal(cpl.restore_order(cpl.load_balance(jnp.asarray(x), cp), cp), x)
    np.testing.assert_array_equal(  # every element lands at the position the helper names
        balanced[0, :, 0] // 2, cpl.context_positions(16, cp, load_balanced=True)
    )
    if cp > 1:
        shards = np.split(cpl.context_positions(16, cp, load_balanced=True), cp)
        for i, shard in enumerate(shards):  # shard i: chunks i and 2cp-1-i
            np.testing.assert_array_equal(shard, cpl.context_positions(16, cp, True, shard=i))
            chunks = set(shard // (16 // (2 * cp)))
            assert chunks == {i, 2 * cp - 1 - i}


def test_positions_of_a_traced_shard():
    mesh = _mesh(4)
    positions = jax.shard_map(
        lambda: cpl.context_positions(16, 4, True, shard=jax.lax.axis_index("context")),
        mesh=mesh, in_specs=(), out_specs=P("context"), axis_names={"context"},
    )()  # fmt: skip
    np.testing.assert_array_equal(positions, cpl.context_positions(16, 4, load_balanced=True))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: cpl.load_balance(np.zeros((2, 12)), 4), "a sequence of 12 tokens does not split"),
        (lambda: cpl.restore_order(np.zeros((2, 6)), 2), "divisible by 4"),
        (lambda: cpl.context_positions(10, 4), "divisible by 4"),
    ],
)
def test_a_length_that_does_not_split_is_one_line(call, message):
    with pytest.raises(ConfigError, match=message) as error:
        call()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "kwargs, shape, message",
    [
        (dict(load_balanced=True), (2, 12, 2, 8), "12 tokens does not split into 8"),
        (dict(), (2, 10, 2, 8), "10 tokens does not split into 4 equal chunks over mesh axis"),
        (dict(strategy="tree"), (2, 16, 2, 8), "strategy='tree'"),
        (dict(implementation="splash"), (2, 16, 2, 8), "blocks of a multiple of 128"),
        (dict(implementation="flash"), (2, 16, 2, 8), "attention='flash'"),
    ],
)
def test_attention_that_cannot_split_is_one_line(kwargs, shape, message):
    x = jnp.ones(shape)
    with jax.set_mesh(_mesh(4)), pytest.raises(ValueError, match=message) as error:
        cpl.context_attention(x, x, x, **kwargs)
    assert "\n" not in str(error.value)
    length_mistake = "tokens does not split" in message
    assert isinstance(error.value, ConfigError) == length_mistake  # a config's, exit 2


# ------------------------------------------------------------ a per-replica step's sequences


def _per_device(fn, mesh, *args):
    """``fn`` on every device of ``mesh`` (all axes manual, ``check_vma``), each with
    the whole of ``args``: `Replicator.run`'s shape without a tensor axis."""
    program = jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=True)
    return jax.jit(program)(*args)


@pytest.mark.parametrize("balanced", [False, True])
def test_split_and_gathered_sequences_give_one_devices_gradients(balanced):
    # The gradient of a parameter that is the same on every device (SGD sees a
    # factor of CP where Adam would hide it) and of the input, through the ring.
    x = jax.random.normal(jax.random.key(1), (2, 16, 2, 8))
    w = jax.random.normal(jax.random.key(2), (8,))

    def loss(w, x, cp):
        x = cpl.load_balance(x, cp) if balanced else x
        block = cpl.split_sequence(x) * w
        positions = cpl.sequence_positions(block, balanced)
        out = cpl.context_attention(block, block, block, strategy="ring", load_balanced=balanced)
        out = cpl.gather_sequence(out * (1 + positions[None, :, None, None]))
        out = cpl.restore_order(out, cp) if balanced else out
        return jnp.sum(jnp.sin(out))

    expected = jax.grad(loss, argnums=(0, 1))(w, x, 1)
    mesh = jax.make_mesh((4,), ("context",), axis_types=(AxisType.Explicit,))
    got = _per_device(jax.grad(functools.partial(loss, cp=4), argnums=(0, 1)), mesh, w, x)
    for g, e in zip(got, expected):  # float32 both: one device's own error is 3e-5 of them
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)


def test_a_split_sequence_positions_and_blocks():
    mesh = jax.make_mesh((4,), ("context",), axis_types=(AxisType.Explicit,))
    tokens = jnp.arange(16)[None]

    def blocks(tokens):
        block = cpl.split_sequence(tokens)
        positions = cpl.sequence_positions(block, load_balanced=True)
        return cpl.gather_sequence(block), cpl.gather_sequence(positions[None])

    whole, positions = _per_device(blocks, mesh, tokens)
    np.testing.assert_array_equal(whole, tokens)  # split, then gathered back in place
    np.testing.assert_array_equal(positions[0], cpl.context_positions(16, 4, True))


def _lm_step_temporaries(mesh, length=2048):
    """Temporaries of the LM's gradient, each device given the same whole sequence."""
    from experiments.lm.model import Transformer

    model = Transformer(vocab_size=64, num_layers=2, num_heads=2, embed_dim=32, max_len=length)
    tokens = jnp.zeros((1, length), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]

    def grads(params, tokens):
        return jax.grad(lambda p: jnp.sum(model.apply({"params": p}, tokens, targets=tokens)))(
            params
        )

    program = jax.shard_map(grads, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=True)
    shapes = (params, jax.ShapeDtypeStruct(tokens.shape, tokens.dtype))
    compiled = jax.jit(program).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_under_run_the_lm_holds_a_block_of_the_sequence_per_device():
    # Replicator.run's shape: each replica's whole sequence on its 8 context devices.
    # Split, a device holds 1/8 of the activations; data=8 is how it was before (each
    # device the whole sequence, as one device does).
    axes = (AxisType.Explicit,)
    split = _lm_step_temporaries(jax.make_mesh((8,), ("context",), axis_types=axes))
    whole = _lm_step_temporaries(jax.make_mesh((8,), ("data",), axis_types=axes))
    assert split < whole / 3, (split, whole)
