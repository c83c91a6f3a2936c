"""The LM's config keys, in one place: the top-level keys it adds to the trainer's
(`OPTIONS`: tokenizer, packing, remat, pipeline and context parallelism), the keys of
its ``model`` dict (`MODEL_KEYS`: `Transformer`'s fields, with their defaults), the
mesh axes it uses (``stage``, ``context``, ``expert``), and `check_config`, which the
trainer runs on a config before anything is written.

The trainer reads them as ``CONFIG_KEYS`` (a `replicator.trainer.ConfigKeys`): it
fills in the defaults, so every key can be overridden on the command line
(``--config.model.num_experts=4``, ``--config.mesh.stage=2``), checks their types,
and lists them in ``train --help --config FILE``. A new model key is a `Transformer`
field and a row of `MODEL_KEYS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from experiments.lm import lora
from experiments.lm.model import Transformer
from replicator.trainer import ConfigError, ConfigKeys, Settings

OPTIONS = {
    "tokenizer": (
        (str,),
        "bytes",
        "'bytes', or a local HF tokenizer.json, sentencepiece .model or tiktoken BPE file "
        "(PATH:PRESET picks its split pattern); the data must be tokenized with it (a text "
        "dataset's tokenizer=...)",
    ),
    "pack_documents": (
        (bool,),
        False,
        "windows hold several documents (each ending in the tokenizer's eos_id): attention "
        "and positions restart at each, no token predicts the next document's first",
    ),
    "remat_policy": (
        (str, None),
        None,
        "which activations the backward pass keeps (replicator.step.remat, MaxText's names): "
        "None (all), 'full', 'minimal', 'minimal_with_context', 'save_dot_except_mlp', "
        "'save_qkv_proj', 'minimal_offloaded'",
    ),
    "pipeline_microbatches": (
        (int, None),
        None,
        "pieces a pipeline (mesh axis 'stage', rp.pipeline) cuts the batch into (None: one "
        "per stage)",
    ),
    "pipeline_repeats": ((int,), 1, "1: a GPipe schedule; more: a circular one (rounds per batch)"),
    "context_strategy": (
        (str,),
        "gather",
        "attention over a sequence split on mesh axis 'context' (rp.context_attention): "
        "'gather' (all-gather keys and values) or 'ring' (pass them round the ring)",
    ),
    "context_load_balance": (
        (bool,),
        False,
        "reorder each sequence so the 'context' shards share the causal work evenly "
        "(the length must divide by 2 x the axis size)",
    ),
    "objective": (
        (str,),
        "lm",
        "what the loss is: 'lm' (next-token prediction on every token), 'sft' (on the "
        "assistant tokens of a chat/ dataset), 'dpo' or 'ipo' (preference pairs of a "
        "preferences/ dataset against the starting weights), 'simpo' (reference-free)",
    ),
    "dpo_beta": (
        (float,),
        0.1,
        "dpo/ipo/simpo: the preference loss's beta (IPO's tau is 1 / beta)",
    ),
    "dpo_label_smoothing": (
        (float,),
        0.0,
        "dpo/simpo: the chance that a pair's label is flipped (conservative DPO), in [0, 0.5)",
    ),
    "simpo_gamma": ((float,), 0.5, "simpo: the target reward margin gamma"),
}
OBJECTIVES = ("lm", "sft", "dpo", "ipo", "simpo")
PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo")
# The options that are `Transformer` fields too (the rest are the data's).
MODEL_OPTIONS = (
    "remat_policy", "pipeline_microbatches", "pipeline_repeats", "context_strategy",
    "context_load_balance",
)  # fmt: skip

# name -> (types, meaning); each default is the `Transformer` field's.
_MODEL_ROWS = {
    "vocab_size": ((int,), "token ids 0 .. vocab_size - 1 (256: bytes; pad a tokenizer's to 128s)"),
    "num_layers": ((int,), "transformer blocks"),
    "num_heads": ((int,), "attention (query) heads"),
    "embed_dim": ((int,), "the residual stream's width"),
    "mlp_dim": ((int, None), "the MLP's hidden width (None: 4 x embed_dim)"),
    "max_len": ((int,), "the longest sequence: the dataset's windows (block size) fit in it"),
    "positions": ((str,), "'learned' (GPT-2's table) or 'rotary'"),
    "tie_embeddings": (
        (bool,),
        "logits from the token embedding (GPT-2), not a matrix of their own",
    ),
    "use_bias": ((bool,), "biases in the attention and MLP projections (GPT-2 has them)"),
    "dropout_rate": ((float,), "dropout on the embeddings and each residual branch in training"),
    "attention": (
        (str,),
        "'auto' (Pallas splash on TPU, cuDNN on GPUs in 16 bits, else XLA), 'splash', 'cudnn' "
        "or 'xla'",
    ),
    "scan_layers": (
        (bool,),
        "the blocks as one nn.scan over stacked parameters (False: block_<i>)",
    ),
    "loss_chunk": ((int, None), "logits this many positions at a time (0 or None: all at once)"),
    "num_experts": (
        (int, None),
        "experts of a mixture in every moe_every-th block, split over mesh axis 'expert' (None: "
        "dense)",
    ),
    "experts_per_token": ((int,), "the experts each token is routed to (top k)"),
    "expert_capacity_factor": (
        (float, None),
        "tokens an expert takes, as a multiple of its even share (over it: dropped); None: "
        "dropless",
    ),
    "moe_every": ((int,), "every moe_every-th block is a mixture of experts"),
    "expert_routing": (
        (str, None),
        "the gates' convention (rp.moe.ROUTINGS): 'switch' (the chosen experts' softmax "
        "probabilities), 'gshard' or 'mixtral' (renormalised over the k); None: 'switch' for "
        "experts_per_token=1, else 'mixtral'",
    ),
    "norm": (
        (str,),
        "'layernorm' (GPT-2), 'rmsnorm' (Llama) or 'gemma_rmsnorm' (Gemma: x / rms(x) * "
        "(1 + scale))",
    ),
    "norm_eps": ((float,), "the norms' epsilon"),
    "mlp_activation": (
        (str,),
        "'gelu' (GPT-2), 'swiglu' (Llama) or 'geglu' (Gemma: tanh GELU gating)",
    ),
    "num_kv_heads": (
        (int, None),
        "key/value heads, dividing num_heads (grouped-query attention); None: GPT-2's fused q/k/v",
    ),
    "head_dim": ((int, None), "each head's width (None: embed_dim / num_heads)"),
    "rope_theta": ((float,), "the rotary base (Llama 2: 10,000; Llama 3: 500,000)"),
    "rope_scaling": (
        (dict, None),
        "Llama 3's rotary scaling, Hugging Face's dict (factor, low_freq_factor, "
        "high_freq_factor, original_max_position_embeddings); None: none",
    ),
    "qkv_bias": ((bool, None), "biases on the q/k/v projections (None: use_bias; Qwen2: True)"),
    "qk_norm": ((bool,), "queries and keys normalised over each head's width (Qwen3)"),
    "moe_balance_weight": (
        (float,),
        "the weight of the experts' load-balancing loss (rp.moe.MoEAux's, 1 when balanced) in "
        "the training loss; Hugging Face's router_aux_loss_coef x experts_per_token",
    ),
    "moe_z_loss_weight": ((float,), "the weight of the experts' router z-loss (ST-MoE's)"),
    "moe_balance_pooled": (
        (bool,),
        "the balancing loss of all MoE layers' routing pooled (Hugging Face's "
        "load_balancing_loss_func), not each layer's averaged",
    ),
    "embed_scale": ((bool,), "the token embeddings times sqrt(embed_dim) (Gemma)"),
    "post_norms": (
        (bool,),
        "a norm on each branch's output before it is added too (Gemma 2 and 3)",
    ),
    "attn_logit_softcap": (
        (float, None),
        "attention scores soft-capped, cap * tanh(score / cap) (Gemma 2: 50.0; None: off)",
    ),
    "final_logit_softcap": ((float, None), "the logits soft-capped alike (Gemma 2: 30.0)"),
    "query_pre_attn_scalar": (
        (float, None),
        "attention scores scaled by its -1/2 power (Gemma's; None: head_dim's)",
    ),
    "sliding_window": (
        (int, None),
        "the local layers attend to their position and the sliding_window - 1 before it "
        "(None: every layer global)",
    ),
    "sliding_window_pattern": (
        (int, None),
        "with sliding_window: every n-th layer global, the rest local (Gemma 2: 2, Gemma 3: "
        "6); None: every layer local",
    ),
    "rope_local_theta": (
        (float, None),
        "the local layers' rotary base, unscaled (Gemma 3: 10,000; None: rope_theta)",
    ),
    "lora_rank": (
        (int,),
        "LoRA adapters of this rank on the lora_targets kernels, the rest frozen (0: off)",
    ),
    "lora_alpha": ((float,), "LoRA's alpha: the adapters' product is scaled by alpha / rank"),
    "lora_dropout": ((float,), "dropout on the adapters' input in training"),
    "lora_targets": (
        (str,),
        "a regex over the parameter paths `python -m replicator params` prints: the kernels "
        "that get adapters (e.g. 'attention/(q|kv|out)_kernel')",
    ),
    "lora_quantize": (
        (str, None),
        "QLoRA: the frozen targeted kernels stored as 'int8' or 'nf4' (None: as the parameters)",
    ),
}
# `Transformer` fields that are no model key: ``dtype`` is the precision policy's to set.
NOT_MODEL_KEYS = ("dtype",)
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(Transformer)}
MODEL_KEYS = {
    name: (types, _DEFAULTS[name], meaning) for name, (types, meaning) in _MODEL_ROWS.items()
}


def options_of(settings: Settings) -> dict[str, Any]:
    """``settings.options`` with every option the LM declares, at its default if left out.

    Raises:
      ConfigError: an option the LM does not declare.
    """
    unknown = sorted(set(settings.options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"options {unknown} are no keys of the LM; it has {sorted(OPTIONS)}")
    return {key: default for key, (_, default, _) in OPTIONS.items()} | dict(settings.options)


def make_model(
    model_kwargs: Mapping[str, Any], remat_policy: str | None = None, **parallel: Any
) -> Transformer:
    """The `Transformer` from the config's ``model`` dict, ``remat_policy`` and
    ``pipeline_microbatches`` / ``pipeline_repeats`` / ``context_strategy`` /
    ``context_load_balance``; its own checks of them (`remat_policy`'s names among
    them) as a one-line `ConfigError`."""
    if "warmup_steps" in model_kwargs:
        raise ConfigError(
            "config.model.warmup_steps is a config key of its own now: config.warmup_steps "
            "(with config.lr_schedule='cosine', config.lr_end_fraction=0.1 as before)"
        )
    if "remat" in model_kwargs or "remat_policy" in model_kwargs:
        raise ConfigError(
            "config.model.remat is config.remat_policy now: None (keep every activation), "
            "'full' (what remat=True was), 'minimal', 'save_dot_except_mlp', 'save_qkv_proj' "
            "or 'minimal_offloaded'"
        )
    try:
        return Transformer(**model_kwargs, remat_policy=remat_policy, **parallel)
    except ValueError as e:  # the model's own checks of its keys (remat_policy's among them)
        raise ConfigError(f"the LM's Transformer: {e}") from None
    except TypeError as e:
        known = sorted(name for name in _DEFAULTS if name not in ("parent", "name"))
        raise ConfigError(
            f"config.model has a key the LM does not take ({e}); known: {known}."
        ) from None


def check_config(values: Mapping[str, Any]) -> list[str]:
    """What the LM cannot run as configured, one line each, before anything is written:
    the model's own checks (`make_model`), and the model against the mesh's sizes (axes
    of size -1 are checked once the devices are known, as the step is traced).

    >>> options = {key: default for key, (_, default, _) in OPTIONS.items()}
    >>> check_config({"model": {"num_experts": 3}, "mesh": {"expert": 2}, **options})
    ... # doctest: +ELLIPSIS
    ["config.model.num_experts: 3 experts do not split over the 2 devices of mesh axis ..."]
    """
    try:
        model = make_model(values["model"], **{key: values[key] for key in MODEL_OPTIONS})
    except ConfigError as e:
        return [str(e)]
    sizes = _axis_sizes(values["mesh"], values.get("dcn_mesh"))
    return (
        _objective_problems(values)
        + _pipeline_problems(model, sizes.get("stage"), values)
        + _expert_problems(model, sizes.get("expert"))
        + lora.lora_problems(model, sizes.get("stage"))
    )


def _objective_problems(values: Mapping[str, Any]) -> list[str]:
    """An unknown objective, a preference loss's keys out of range, or data of another
    kind than the objective trains on (``chat/`` for sft, ``preferences/`` for dpo, ipo,
    simpo, judged by the dataset's builder name; a dataset of one's own is checked by
    its examples as the run starts)."""
    objective = values["objective"]
    if objective not in OBJECTIVES:
        return [f"config.objective={objective!r}: use one of {list(OBJECTIVES)}"]
    if not values["dpo_beta"] > 0:
        return [f"config.dpo_beta={values['dpo_beta']} must be > 0"]
    if not 0 <= values["dpo_label_smoothing"] < 0.5:
        return [f"config.dpo_label_smoothing={values['dpo_label_smoothing']} must be in [0, 0.5)"]
    dataset = str(values.get("dataset") or "")
    if ":" in dataset:  # a dataset of one's own: its examples are checked as the run starts
        return []
    kind = dataset.split("/", 1)[0]
    wanted = {"sft": "chat", "lm": None}.get(objective, "preferences")
    if kind == "preferences" and objective in ("lm", "sft"):
        return [
            f"config.dataset={dataset!r} holds preference pairs: set config.objective='dpo', "
            "'ipo' or 'simpo'"
        ]
    if wanted is not None and kind != wanted:
        return [
            f"config.objective={objective!r} trains on {wanted}/... data (its loss mask marks "
            f"the tokens to learn); config.dataset={dataset!r} is none"
        ]
    return []


def frozen_parameters(values: Mapping[str, Any]) -> tuple[str, str] | None:
    """What the LM freezes itself (`replicator.trainer.ConfigKeys.frozen`), beside
    ``config.freeze``: under LoRA every parameter but the adapters; with ``dpo`` or
    ``ipo`` and no LoRA, the reference's copy of the starting weights.

    >>> frozen_parameters({"model": {"lora_rank": 8}, "objective": "dpo"})[1]
    'LoRA: every parameter but the adapters'
    """
    if (values.get("model") or {}).get("lora_rank"):
        return lora.FROZEN_BY_LORA, "LoRA: every parameter but the adapters"
    if values.get("objective") in ("dpo", "ipo"):
        return "^reference/", "the reference: a copy of the starting weights"
    return None


def _axis_sizes(mesh: Mapping[str, int], dcn_mesh: Mapping[str, int] | None) -> dict[str, int]:
    """Each axis's size over the slices (the mesh's times dcn_mesh's); -1 left out."""
    sizes = {}
    for axis in ("stage", "context", "expert"):
        size, across = (mesh or {}).get(axis, 1), (dcn_mesh or {}).get(axis, 1)
        if size != -1 and across != -1:
            sizes[axis] = size * across
    return sizes


