"""The LM's Llama-family block: RMSNorm, SwiGLU, grouped-query attention, Llama 3's rotary.

Its pieces against NumPy transcriptions of the published definitions (Hugging
Face's ``_compute_llama3_parameters``, ``LlamaRMSNorm``, ``LlamaMLP``, the whole
forward pass with ``repeat_kv`` and ``rotate_half``), then the invariants the GPT-2
block keeps: sharded over fsdp and tensor, split over context (gather and ring, load
balanced), pipelined over stages, with SwiGLU experts over ``expert``, on both step
paths, it trains like one device; every remat policy gives the gradients of none.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from experiments.lm import Transformer, make_experiment
from experiments.lm.layers import GatedFeedForward, apply_rotary, make_norm, rope_frequencies
from experiments.lm.task import make_model, make_preprocess, summarize
from replicator.parallel import sharding as sharding
from replicator.step import remat as remat
from replicator.trainer import ConfigError
from replicator.trainer.experiment import Settings
from tests.helpers.steps import train_steps

SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=16)  # fmt: skip
LLAMA = dict(
    vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, head_dim=16,
    mlp_dim=48, max_len=32, norm="rmsnorm", mlp_activation="swiglu", positions="rotary",
    rope_theta=500_000.0, rope_scaling=SCALING, tie_embeddings=False, use_bias=False,
)  # fmt: skip
MOE = dict(LLAMA, num_experts=4, experts_per_token=2, expert_capacity_factor=2.0, moe_every=2)


# ------------------------------------------------------------ NumPy references


def hf_llama3_inv_freq(head_dim, theta, factor, low_freq_factor, high_freq_factor, old_context):
    """Hugging Face's ``_compute_default_rope_parameters`` then ``_compute_llama3_parameters``,
    line by line with torch replaced by NumPy (float32 throughout, as there)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama).astype(np.float32)


def np_rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * scale


def np_silu(x):
    return x / (1 + np.exp(-x))


def np_rotary(x_BxTxHxD, positions_BxT, inv_freq):
    angles = positions_BxT[..., None] * inv_freq  # B, T, D/2
    emb = np.concatenate([angles, angles], axis=-1)[:, :, None]  # HF's cat((freqs, freqs))
    half = x_BxTxHxD.shape[-1] // 2
    rotate_half = np.concatenate([-x_BxTxHxD[..., half:], x_BxTxHxD[..., :half]], axis=-1)
    return x_BxTxHxD * np.cos(emb) + rotate_half * np.sin(emb)


def np_llama_logits(params, tokens_BxT, positions_BxT, config):
    """Llama's forward pass (``LlamaForCausalLM``) in NumPy float64 from our parameters."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    H, K, D = config["num_heads"], config["num_kv_heads"], config["head_dim"]
    inv_freq = rope_frequencies(D, config["rope_theta"], config["rope_scaling"]).astype(np.float64)
    x = p["token_embedding"]["embedding"][tokens_BxT]
    T = tokens_BxT.shape[1]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(config["num_layers"]):
        b = jax.tree.map(lambda leaf, i=i: leaf[i], p["blocks"])
        a = b["attention"]
        h = np_rms_norm(x, b["ln_attention"]["scale"], 1e-5)
        q = np.einsum("bte,ehd->bthd", h, a["q_kernel"])
        k = np.einsum("bte,ehd->bthd", h, a["kv_kernel"][:, 0])
        v = np.einsum("bte,ehd->bthd", h, a["kv_kernel"][:, 1])
        q, k = np_rotary(q, positions_BxT, inv_freq), np_rotary(k, positions_BxT, inv_freq)
        k, v = (np.repeat(t, H // K, axis=2) for t in (k, v))  # HF's repeat_kv
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("bhqk,bkhd->bqhd", probs, v)
        x = x + np.einsum("bthd,hde->bte", out, a["out_kernel"])
        h = np_rms_norm(x, b["ln_mlp"]["scale"], 1e-5)
        mlp = b["mlp"]
        gated = np_silu(h @ mlp["gate"]["kernel"]) * (h @ mlp["up"]["kernel"])
        x = x + gated @ mlp["down"]["kernel"]
    x = np_rms_norm(x, p["ln_final"]["scale"], 1e-5)
    return x @ p["head"]["kernel"]


# ------------------------------------------------------------ pieces


@pytest.mark.parametrize(
    "head_dim, theta, scaling",
    [
        (128, 500_000.0, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)),  # Llama 3.1's
        (16, 500_000.0, SCALING),
        (64, 10_000.0, dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)),  # Llama 3.2's factor
    ],
)  # fmt: skip
def test_rope_scaling_is_hugging_faces_llama3_formula(head_dim, theta, scaling):
    got = rope_frequencies(head_dim, theta, scaling)
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    expected = hf_llama3_inv_freq(head_dim, theta, *(scaling[k] for k in keys))
    assert got.dtype == np.float32 and got.shape == (head_dim // 2,)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    plain = rope_frequencies(head_dim, theta)
    np.testing.assert_allclose(plain, theta ** -(np.arange(0, head_dim, 2) / head_dim), rtol=1e-6)
    wavelength = 2 * math.pi / plain
    context = scaling["original_max_position_embeddings"]
    long, short = wavelength > context, wavelength < context / 4
    assert long.any() and (~long & ~short).any()  # divided, and interpolated
    np.testing.assert_allclose(got[long], plain[long] / scaling["factor"], rtol=1e-6)
    np.testing.assert_array_equal(got[short], plain[short])


def test_rope_scaling_equals_transformers_own():
    """The same against the installed ``transformers`` (HF's code itself)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip
    config = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, head_dim=128, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, **scaling},
    )  # fmt: skip
    inv_freq, factor = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    assert factor == 1.0
    np.testing.assert_allclose(
        rope_frequencies(128, 500_000.0, scaling), inv_freq.numpy(), rtol=1e-6
    )


