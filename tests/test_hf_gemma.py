"""Gemma 2 and Gemma 3 (text) checkpoints in and out of the LM, against transformers' code.

Random tiny checkpoints written by transformers (every weight drawn at random, norms
too) with a sliding window shorter than the sequences, so that the local layers' window,
the global layers, the two rotary bases, the soft-capping and the q/k norms all show:
the imported logits equal HF's forward in float32; greedy continuations equal
``generate``'s, for a prompt longer than the window too; an export reloads in
``from_pretrained`` with the same logits. The sliding-window attention itself equals a
plain masked reference on each kernel (XLA's, splash's in Pallas's interpreter) and in
the KV-cache sampler.
"""

import functools
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from experiments.lm import hf_gemma
from experiments.lm.model import Transformer
from experiments.lm.sample import generate
from replicator.attention import context_attention, kernels
from replicator.errors import ConfigError
from replicator.trainer import export, init_from, pretrained
from tests import test_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, WINDOW = 300, 8
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
)  # fmt: skip


def gemma2(**kw):
    config = transformers.Gemma2Config(**{**SHAPE, "num_hidden_layers": 4, **kw})
    return transformers.Gemma2ForCausalLM(config)


def gemma3(**kw):
    """Seven layers: five local, one global, one local again (the 5:1 pattern cut short);
    the global layers' rotary base 1e6 scaled linearly by 8, the local ones' 1e4. (Its
    attn_logit_softcapping is in config.json only: transformers' Gemma 3 attention, and
    so the import, ignore it.)"""
    config = transformers.Gemma3TextConfig(**{
        **SHAPE, "num_hidden_layers": 7, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "attn_logit_softcapping": 20.0, **kw,
    })  # fmt: skip
    return transformers.Gemma3ForCausalLM(config)


FAMILIES = {"gemma2": gemma2, "gemma3": gemma3}
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 24))  # 3 windows long


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))).logits.numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_imported_logits_equal_hf(family, tmp_path):
    model = FAMILIES[family]()
    net, params, the_plan = test_hf.import_params(test_hf.save(model, tmp_path))
    assert not the_plan.fresh and not the_plan.unused, the_plan.details()
    got = np.asarray(jax.jit(net.apply)(params, jnp.asarray(IDS, jnp.int32)))
    np.testing.assert_allclose(got, hf_logits(model, IDS), rtol=1e-5, atol=5e-5)


def test_unscanned_layers_import_alike(tmp_path):
    model = gemma3(num_hidden_layers=3, sliding_window_pattern=3)
    spec = test_hf.save(model, tmp_path)
    net, params, _ = test_hf.import_params(spec, scan_layers=False)
    assert "block_2" in params["params"]
    got = np.asarray(jax.jit(net.apply)(params, jnp.asarray(IDS, jnp.int32)))
    np.testing.assert_allclose(got, hf_logits(model, IDS), rtol=1e-5, atol=5e-5)


