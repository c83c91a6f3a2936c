"""Qwen3, Mixtral and Qwen3-MoE checkpoints: the Llama block with q/k norms or experts.

`experiments.lm.hf` maps the Llama family; these three families are its block with
changes, and this module says what changes (the model keys, the ``config.json`` and
the tensors), checked against transformers' modeling code (tests/test_hf_qwen3_moe.py):

* Qwen3 (``Qwen3ForCausalLM``): an RMSNorm over each head's width on the queries and
  keys (``self_attn.q_norm``/``k_norm``, one scale ``[head_dim]`` each) before the
  rotary embedding: the model key ``qk_norm``; ``head_dim`` free of ``hidden_size``.
* Mixtral (``MixtralForCausalLM``): every MLP a mixture of ``num_local_experts``
  SwiGLU experts (``block_sparse_moe.experts.N.w1``/``w3``/``w2``: gate, up, down)
  and a router ``block_sparse_moe.gate`` ``[E, d]``: a softmax over every expert, the
  top ``num_experts_per_tok`` renormalised (`rp.moe`'s ``'mixtral'`` routing).
* Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention, experts
  ``mlp.experts.N.gate_proj``/``up_proj``/``down_proj`` of ``moe_intermediate_size``;
  ``norm_topk_prob`` True renormalises the top ``k`` (``'mixtral'``), False keeps their
  softmax probabilities (``'switch'``). Every layer sparse (``decoder_sparse_step``
  1, no ``mlp_only_layers``): ``moe_every=1``; other layouts are refused.

Imported, the experts route dropless (``expert_capacity_factor=None``): no token is
dropped, as in transformers. The experts are stacked as the LM's are: ``moe/wi_gate``
and ``moe/wi`` ``[E, d, f]`` (gate and up), ``moe/wo`` ``[E, f, d]`` (down), each
expert's ``nn.Linear`` weight transposed, and ``moe/router`` ``[d, E]``.

The load-balancing loss: transformers' ``load_balancing_loss_func`` is ``k`` times
`rp.moe.MoEAux.load_balance_loss` (whose ``f_e`` are shares of the token-choice pairs,
summing to 1), so the model key ``moe_balance_weight`` is ``router_aux_loss_coef * k``
and ``moe_z_loss_weight`` 0 (these families have no z-loss); ``moe_balance_pooled``
pools the layers' routing statistics before the product, as transformers does: the
training loss is transformers' with ``output_router_logits=True`` (which its configs
leave False: transformers then trains without it). Mixtral's ``router_jitter_noise``
(training only) is not reproduced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from replicator.errors import ConfigError
from replicator.parallel.moe import resolve_routing
from replicator.trainer.pretrained import HFTensor

FAMILIES = {
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
SPARSE = ("mixtral", "qwen3_moe")
QK_NORM = ("qwen3", "qwen3_moe")
SLIDING_OPTIONAL = QK_NORM  # a sliding window only with use_sliding_window, as Qwen2's

_LAYER = "model.layers.{layer}."


# ---- config.json -> model keys


def model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The keys a Llama-block checkpoint's ``config.json`` ``hf`` sets beyond the Llama
    block's: ``qk_norm`` (False but for Qwen3's), and the sparse families' experts."""
    model_type = hf["model_type"]
    keys: dict[str, Any] = {"qk_norm": model_type in QK_NORM}
    if model_type not in SPARSE:
        return keys
    k = hf.get("num_experts_per_tok", 2)
    if model_type == "mixtral":
        experts, mlp_dim = hf.get("num_local_experts", 8), hf["intermediate_size"]
        routing = "mixtral"
    else:
        _check_sparse_layers(hf)
        experts = hf.get("num_experts", hf.get("num_local_experts", 128))
        mlp_dim = hf.get("moe_intermediate_size", 768)
        routing = "mixtral" if hf.get("norm_topk_prob", False) else "switch"
    coef = hf.get("router_aux_loss_coef", 0.001)
    return {
        **keys, "num_experts": experts, "experts_per_token": k, "expert_capacity_factor": None,
        "moe_every": 1, "expert_routing": routing, "mlp_dim": mlp_dim,
        "moe_balance_weight": float(coef) * k, "moe_z_loss_weight": 0.0,
        "moe_balance_pooled": True,
    }  # fmt: skip


def _check_sparse_layers(hf: Mapping[str, Any]) -> None:
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ConfigError(
            f"a qwen3_moe checkpoint with decoder_sparse_step={step}, mlp_only_layers={dense}: "
            "the LM reads Qwen3-MoE with every layer sparse (decoder_sparse_step=1, no "
            "mlp_only_layers)"
        )


def summary_parts(m: Mapping[str, Any]) -> list[str]:
    """The one-line summary's words for q/k norms and experts."""
    parts = ["q/k norm"] if m["qk_norm"] else []
    if m["num_experts"]:
        routing = resolve_routing(m["expert_routing"], m["experts_per_token"])
        capacity = m["expert_capacity_factor"]
        dropping = "dropless" if capacity is None else f"capacity x{capacity:g}"
        parts.append(
            f"{m['num_experts']} experts, top {m['experts_per_token']} ({routing}, {dropping})"
        )
    return parts