def test_rotary_with_per_row_positions_is_rotate_half():
    x = np.random.default_rng(0).normal(size=(2, 5, 3, 16)).astype(np.float32)
    positions = np.array([[0, 1, 2, 0, 1], [7, 8, 9, 10, 11]], np.int32)
    got = apply_rotary(jnp.asarray(x), 500_000.0, positions, SCALING)
    inv_freq = hf_llama3_inv_freq(16, 500_000.0, 8.0, 1.0, 4.0, 16)
    np.testing.assert_allclose(got, np_rotary(x, positions, inv_freq), atol=1e-5)


def test_rmsnorm_and_swiglu_are_llamas():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 8)).astype(np.float32)
    scale = rng.normal(size=8).astype(np.float32)
    norm = make_norm("rmsnorm", 1e-5, None, "norm").apply({"params": {"scale": scale}}, x)
    np.testing.assert_allclose(norm, np_rms_norm(x, scale, 1e-5), rtol=1e-5, atol=1e-6)

    mlp = GatedFeedForward(mlp_dim=12, out_stddev=0.02, use_bias=False, dtype=None)
    params = nn.meta.unbox(jax.jit(mlp.init)(jax.random.key(0), x))["params"]
    assert set(params) == {"gate", "up", "down"} and set(params["gate"]) == {"kernel"}
    got = jax.jit(mlp.apply)({"params": params}, x)
    gate, up, down = (np.asarray(params[n]["kernel"]) for n in ("gate", "up", "down"))
    np.testing.assert_allclose(got, (np_silu(x @ gate) * (x @ up)) @ down, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def params():
    tokens = jnp.zeros((1, 32), jnp.int32)
    return nn.meta.unbox(jax.jit(Transformer(**LLAMA).init)(jax.random.key(0), tokens)["params"])


def test_the_llama_lm_is_llamas_forward_pass_with_per_document_positions(params):
    model = Transformer(**LLAMA)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 64)
    params = jax.tree.map(np.asarray, params)
    assert set(params) == {"token_embedding", "blocks", "ln_final", "head"}
    attention = params["blocks"]["attention"]
    assert set(attention) == {"q_kernel", "kv_kernel", "out_kernel"}
    assert attention["kv_kernel"].shape == (2, 32, 2, 2, 16)
    # Sharper attention than the init's, so that positions weigh in the logits.
    for name in ("q_kernel", "kv_kernel"):
        attention[name] = attention[name] * 30
    positions = np.stack([np.arange(24), np.r_[np.arange(10), np.arange(14)]]).astype(np.int32)
    apply = jax.jit(lambda p, t, pos: model.apply({"params": p}, t, positions=pos))
    got = apply(params, tokens, positions)
    expected = np_llama_logits(params, np.asarray(tokens), positions, LLAMA)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
    # Row 0's positions are the default ones: the same logits without them.
    default = jax.jit(lambda p, t: model.apply({"params": p}, t))(params, tokens)
    np.testing.assert_allclose(default[0], got[0], atol=1e-6)
    assert np.abs(default[1, 10:] - got[1, 10:]).max() > 1e-2


