"""Gemma 2 and Gemma 3 (text) checkpoints: ``config.json`` <-> model keys, HF names <-> parameters.

`experiments.lm.hf.hf_checkpoint` hands these two families here (`is_gemma`). Checked
against transformers' own modeling code (tests/test_hf_gemma.py):

* Gemma 2 (``Gemma2ForCausalLM``, ``model_type`` ``gemma2``): the Llama family's
  attention and rotary layout (``q_proj``/``k_proj``/``v_proj``/``o_proj``, grouped-query,
  no biases), but RMSNorm scaled by ``1 + w`` (``norm='gemma_rmsnorm'``: HF's stored
  ``w`` is our ``scale``), a norm before and after each branch (``post_norms``: HF's
  ``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm``), a GeGLU MLP with tanh GELU (``mlp_activation='geglu'``),
  embeddings times ``sqrt(hidden_size)`` (``embed_scale``), tied logits, attention and
  final logits soft-capped (``attn_logit_softcap``, ``final_logit_softcap``), scores
  scaled by ``query_pre_attn_scalar ** -0.5``, and every other layer attending within a
  sliding window (``sliding_window``, ``sliding_window_pattern=2``).
* Gemma 3 text (``Gemma3ForCausalLM``, ``gemma3_text``): Gemma 2's block with a q/k
  RMSNorm per head (``qk_norm``, HF's ``q_norm``/``k_norm``), five local layers to one
  global (``sliding_window_pattern=6``), the local layers' rotary base
  ``rope_local_theta`` (HF's ``rope_local_base_freq``, or ``rope_parameters``'
  ``sliding_attention``) unscaled and the global layers' ``rope_theta`` with its linear
  ``rope_scaling``; its final logits soft-capped only where ``config.json`` says so,
  its attention never (transformers' Gemma 3 attention ignores
  ``attn_logit_softcapping``; so does the import, and an export refuses it).

The layers' kinds come from ``config.json``'s ``layer_types``: the LM reads those where
every ``n``-th layer is global and the others local (or all alike); any other order is
refused in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from experiments.datasets.tokenizers import load_tokenizer
from experiments.lm import hf as hf_lib
from experiments.lm.layers import check_rope_scaling
from experiments.lm.model import layer_is_local
from replicator.trainer import ConfigError
from replicator.trainer.pretrained import HFLayout

GEMMA_FAMILY = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
SLIDING, FULL = "sliding_attention", "full_attention"
_PATTERN = {"gemma2": 2, "gemma3_text": 6}  # transformers' default layer_types
_LAYER = "model.layers.{layer}."


def is_gemma(model: Mapping[str, Any], hf_config: Mapping[str, Any] | None) -> bool:
    """Whether a checkpoint (importing) or the model keys (exporting) are Gemma's.

    >>> is_gemma({}, {"model_type": "gemma2"}), is_gemma({"norm": "rmsnorm"}, None)
    (True, False)
    """
    if hf_config is not None:
        return hf_config.get("model_type") in GEMMA_FAMILY
    return model.get("norm") == "gemma_rmsnorm"


def hf_checkpoint(
    model: Mapping[str, Any],
    hf_config: Mapping[str, Any] | None = None,
    *,
    tokenizer: str | None = None,
    base: bool = False,
) -> HFLayout:
    """Gemma's `HFLayout` (`experiments.lm.hf.hf_checkpoint`'s for these families).

    >>> hf = hf_checkpoint({"max_len": 64}, {"model_type": "gemma2", "vocab_size": 300,
    ...     "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    ...     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    ...     "sliding_window": 8})
    >>> hf.model["sliding_window"], hf.model["sliding_window_pattern"], len(hf.tensors)
    (8, 2, 12)
    >>> hf_checkpoint(hf.model).config["layer_types"]
    ['sliding_attention', 'full_attention']
    """
    importing, files = hf_config is not None, ()
    if importing:
        hf_config = dict(hf_config)
        model = {**model, **gemma_keys(hf_config)}
    full = {**hf_lib._defaults(), **model}
    if full["num_experts"]:
        raise ConfigError("config.model.num_experts: Hugging Face's Gemma 2 and 3 are dense")
    if not importing:
        hf_config = gemma_config(full)
        if tokenizer is not None:
            found = load_tokenizer(tokenizer)
            files = found.files
            hf_config.update(bos_token_id=found.bos_id, eos_token_id=found.eos_id)
    tensors = gemma_tensors(full)
    adapters, adapter_config = (), {}
    if full["lora_rank"]:
        tensors = hf_lib._lora_tensors(tensors, full, importing=importing, base=base)
        if not importing and not base:
            adapters, adapter_config = hf_lib.peft_adapters(full, False)
    return HFLayout(
        model=dict(model),
        config=hf_config,
        summary=_summary(hf_config, full),
        tensors=tuple(tensors),
        prefix="model.",
        files=tuple(files),
        adapters=adapters,
        adapter_config=adapter_config,
    )


# ---- config.json -> model keys


def gemma_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The model keys of a Gemma 2 or Gemma 3 text ``config.json``.

    Raises:
      ConfigError: a setting the LM does not reproduce (biases, another activation,
        bidirectional attention, layer kinds in no every-n-th order, rope scaling
        other than linear).
    """
    model_type = hf["model_type"]
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(
            f"a {model_type} checkpoint with hidden_activation={activation!r}: the LM's GeGLU "
            "is the tanh GELU (gelu_pytorch_tanh)"
        )
    if hf.get("attention_bias"):
        raise ConfigError(f"a {model_type} checkpoint with attention_bias: the LM's has none")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(
            f"a {model_type} checkpoint with use_bidirectional_attention: the LM is causal"
        )
    width, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or width // heads
    window, pattern = _layer_pattern(hf)
    gemma3 = model_type == "gemma3_text"  # whose attention ignores attn_logit_softcapping
    theta, scaling, local_theta = _gemma_rope(hf)
    keys = dict(
        vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
        embed_dim=width, mlp_dim=hf["intermediate_size"], positions="rotary",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), use_bias=False,
        norm="gemma_rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp_activation="geglu",
        num_kv_heads=None if kv_heads == heads else kv_heads, head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta, qkv_bias=None,
        qk_norm=gemma3, embed_scale=True, post_norms=True,
        attn_logit_softcap=None if gemma3 else _number(hf.get("attn_logit_softcapping")),
        final_logit_softcap=_number(hf.get("final_logit_softcapping")),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or head_dim),
        sliding_window=window, sliding_window_pattern=pattern,
    )  # fmt: skip
    return keys