# ---- model keys -> config.json (export)


def family(m: Mapping[str, Any]) -> str | None:
    """``qwen3``, ``mixtral`` or ``qwen3_moe`` for model keys ``m`` (defaults filled in)
    with q/k norms or experts; None for the other keys (`experiments.lm.hf` decides)."""
    if not (m["qk_norm"] or m["num_experts"]):
        return None
    llama = (m["positions"], m["norm"], m["mlp_activation"]) == ("rotary", "rmsnorm", "swiglu")
    if not llama or m["use_bias"] or m["qkv_bias"]:
        raise ConfigError(
            "q/k norms or experts have a Hugging Face family only on the Llama block: "
            "positions='rotary', norm='rmsnorm', mlp_activation='swiglu', no biases"
        )
    if not m["num_experts"]:
        return "qwen3"
    if m["moe_every"] != 1:
        raise ConfigError(
            f"config.model.moe_every={m['moe_every']}: Mixtral and Qwen3-MoE (as the LM "
            "writes them) have experts in every layer (moe_every=1)"
        )
    routing = resolve_routing(m["expert_routing"], m["experts_per_token"])
    if routing == "gshard":
        raise ConfigError(
            "config.model.expert_routing='gshard' has no Hugging Face family: Mixtral and "
            "Qwen3-MoE route 'mixtral' (renormalised), Qwen3-MoE 'switch' too"
        )
    if m["qk_norm"]:
        return "qwen3_moe"
    if routing != "mixtral":
        raise ConfigError(
            f"config.model.expert_routing={routing!r} without qk_norm: Mixtral renormalises "
            "its gates ('mixtral'); Qwen3-MoE (qk_norm=True) keeps them ('switch')"
        )
    return "mixtral"


def hf_config(m: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The family's ``config.json``: the Llama block's ``config`` with its own keys."""
    model_type = config["model_type"]
    out = dict(config)
    if model_type in QK_NORM:
        out.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    if model_type not in SPARSE:
        return out
    k = m["experts_per_token"]
    routing = resolve_routing(m["expert_routing"], k)
    out.update(
        num_experts_per_tok=k, router_aux_loss_coef=m["moe_balance_weight"] / k,
        output_router_logits=False,
    )  # fmt: skip
    if model_type == "mixtral":
        out.update(num_local_experts=m["num_experts"], router_jitter_noise=0.0)
    else:
        out.update(
            num_experts=m["num_experts"], moe_intermediate_size=out["intermediate_size"],
            norm_topk_prob=routing == "mixtral", decoder_sparse_step=1, mlp_only_layers=[],
        )  # fmt: skip
    return out


# ---- tensors <-> parameters


def block_tensors(
    tensors: list[HFTensor], m: Mapping[str, Any], blocks: str, layers: int
) -> list[HFTensor]:
    """The Llama block's maps ``tensors`` (stacked as ``blocks``, ``layers``) with the q/k
    norms added and, for a mixture of experts, its router and experts for the MLP's."""
    if m["num_experts"]:
        tensors = [t for t in tensors if "/mlp/" not in t.path]
    if m["qk_norm"]:
        D = m["head_dim"] or m["embed_dim"] // m["num_heads"]
        for x in "qk":
            name = f"{_LAYER}self_attn.{x}_norm.weight"
            path = f"{blocks}/attention/{x}_norm/scale"
            tensors.append(HFTensor(path, (name,), ((D,),), _same, _one, layers))
    if m["num_experts"]:
        tensors += _expert_tensors(m, blocks, layers)
    return tensors


def _same(x):
    return x


def _one(x):
    return (np.asarray(x),)


def _expert_tensors(m: Mapping[str, Any], blocks: str, layers: int) -> list[HFTensor]:
    """The router ``[d, E]`` and the stacked experts, from Mixtral's or Qwen3-MoE's names."""
    E, d, f = m["num_experts"], m["embed_dim"], m["mlp_dim"] or 4 * m["embed_dim"]
    qwen = m["qk_norm"]
    moe = f"{_LAYER}mlp." if qwen else f"{_LAYER}block_sparse_moe."
    names = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
    router = HFTensor(
        f"{blocks}/moe/router", (f"{moe}gate.weight",), ((E, d),),
        lambda w: np.asarray(w).T, lambda x: (np.asarray(x).T,), layers,
    )  # fmt: skip
    out = [router]
    for ours, theirs, shape in zip(("wi_gate", "wi", "wo"), names, ((f, d), (f, d), (d, f))):
        experts = tuple(f"{moe}experts.{e}.{theirs}.weight" for e in range(E))
        out.append(
            HFTensor(f"{blocks}/moe/{ours}", experts, (shape,) * E, _stacked, _unstacked, layers)
        )
    return out


def _stacked(*weights) -> np.ndarray:  # E tensors [out, in] -> [E, in, out]
    return np.stack([np.asarray(w).T for w in weights])


def _unstacked(x) -> tuple[np.ndarray, ...]:
    return tuple(w.T for w in np.asarray(x))
