"""LoRA and QLoRA in the LM (`experiments.lm.lora`), checked against HF PEFT and transformers.

The invariants: a fresh adapter (B = 0) changes nothing; an adapter's model equals the
plain model with ``W + (alpha / rank) A B`` as its kernel (QLoRA's dequantized), and
``adapters=False`` is the base; PEFT's ``PeftModel.from_pretrained`` of the exported
adapters on the exported base, and ``from_pretrained`` of the merged export, give our
logits (Llama with grouped-query attention, GPT-2 with its fused ``c_attn``); adapters
are placed like their kernels and a LoRA step on an fsdp x tensor mesh, on either step
path, equals one device; remat policies give the same gradient; QLoRA's codes hold 1 and
about 0.5 bytes a number, within the quantization's error, and survive a checkpoint
bitwise.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from experiments.lm import lora
from experiments.lm.config import make_model
from experiments.lm.hf import hf_checkpoint
from experiments.lm.kv_cache import init_cache
from experiments.lm.model import Transformer
from experiments.lm.task import make_preprocess
from replicator.parallel import sharding
from replicator.trainer import init_from, pretrained
from tests.compare import assert_trained_alike
from tests.helpers.lora import (
    flat,
    hf_tensors,
    merged_params,
    nested,
    random_params,
    train_lora,
    with_random_adapters,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LLAMA = dict(
    vocab_size=64, num_layers=2, num_heads=4, embed_dim=32, mlp_dim=64, max_len=16,
    positions="rotary", norm="rmsnorm", mlp_activation="swiglu", num_kv_heads=2,
    use_bias=False, tie_embeddings=False, attention="xla",
)  # fmt: skip
GPT2 = dict(vocab_size=64, num_layers=2, num_heads=4, embed_dim=32, max_len=16, attention="xla")
LORA = dict(lora_rank=4, lora_alpha=8.0)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)


def _init(model: Transformer) -> dict:
    return random_params(model, TOKENS)


def test_a_fresh_adapter_starts_as_peft_s():
    """B zero (the product changes nothing), A uniform in +-1/sqrt(fan_in) (Kaiming's)."""
    model = Transformer(**dict(LLAMA, num_layers=1), **LORA, lora_quantize="int8")
    params = flat(jax.jit(model.init)(jax.random.key(0, impl="rbg"), TOKENS)["params"])
    fan_in = {"q_kernel": 32, "out_kernel": 32, "down/kernel": 64}
    for path, x in params.items():
        if path.endswith(lora.ADAPTERS[1]):
            assert not np.any(np.asarray(x)), path
        elif path.endswith(lora.ADAPTERS[0]):
            fan = next((n for k, n in fan_in.items() if k + "_lora_a" in path), 32)
            assert 0.5 < np.abs(x).max() * np.sqrt(fan) <= 1.0, path
    assert params["blocks/attention/q_kernel"].dtype == np.int8


@pytest.mark.parametrize(
    "keys",
    [
        dict(LLAMA, **LORA),
        dict(GPT2, **LORA, scan_layers=False, lora_targets="block_1/|attention/qkv"),
        dict(LLAMA, **LORA, num_kv_heads=None, lora_quantize="nf4"),
    ],
    ids=["llama_gqa", "gpt2_unscanned_some_layers", "llama_mha_nf4"],
)
def test_an_adapter_is_its_merged_kernel_and_a_fresh_one_changes_nothing(keys):
    model = Transformer(**keys)
    plain = Transformer(**{k: v for k, v in keys.items() if not k.startswith("lora_")})
    apply = jax.jit(
        lambda p, adapters=True: model.apply({"params": p}, TOKENS, adapters=adapters),
        static_argnames="adapters",
    )
    apply_plain = jax.jit(lambda p: plain.apply({"params": p}, TOKENS))
    params = _init(model)
    base = np.asarray(apply_plain(merged_params(params, model)))
    np.testing.assert_allclose(apply(params), base, rtol=1e-6, atol=1e-7)  # B = 0: the base
    trained = with_random_adapters(params)
    got = np.asarray(apply(trained))
    np.testing.assert_allclose(
        got, apply_plain(merged_params(trained, model)), rtol=1e-5, atol=1e-5
    )
    assert np.abs(got - base).max() > 1e-2  # the adapters do something
    np.testing.assert_allclose(apply(trained, adapters=False), base, rtol=1e-6, atol=1e-7)


def test_the_kv_cache_decodes_with_the_adapters():
    model = Transformer(**LLAMA, **LORA)
    params = {"params": with_random_adapters(_init(model))}
    whole = jax.jit(model.apply)(params, TOKENS)
    step = jax.jit(lambda tokens, cache: model.apply(params, tokens, cache=cache))
    logits, cache = step(TOKENS[:, :12], init_cache(model, jnp.zeros(2, jnp.int32), 16))
    np.testing.assert_allclose(logits, whole[:, :12], rtol=1e-5, atol=1e-5)
    for t in range(12, 16):
        logits, cache = step(TOKENS[:, t : t + 1], cache)
        np.testing.assert_allclose(logits[:, 0], whole[:, t], rtol=1e-5, atol=1e-5)


# ---- Hugging Face: PEFT's adapters and the merged weights


def _hf_model(family: str):
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def _imported(spec: str, **keys):
    """The LoRA model and its parameters as ``init_from='hf:DIR'`` loads them."""
    _, hf_config = pretrained.read_hf_config(spec)
    keys = pretrained.layout("experiments.lm", dict(max_len=16, attention="xla", **keys), hf_config)
    net = make_model(keys.model)
    abstract = jax.eval_shape(lambda: net.init(jax.random.key(0), TOKENS))
    repl = rp.Replicator(devices=jax.devices()[:1])
    abstract = sharding.attach_shardings(abstract, repl.param_shardings(abstract))
    plan, source = pretrained.plan(spec, "experiments.lm", keys.model, abstract)
    params = init_from.place(plan, pretrained.read(plan, source, abstract), abstract)
    return net, keys.model, params["params"], plan


def _write(directory, tensors: dict, config: dict, name: str = "config.json") -> str:
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    weights = "adapter_model" if name.startswith("adapter") else "model"
    save_file(tensors, os.path.join(directory, f"{weights}.safetensors"))
    with open(os.path.join(directory, name), "w") as f:
        json.dump(config, f)
    return str(directory)


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor(np.asarray(TOKENS))).logits.numpy()