def _number(x: Any) -> float | None:
    return None if x is None else float(x)


def _layer_pattern(hf: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(sliding_window, sliding_window_pattern)`` from ``layer_types``: ``(None, None)``
    when every layer is global, ``(window, None)`` when every one is local, else
    ``(window, n)`` for every ``n``-th layer global."""
    model_type, layers = hf["model_type"], hf["num_hidden_layers"]
    every = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
    every = every or _PATTERN[model_type]
    kinds = hf.get("layer_types") or [
        FULL if (i + 1) % every == 0 else SLIDING for i in range(layers)
    ]
    unknown = sorted(set(kinds) - {SLIDING, FULL})
    if unknown or len(kinds) != layers:
        raise ConfigError(
            f"a {model_type} checkpoint with layer_types {unknown or kinds}: the LM reads "
            f"{SLIDING!r} and {FULL!r}, one per layer"
        )
    local = [kind == SLIDING for kind in kinds]
    window = hf.get("sliding_window")
    if window is None or not any(local):
        return None, None
    if all(local):
        return int(window), None
    for n in range(2, layers + 1):
        if local == [layer_is_local(i, n) for i in range(layers)]:
            return int(window), n
    raise ConfigError(
        f"a {model_type} checkpoint whose layer_types are in no every-n-th-layer-global "
        f"order ({''.join('L' if x else 'G' for x in local)}): the LM's layers alternate so"
    )


def _gemma_rope(hf: Mapping[str, Any]) -> tuple[float, dict | None, float | None]:
    """``(rope_theta, rope_scaling, rope_local_theta)``: the global layers' base and
    scaling and the local layers' base (Gemma 2: None, the same rotary everywhere), from
    transformers 5's ``rope_parameters`` (by layer kind for Gemma 3) or 4's keys."""
    model_type = hf["model_type"]
    parameters = dict(hf.get("rope_parameters") or {})
    if FULL in parameters or SLIDING in parameters:
        full = dict(parameters.get(FULL) or {})
        local = dict(parameters.get(SLIDING) or {})
    else:
        full = {**parameters, **dict(hf.get("rope_scaling") or {})}
        full.setdefault("rope_theta", hf.get("rope_theta", 10_000.0 if model_type == "gemma2"
                                                         else 1_000_000.0))  # fmt: skip
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(
            f"a {model_type} checkpoint with rope scaling of its local layers: the LM scales "
            "the global layers' only"
        )
    theta, scaling = float(full.get("rope_theta", 10_000.0)), None
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(full["factor"])}
    elif kind != "default":
        raise ConfigError(
            f"a {model_type} checkpoint with rope scaling of rope_type={kind!r}: the LM "
            "reproduces Gemma 3's 'linear' (and Llama 3's 'llama3')"
        )
    local_theta = None if model_type == "gemma2" else float(local.get("rope_theta", 10_000.0))
    return theta, scaling, local_theta


def _summary(hf: Mapping[str, Any], m: Mapping[str, Any]) -> str:
    parts = [hf_lib._summary(hf, m)]
    if m["rope_scaling"] is not None:  # (the Llama family's line names llama3's)
        parts[0] = parts[0].replace("llama3 scaling", "linear scaling of the global layers")
    if m["sliding_window"]:
        every = m["sliding_window_pattern"]
        which = f"1 layer in {every} global" if every else "every layer"
        parts.append(f"sliding window {m['sliding_window']} ({which})")
    if m["rope_local_theta"]:
        parts.append(f"local rope_theta {m['rope_local_theta']:g}")
    caps = [f"{x:g}" for x in (m["attn_logit_softcap"], m["final_logit_softcap"]) if x]
    if caps:
        parts.append(f"soft-capped logits {'/'.join(caps)}")
    return ", ".join(parts)


# ---- model keys -> config.json (export)


def gemma_config(m: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of the model keys ``m`` (defaults filled in): Gemma 3 text with
    a q/k norm, else Gemma 2.

    Raises:
      ConfigError: keys outside what either family computes.
    """
    model_type = "gemma3_text" if m["qk_norm"] else "gemma2"
    _check_exportable(m, model_type)
    heads, head_dim = m["num_heads"], m["head_dim"] or m["embed_dim"] // m["num_heads"]
    window, every, layers = m["sliding_window"], m["sliding_window_pattern"], m["num_layers"]
    kinds = [
        SLIDING if window and layer_is_local(i, every) else FULL for i in range(layers)
    ]  # fmt: skip
    scalar = m["query_pre_attn_scalar"] or head_dim
    config = {
        "architectures": [GEMMA_FAMILY[model_type]], "model_type": model_type,
        "vocab_size": m["vocab_size"], "hidden_size": m["embed_dim"],
        "intermediate_size": m["mlp_dim"] or 4 * m["embed_dim"],
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": m["num_kv_heads"] or heads, "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": m["max_len"],
        "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_theta"],
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "sliding_window": window or m["max_len"], "layer_types": kinds,
        "attn_logit_softcapping": m["attn_logit_softcap"],
        "final_logit_softcapping": m["final_logit_softcap"], "attention_bias": False,
        "tie_word_embeddings": m["tie_embeddings"], "torch_dtype": "float32",
    }  # fmt: skip
    if model_type == "gemma3_text":
        scaling = m["rope_scaling"]
        config["rope_local_base_freq"] = m["rope_local_theta"] or m["rope_theta"]
        config["rope_scaling"] = None if scaling is None else dict(scaling)
    return config


