"""The LM's Hugging Face checkpoints: ``config.json`` <-> model keys, HF names <-> parameters.

`hf_checkpoint` is the experiment's hook for ``init_from='hf:DIR'`` and ``export
--format hf`` (`replicator.trainer.pretrained`). Two families, checked against
transformers' own modeling code (tests/test_hf.py):

* GPT-2 (``GPT2LMHeadModel``): learned positions, LayerNorm, tanh GELU
  (``gelu_new``), biases everywhere, tied embeddings. Its ``Conv1D`` weights are
  stored ``[in, out]``, as our kernels; ``c_attn`` fuses q, k and v along its
  output, which is our ``qkv_kernel [E, 3, H, D]`` flattened.
* The Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``,
  ``Qwen2ForCausalLM``): rotary positions in the half-split layout that our model
  uses too (no permutation), RMSNorm, SwiGLU, grouped-query attention, no biases
  but Qwen2's on q/k/v. ``nn.Linear`` weights are stored ``[out, in]``: transposed.
  Exported, every member of the family is written as ``LlamaForCausalLM`` (as
  ``Qwen2ForCausalLM`` with q/k/v biases): the same computation.
* Qwen3, Mixtral and Qwen3-MoE: the Llama block with q/k norms or experts
  (`experiments.lm.hf_qwen3_moe` says what differs).

Under LoRA (`experiments.lm.lora`) an import quantizes each QLoRA kernel as it is read
(its codes and its scales, each from the one tensor); an export writes each kernel
with its adapter merged (``W + (alpha / rank) A B``, dequantized), or with ``base=True``
the base alone, and lists PEFT's tensors of the adapters (`peft_adapters`).

The model keys that ``config.json`` decides are listed in `SHAPE_KEYS`; the
others (``max_len`` of a rotary model, ``scan_layers``, ``attention``, dropout,
remat) stay the config's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from experiments.datasets.tokenizers import load_tokenizer
from experiments.lm import hf_qwen3_moe, lora
from experiments.lm.model import Transformer
from replicator.trainer import ConfigError
from replicator.trainer.pretrained import LAYER, HFLayout, HFTensor

LLAMA_FAMILY = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
ARCHITECTURES = {**LLAMA_FAMILY, **hf_qwen3_moe.FAMILIES}  # the Llama block's families
SUPPORTED = ("gpt2", *ARCHITECTURES, "gemma2", "gemma3_text")
SHAPE_KEYS = (
    "vocab_size", "num_layers", "num_heads", "embed_dim", "mlp_dim", "positions",
    "tie_embeddings", "use_bias", "norm", "norm_eps", "mlp_activation", "num_kv_heads",
    "head_dim", "rope_theta", "rope_scaling", "qkv_bias", "qk_norm", "num_experts",
    "experts_per_token", "expert_capacity_factor", "moe_every", "expert_routing",
    "moe_balance_weight", "moe_z_loss_weight", "moe_balance_pooled",
)  # fmt: skip
ROPE_SCALING_KEYS = (
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
)  # fmt: skip


def hf_checkpoint(
    model: Mapping[str, Any],
    hf_config: Mapping[str, Any] | None = None,
    *,
    tokenizer: str | None = None,
    base: bool = False,
) -> HFLayout:
    """The LM's `HFLayout`: importing (``hf_config`` given) or exporting ``model``.

    Args:
      model: the config's ``model`` keys.
      hf_config: a checkpoint's ``config.json``; None to describe ``model`` for export.
      tokenizer: exporting, the run's ``config.tokenizer``: its files go beside the
        weights, its end and start ids into ``config.json``.
      base: exporting a model with LoRA adapters, the base alone (not merged).

    Returns:
      The layout: the model keys (the checkpoint's on top of ``model``'s), the
      ``config.json``, a one-line summary and every parameter's tensors.

    Raises:
      ConfigError: a ``model_type`` or a setting that the LM does not reproduce, or
        (export) model keys that no Hugging Face family has.

    >>> hf = hf_checkpoint({"max_len": 64}, {"model_type": "llama", "vocab_size": 300,
    ...     "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    ...     "num_attention_heads": 4, "num_key_value_heads": 2})
    >>> hf.model["num_kv_heads"], hf.model["norm"], hf.model["max_len"], len(hf.tensors)
    (2, 'rmsnorm', 64, 11)
    >>> hf_checkpoint(hf.model).config["architectures"]
    ['LlamaForCausalLM']
    """
    from experiments.lm import hf_gemma  # (it builds on this module's maps)

    if hf_gemma.is_gemma(model, hf_config):
        return hf_gemma.hf_checkpoint(model, hf_config, tokenizer=tokenizer, base=base)
    files, importing = (), hf_config is not None
    if not importing:
        full = {**_defaults(), **model}
        model_type = hf_qwen3_moe.family(full) or _family(full)
        hf_config = _gpt2_config(full) if model_type == "gpt2" else _llama_config(full, model_type)
        if model_type in hf_qwen3_moe.FAMILIES:
            hf_config = hf_qwen3_moe.hf_config(full, hf_config)
        model = dict(model)
        if tokenizer is not None:
            found = load_tokenizer(tokenizer)
            files = found.files
            hf_config.update(bos_token_id=found.bos_id, eos_token_id=found.eos_id)
    else:
        hf_config = dict(hf_config)
        model, model_type = _imported_keys(model, hf_config)
    full = {**_defaults(), **model}
    if full["num_experts"] and model_type not in hf_qwen3_moe.SPARSE:
        raise ConfigError("config.model.num_experts: Hugging Face's GPT-2 and Llama are dense")
    if full["num_experts"] and full["lora_rank"]:
        raise ConfigError("config.model.lora_rank: LoRA on a mixture of experts' checkpoint")
    gpt2 = model_type == "gpt2"
    tensors = _gpt2_tensors(full) if gpt2 else _llama_tensors(full)
    adapters, adapter_config = (), {}
    if full["lora_rank"]:
        tensors = _lora_tensors(tensors, full, importing=importing, base=base)
        if not importing and not base:
            adapters, adapter_config = peft_adapters(full, gpt2)
    return HFLayout(
        model=model,
        config=hf_config,
        summary=_summary(hf_config, full),
        tensors=tuple(tensors),
        prefix="transformer." if gpt2 else "model.",
        files=tuple(files),
        adapters=adapters,
        adapter_config=adapter_config,
    )


def _defaults() -> dict[str, Any]:
    fields = dataclasses.fields(Transformer)
    return {f.name: f.default for f in fields if f.name not in ("parent", "name")}


# ---- config.json -> model keys


def _imported_keys(model: Mapping[str, Any], hf: Mapping[str, Any]) -> tuple[dict, str]:
    """``model`` with the keys that ``config.json`` (``hf``) decides on top, and its
    ``model_type``."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ConfigError(
            f"a Hugging Face checkpoint of model_type={model_type!r}: the LM reads "
            f"{', '.join(SUPPORTED)}"
        )
    taken = _gpt2_keys(hf) if model_type == "gpt2" else _llama_keys(hf)
    if model_type != "gpt2":
        taken.update(hf_qwen3_moe.model_keys(hf))
    model = {**model, **taken}
    _check_window(hf, {**_defaults(), **model})
    return model, model_type


def _gpt2_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(
            f"a GPT-2 checkpoint with activation_function={activation!r}: the LM's GELU is "
            "the tanh approximation (gelu_new)"
        )
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise ConfigError("a GPT-2 checkpoint with other attention scaling than 1/sqrt(head_dim)")
    width = hf.get("n_embd", 768)
    return dict(
        vocab_size=hf.get("vocab_size", 50257), num_layers=hf.get("n_layer", 12),
        num_heads=hf.get("n_head", 12), embed_dim=width, mlp_dim=hf.get("n_inner") or 4 * width,
        max_len=hf.get("n_positions", 1024), positions="learned",
        tie_embeddings=hf.get("tie_word_embeddings", True), use_bias=True, norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), mlp_activation="gelu", num_kv_heads=None,
        head_dim=None, qkv_bias=None,
    )  # fmt: skip