def test_llama_keys_that_cannot_work_are_one_line():
    for kwargs, message in [
        (dict(num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
        (dict(norm="batchnorm"), "norm='batchnorm'"),
        (dict(mlp_activation="relu"), "mlp_activation='relu'"),
        (dict(positions="learned"), "rope_scaling rescales rotary positions"),
        (dict(rope_scaling=dict(SCALING, rope_type="yarn")), "rope_type='yarn'"),
        (dict(rope_scaling={"factor": 8.0}), "rope_scaling lacks 'low_freq_factor'"),
        (dict(head_dim=15), "head_dim=15 is odd"),
    ]:
        with pytest.raises(ConfigError, match=message) as error:
            make_model({**LLAMA, **kwargs})
        assert "\n" not in str(error.value)
    # head_dim frees the width from num_heads * head_dim (Llama 3 8B's 4096 = 32 x 128 is not
    # required): 5 heads of 16 on a width of 32.
    model = Transformer(**{**LLAMA, "num_heads": 5, "num_kv_heads": 1})
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    assert nn.meta.unbox(shapes)["params"]["blocks"]["attention"]["out_kernel"].shape == (
        2, 5, 16, 32,
    )  # fmt: skip


@pytest.mark.parametrize(
    "policy",
    [
        "full",
        pytest.param("minimal", marks=pytest.mark.slow),
        *(pytest.param(p, marks=pytest.mark.slow) for p in remat.REMAT_POLICIES[3:]),
    ],
)
def test_every_remat_policy_gives_the_gradients_of_none(policy, params):
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 64)

    def grads(policy):
        if policy == "minimal_offloaded":  # needs a backend with pinned host memory
            policy = "minimal"
        model = Transformer(**LLAMA, remat_policy=policy)
        loss = lambda p: model.apply({"params": p}, tokens, targets=tokens).mean()  # noqa: E731
        return jax.jit(jax.grad(loss))(params)

    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7), grads(policy),
                 grads(None))  # fmt: skip


# ------------------------------------------------------------ over the mesh


def _settings(repl, model, **parallel):
    return Settings(
        repl=repl, model=model, learning_rate=0.5, optimizer="sgd", num_train_steps=2,
        grad_accum_steps=1, seed=0, options=parallel,
    )  # fmt: skip


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    preprocess = make_preprocess(LLAMA["max_len"])
    return [preprocess({"tokens": rng.integers(0, 64, (8, 33))}) for _ in range(2)]


def _train(repl, path, batches, model=LLAMA, **parallel):
    """Two SGD steps (parameters move by the gradients, unmagnified): losses, parameters."""
    experiment = make_experiment(_settings(repl, model, **parallel))
    example = jax.tree.map(lambda x: x[0], batches[0])
    state = repl.init(experiment.init_state, jax.random.key(0), example)
    return train_steps(repl, path, experiment.train_step, state, batches, summarize)


def _assert_trains_alike(got, expected, atol=2e-6):
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    assert got[0][1] != got[0][0]  # the first step changed the parameters
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=atol), got[1], expected[1])


@pytest.fixture(scope="module")
def one_device(batches):
    return _train(rp.Replicator(devices=jax.devices()[:1]), "compile", batches)