def test_the_model_keys_say_what_config_json_does(tmp_path):
    _, hf_config = pretrained.read_hf_config(test_hf.save(gemma3(), tmp_path))
    hf = pretrained.layout("experiments.lm", {"max_len": 64}, hf_config)
    m = hf.model
    assert (m["norm"], m["mlp_activation"], m["qk_norm"], m["post_norms"]) == (
        "gemma_rmsnorm", "geglu", True, True,
    )  # fmt: skip
    assert (m["sliding_window"], m["sliding_window_pattern"]) == (WINDOW, 6)
    assert (m["rope_theta"], m["rope_local_theta"]) == (1e6, 1e4)
    assert m["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert "rope_theta 1e+06, linear scaling of the global layers x8" in hf.summary
    assert "sliding window 8 (1 layer in 6 global), local rope_theta 10000" in hf.summary


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_samples_equal_hf_generate_past_the_window(family, tmp_path):
    model = FAMILIES[family]()
    net, variables, _ = test_hf.import_params(test_hf.save(model, tmp_path))
    prompts = [[int(t) for t in IDS[0, :13]], [int(t) for t in IDS[1, :3]]]  # 13 > WINDOW
    samples = generate(net, variables["params"], prompts, max_new_tokens=8, temperature=0)
    for prompt, sample in zip(prompts, samples):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8
            )
        assert list(sample.ids) == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_an_export_reloads_in_transformers_with_the_same_logits(family, tmp_path):
    model = FAMILIES[family]()
    net, params, _ = test_hf.import_params(test_hf.save(model, tmp_path / "in"))
    keys = pretrained.layout("experiments.lm", {"max_len": 64}, _config_of(tmp_path / "in")).model
    # Trained weights stand-in: every parameter moved, so the export is not the input.
    moved = jax.tree.map(lambda x: x + 0.01 * jnp.cos(jnp.arange(x.size).reshape(x.shape)), params)
    hf = pretrained.layout("experiments.lm", keys, None)
    export._export_weights(str(tmp_path / "out"), hf, init_from.model_paths(moved), 1, 2**30)
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert type(exported).__name__ == type(model).__name__
    ours = np.asarray(jax.jit(net.apply)(moved, jnp.asarray(IDS, jnp.int32)))
    np.testing.assert_allclose(hf_logits(exported, IDS), ours, rtol=1e-5, atol=1e-5)


def _config_of(directory):
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize(
    "change, words",
    [
        ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "no every-n-th"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_activation": "relu"}, "gelu_pytorch_tanh"),
        ({"use_bidirectional_attention": True}, "causal"),
    ],
)
def test_what_the_lm_cannot_reproduce_is_one_config_error(change, words):
    hf_config = {"model_type": "gemma2", "num_hidden_layers": 4, **SHAPE, **change}
    with pytest.raises(ConfigError, match=words):
        hf_gemma.hf_checkpoint({}, hf_config)


# ----------------------------------------------------------------------- the kernels


def _reference(q, k, v, window, cap):
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = cap * jnp.tanh(scores / cap) if cap else scores
    i = np.arange(q.shape[1])
    seen = (i[:, None] >= i[None]) & (i[:, None] - i[None] < (window or q.shape[1]))
    weights = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


@pytest.mark.parametrize("implementation", ["xla", "splash"])
@pytest.mark.parametrize("window, cap", [(48, None), (None, 2.0), (48, 2.0)])
def test_a_window_and_a_soft_cap_on_each_kernel_equal_the_masked_reference(
    implementation, window, cap
):
    q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 256, 2, 16)) * 2
    got = kernels.causal_attention(
        q, k, v, implementation=implementation, window=window, softcap=cap
    )
    np.testing.assert_allclose(got, _reference(q, k, v, window, cap), atol=2e-5)
    attend = functools.partial(
        kernels.causal_attention, implementation=implementation, window=window, softcap=cap
    )
    grad = jax.grad(lambda q: attend(q, k, v).sum())(q)
    want = jax.grad(lambda q: _reference(q, k, v, window, cap).sum())(q)
    np.testing.assert_allclose(grad, want, atol=1e-4)