@pytest.mark.parametrize(
    "family, keys",
    [
        ("llama", dict(scan_layers=True)),
        ("gpt2", dict(scan_layers=False, lora_quantize="int8")),
    ],
)
def test_peft_and_the_merged_export_give_our_logits(family, keys, tmp_path):
    _hf_model(family).save_pretrained(tmp_path / "hf")
    net, model, params, plan = _imported(f"hf:{tmp_path / 'hf'}", **LORA, **keys)
    fresh = [p.removesuffix("/value") for p in plan.fresh]
    assert fresh and all(p.endswith(lora.ADAPTERS) for p in fresh), fresh  # the rest loaded
    params = with_random_adapters(params)
    ours = np.asarray(net.apply({"params": params}, TOKENS))
    layout = hf_checkpoint(model)
    # PEFT's tensors: ours back from them (A's map is invertible), and loaded by PEFT.
    adapters = hf_tensors(layout.adapters, params)
    for t in layout.adapters[:2]:
        layer = [adapters[n.replace("{layer}", "0")] for n in t.names]
        want = flat(params)[t.path]
        np.testing.assert_array_equal(t.to_ours(*layer), want[0] if t.layers else want)
    base = str(tmp_path / "hf")
    if keys.get("lora_quantize"):  # the dequantized base, as export writes it
        base_layout = hf_checkpoint(model, base=True)
        base = _write(tmp_path / "base", hf_tensors(base_layout.tensors, params), layout.config)
    config = {**layout.adapter_config, "base_model_name_or_path": base}
    _write(tmp_path / "peft", adapters, config, "adapter_config.json")
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base)
    theirs = _torch_logits(peft.PeftModel.from_pretrained(base_model, str(tmp_path / "peft")))
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=2e-5)
    merged = _write(tmp_path / "merged", hf_tensors(layout.tensors, params), layout.config)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(merged)
    np.testing.assert_allclose(_torch_logits(loaded), ours, rtol=1e-5, atol=2e-5)


def test_gpt2s_fused_c_attn_is_one_module_of_three_times_the_rank():
    layout = hf_checkpoint(dict(GPT2, **LORA, lora_targets="attention/"))
    config = layout.adapter_config
    assert config["target_modules"] == ["attn.c_attn", "attn.c_proj"]
    assert config["rank_pattern"] == {"attn.c_attn": 12} and config["fan_in_fan_out"]
    assert config["alpha_pattern"] == {"attn.c_attn": 24.0}
    c_attn = layout.adapters[0]
    assert c_attn.shapes == ((12, 32), (96, 12))  # [3r, E] and block-diagonal [3E, 3r]
    llama = hf_checkpoint(dict(LLAMA, **LORA, scan_layers=False, lora_targets="block_0/.*kv"))
    assert llama.adapter_config["target_modules"] == [
        "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
    ]  # fmt: skip
    assert not llama.adapter_config["fan_in_fan_out"]