def _llama_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
    model_type = hf["model_type"]
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"a {model_type} checkpoint with hidden_act={hf['hidden_act']!r}, not silu"
        )
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError(
            f"a {model_type} checkpoint with attention_bias or mlp_bias: the LM's Llama block "
            "has biases on q/k/v only (Qwen2's)"
        )
    width, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or width // heads
    theta, scaling = _rope(hf)
    return dict(
        vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
        embed_dim=width, mlp_dim=hf["intermediate_size"], positions="rotary",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), use_bias=False,
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp_activation="swiglu",
        num_kv_heads=None if kv_heads == heads else kv_heads,
        head_dim=head_dim, rope_theta=theta,
        rope_scaling=scaling, qkv_bias=True if model_type == "qwen2" else None,
    )  # fmt: skip


def _rope(hf: Mapping[str, Any]) -> tuple[float, dict | None]:
    """``rope_theta`` and Llama 3's ``rope_scaling`` (None: none), as transformers 4 writes
    them (``rope_theta``, ``rope_scaling``) or 5 (``rope_parameters``)."""
    parameters = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or parameters)
    theta = hf.get("rope_theta", parameters.get("rope_theta", 10_000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ConfigError(
            f"a {hf['model_type']} checkpoint with rope scaling of rope_type={kind!r}: the LM "
            "reproduces Llama 3's ('llama3') only"
        )
    return float(theta), {key: scaling[key] for key in ROPE_SCALING_KEYS}


def _check_window(hf: Mapping[str, Any], model: Mapping[str, Any]) -> None:
    """Mistral's (or Qwen2's) sliding window: the same attention for windows no longer."""
    window = hf.get("sliding_window")
    qwen = ("qwen2", *hf_qwen3_moe.SLIDING_OPTIONAL)
    if hf.get("model_type") in qwen and not hf.get("use_sliding_window", False):
        window = None
    if window is not None and model["max_len"] > window:
        raise ConfigError(
            f"a {hf['model_type']} checkpoint with sliding_window={window}: the LM attends to "
            f"the whole window; set config.model.max_len <= {window} (now {model['max_len']})"
        )


def _summary(hf: Mapping[str, Any], m: Mapping[str, Any]) -> str:
    architecture = (hf.get("architectures") or ["?"])[0]
    kv = m["num_kv_heads"] or m["num_heads"]
    parts = [
        f"{hf.get('model_type')} ({architecture}): {m['num_layers']} layers",
        f"width {m['embed_dim']}",
        f"{m['num_heads']} heads of {m['head_dim'] or m['embed_dim'] // m['num_heads']}",
        f"{kv} kv heads",
        f"mlp {m['mlp_dim']}",
        f"vocab {m['vocab_size']}",
    ]
    if m["positions"] == "rotary":
        scaling = m["rope_scaling"]
        scaled = f", llama3 scaling x{dict(scaling)['factor']:g}" if scaling else ""
        parts.append(f"rope_theta {m['rope_theta']:g}{scaled}")
    else:
        parts.append(f"{m['max_len']} learned positions")
    if m["qkv_bias"]:
        parts.append("q/k/v bias")
    parts += hf_qwen3_moe.summary_parts(m)
    parts.append("tied embeddings" if m["tie_embeddings"] else "untied embeddings")
    return ", ".join(parts)


# ---- model keys -> config.json (export)


def _family(m: Mapping[str, Any]) -> str:
    """``gpt2``, ``llama`` or ``qwen2``: the family whose definition computes what ``m`` does."""
    head_dim = m["head_dim"] or m["embed_dim"] // m["num_heads"]
    plain = head_dim * m["num_heads"] == m["embed_dim"] and m["num_kv_heads"] is None
    if (m["positions"], m["norm"], m["mlp_activation"]) == ("learned", "layernorm", "gelu"):
        if m["use_bias"] and m["qkv_bias"] in (None, True) and plain:
            return "gpt2"
    if (m["positions"], m["norm"], m["mlp_activation"]) == ("rotary", "rmsnorm", "swiglu"):
        if not m["use_bias"]:
            return "qwen2" if m["qkv_bias"] else "llama"
    raise ConfigError(
        "these model keys have no Hugging Face family: GPT-2 is positions='learned', "
        "norm='layernorm', mlp_activation='gelu', use_bias=True, no num_kv_heads or "
        "head_dim; Llama is positions='rotary', norm='rmsnorm', mlp_activation='swiglu', "
        "use_bias=False (qkv_bias=True: Qwen2)"
    )


def _gpt2_config(m: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": m["vocab_size"], "n_positions": m["max_len"], "n_embd": m["embed_dim"],
        "n_layer": m["num_layers"], "n_head": m["num_heads"],
        "n_inner": m["mlp_dim"] or 4 * m["embed_dim"], "activation_function": "gelu_new",
        "layer_norm_epsilon": m["norm_eps"], "tie_word_embeddings": m["tie_embeddings"],
        "resid_pdrop": m["dropout_rate"], "embd_pdrop": m["dropout_rate"],
        "attn_pdrop": 0.0, "scale_attn_weights": True, "torch_dtype": "float32",
    }  # fmt: skip


def _llama_config(m: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    heads = m["num_heads"]
    scaling = m["rope_scaling"]
    if scaling is not None:
        scaling = {"rope_type": "llama3", **{k: dict(scaling)[k] for k in ROPE_SCALING_KEYS}}
    config = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": m["vocab_size"], "hidden_size": m["embed_dim"],
        "intermediate_size": m["mlp_dim"] or 4 * m["embed_dim"],
        "num_hidden_layers": m["num_layers"], "num_attention_heads": heads,
        "num_key_value_heads": m["num_kv_heads"] or heads,
        "head_dim": m["head_dim"] or m["embed_dim"] // heads, "hidden_act": "silu",
        "max_position_embeddings": m["max_len"], "rms_norm_eps": m["norm_eps"],
        "rope_theta": m["rope_theta"], "rope_scaling": scaling,
        "tie_word_embeddings": m["tie_embeddings"], "torch_dtype": "float32",
    }  # fmt: skip
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    return config


# ---- tensors <-> parameters


def _same(x):
    return x


def _transposed(x):
    return np.asarray(x).T


def _map(path, names, shapes, to_ours=_same, to_hf=None, layers=0) -> HFTensor:
    """An `HFTensor`; without ``to_hf``, ``to_ours`` is `_same` or `_transposed`, its own
    inverse."""
    if to_hf is None:
        to_hf = lambda x: (to_ours(np.asarray(x)),)  # noqa: E731
    return HFTensor(path, tuple(names), tuple(tuple(s) for s in shapes), to_ours, to_hf, layers)


def _block_maps(m: Mapping[str, Any]) -> tuple[str, int]:
    """The blocks' path prefix and layer count: scanned (stacked; a mixture of experts'
    in groups of one block, ``moe_every=1``) or ``block_<i>``."""
    if not m["scan_layers"]:
        return "block_{layer}", 0
    return ("blocks/block_0" if m["num_experts"] else "blocks"), m["num_layers"]


def _expand(tensors: list[HFTensor], m: Mapping[str, Any]) -> list[HFTensor]:
    """Stacked maps as they are; unscanned blocks as one map per block (``block_<i>``)."""
    if m["scan_layers"]:
        return tensors
    out = []
    for t in tensors:
        if "{layer}" not in t.path:
            out.append(t)
            continue
        for i in range(m["num_layers"]):
            names = tuple(n.replace(LAYER, str(i)) for n in t.names)
            also = tuple(p.replace(LAYER, str(i)) for p in t.also)
            path = t.path.replace(LAYER, str(i))
            out.append(dataclasses.replace(t, path=path, names=names, also=also))
    return out


def _gpt2_tensors(m: Mapping[str, Any]) -> list[HFTensor]:
    E, H, V, M = m["embed_dim"], m["num_heads"], m["vocab_size"], m["mlp_dim"] or 4 * m["embed_dim"]
    D = E // H
    blocks, L = _block_maps(m)
    h = "transformer.h.{layer}."
    tensors = [
        _map("token_embedding/embedding", ["transformer.wte.weight"], [(V, E)]),
        _map("position_embedding", ["transformer.wpe.weight"], [(m["max_len"], E)]),
        _map("ln_final/scale", ["transformer.ln_f.weight"], [(E,)]),
        _map("ln_final/bias", ["transformer.ln_f.bias"], [(E,)]),
    ]
    per_layer = [
        ("ln_attention/scale", "ln_1.weight", (E,), _same, None),
        ("ln_attention/bias", "ln_1.bias", (E,), _same, None),
        ("attention/qkv_kernel", "attn.c_attn.weight", (E, 3 * E),
         lambda w: np.asarray(w).reshape(E, 3, H, D), lambda x: (np.asarray(x).reshape(E, 3 * E),)),
        ("attention/qkv_bias", "attn.c_attn.bias", (3 * E,),
         lambda b: np.asarray(b).reshape(3, H, D), lambda x: (np.asarray(x).reshape(3 * E),)),
        ("attention/out_kernel", "attn.c_proj.weight", (E, E),
         lambda w: np.asarray(w).reshape(H, D, E), lambda x: (np.asarray(x).reshape(E, E),)),
        ("attention/out_bias", "attn.c_proj.bias", (E,), _same, None),
        ("ln_mlp/scale", "ln_2.weight", (E,), _same, None),
        ("ln_mlp/bias", "ln_2.bias", (E,), _same, None),
        ("mlp/fc/kernel", "mlp.c_fc.weight", (E, M), _same, None),
        ("mlp/fc/bias", "mlp.c_fc.bias", (M,), _same, None),
        ("mlp/proj/kernel", "mlp.c_proj.weight", (M, E), _same, None),
        ("mlp/proj/bias", "mlp.c_proj.bias", (E,), _same, None),
    ]  # fmt: skip
    for path, name, shape, to_ours, to_hf in per_layer:
        tensors.append(_map(f"{blocks}/{path}", [h + name], [shape], to_ours, to_hf, L))
    if not m["tie_embeddings"]:
        tensors.append(_map("head/kernel", ["lm_head.weight"], [(V, E)], _transposed))
    return _expand(tensors, m)


def _llama_tensors(m: Mapping[str, Any]) -> list[HFTensor]:
    E, H, V, M = m["embed_dim"], m["num_heads"], m["vocab_size"], m["mlp_dim"] or 4 * m["embed_dim"]
    D = m["head_dim"] or E // H
    K = m["num_kv_heads"] or H
    blocks, L = _block_maps(m)
    a = "model.layers.{layer}.self_attn."
    q, k, v = (f"{a}{x}_proj" for x in "qkv")

    def heads_in(count):  # [count * D, E] -> [E, count, D]
        return lambda w: np.asarray(w).T.reshape(E, count, D)

    def heads_out(count):
        return lambda x: np.asarray(x).reshape(E, count * D).T

    def stacked(*fs):  # tensors -> [E, n, heads, D], and back
        return lambda *ws: np.stack([f(w) for f, w in zip(fs, ws)], axis=1)

    def unstacked(*fs):
        return lambda x: tuple(f(np.asarray(x)[:, i]) for i, f in enumerate(fs))

    def bias_in(count):
        return lambda *bs: np.stack([np.asarray(b).reshape(count, D) for b in bs])

    def bias_out(count):
        return lambda x: tuple(np.asarray(row).reshape(count * D) for row in np.asarray(x))

    tensors = [
        _map("token_embedding/embedding", ["model.embed_tokens.weight"], [(V, E)]),
        _map("ln_final/scale", ["model.norm.weight"], [(E,)]),
    ]
    if m["num_kv_heads"] is None:  # one fused projection: [E, 3, H, D]
        tensors.append(_map(f"{blocks}/attention/qkv_kernel", [f"{q}.weight", f"{k}.weight",
                            f"{v}.weight"], [(H * D, E)] * 3, stacked(*[heads_in(H)] * 3),
                            unstacked(*[heads_out(H)] * 3), L))  # fmt: skip
        if m["qkv_bias"]:
            tensors.append(_map(f"{blocks}/attention/qkv_bias", [f"{x}.bias" for x in (q, k, v)],
                                [(H * D,)] * 3, bias_in(H), bias_out(H), L))  # fmt: skip
    else:  # grouped-query: q [E, H, D], k and v [E, 2, K, D]
        tensors.append(_map(f"{blocks}/attention/q_kernel", [f"{q}.weight"], [(H * D, E)],
                            heads_in(H), lambda x: (heads_out(H)(x),), L))  # fmt: skip
        tensors.append(_map(f"{blocks}/attention/kv_kernel", [f"{k}.weight", f"{v}.weight"],
                            [(K * D, E)] * 2, stacked(heads_in(K), heads_in(K)),
                            unstacked(heads_out(K), heads_out(K)), L))  # fmt: skip
        if m["qkv_bias"]:
            tensors.append(_map(f"{blocks}/attention/q_bias", [f"{q}.bias"], [(H * D,)],
                                lambda b: np.asarray(b).reshape(H, D),
                                lambda x: (np.asarray(x).reshape(H * D),), L))  # fmt: skip
            tensors.append(_map(f"{blocks}/attention/kv_bias", [f"{k}.bias", f"{v}.bias"],
                                [(K * D,)] * 2, bias_in(K), bias_out(K), L))  # fmt: skip
    per_layer = [
        ("attention/out_kernel", f"{a}o_proj.weight", (E, H * D),
         lambda w: np.asarray(w).T.reshape(H, D, E),
         lambda x: (np.asarray(x).reshape(H * D, E).T,)),
        ("ln_attention/scale", "model.layers.{layer}.input_layernorm.weight", (E,), _same, None),
        ("ln_mlp/scale", "model.layers.{layer}.post_attention_layernorm.weight", (E,), _same, None),
        ("mlp/gate/kernel", "model.layers.{layer}.mlp.gate_proj.weight", (M, E), _transposed, None),
        ("mlp/up/kernel", "model.layers.{layer}.mlp.up_proj.weight", (M, E), _transposed, None),
        ("mlp/down/kernel", "model.layers.{layer}.mlp.down_proj.weight", (E, M), _transposed, None),
    ]  # fmt: skip
    for path, name, shape, to_ours, to_hf in per_layer:
        tensors.append(_map(f"{blocks}/{path}", [name], [shape], to_ours, to_hf, L))
    if not m["tie_embeddings"]:
        tensors.append(_map("head/kernel", ["lm_head.weight"], [(V, E)], _transposed))
    return _expand(hf_qwen3_moe.block_tensors(tensors, m, blocks, L), m)


# ---- LoRA: quantized kernels in, adapters merged or apart out


def _lora_tensors(
    tensors: list[HFTensor], m: Mapping[str, Any], *, importing: bool, base: bool
) -> list[HFTensor]:
    """The maps of the kernels with adapters: importing, a QLoRA kernel as its codes and
    its scales (each quantized from the tensor as it is read); exporting, each kernel
    dequantized and, unless ``base``, with its adapter merged (`lora.merge`)."""
    kind, scale = m["lora_quantize"], m["lora_alpha"] / m["lora_rank"]
    out = []
    for t in tensors:
        if not lora.is_target(t.path, m["lora_targets"]):
            out.append(t)
        elif importing and kind:  # codes and scales, each quantized from the tensor
            scales = t.path + lora.SCALE
            to_hf = _merged(t.to_hf, kind, scale)
            out.append(dataclasses.replace(
                t, to_ours=_quantized(t.to_ours, kind, 0), to_hf=to_hf, also=(scales,)
            ))  # fmt: skip
            out.append(dataclasses.replace(
                t, path=scales, to_ours=_quantized(t.to_ours, kind, 1),
                to_hf=lambda s, codes, f=to_hf: f(codes, s), also=(t.path,),
            ))  # fmt: skip
        elif importing:
            out.append(t)
        else:
            also = (t.path + lora.SCALE,) if kind else ()
            if not base:
                also += tuple(t.path + suffix for suffix in lora.ADAPTERS)
            out.append(dataclasses.replace(t, to_hf=_merged(t.to_hf, kind, scale), also=also))
    return out


def _quantized(to_ours, kind: str | None, part: int):
    if kind is None:
        return to_ours
    return lambda *ws: lora.quantize(to_ours(*ws), kind, np)[part]


def _merged(to_hf, kind: str | None, scale: float):
    """``to_hf`` of the kernel ``(codes, scales,)? (A, B)?`` make."""

    def merged(w, *rest):
        if kind is not None:
            w, rest = lora.dequantize(np.asarray(w), np.asarray(rest[0]), kind, np), rest[1:]
        if rest:
            w = lora.merge(np.asarray(w), np.asarray(rest[0]), np.asarray(rest[1]), scale)
        return to_hf(w)

    return merged


# Our kernels -> the modules PEFT adapts (the ends of HF's module names). A fused kernel's
# slots are modules of their own (k_proj, v_proj), but for GPT-2's c_attn, one module of
# the three: its adapter is ours of rank 3r, A stacked and B block-diagonal (exact).
_LLAMA_MODULES = {
    "attention/q_kernel": ("self_attn.q_proj",),
    "attention/kv_kernel": ("self_attn.k_proj", "self_attn.v_proj"),
    "attention/qkv_kernel": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention/out_kernel": ("self_attn.o_proj",),
    "mlp/gate/kernel": ("mlp.gate_proj",),
    "mlp/up/kernel": ("mlp.up_proj",),
    "mlp/down/kernel": ("mlp.down_proj",),
}
_GPT2_MODULES = {
    "attention/qkv_kernel": ("attn.c_attn",),
    "attention/out_kernel": ("attn.c_proj",),
    "mlp/fc/kernel": ("mlp.c_fc",),
    "mlp/proj/kernel": ("mlp.c_proj",),
}


def peft_adapters(m: Mapping[str, Any], gpt2: bool) -> tuple[tuple[HFTensor, ...], dict]:
    """Hugging Face PEFT's tensors of the adapters (``lora_A.weight [r, in]``,
    ``lora_B.weight [out, r]`` under ``base_model.model.``) and ``adapter_config.json``
    (but ``base_model_name_or_path``) for the model keys ``m`` (defaults filled in).

    ``target_modules`` name a module by its end (``self_attn.q_proj``) where every layer
    has the adapter, else in full (``model.layers.3.self_attn.q_proj``); GPT-2's fused
    ``c_attn`` has rank ``3r`` and alpha ``3 alpha`` in ``rank_pattern``/``alpha_pattern``
    (the same scale), and its ``Conv1D`` modules ``fan_in_fan_out``.
    """
    E, H, M = m["embed_dim"], m["num_heads"], m["mlp_dim"] or 4 * m["embed_dim"]
    D, r = m["head_dim"] or E // H, m["lora_rank"]
    K = m["num_kv_heads"]
    blocks, L = _block_maps(m)
    kernels = {  # kernel -> (its input axes, its slots, one slot's output width)
        "attention/q_kernel": ((E,), 0, H * D), "attention/kv_kernel": ((E,), 2, (K or H) * D),
        "attention/qkv_kernel": ((E,), 3, H * D), "attention/out_kernel": ((H, D), 0, E),
        "mlp/fc/kernel": ((E,), 0, M), "mlp/gate/kernel": ((E,), 0, M),
        "mlp/up/kernel": ((E,), 0, M), "mlp/proj/kernel": ((M,), 0, E),
        "mlp/down/kernel": ((M,), 0, E),
    }  # fmt: skip
    fused = "attention/qkv_kernel" if K is None else None
    layer = "transformer.h.{layer}." if gpt2 else "model.layers.{layer}."
    tensors = []
    for kernel, modules in (_GPT2_MODULES if gpt2 else _LLAMA_MODULES).items():
        if kernel.startswith(("attention/q_kernel", "attention/kv_kernel")) and K is None:
            continue
        if kernel == "attention/qkv_kernel" and kernel != fused:
            continue
        shape_in, slots, width = kernels[kernel]
        n = max(1, slots) // len(modules)  # slots per module
        names, shapes = [], []
        for module in modules:
            full = f"base_model.model.{layer}{module}"
            names += [f"{full}.lora_A.weight", f"{full}.lora_B.weight"]
            shapes += [(n * r, int(np.prod(shape_in))), (n * width, n * r)]
        tensors.append(_map(
            f"{blocks}/{kernel}_lora_a", names, shapes, _adapter_a(shape_in, slots, len(modules)),
            _adapter_hf(slots, len(modules)), L,
        ))  # fmt: skip
        tensors[-1] = dataclasses.replace(tensors[-1], also=(f"{blocks}/{kernel}_lora_b",))
    tensors = [
        t for t in _expand(tensors, m)
        if lora.is_target(t.path.removesuffix(lora.ADAPTERS[0]), m["lora_targets"])
    ]  # fmt: skip
    return tuple(tensors), _adapter_config(m, tensors, gpt2)


def _adapter_hf(slots: int, modules: int):
    """``(A, B) -> (lora_A, lora_B) per module``: one layer's adapter in PEFT's layout."""

    def to_hf(a, b):
        a, b = np.asarray(a), np.asarray(b)
        r = a.shape[-1]
        if not slots:
            return a.reshape(-1, r).T, b.reshape(r, -1).T
        pairs = [(a[..., s, :].reshape(-1, r).T, b[s].reshape(r, -1).T) for s in range(slots)]
        if modules == slots:
            return tuple(x for pair in pairs for x in pair)
        width = pairs[0][1].shape[0]
        b_hf = np.zeros((slots * width, slots * r), b.dtype)
        for s, (_, b_s) in enumerate(pairs):
            b_hf[s * width : (s + 1) * width, s * r : (s + 1) * r] = b_s
        return np.concatenate([a_s for a_s, _ in pairs]), b_hf

    return to_hf


def _adapter_a(shape_in: tuple[int, ...], slots: int, modules: int):
    """The inverse of `_adapter_hf` for ``A``: PEFT's ``lora_A`` tensors -> our ``A``."""

    def to_ours(*tensors):
        a_hf = [np.asarray(x) for x in tensors[0::2]]
        if slots and modules != slots:
            a_hf = np.split(a_hf[0], slots)
        parts = [x.T.reshape(*shape_in, -1) for x in a_hf]
        return parts[0] if not slots else np.stack(parts, axis=-2)

    return to_ours


def _adapter_config(m: Mapping[str, Any], tensors: list[HFTensor], gpt2: bool) -> dict:
    layers: dict[str, list[str]] = {}  # a module's end -> the full names of its adapted ones
    for t in tensors:
        for name in t.names[0::2]:
            full = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            end = full.split(".", 3)[-1]  # past model.layers.{layer}. (transformer.h.{layer}.)
            layers.setdefault(end, []).extend(
                [full.replace(LAYER, str(i)) for i in range(m["num_layers"])]
                if LAYER in full else [full]
            )  # fmt: skip
    targets = []
    for end, names in sorted(layers.items()):
        targets += [end] if len(names) == m["num_layers"] else names
    r, alpha = m["lora_rank"], m["lora_alpha"]
    fused = [t for t in targets if t.endswith("attn.c_attn")]
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
        "lora_dropout": m["lora_dropout"], "target_modules": targets,
        "rank_pattern": {t: 3 * r for t in fused}, "alpha_pattern": {t: 3 * alpha for t in fused},
        "fan_in_fan_out": gpt2, "bias": "none", "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }  # fmt: skip
