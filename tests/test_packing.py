"""Packed documents: several documents in one window, each as if alone.

The invariants: attention with segment ids equals a dense reference that masks
by causality and by document, on every kernel (XLA, splash in Pallas's
interpreter, the context-parallel paths with XLA's or splash's blocks: gathered
or a ring, load balanced or not, values and gradients); the LM's per-token
losses on a packed window equal each document's run alone, on both step paths
and over a context mesh; positions restart at every document, and no target is
the next document's first token.
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
from replicator.attention import context as cpl
from replicator.attention import kernels as attention_lib

BATCH, LENGTH, HEADS, HEAD_DIM = 4, 16, 2, 8


def _segment_ids(batch, length, seed=0):
    """Documents of random lengths (some of one token), the last row one document."""
    rng = np.random.default_rng(seed)
    starts = rng.random((batch, length)) < 0.3
    starts[:, 0] = False
    starts[-1] = False
    return np.cumsum(starts, axis=1).astype(np.int32)


def _dense_reference(q, k, v, ids):
    """NumPy: softmax over the keys at or before each query in its own document."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    length = q.shape[1]
    causal = np.arange(length)[:, None] >= np.arange(length)[None, :]
    same = ids[:, :, None] == ids[:, None, :]
    scores = np.where((causal & same)[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


@functools.cache
def _inputs(batch=BATCH, length=LENGTH):
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (batch, length, HEADS, HEAD_DIM)
    q, k, v, cotangent = (jax.random.normal(key, shape) for key in keys)
    return tuple(np.asarray(x) for x in (q, k, v, cotangent)) + (_segment_ids(batch, length),)


def _attend_and_pull(attend, cotangent):
    """A jitted ``(q, k, v, ids) -> (output, gradients of sum(output * cotangent))``."""

    def both(q, k, v, ids):
        out, pull = jax.vjp(lambda q, k, v: attend(q, k, v, ids), q, k, v)
        return out, pull(cotangent)

    return jax.jit(both)


@functools.cache
def _xla_reference(batch=BATCH, length=LENGTH):
    """Segmented XLA attention of the whole sequence on one device, and its gradients."""
    q, k, v, cotangent, ids = _inputs(batch, length)

    def attend(q, k, v, ids):
        return attention_lib.causal_attention(q, k, v, implementation="xla", segment_ids=ids)

    return _attend_and_pull(attend, cotangent)(q, k, v, ids)


def test_segmented_xla_attention_equals_a_dense_reference():
    q, k, v, _, ids = _inputs()
    got, _ = _xla_reference()
    np.testing.assert_allclose(got, _dense_reference(q, k, v, ids), atol=1e-5)
    # and the segments matter: without them the output differs
    plain = attention_lib.causal_attention(q, k, v, implementation="xla")
    assert not np.allclose(plain, got, atol=1e-3)


def test_segmented_splash_attention_equals_xla_values_and_gradients():
    # Pallas's interpreter on CPU: the TPU kernel's program, with SegmentIds.
    q, k, v, cotangent, ids = _inputs(batch=1, length=128)

    def attend(implementation):
        def fn(q, k, v, ids):
            return attention_lib.causal_attention(
                q, k, v, implementation=implementation, segment_ids=ids
            )

        return _attend_and_pull(fn, cotangent)(q, k, v, ids)

    (want, want_grads), (got, got_grads) = attend("xla"), attend("splash")
    np.testing.assert_allclose(want, _dense_reference(q, k, v, ids), atol=1e-5)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-4)


def test_segment_ids_of_the_wrong_shape_are_one_line():
    q, k, v, _, ids = _inputs()
    with pytest.raises(ValueError, match=r"segment_ids \(4, 8\).*\[batch, time\]"):
        attention_lib.causal_attention(q, k, v, segment_ids=ids[:, :8])
    with pytest.raises(ValueError, match=r"segment_ids \(4, 8\).*\[batch, time\]"):
        cpl.context_attention(q, k, v, segment_ids=ids[:, :8])


def _mesh(cp):
    return jax.make_mesh((8 // cp, cp), ("data", "context"), axis_types=(AxisType.Auto,) * 2)


def _check(attend, cp, balanced, place=lambda x: x):
    """``attend`` on the (reordered) sequence and ids equals `_xla_reference`."""
    order = (lambda x: cpl.load_balance(x, cp)) if balanced else (lambda x: x)
    back = (lambda x: cpl.restore_order(x, cp)) if balanced else (lambda x: x)
    expected, expected_grads = _xla_reference()
    q, k, v, cotangent, ids = (place(order(x)) for x in _inputs())
    out, grads = _attend_and_pull(attend, cotangent)(q, k, v, ids)
    np.testing.assert_allclose(back(out), expected, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(back(got), want, atol=1e-5)


@pytest.mark.parametrize("strategy", cpl.STRATEGIES)
@pytest.mark.parametrize("balanced", [False, True])
def test_context_attention_with_segments_equals_one_device(strategy, balanced):
    # 16 positions over context=2, chunks of 2: several pairs per block, documents
    # that straddle chunks, blocks and (load balanced) the reordered halves.
    def attend(q, k, v, ids):
        return cpl.context_attention(
            q, k, v, strategy=strategy, load_balanced=balanced, chunk=2, segment_ids=ids
        )

    with jax.set_mesh(_mesh(2)):
        _check(attend, 2, balanced, place=lambda x: jax.device_put(x, P("data", "context")))


@pytest.mark.parametrize("strategy", cpl.STRATEGIES)
def test_context_attention_with_segments_over_four_shards(strategy):
    def attend(q, k, v, ids):
        return cpl.context_attention(q, k, v, strategy=strategy, load_balanced=True,
                                     segment_ids=ids)  # fmt: skip

    with jax.set_mesh(_mesh(4)):
        _check(attend, 4, True, place=lambda x: jax.device_put(x, P("data", "context")))


def test_segments_on_a_whole_sequence_on_every_shard():
    # run's shape without a tensor axis: context manual, the inputs the same on each.
    def attend(q, k, v, ids):
        return jax.shard_map(
            lambda *args: cpl.context_attention(*args[:3], strategy="ring", chunk=4,
                                                segment_ids=args[3]),
            in_specs=(P("data"),) * 4, out_specs=P("data"), check_vma=True,
        )(q, k, v, ids)  # fmt: skip

    with jax.set_mesh(_mesh(2)):
        _check(attend, 2, False)


@pytest.mark.parametrize("strategy", cpl.STRATEGIES)
def test_segments_under_a_shard_map_over_data_only(strategy):
    # run's shape with a tensor axis: data manual, context left to the compiler (the
    # nested program, with a backward pass of its own).
    def attend(q, k, v, ids):
        return jax.shard_map(
            lambda *args: cpl.context_attention(*args[:3], strategy=strategy, chunk=4,
                                                segment_ids=args[3]),
            in_specs=(P("data"),) * 4, out_specs=P("data"), axis_names={"data"},
        )(q, k, v, ids)  # fmt: skip

    with jax.set_mesh(_mesh(2)):
        _check(attend, 2, False)


def test_splash_blocks_with_segments_under_context_equal_xla():
    # Pallas's interpreter on CPU: splash's kernels for the ring's blocks (halves of
    # 128 positions, load balanced over context=2), each masked by its two blocks' ids.
    q, k, v, cotangent, ids = _inputs(length=512)
    expected, expected_grads = _xla_reference(length=512)
    balance, back = (lambda x: cpl.load_balance(x, 2)), (lambda x: cpl.restore_order(x, 2))

    def attend(q, k, v, ids):
        return cpl.context_attention(
            q, k, v, strategy="ring", load_balanced=True, implementation="splash", segment_ids=ids
        )

    with jax.set_mesh(_mesh(2)):
        place = lambda x: jax.device_put(balance(x), P("data", "context"))  # noqa: E731
        out, grads = _attend_and_pull(attend, balance(cotangent))(*map(place, (q, k, v, ids)))
    np.testing.assert_allclose(back(out), expected, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(back(got), want, atol=1e-5)


def _layers_temporaries(strategy, segmented, length=1024, layers=2):
    """Bytes of temporaries in the gradient of a scan of attention layers over
    context=8, with or without segment ids."""
    mesh = jax.make_mesh((8,), ("context",), axis_types=(AxisType.Auto,))
    split = NamedSharding(mesh, P(None, "context"))
    x = jax.ShapeDtypeStruct((1, length, 2, 8), jnp.float32, sharding=split)
    ids = jax.ShapeDtypeStruct((1, length), jnp.int32, sharding=split)
    w = jax.ShapeDtypeStruct((layers, 8, 8), jnp.float32)

    def loss(w, x, ids):
        def layer(h, w_l):
            q = jnp.einsum("btnd,de->btne", h, w_l)
            out = cpl.context_attention(
                q, h, h, strategy=strategy, chunk=16, segment_ids=ids if segmented else None
            )
            return out, None

        return jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss)).lower(w, x, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("strategy", ["ring", pytest.param("gather", marks=pytest.mark.slow)])
def test_segment_masks_are_not_stacked_under_a_scan_of_layers(strategy):
    # Every pair's mask depends only on the ids, constant over the layers: left
    # loose, differentiating the scan hoisted them all out of it (2x the gather's
    # temporaries, 6x the ring's). Tied to the queries, each is made in its pair.
    plain, segmented = (_layers_temporaries(strategy, s) for s in (False, True))
    assert segmented < 1.1 * plain, (segmented, plain)


needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed here: pip install -e '.[tpu]' (make install does)",
)


@needs_libtpu
def test_segmented_attention_compiles_to_splash_for_a_tpu():
    # libtpu compiles for a v5e-4 from this CPU host: "auto" picks splash there, and
    # the segment ids reach the kernel (Pallas names its segmented variants so).
    from replicator.compiled import topology as topology

    mesh = jax.sharding.Mesh(np.array(topology.devices("v5e-4")), ("data",))
    rows = NamedSharding(mesh, P("data"))
    x = jax.ShapeDtypeStruct((4, 256, 2, 128), jnp.bfloat16, sharding=rows)
    ids = jax.ShapeDtypeStruct((4, 256), jnp.int32, sharding=rows)

    def loss(x, ids):
        return jnp.sum(attention_lib.causal_attention(x, x, x, segment_ids=ids).astype(jnp.float32))

    with jax.set_mesh(mesh):
        assert attention_lib.choose_implementation("auto", x.dtype, x.shape, ids) == "splash"
        hlo = jax.jit(jax.grad(loss)).lower(x, ids).compile().as_text()
    for kernel in ("fwd", "dq", "dkv"):
        assert f"splash_mha_{kernel}_segmented" in hlo, kernel


# ------------------------------------------------------------------ the data


def _layout_by_loop(inputs, separator):
    """`document_layout`, one token at a time."""
    segments, positions, weights = (np.zeros(inputs.shape, dtype) for dtype in
                                    (np.int32, np.int32, np.float32))  # fmt: skip
    for row, tokens in enumerate(inputs):
        segment = position = 0
        for i, token in enumerate(tokens):
            segments[row, i], positions[row, i] = segment, position
            weights[row, i] = token != separator
            segment, position = (segment + 1, 0) if token == separator else (segment, position + 1)
    return segments, positions, weights


def test_positions_restart_after_each_separator_and_no_target_crosses_one():
    from experiments.lm.task import make_preprocess

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 6, (5, 33))
    tokens[rng.random(tokens.shape) < 0.2] = 0  # separators, some adjacent
    tokens[0, 0], tokens[1, -2:], tokens[2] = 0, 0, 3  # a window starting, ending, without
    batch = make_preprocess(32, separator=0)({"tokens": tokens})
    segments, positions, weights = _layout_by_loop(batch["inputs"], 0)
    np.testing.assert_array_equal(batch["segment_ids"], segments)
    np.testing.assert_array_equal(batch["positions"], positions)
    np.testing.assert_array_equal(batch["target_weights"], weights)
    # A target is weighed exactly when it is in its input's document.
    next_segment = np.cumsum(tokens == 0, axis=1)[:, :-1]  # the target's, by its index
    np.testing.assert_array_equal(weights == 1, next_segment == segments)
    assert batch["positions"][2].tolist() == list(range(32))  # one document: 0 .. L - 1
    assert {k: v.dtype for k, v in batch.items()} == {
        "inputs": np.int32, "targets": np.int32, "segment_ids": np.int32,
        "positions": np.int32, "target_weights": np.float32,
    }  # fmt: skip
    plain = make_preprocess(32)({"tokens": tokens})
    assert set(plain) == {"inputs", "targets"}  # pack_documents=False: as before


def test_the_loss_weights_skip_cross_document_targets_and_padding():
    from experiments.lm.task import document_layout, token_weights

    inputs = np.array([[4, 0, 5, 6], [7, 8, 0, 0]], np.int32)
    batch = {"inputs": inputs, "targets": inputs, **document_layout(inputs, 0)}
    assert np.asarray(token_weights(batch)).tolist() == [[1, 0, 1, 1], [1, 1, 0, 0]]
    batch["mask"] = np.array([1, 0])  # the second row pads an eval batch
    assert np.asarray(token_weights(batch)).tolist() == [[1, 0, 1, 1], [0, 0, 0, 0]]


def test_pack_documents_is_a_config_key_and_needs_an_eos_id(tmp_path):
    import tokenizers

    from experiments.lm.task import document_separator
    from replicator.trainer import ConfigError
    from replicator.trainer import config as config_lib

    assert config_lib.experiment_keys("experiments.lm").options["pack_documents"][1] is False
    assert document_separator("bytes") == 0
    # A tokenizer.json with no end-of-document token.
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    bpe.train_from_iterator(["a few words of text"] * 4, tokenizers.trainers.BpeTrainer(
        vocab_size=40, special_tokens=["[UNK]"]))  # fmt: skip
    path = str(tmp_path / "tokenizer.json")
    bpe.save(path)
    with pytest.raises(ConfigError, match="pack_documents=True needs a tokenizer .* eos"):
        document_separator(path)


# ------------------------------------------------------------------ the LM

TINY = dict(vocab_size=32, num_layers=2, num_heads=2, embed_dim=32, mlp_dim=64, max_len=32)


@functools.cache
def _windows(rows=8, length=32):
    """Windows of documents 1 to 12 tokens long, each ended by the separator 0; the
    last row a single document that fills it."""
    rng = np.random.default_rng(1)
    windows = []
    for _ in range(rows - 1):
        stream = []
        while len(stream) <= length:
            stream += [*rng.integers(1, TINY["vocab_size"], rng.integers(1, 13)), 0]
        windows.append(stream[: length + 1])
    windows.append(rng.integers(1, TINY["vocab_size"], length + 1))
    return np.array(windows)


def _packed_batch():
    from experiments.lm.task import make_preprocess

    return make_preprocess(TINY["max_len"], separator=0)({"tokens": _windows()})


def _alone_nats(batch, model=TINY):
    """``params -> nats [B, L]``: each document of ``batch`` run alone (a row of its own
    from position 0, padded to the window's length) through the plain model, its nats
    put where it lies in ``batch``."""
    from experiments.lm.model import Transformer

    inputs, targets, ids = batch["inputs"], batch["targets"], batch["segment_ids"]
    where = [(r, np.flatnonzero(ids[r] == s)) for r in range(len(ids)) for s in np.unique(ids[r])]
    alone = np.ones((2, len(where), inputs.shape[1]), np.int32)  # inputs, targets
    for d, (r, cols) in enumerate(where):
        alone[:, d, : len(cols)] = inputs[r, cols], targets[r, cols]
    # (document, its position) -> (row, column) of the packed batch: cropped to each.
    doc, pos, row, col = (np.concatenate(x) for x in zip(*(
        (np.full(len(c), d), np.arange(len(c)), np.full(len(c), r), c)
        for d, (r, c) in enumerate(where))))  # fmt: skip

    def nats(params):
        alone_nats = Transformer(**model).apply({"params": params}, alone[0], targets=alone[1])
        return jnp.zeros(inputs.shape, jnp.float32).at[row, col].set(alone_nats[doc, pos])

    return nats


def _alone(params, batch, model=TINY):
    return np.asarray(jax.jit(_alone_nats(batch, model))(params))


@pytest.mark.parametrize(  # (learned positions: the LM's tests over context below too)
    "positions", [pytest.param("learned", marks=pytest.mark.slow), "rotary"]
)
def test_a_packed_window_equals_its_documents_alone(positions):
    from experiments.lm.model import Transformer
    from experiments.lm.task import token_nats, token_weights

    model = dict(TINY, positions=positions)
    batch = _packed_batch()
    network = Transformer(**model)
    params = network.init(jax.random.key(0), batch["inputs"][:1])["params"]

    def packed_nats(params, batch):
        return token_nats(network, params, batch)

    def loss_and_grads(nats_fn):  # the training loss's numerator: weighed nats
        def loss(params):
            nats = nats_fn(params)
            return jnp.sum(nats * token_weights(batch)), nats

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    ((got, packed), got_grads), ((want, alone), want_grads) = (
        loss_and_grads(fn) for fn in (lambda p: packed_nats(p, batch), _alone_nats(batch, model))
    )
    np.testing.assert_allclose(packed, alone, atol=2e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, atol=2e-5)
    # and packing matters: the same windows unpacked see across documents
    plain = jax.jit(packed_nats)(params, {"inputs": batch["inputs"], "targets": batch["targets"]})
    assert not np.allclose(plain, packed, atol=1e-3)


def _on_path(repl, path, **parallel):
    """The LM experiment (``pack_documents=True``) on ``path``: its per-token nats of
    `_windows`, its train and eval steps' sums, its parameters and its batch."""
    from experiments.lm import make_experiment
    from experiments.lm.task import make_model, token_nats
    from replicator.trainer.experiment import Settings

    settings = Settings(
        repl=repl, model=TINY, learning_rate=0.0, optimizer="sgd", num_train_steps=1,
        grad_accum_steps=1, seed=0, options={"pack_documents": True, **parallel},
    )  # fmt: skip
    experiment = make_experiment(settings)
    batch = experiment.preprocess({"tokens": _windows()})  # the experiment's own
    state = repl.init(experiment.init_state, jax.random.key(0), jax.tree.map(lambda x: x[0], batch))
    network = make_model(TINY, **parallel)

    def step(state, batch):
        sums = experiment.train_step(state, batch)[1]
        sums = sums, experiment.eval_step({"params": state.params}, batch)
        return token_nats(network, state.params, batch), sums

    program = repl.compile(step) if path == "compile" else functools.partial(repl.run, step)
    nats, sums = program(state, repl.shard_batch(batch))
    if path == "run":
        sums = repl.reduce(rp.ReduceOp.SUM, sums)
    nats = np.asarray(nats).reshape(batch["inputs"].shape)
    return nats, jax.device_get(sums), jax.device_get(state.params), batch


@pytest.mark.parametrize(
    "path, mesh, strategy, balanced",
    [  # (the model alone on one device: test_a_packed_window_equals_its_documents_alone)
        ("compile", {"data": 2, "context": 4}, "ring", True),
        pytest.param("run", {"data": 2, "context": 4}, "gather", True, marks=pytest.mark.slow),
        pytest.param("compile", None, "gather", False, marks=pytest.mark.slow),
        pytest.param("run", {"data": 8}, "gather", False, marks=pytest.mark.slow),
        pytest.param("compile", {"data": 4, "context": 2}, "gather", False, marks=pytest.mark.slow),
        pytest.param("compile", {"data": 2, "context": 4}, "gather", True, marks=pytest.mark.slow),
        pytest.param("compile", {"data": 4, "context": 2}, "ring", False, marks=pytest.mark.slow),
        pytest.param("run", {"data": 4, "context": 2}, "ring", False, marks=pytest.mark.slow),
        pytest.param("run", {"data": 2, "context": 4}, "ring", True, marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_the_lm_on_both_paths_and_over_context_equals_documents_alone(
    path, mesh, strategy, balanced
):
    if mesh is None:
        repl = rp.Replicator(devices=jax.devices()[:1])
    else:
        repl = rp.Replicator(mesh=mesh, min_size=0)
    nats, (train_sums, eval_sums), params, batch = _on_path(
        repl, path, context_strategy=strategy, context_load_balance=balanced
    )
    expected = _alone(params, batch)
    np.testing.assert_allclose(nats, expected, atol=2e-5)
    weights = batch["target_weights"]
    for sums in (train_sums, eval_sums):  # both steps weigh the same tokens
        np.testing.assert_allclose(sums["tokens"], weights.sum())
        np.testing.assert_allclose(sums["loss"], (expected * weights).sum(), rtol=1e-5)