# ---- Sharding, step paths, remat


def test_adapters_are_placed_like_their_kernels():
    repl = rp.Replicator(mesh={"data": 2, "fsdp": 2, "tensor": 2}, min_size=0)
    model = Transformer(**dict(LLAMA, **LORA, lora_quantize="int8"))
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), TOKENS))["params"]
    specs = {p: s.spec for p, s in flat(repl.param_shardings({"params": abstract})).items()}
    specs = {p.removeprefix("params/").removesuffix("/value"): s for p, s in specs.items()}
    specs = {
        p: tuple(s) + (None,) * (len(flat(abstract)[p].shape) - len(s)) for p, s in specs.items()
    }
    # The kernels' axes keep their places (the rest may take fsdp, as ZeRO splits them).
    assert specs["blocks/attention/q_kernel"][1:3] == ("fsdp", "tensor")  # embed, heads
    assert specs["blocks/attention/q_kernel_lora_a"][1] == "fsdp"  # embed (then the rank)
    assert specs["blocks/attention/q_kernel_lora_b"][2] == "tensor"  # (the rank) heads
    assert specs["blocks/attention/kv_kernel_lora_a"][1] == "fsdp"
    assert specs["blocks/attention/kv_kernel_lora_b"][3] == "tensor"  # (slot, rank) kv heads
    assert specs["blocks/attention/out_kernel_lora_a"][1] == "tensor"  # heads
    assert specs["blocks/mlp/down/kernel_lora_a"][1] == "tensor"  # mlp
    assert specs["blocks/mlp/up/kernel_lora_b"][2] == "tensor"  # (the rank) mlp
    assert specs["blocks/attention/q_kernel_scale"] == specs["blocks/attention/q_kernel"]


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    preprocess = make_preprocess(LLAMA["max_len"])
    return [preprocess({"tokens": rng.integers(0, 64, (8, 17))}) for _ in range(2)]


STEP_MODEL = dict(LLAMA, **LORA, lora_quantize="nf4")


@pytest.fixture(scope="module")
def start():
    return _init(Transformer(**STEP_MODEL))


@pytest.fixture(scope="module")
def one_device(batches, start):
    repl = rp.Replicator(devices=jax.devices()[:1])
    return train_lora(repl, "compile", batches, STEP_MODEL, start)


@pytest.mark.parametrize(
    "path, remat",
    [("compile", "full"), pytest.param("run", None, marks=pytest.mark.slow)],  # 10 s each
)
def test_a_lora_step_on_fsdp_and_tensor_equals_one_device(path, remat, batches, start, one_device):
    repl = rp.Replicator(mesh={"data": 2, "fsdp": 2, "tensor": 2}, min_size=0)
    losses, params = train_lora(repl, path, batches, STEP_MODEL, start, remat_policy=remat)
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)
    assert_trained_alike(params, one_device[1])
    start = flat(start)
    for p, x in flat(params).items():  # the base frozen bitwise, the adapters trained
        if p.endswith(lora.ADAPTERS[1]):
            assert np.abs(x).max() > 0, p
        elif not p.endswith(lora.ADAPTERS):
            np.testing.assert_array_equal(x, start[p], err_msg=p)


@pytest.mark.slow  # 8 s; the fsdp x tensor step under 'full' remat holds it fast
def test_remat_policies_give_the_same_adapter_gradient(batches):
    batch = jax.tree.map(jnp.asarray, batches[0])

    def grads(policy):
        model = Transformer(**LLAMA, **LORA, lora_dropout=0.1, remat_policy=policy)
        params = flat(with_random_adapters(_init(model)))
        adapters = {p: x for p, x in params.items() if p.endswith(lora.ADAPTERS)}

        def loss(adapters):
            nats = model.apply(
                {"params": nested({**params, **adapters})}, batch["inputs"],
                targets=batch["targets"], train=True, rngs={"dropout": jax.random.key(1)},
            )  # fmt: skip
            return nats.mean()

        return jax.jit(jax.grad(loss))(adapters)

    want = grads(None)
    assert all(np.abs(g).max() > 0 for g in want.values())
    for policy in ("full", "minimal"):
        got = grads(policy)
        for p in want:
            np.testing.assert_allclose(got[p], want[p], rtol=1e-5, atol=1e-7, err_msg=p)