def _pipeline_problems(model: Transformer, stages: int | None, values: Mapping) -> list[str]:
    """A 'stage' axis above 1 with a model it cannot split, or pipeline keys out of range."""
    repeats, micro = model.pipeline_repeats, model.pipeline_microbatches
    if repeats < 1 or (micro is not None and micro < 1):
        return [f"pipeline_repeats={repeats} and pipeline_microbatches={micro} must be >= 1"]
    if stages is None or stages == 1:
        return []  # (the model refuses pipeline keys with experts itself)
    axis = f"mesh axis 'stage' of {stages}"
    if model.num_experts:
        return [
            f"config.model.num_experts={model.num_experts} with a pipeline ({axis}): a "
            "pipeline does not run mixture-of-experts blocks; drop the 'stage' axis and the "
            "pipeline keys, or the experts"
        ]
    if model.num_layers % (stages * repeats):
        return [
            f"pipeline: {model.num_layers} layers do not split over {stages} stages x "
            f"{repeats} repeats ({axis}, pipeline_repeats); set config.model.num_layers to a "
            f"multiple of {stages * repeats}, or use fewer stages or repeats"
        ]
    if micro is not None and micro < stages:
        return [f"pipeline_microbatches={micro} leaves stages of {axis} idle; use >= {stages}"]
    if model.dropout_rate:
        return [f"a pipeline ({axis}) does not run dropout yet; set model.dropout_rate=0"]
    if values["pack_documents"]:
        return [f"a pipeline ({axis}) does not pass packed documents' positions on yet"]
    return []


def _expert_problems(model: Transformer, experts: int | None) -> list[str]:
    """A capacity factor of 0 or less; experts that do not split over the 'expert' axis."""
    if not model.num_experts:
        return []
    factor = model.expert_capacity_factor
    if factor is not None and not factor > 0:
        return [f"config.model.expert_capacity_factor={factor} must be > 0 (None: dropless)"]
    if experts is not None and model.num_experts % experts:
        return [
            f"config.model.num_experts: {model.num_experts} experts do not split over the "
            f"{experts} devices of mesh axis 'expert'; use a number divisible by {experts}"
        ]
    return []


CONFIG_KEYS = ConfigKeys(
    options=OPTIONS,
    model=MODEL_KEYS,
    mesh_axes=("stage", "context", "expert"),
    check=check_config,
    frozen=frozen_parameters,
)
