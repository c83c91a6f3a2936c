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
from experiments.lm.model import Transformer
from replicator.trainer import ConfigError
from replicator.trainer.pretrained import LAYER, HFLayout, HFTensor

LLAMA_FAMILY = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED = ("gpt2", *LLAMA_FAMILY)
SHAPE_KEYS = (
    "vocab_size", "num_layers", "num_heads", "embed_dim", "mlp_dim", "positions",
    "tie_embeddings", "use_bias", "norm", "norm_eps", "mlp_activation", "num_kv_heads",
    "head_dim", "rope_theta", "rope_scaling", "qkv_bias",
)  # fmt: skip
ROPE_SCALING_KEYS = (
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
)  # fmt: skip


def hf_checkpoint(
    model: Mapping[str, Any],
    hf_config: Mapping[str, Any] | None = None,
    *,
    tokenizer: str | None = None,
) -> HFLayout:
    """The LM's `HFLayout`: importing (``hf_config`` given) or exporting ``model``.

    Args:
      model: the config's ``model`` keys.
      hf_config: a checkpoint's ``config.json``; None to describe ``model`` for export.
      tokenizer: exporting, the run's ``config.tokenizer``: its files go beside the
        weights, its end and start ids into ``config.json``.

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
    files = ()
    if hf_config is None:
        full = {**_defaults(), **model}
        model_type = _family(full)
        hf_config = _gpt2_config(full) if model_type == "gpt2" else _llama_config(full, model_type)
        model = dict(model)
        if tokenizer is not None:
            found = load_tokenizer(tokenizer)
            files = found.files
            hf_config.update(bos_token_id=found.bos_id, eos_token_id=found.eos_id)
    else:
        hf_config = dict(hf_config)
        model_type = hf_config.get("model_type")
        if model_type not in SUPPORTED:
            raise ConfigError(
                f"a Hugging Face checkpoint of model_type={model_type!r}: the LM reads "
                f"{', '.join(SUPPORTED)}"
            )
        taken = _gpt2_keys(hf_config) if model_type == "gpt2" else _llama_keys(hf_config)
        model = {**model, **taken}
        _check_window(hf_config, {**_defaults(), **model})
    full = {**_defaults(), **model}
    if full["num_experts"]:
        raise ConfigError("config.model.num_experts: Hugging Face's GPT-2 and Llama are dense")
    gpt2 = model_type == "gpt2"
    return HFLayout(
        model=model,
        config=hf_config,
        summary=_summary(hf_config, full),
        tensors=tuple(_gpt2_tensors(full) if gpt2 else _llama_tensors(full)),
        prefix="transformer." if gpt2 else "model.",
        files=tuple(files),
    )


def _defaults() -> dict[str, Any]:
    fields = dataclasses.fields(Transformer)
    return {f.name: f.default for f in fields if f.name not in ("parent", "name")}


# ---- config.json -> model keys


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
    if hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window", False):
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
        "architectures": [LLAMA_FAMILY[model_type]], "model_type": model_type,
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
    """The blocks' path prefix and layer count: scanned (stacked) or ``block_<i>``."""
    return ("blocks", m["num_layers"]) if m["scan_layers"] else ("block_{layer}", 0)


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
            out.append(dataclasses.replace(t, path=t.path.replace(LAYER, str(i)), names=names))
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
    return _expand(tensors, m)