def _check_exportable(m: Mapping[str, Any], model_type: str) -> None:
    """One line for model keys with a Gemma norm that no Gemma family computes."""
    wanted = dict(
        positions="rotary", mlp_activation="geglu", use_bias=False, embed_scale=True,
        post_norms=True,
    )  # fmt: skip
    wrong = [f"{k}={m[k]!r}" for k, v in wanted.items() if m[k] != v]
    if m["qkv_bias"]:
        wrong.append("qkv_bias=True")
    if model_type == "gemma2" and (m["rope_local_theta"] or m["rope_scaling"]):
        wrong.append("rope_local_theta or rope_scaling without qk_norm (Gemma 3's)")
    if model_type == "gemma3_text" and m["attn_logit_softcap"]:
        wrong.append("attn_logit_softcap with qk_norm (transformers' Gemma 3 ignores it)")
    if m["rope_scaling"] is not None and dict(m["rope_scaling"]).get("rope_type") != "linear":
        wrong.append("rope_scaling other than linear")
    if wrong:
        raise ConfigError(
            "norm='gemma_rmsnorm' exports as Gemma 2 or 3, which compute positions='rotary', "
            "mlp_activation='geglu', use_bias=False, embed_scale=True, post_norms=True; these "
            f"keys differ: {', '.join(wrong)}"
        )
    check_rope_scaling(m["rope_scaling"])


# ---- tensors <-> parameters


def gemma_tensors(m: Mapping[str, Any]) -> list:
    """The Llama family's maps (`experiments.lm.hf._llama_tensors`) with Gemma's four norms
    per block (its ``post_attention_layernorm`` is the attention's output norm, not the
    MLP's input norm as Llama's) and Gemma 3's q/k norms."""
    tensors = []
    for t in hf_lib._llama_tensors(m):
        if t.path.endswith("ln_mlp/scale"):
            names = tuple(
                n.replace("post_attention_layernorm", "pre_feedforward_layernorm") for n in t.names
            )  # fmt: skip
            t = dataclasses.replace(t, names=names)
        tensors.append(t)
    E, D = m["embed_dim"], m["head_dim"] or m["embed_dim"] // m["num_heads"]
    blocks, layers = hf_lib._block_maps(m)
    extra = [
        ("ln_post_attention/scale", "post_attention_layernorm.weight", E),
        ("ln_post_mlp/scale", "post_feedforward_layernorm.weight", E),
    ]
    if m["qk_norm"] and not any(t.path.endswith("q_norm/scale") for t in tensors):
        extra += [
            ("attention/q_norm/scale", "self_attn.q_norm.weight", D),
            ("attention/k_norm/scale", "self_attn.k_norm.weight", D),
        ]
    maps = [
        hf_lib._map(f"{blocks}/{path}", [_LAYER + name], [(size,)], layers=layers)
        for path, name, size in extra
    ]
    return tensors + hf_lib._expand(maps, m)