@pytest.mark.parametrize(
    "path, mesh, parallel",
    [
        ("compile", {"data": 2, "fsdp": 2, "tensor": 2}, {}),
        pytest.param("run", {"data": 2, "fsdp": 2, "tensor": 2}, {}, marks=pytest.mark.slow),
        pytest.param("compile", {"context": 2, "data": 4},
                     dict(context_strategy="gather", context_load_balance=True),
                     marks=pytest.mark.slow),
        pytest.param("run", {"context": 2, "fsdp": 4},
                     dict(context_strategy="ring", context_load_balance=True),
                     marks=pytest.mark.slow),
        # (a pipelined LM equals one device in make test: tests/test_pipeline.py)
        pytest.param("compile", {"stage": 2, "data": 4}, dict(pipeline_microbatches=2),
                     marks=pytest.mark.slow),
        pytest.param("run", {"stage": 2, "data": 4}, {}, marks=pytest.mark.slow),
        pytest.param("compile", {"context": 4, "data": 2},
                     dict(context_strategy="ring", context_load_balance=True),
                     marks=pytest.mark.slow),
        pytest.param("run", {"context": 2, "data": 4},
                     dict(context_strategy="gather", context_load_balance=False),
                     marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_the_llama_lm_trains_like_one_device(path, mesh, parallel, batches, one_device):
    repl = rp.Replicator(mesh=mesh, min_size=0)
    _assert_trains_alike(_train(repl, path, batches, **parallel), one_device)


@pytest.mark.slow  # make test-slow: the MoE LM's own tests hold its invariant
@pytest.mark.parametrize("path", ["compile", "run"])
def test_swiglu_experts_train_like_one_device(path, batches):
    """Each expert a SwiGLU (``wi_gate``, ``wi``, ``wo``), split over ``expert``."""
    expected = _train(rp.Replicator(devices=jax.devices()[:1]), "compile", batches, MOE)
    assert set(expected[1]["blocks"]["block_1"]["moe"]) == {"router", "wi", "wi_gate", "wo"}
    got = _train(rp.Replicator(mesh={"expert": 2, "data": 4}, min_size=0), path, batches, MOE)
    _assert_trains_alike(got, expected, atol=1e-5)


def test_key_value_heads_that_do_not_divide_over_tensor_stay_whole():
    """2 key/value heads on 4 tensor devices: the query heads split, the key/value heads
    are kept whole (said once, as any dimension that does not divide), nothing fails."""
    repl = rp.Replicator(mesh={"tensor": 4, "data": 2}, min_size=0)
    model = Transformer(**LLAMA)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    with pytest.warns(sharding.ShardingWarning, match="kv_kernel"):
        shardings = nn.meta.unbox(repl.param_shardings(abstract["params"]))
    attention = shardings["blocks"]["attention"]
    assert attention["q_kernel"].spec == jax.sharding.PartitionSpec(None, None, "tensor")
    assert "tensor" not in jax.tree.leaves(tuple(attention["kv_kernel"].spec))


@pytest.mark.parametrize(
    "path, mesh, strategy",
    [("compile", {"context": 2, "data": 4}, "ring"), ("run", {"context": 4, "data": 2}, "gather")],
)
def test_documents_positions_and_segments_follow_the_load_balanced_split_tokens(
    path, mesh, strategy, params
):
    """``positions`` and ``segment_ids`` are reordered and split with the tokens: the
    per-token nats of two packed documents per row under context parallelism equal one
    device's, whose second document's equal it run alone."""
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (8, 32), 0, 64))
    starts = np.random.default_rng(0).integers(1, 31, size=(8, 1))
    second = np.arange(32) >= starts
    positions = np.where(second, np.arange(32) - starts, np.arange(32)).astype(np.int32)
    batch = {"tokens": tokens, "positions": positions, "segment_ids": second.astype(np.int32)}
    one = Transformer(**LLAMA)

    def nats(model, params, batch):
        return model.apply({"params": params}, batch["tokens"], targets=batch["tokens"],
                           positions=batch.get("positions"),
                           segment_ids=batch.get("segment_ids"))  # fmt: skip

    expected = jax.jit(functools.partial(nats, one))(params, batch)
    s = int(starts[0, 0])
    alone = jax.jit(functools.partial(nats, one))(params, {"tokens": tokens[:1, s:]})
    np.testing.assert_allclose(expected[0, s:], alone[0], rtol=1e-5, atol=1e-5)

    model = Transformer(**LLAMA, context_strategy=strategy, context_load_balance=True)
    repl = rp.Replicator(mesh=mesh, min_size=0)
    placed = repl.replicate(params)
    step = functools.partial(nats, model)
    if path == "compile":
        got = repl.compile(step)(placed, repl.shard_batch(batch))
    else:
        got = repl.run(step, placed, repl.shard_batch(batch)).reshape(8, 32)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_learned_positions_restart_per_document():
    """GPT-2's position table read at each document's positions: a second document's
    logits equal it run alone."""
    model = Transformer(vocab_size=64, num_layers=1, num_heads=2, embed_dim=16, max_len=16)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (1, 16), 0, 64))
    segments = (np.arange(16) >= 6).astype(np.int32)[None]
    positions = np.r_[np.arange(6), np.arange(10)].astype(np.int32)[None]
    variables = jax.jit(model.init)(jax.random.key(0), tokens)
    packed = jax.jit(functools.partial(model.apply, positions=positions, segment_ids=segments))
    alone = jax.jit(model.apply)(variables, tokens[:, 6:])
    np.testing.assert_allclose(packed(variables, tokens)[:, 6:], alone, rtol=1e-5, atol=1e-6)