# ---- QLoRA's storage


@pytest.mark.parametrize("kind, nbytes, error", [("int8", 1.0, 1 / 254), ("nf4", 0.5, 0.16)])
def test_quantized_kernels_within_their_error_and_bytes(kind, nbytes, error):
    w = np.random.default_rng(0).normal(0.0, 0.02, (64, 4, 128)).astype(np.float32)
    codes, scale = lora.quantize(w, kind, np)
    back = lora.dequantize(codes, scale, kind, np)
    assert codes.nbytes / w.size == nbytes and scale.nbytes / w.size == 4 / lora.BLOCK
    absmax = np.abs(w.reshape(64, 4, 2, 64)).max(-1, keepdims=True)
    assert np.all(np.abs(back - w).reshape(64, 4, 2, 64) <= error * absmax + 1e-7)
    jax_codes, jax_scale = lora.quantize(jnp.asarray(w), kind)  # the model's init: the same
    np.testing.assert_array_equal(np.asarray(jax_codes), codes)
    np.testing.assert_allclose(np.asarray(jax_scale), scale, rtol=1e-6)  # XLA's division


def test_qlora_imports_quantized_and_a_checkpoint_round_trip_is_bitwise(tmp_path):
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    net, model, params, plan = _imported(f"hf:{tmp_path / 'hf'}", **LORA, lora_quantize="nf4")
    params = with_random_adapters(params)  # (init_from left them abstract: initialised fresh)
    by_path = flat(params)
    q = hf.model.layers[1].self_attn.q_proj.weight.detach().numpy()  # [H D, E]
    codes, scale = lora.quantize(q.T.reshape(32, 4, 8), "nf4", np)
    np.testing.assert_array_equal(by_path["blocks/attention/q_kernel"][1], codes)
    np.testing.assert_array_equal(by_path["blocks/attention/q_kernel_scale"][1], scale)
    assert by_path["blocks/attention/q_kernel"].dtype == np.uint8
    assert "q_proj.weight (q_kernel_scale)" in plan.details()
    repl = rp.Replicator(mesh={"data": 2, "fsdp": 4}, min_size=0)
    state = jax.device_put({"params": params}, repl.param_shardings({"params": params}))
    checkpoints = rp.Checkpoints(str(tmp_path / "ckpt"), repl)
    checkpoints.save(1, state)
    checkpoints.wait()
    restored = checkpoints.restore(like=state)
    checkpoints.close()
    for p, x in flat(restored).items():
        assert x.dtype == flat(state)[p].dtype, p
        np.testing.assert_array_equal(np.asarray(x), np.asarray(flat(state)[p]), err_msg=p)


# ---- Bad keys


@pytest.mark.parametrize(
    "keys, words",
    [
        (dict(lora_rank=-1), "lora_rank=-1 must be an int >= 0"),
        (dict(lora_rank=4, lora_alpha=0.0), "lora_alpha=0.0 must be > 0"),
        (dict(lora_rank=4, lora_dropout=1.0), "lora_dropout=1.0 must be in [0, 1)"),
        (dict(lora_rank=4, lora_quantize="fp8"), "lora_quantize='fp8': use None, 'int8' or 'nf4'"),
        (dict(lora_quantize="nf4"), "set config.model.lora_rank > 0 too"),
        (dict(lora_rank=4, lora_targets="embedding"), "matches no projection kernel; they are"),
        (dict(lora_rank=4, lora_targets="moe/", num_experts=4), "matches no projection kernel"),
        (dict(lora_rank=4, lora_targets="(("), "is no regex"),
    ],
)
def test_lora_problems_are_one_line_each(keys, words):
    try:  # the model's own check: the keys alone (the first problem)
        problems = lora.lora_problems(Transformer(**LLAMA, **keys))
    except ValueError as e:
        problems = [str(e)]
    (line,) = problems
    assert words in line and "\n" not in line, line


def test_a_stage_axis_refuses_lora_dropout_and_the_model_checks_its_keys():
    model = Transformer(**LLAMA, **LORA, lora_dropout=0.1)
    assert "a pipeline ('stage' axis) runs no dropout" in lora.lora_problems(model, stages=2)[0]
    assert lora.lora_problems(model, stages=1) == []
    with pytest.raises(ValueError, match="lora_alpha=-1.0 must be > 0"):
        Transformer(**LLAMA, lora_rank=2, lora_alpha=-1.0)
