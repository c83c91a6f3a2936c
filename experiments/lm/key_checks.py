"""The one-line errors of `experiments.lm.model.Transformer`'s keys that cannot work
together (raised as ``ValueError`` while the model is made; the trainer's config
checks turn them into a `ConfigError`)."""

from __future__ import annotations

from typing import Any

from experiments.lm.layers import MLP_ACTIVATIONS, NORMS, check_rope_scaling
from replicator.attention.context import STRATEGIES
from replicator.parallel.moe import resolve_routing


def check_block_keys(model: Any) -> None:
    """One-line errors for block keys (norm, MLP, heads, rotary) that cannot work."""
    if model.norm not in NORMS:
        raise ValueError(f"norm={model.norm!r}: use one of {NORMS}.")
    if model.mlp_activation not in MLP_ACTIVATIONS:
        raise ValueError(f"mlp_activation={model.mlp_activation!r}: use one of {MLP_ACTIVATIONS}.")
    kv = model.num_kv_heads
    if kv is not None and (kv < 1 or model.num_heads % kv):
        raise ValueError(
            f"num_kv_heads={kv} must divide num_heads={model.num_heads} (each key/value head "
            "serves num_heads / num_kv_heads query heads)."
        )
    if model.head_dim is not None and model.head_dim < 1:
        raise ValueError(f"head_dim={model.head_dim} must be positive (or None).")
    head_dim = model.head_dim or model.embed_dim // model.num_heads
    if model.positions == "rotary" and head_dim % 2:
        raise ValueError(f"positions='rotary' pairs a head's features: head_dim={head_dim} is odd.")
    if model.rope_scaling is not None and model.positions != "rotary":
        raise ValueError("rope_scaling rescales rotary positions: set positions='rotary'.")
    check_rope_scaling(model.rope_scaling)


def check_gemma_keys(model: Any) -> None:
    """One-line errors for the sliding-window, soft-capping and scaling keys (Gemma's)."""
    positive = {
        "sliding_window": model.sliding_window, "sliding_window_pattern":
        model.sliding_window_pattern, "attn_logit_softcap": model.attn_logit_softcap,
        "final_logit_softcap": model.final_logit_softcap,
        "query_pre_attn_scalar": model.query_pre_attn_scalar,
        "rope_local_theta": model.rope_local_theta,
    }  # fmt: skip
    for key, value in positive.items():
        if value is not None and not value > 0:
            raise ValueError(f"{key}={value} must be positive (or None).")
    if model.sliding_window is None:
        unused = [k for k in ("sliding_window_pattern", "rope_local_theta") if positive[k]]
        if unused:
            raise ValueError(f"{unused[0]} sets the local layers: give sliding_window too.")
        return
    if model.rope_local_theta is not None and model.positions != "rotary":
        raise ValueError("rope_local_theta is a rotary base: set positions='rotary'.")
    if model.num_experts:
        raise ValueError("sliding_window with num_experts: the MoE blocks take no window yet.")
    if model.pipeline_microbatches is not None or model.pipeline_repeats != 1:
        raise ValueError("A pipeline does not pass the layers' kinds yet: no sliding_window.")


def check_parallel_keys(model: Any) -> None:
    """One-line errors for context-parallel and mixture-of-experts keys that cannot work."""
    if model.context_strategy not in STRATEGIES:
        raise ValueError(f"context_strategy={model.context_strategy!r}: use one of {STRATEGIES}.")
    if not model.num_experts:
        return
    if not 1 <= model.experts_per_token <= model.num_experts:
        raise ValueError(
            f"experts_per_token={model.experts_per_token} must be in [1, "
            f"num_experts={model.num_experts}]."
        )
    resolve_routing(model.expert_routing, model.experts_per_token, key="expert_routing")
    if model.moe_balance_weight < 0 or model.moe_z_loss_weight < 0:
        raise ValueError("moe_balance_weight and moe_z_loss_weight must be >= 0.")
    if model.moe_every < 1 or model.num_layers % model.moe_every:
        raise ValueError(
            f"moe_every={model.moe_every}: every moe_every-th block is a mixture of experts, "
            f"so num_layers={model.num_layers} must divide by it."
        )
    if model.pipeline_microbatches is not None or model.pipeline_repeats != 1:
        raise ValueError("A pipeline does not run mixture-of-experts blocks: num_experts=0.")


def check_length(length: int, max_len: int) -> None:
    """Raises a one-line error for a sequence longer than the model's context.

    >>> check_length(2048, 1024)
    Traceback (most recent call last):
    ...
    ValueError: Sequence length 2048 is above the model's max_len 1024.
    """
    if length > max_len:
        raise ValueError(f"Sequence length {length} is above the model's max_len {max_len}.")