def test_a_window_over_a_context_axis_is_one_config_error():
    mesh = jax.make_mesh((4, 2), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    x = jnp.zeros((4, 16, 2, 8))
    with jax.set_mesh(mesh), pytest.raises(ConfigError, match="soft cap over mesh axis 'context'"):
        context_attention(x, x, x, window=4)


@pytest.mark.slow  # 20 s; the HF greedy tests above hold it for the scanned layers, fast
@pytest.mark.parametrize("scan", [True, False])
def test_windowed_greedy_samples_are_the_full_forward_argmax(scan):
    """The KV-cache sampler's window mask: a prompt longer than the window, local and
    global layers, scanned and unrolled, against the whole sequence's forward pass."""
    net = Transformer(**GEMMA_KEYS, scan_layers=scan)
    params = jax.jit(net.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x + 0.5, params)
    prompts = [[int(t) % 64 for t in IDS[0, :13]], [5, 9]]
    samples = generate(net, params, prompts, max_new_tokens=6, temperature=0)
    for prompt, sample in zip(prompts, samples):
        sequence = jnp.asarray([list(prompt) + list(sample.ids[:-1])], jnp.int32)
        argmax = np.argmax(np.asarray(jax.jit(net.apply)({"params": params}, sequence)), -1)[0]
        assert argmax[len(prompt) - 1 :].tolist() == list(sample.ids)


GEMMA_KEYS = dict(
    vocab_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, embed_dim=32,
    mlp_dim=48, max_len=32, positions="rotary", norm="gemma_rmsnorm", mlp_activation="geglu",
    use_bias=False, embed_scale=True, post_norms=True, attn_logit_softcap=5.0,
    final_logit_softcap=3.0, query_pre_attn_scalar=12.0, sliding_window=4,
    sliding_window_pattern=3, rope_local_theta=100.0, attention="xla",
)  # fmt: skip


@pytest.mark.slow  # about 40 s: a libtpu compile of the train and eval steps
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_a_small_gemma_compiles_to_local_splash_for_a_tpu(tmp_path):
    """Sliding windows and soft caps through splash (its LocalMask, attn_logits_soft_cap)
    for a v5e-8, the layers' kinds picked in the scan: the command the guide names."""
    keys = {**GEMMA_KEYS, "max_len": 128, "sliding_window": 64, "vocab_size": 256}
    keys.pop("attention")
    overrides = [f"--config.model.{k}={v}" for k, v in keys.items()]
    done = test_hf.run_cli(
        "compile", "--config", "configs/llama_tiny.py:smoke", "--topology", "v5e-8",
        "--workdir", str(tmp_path / "run"), "--config.step_path=compile",
        f"--config.data_dir={tmp_path / 'tfds'}", *overrides,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (folder,) = (tmp_path / "run").glob("compile*")
    hlo = (folder / "train_step.hlo.txt").read_text()
    assert all(f"splash_mha_{k}" in hlo for k in ("fwd", "dq", "dkv"))


# ----------------------------------------------------------------------- chat template

# Gemma's chat template as the Hub's Gemma 2/3 tokenizers carry it (a system message folded
# into the first user turn, the assistant's role named "model", contents trimmed), with
# generation marks around the model's turns for transformers' assistant mask.
GEMMA_CHAT = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}"
    "{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<start_of_turn>model\\n' }}{% generation %}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{% endgeneration %}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + message['role'] + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def test_gemmas_chat_template_encodes_as_transformers_does(tmp_path):
    """Ids and assistant masks of Gemma's template (marked, and unmarked through the
    prefix-rendering path) equal transformers' ``apply_chat_template``."""
    from experiments.datasets.chat_template import ChatTemplate, encode_chat, load_encoder
    from tests.helpers.chat import hf_tokenizer
    from tests.helpers.tiny_hf import write_tokenizer
    from tests.test_chat_data import CONVERSATIONS, _unmarked

    write_tokenizer(str(tmp_path))
    hf, encoder = hf_tokenizer(str(tmp_path)), load_encoder(str(tmp_path))
    for template in (GEMMA_CHAT, _unmarked(GEMMA_CHAT)):
        ours = ChatTemplate(template, encoder.template.variables)
        for conversation in CONVERSATIONS:
            theirs = hf.apply_chat_template(
                conversation, chat_template=GEMMA_CHAT, tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True,
            )  # fmt: skip
            ids, mask = encode_chat(ours, encoder.tokenizer, conversation)
            assert ids.tolist() == list(theirs["input_ids"])
            assert mask.tolist() == list(theirs["assistant_masks"]) and mask.any()
