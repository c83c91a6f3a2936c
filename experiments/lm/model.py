"""A decoder-only transformer: GPT-2's block or the Llama family's, annotated for sharding.

Token embedding plus learned (or rotary) positions, pre-norm blocks of causal
self-attention and an MLP, a final norm, and output logits through the tied token
embedding (or a separate head). The block is GPT-2's (LayerNorm, fused q/k/v, GELU,
biases) or, by the model keys ``norm``, ``mlp_activation``, ``num_kv_heads``,
``head_dim``, ``rope_theta``, ``rope_scaling`` and ``qkv_bias``, the Llama family's
(RMSNorm, grouped-query attention, SwiGLU, Llama 3's rotary scaling; `experiments.lm.layers`).
The blocks are one ``nn.scan`` over parameters stacked on a ``layers`` axis
(MaxText's ``scan_layers``), rematerialised by a named policy (`replicator.step.remat`),
and attention goes through each backend's fused kernel
(`replicator.attention.kernels.causal_attention`: splash on TPU, cuDNN on GPU).

Every parameter carries logical axis names (`nn.with_logical_partitioning`):
``vocab`` and ``embed`` for embeddings, ``heads`` and ``kv`` (the head width)
for attention, ``mlp`` for the MLP's hidden width; ``None`` for axes that are
never split (the position table's length, the q/k/v index). A mesh's rules map
them to mesh axes, e.g. ``("embed", "fsdp"), ("heads", "tensor"), ("mlp",
"tensor")`` for FSDP plus Megatron-style tensor parallelism.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments.lm import key_checks, kv_cache, lora
from experiments.lm.layers import (  # noqa: F401  (apply_rotary: part of this module's API)
    EMBED,
    MLP_ACTIVATIONS,
    NORMS,
    VOCAB,
    ACTIVATION_BxTxE,
    FeedForward,
    GatedFeedForward,
    SelfAttention,
    apply_rotary,
    check_rope_scaling,
    make_norm,
    normal,
)
from experiments.lm.logits import (  # noqa: F401  (part of this module's API, as before)
    Head,
    chunked_token_nats,
    project,
    token_nats,
    token_outputs,
)
from replicator.attention import kernels as attention_lib
from replicator.attention.context import (
    context_positions,
    context_size,
    gather_sequence,
    load_balance,
    restore_order,
    sequence_positions,
    split_sequence,
)
from replicator.parallel.activations import constrain
from replicator.parallel.moe import MoEFeedForward
from replicator.parallel.pipelining import pipeline, stage_count
from replicator.step import remat as remat_lib

ATTENTION_IMPLEMENTATIONS = attention_lib.IMPLEMENTATIONS


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``;
    with ``num_experts`` the MLP is a mixture of experts (`replicator.parallel.moe`), whose
    `MoEAux` it sows as ``intermediates/.../moe_aux``.

    ``scanned``: called by ``nn.scan`` over a stack of blocks, so it returns ``(x,
    None)`` (the scan's carry and per-layer output). ``positions`` (rotary, per
    row) and ``segment_ids`` reach the attention (None: the sequence's own positions,
    one segment)."""

    num_heads: int
    head_dim: int
    mlp_dim: int
    out_stddev: float
    rotary: bool
    use_bias: bool
    attention: str
    dropout_rate: float
    deterministic: bool
    dtype: Any
    scanned: bool = False
    context_strategy: str = "gather"
    context_load_balance: bool = False
    num_experts: int | None = None
    experts_per_token: int = 2
    expert_capacity_factor: float | None = 1.25
    expert_routing: str | None = None
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp_activation: str = "gelu"
    num_kv_heads: int | None = None
    qkv_bias: bool | None = None
    rope_theta: float = 10_000.0
    rope_scaling: tuple | None = None
    lora: Any = None  # the projections' adapters: `experiments.lm.lora.LoraSpec`
    post_norms: bool = False
    attn_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    qk_norm: bool = False
    moe_balance_pooled: bool = False

    @nn.compact
    def __call__(
        self, x_BxTxE: jax.Array, positions: Any = None, segment_ids: Any = None,
        cache: Any = None, cache_at: Any = None, local: Any = None,
    ) -> Any:  # fmt: skip
        """Decoding, ``cache`` is this layer's ``(k, v)`` and ``cache_at`` ``(index,
        mask[, window mask])`` (`experiments.lm.kv_cache`); the block then returns ``(x,
        new (k, v))``. ``local``: whether this layer attends within ``sliding_window``
        (`experiments.lm.layers.by_layer_kind`). With ``post_norms`` each branch's
        output is normed too before it is added (Gemma 2 and 3)."""
        dropout = nn.Dropout(self.dropout_rate, deterministic=self.deterministic)
        decoding = {} if cache is None else {"cache": (cache, cache_at)}
        h = make_norm(self.norm, self.norm_eps, self.dtype, "ln_attention")(x_BxTxE)
        h = SelfAttention(
            num_heads=self.num_heads, head_dim=self.head_dim, out_stddev=self.out_stddev,
            rotary=self.rotary, use_bias=self.use_bias, attention=self.attention,
            dtype=self.dtype, context_strategy=self.context_strategy,
            context_load_balance=self.context_load_balance, num_kv_heads=self.num_kv_heads,
            qkv_bias=self.qkv_bias, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            lora=self.lora, attn_logit_softcap=self.attn_logit_softcap,
            query_pre_attn_scalar=self.query_pre_attn_scalar, sliding_window=self.sliding_window,
            rope_local_theta=self.rope_local_theta, qk_norm=self.qk_norm, norm=self.norm,
            norm_eps=self.norm_eps, name="attention",
        )(h, positions, segment_ids, local=local, **decoding)  # fmt: skip
        h, new_kv = h if decoding else (h, None)
        h = self._post_norm(h, "ln_post_attention")
        x_BxTxE = constrain(x_BxTxE + dropout(h), ACTIVATION_BxTxE)
        h = make_norm(self.norm, self.norm_eps, self.dtype, "ln_mlp")(x_BxTxE)
        gated = self.mlp_activation in ("swiglu", "geglu")
        gate = nn.silu if self.mlp_activation == "swiglu" else nn.gelu  # tanh GELU
        if self.num_experts:
            # Load-balanced tokens are stored out of order: capacity queues follow
            # their positions, so the tokens that drop are those one device drops.
            cp = context_size()
            length = x_BxTxE.shape[1]
            order = (
                context_positions(length, cp, True)
                if self.context_load_balance and cp > 1
                else None
            )
            moe_in = h
            h, aux = MoEFeedForward(
                self.num_experts, self.experts_per_token, self.mlp_dim,
                self.expert_capacity_factor, gated=gated,
                activation=gate, routing=self.expert_routing, name="moe",
            )(h, token_order=order)  # fmt: skip
            self.sow("intermediates", "moe_aux", aux)
            if self.moe_balance_pooled and self.is_mutable_collection("intermediates"):
                self._sow_router_logits(moe_in)
        else:
            mlp_args = (self.mlp_dim, self.out_stddev, self.use_bias, self.dtype, self.lora)
            if gated:
                h = GatedFeedForward(*mlp_args, activation=gate, name="mlp")(h)
            else:
                h = FeedForward(*mlp_args, name="mlp")(h)
        h = self._post_norm(h, "ln_post_mlp")
        x_BxTxE = constrain(x_BxTxE + dropout(h), ACTIVATION_BxTxE)
        if self.scanned:
            return x_BxTxE, new_kv  # new_kv: the scan's per-layer output
        return x_BxTxE if new_kv is None else (x_BxTxE, new_kv)

    def _sow_router_logits(self, h_BxTxE: jax.Array) -> None:
        """The router's logits (as `rp.moe` computes them, in float32), sown for a
        balancing loss over every layer's routing pooled (``moe_balance_pooled``)."""
        router = nn.meta.unbox(self.variables["params"]["moe"]["router"])
        logits = jnp.einsum("bsd,de->bse", h_BxTxE.astype(jnp.float32), router.astype(jnp.float32))
        self.sow("intermediates", "router_logits", logits)

    def _post_norm(self, h_BxTxE: jax.Array, name: str) -> jax.Array:
        """``h`` normed (``post_norms``: Gemma's norm of each branch's output), else as is."""
        if not self.post_norms:
            return h_BxTxE
        return make_norm(self.norm, self.norm_eps, self.dtype, name)(h_BxTxE)


class BlockGroup(nn.Module):
    """``every`` blocks in a row, the last a mixture of experts (``block_<i>``): what
    ``nn.scan`` stacks when only every ``moe_every``-th block is one. Decoding,
    ``cache`` is the group's ``(k, v)``, ``[every, ...]``, and it returns the new ones."""

    every: int
    block: Any
    kwargs: Any
    scanned: bool = False

    @nn.compact
    def __call__(
        self, x_BxTxE: jax.Array, positions: Any = None, segment_ids: Any = None,
        cache: Any = None, cache_at: Any = None,
    ) -> Any:  # fmt: skip
        kwargs = dict(self.kwargs)
        num_experts = kwargs.pop("num_experts")
        new = []
        for i in range(self.every):
            moe = num_experts if i == self.every - 1 else None
            block = self.block(**kwargs, num_experts=moe, name=f"block_{i}")
            if cache is None:
                x_BxTxE = block(x_BxTxE, positions, segment_ids)
                continue
            layer_cache = (cache[0][i], cache[1][i])
            x_BxTxE, kv = block(x_BxTxE, positions, segment_ids, layer_cache, cache_at)
            new.append(kv)
        new_kv = jax.tree.map(lambda *kvs: jnp.stack(kvs), *new) if new else None
        if self.scanned:
            return x_BxTxE, new_kv
        return x_BxTxE if new_kv is None else (x_BxTxE, new_kv)


class Transformer(nn.Module):
    """A decoder-only language model: ``tokens [batch, time] -> logits [batch, time, vocab]``.

    Attributes:
      vocab_size: tokens are ``0 .. vocab_size - 1`` (256 for bytes; pad a
        tokenizer's vocabulary to a multiple of 128 for fast matmuls).
      num_layers: transformer blocks.
      num_heads: attention (query) heads; ``embed_dim`` must divide by it unless
        ``head_dim`` is set.
      embed_dim: the residual stream's width.
      mlp_dim: the MLP's hidden width; None means ``4 * embed_dim``.
      max_len: the longest sequence (the context); a longer input is an error.
      positions: ``"learned"`` (a GPT-2 position table) or ``"rotary"``.
      tie_embeddings: compute logits with the token embedding (GPT-2) instead
        of a separate output matrix.
      use_bias: biases in the attention and MLP projections (GPT-2 has them).
      dropout_rate: dropout on the embeddings and each residual branch while
        training (``train=True`` with a ``"dropout"`` rng).
      attention: `replicator.attention.kernels.causal_attention`'s implementation:
        ``"auto"`` (Pallas splash attention on TPU, cuDNN on GPUs for 16-bit
        inputs, else XLA), ``"splash"``, ``"cudnn"`` or ``"xla"``.
      remat_policy: which of each block's activations the backward pass keeps
        (`replicator.step.remat`: MaxText's names, e.g. ``"full"`` keeps only the
        block's input, ``"minimal"`` the projections); None keeps all of them.
      scan_layers: the blocks as one ``nn.scan`` over parameters stacked on a
        leading ``layers`` axis (``params/blocks/...``, ``[num_layers, ...]``):
        one block's program, compiled once, instead of ``num_layers`` copies
        (``params/block_<i>/...``, the layout of checkpoints written before).
      loss_chunk: with ``targets`` (the model computes its own loss), make the
        logits this many positions of the sequence at a time, recomputed in the
        backward pass: the ``[batch, time, vocab]`` logits never exist at once
        (`chunked_token_nats`). None or 0: all positions at once.
      norm: ``"layernorm"`` (GPT-2: scale and bias) or ``"rmsnorm"`` (Llama: scale).
      norm_eps: the norms' epsilon (GPT-2 and Llama 3: 1e-5; Llama 2: 1e-6).
      mlp_activation: ``"gelu"`` (GPT-2's two matrices ``fc``/``proj``, tanh GELU)
        or ``"swiglu"`` (Llama's three, ``gate``/``up``/``down``; the experts of a
        mixture of experts gated alike).
      num_kv_heads: None: one fused q/k/v projection (GPT-2's ``qkv_kernel``);
        else separate ``q_kernel`` and ``kv_kernel`` with this many key/value heads,
        dividing ``num_heads`` (grouped-query attention when fewer).
      head_dim: each head's width; None means ``embed_dim // num_heads``.
      rope_theta: the rotary base (``positions="rotary"``): 10,000 (GPT-NeoX,
        Llama 2) or 500,000 (Llama 3).
      rope_scaling: None, or Llama 3's rotary scaling, Hugging Face's dict:
        ``factor``, ``low_freq_factor``, ``high_freq_factor``,
        ``original_max_position_embeddings`` (`experiments.lm.layers.rope_frequencies`).
      qkv_bias: biases on the q/k/v projections; None follows ``use_bias`` (Qwen2:
        True with ``use_bias=False``, which then covers the output projection and MLP).
      qk_norm: queries and keys normalised over each head's width (a norm of kind
        ``norm`` each, ``q_norm``/``k_norm``) before the rotary embedding (Qwen3).
      moe_balance_weight, moe_z_loss_weight: the weights of a mixture of experts'
        load-balancing loss and router z-loss in the training loss, means over the MoE
        layers (`replicator.parallel.moe.MoEAux`); an import sets them as its family
        defines its router loss (`experiments.lm.hf_qwen3_moe`).
      moe_balance_pooled: the load-balancing loss of every MoE layer's routing pooled
        before the product (transformers' ``load_balancing_loss_func``), not each
        layer's loss averaged; the layers' router logits are kept for it.
      embed_scale: the token embeddings times ``sqrt(embed_dim)``, rounded to the compute
        dtype (Gemma's; the tied head uses them unscaled).
      post_norms: each branch's output normed before it is added (``ln_post_attention``,
        ``ln_post_mlp``: Gemma 2 and 3's norms before and after each branch).
      attn_logit_softcap, final_logit_softcap: None, or the attention scores and the
        logits soft-capped, ``cap * tanh(x / cap)`` (Gemma 2: 50 and 30).
      query_pre_attn_scalar: the attention scores scaled by its ``-1/2`` power (Gemma's);
        None: ``head_dim``'s.
      sliding_window: None, or the local layers attend to their own position and the
        ``sliding_window - 1`` before it (`local_layers` says which layers are local).
      sliding_window_pattern: with ``sliding_window``, every ``n``-th layer is global, the
        others local (Gemma 2: 2, Gemma 3: 6); None: every layer local (Mistral's window).
      rope_local_theta: the local layers' rotary base, unscaled (Gemma 3: 10,000); None:
        ``rope_theta`` and ``rope_scaling`` in every layer.
      lora_rank, lora_alpha, lora_dropout, lora_targets, lora_quantize: LoRA adapters of
        rank ``lora_rank`` (0: none) on the projection kernels whose paths
        ``lora_targets`` finds, QLoRA's storage of those kernels (`experiments.lm.lora`).
      dtype: compute dtype; None (the default) computes in the dtype of the
        parameters, which is how replicator's precision policy sets it.

    Parameters are initialised GPT-2 style: normal with std 0.02, and the
    projections back into the residual stream scaled by ``1/sqrt(2 num_layers)``.

    >>> model = Transformer(vocab_size=16, num_layers=1, num_heads=2, embed_dim=8, max_len=4)
    >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    >>> model.apply(variables, jnp.zeros((2, 3), jnp.int32)).shape
    (2, 3, 16)
    """

    vocab_size: int = 256
    num_layers: int = 12
    num_heads: int = 12
    embed_dim: int = 768
    mlp_dim: int | None = None
    max_len: int = 1024
    positions: str = "learned"
    tie_embeddings: bool = True
    use_bias: bool = True
    dropout_rate: float = 0.0
    attention: str = "auto"
    remat_policy: str | None = None
    scan_layers: bool = True
    loss_chunk: int | None = None
    pipeline_microbatches: int | None = None
    pipeline_repeats: int = 1
    context_strategy: str = "gather"
    context_load_balance: bool = False
    num_experts: int | None = None
    experts_per_token: int = 2
    expert_capacity_factor: float | None = 1.25
    expert_routing: str | None = None  # rp.moe.ROUTINGS; None: "switch" for k = 1, else "mixtral"
    moe_every: int = 1
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp_activation: str = "gelu"
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10_000.0
    rope_scaling: Any = None
    qkv_bias: bool | None = None
    qk_norm: bool = False
    moe_balance_weight: float = 1e-2  # Switch's load balancing
    moe_z_loss_weight: float = 1e-3  # ST-MoE's router z-loss
    moe_balance_pooled: bool = False
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = r"(attention|mlp)/.*kernel"
    lora_quantize: str | None = None
    embed_scale: bool = False
    post_norms: bool = False
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None
    rope_local_theta: float | None = None
    dtype: Any = None

    def _blocks(self, x_BxTxE: jax.Array, train: bool, adapters: bool, *per_token: Any):
        """The ``num_layers`` blocks, scanned or unrolled, rematerialised by the policy;
        ``per_token``: the blocks' ``positions`` and ``segment_ids`` (or None)."""
        block = Block
        if remat_lib.is_remat(self.remat_policy):
            policy = remat_lib.checkpoint_policy(self.remat_policy)
            # Under scan the loop keeps XLA from merging recomputation away (CSE).
            block = nn.remat(Block, policy=policy, prevent_cse=not self.scan_layers)
        kwargs = _block_kwargs(self, train, adapters)
        every = self.moe_every if self.num_experts else 1
        local_L = local_layers(self)
        if not self.scan_layers:
            experts = kwargs.pop("num_experts")
            for i in range(self.num_layers):
                moe = experts if (i + 1) % every == 0 else None
                kind = () if local_L is None else (None, None, bool(local_L[i]))
                layer = block(**kwargs, num_experts=moe, name=f"block_{i}")
                x_BxTxE = layer(x_BxTxE, *per_token, *kind)
            return x_BxTxE
        if self.num_experts:  # scanned in groups of `every` blocks, the last one MoE
            scanned, kwargs = BlockGroup, dict(every=every, block=block, kwargs=kwargs)
        else:
            scanned = block
        # Every layer sees the same positions; with a sliding window each its own kind
        # (a row of local_L; after the two cache arguments, None here).
        in_axes, kinds = (nn.broadcast, nn.broadcast), ()
        if local_L is not None:
            in_axes += (nn.broadcast, nn.broadcast, 0)
            kinds = (None, None, jnp.asarray(local_L))
        stack = nn.scan(
            scanned,
            variable_axes={"params": 0, "intermediates": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=in_axes,
            length=self.num_layers // every,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        blocks = stack(**kwargs, scanned=True, name="blocks")
        if self.is_initializing() or stage_count() == 1:
            x_BxTxE, _ = blocks(x_BxTxE, *per_token, *kinds)
            return x_BxTxE
        # Over a "stage" axis: the same stacked parameters, one block per layer_fn call.
        if self.num_experts:
            raise ValueError("A pipeline does not run mixture-of-experts blocks: num_experts=0.")
        if (self.dropout_rate or self.lora_rank and self.lora_dropout) and train:
            raise ValueError("A pipeline does not run dropout yet: set dropout_rate=0.")
        if any(x is not None for x in per_token):
            raise ValueError(
                "A pipeline does not pass per-token positions or segment ids to its stages "
                "yet: drop the 'stage' mesh axis or pack_documents."
            )
        if local_L is not None:
            raise ValueError(
                "A pipeline does not pass the layers' kinds (sliding_window) to its stages "
                "yet: drop the 'stage' mesh axis."
            )
        stacked = nn.meta.unbox(self.variables["params"]["blocks"])

        def layer_fn(params, h):
            return scanned(**kwargs).apply({"params": params}, h)

        return pipeline(
            layer_fn,
            stacked,
            x_BxTxE,
            microbatches=self.pipeline_microbatches or stage_count(),
            repeats=self.pipeline_repeats,
        )

    def _decode_blocks(self, x_BxTxE, positions_BxT, cache: kv_cache.KVCache, adapters: bool):
        """The blocks over a `kv_cache.KVCache`, scanned or unrolled as the parameters are
        laid out, each layer reading its slice of the cache; the output and every
        layer's new keys and values, ``[layers, batch, time, kv_heads, head_dim]``.
        Mixtures of experts decode dropless (no capacity), as a dropless full forward."""
        kwargs = _block_kwargs(self, train=False, adapters=adapters)
        kwargs["expert_capacity_factor"] = None
        length, local_L = x_BxTxE.shape[1], local_layers(self)
        every, L = (self.moe_every if self.num_experts else 1), self.num_layers
        at = (cache.index, kv_cache.attention_mask(cache, length))
        if local_L is not None:  # the local layers' mask beside it
            at += (kv_cache.attention_mask(cache, length, self.sliding_window),)
        if not self.scan_layers:
            experts, new = kwargs.pop("num_experts"), []
            for i in range(L):
                moe = experts if (i + 1) % every == 0 else None
                layer = Block(**kwargs, num_experts=moe, name=f"block_{i}")
                kind = () if local_L is None else (bool(local_L[i]),)
                kv_i = (cache.k[i], cache.v[i])
                x_BxTxE, kv = layer(x_BxTxE, positions_BxT, None, kv_i, at, *kind)
                new.append(kv)
            return x_BxTxE, jax.tree.map(lambda *layers: jnp.stack(layers), *new)
        kinds = () if local_L is None else (jnp.asarray(local_L),)
        scanned, kv = Block, (cache.k, cache.v)
        if self.num_experts:  # groups of `every` layers, as `_blocks` stacks them
            scanned, kwargs = BlockGroup, dict(every=every, block=Block, kwargs=kwargs)
            kv = tuple(c.reshape(L // every, every, *c.shape[1:]) for c in kv)
        stack = nn.scan(
            scanned,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            # the cache (and each layer's kind) by layer
            in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast) + (0,) * len(kinds),
            length=L // every,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        blocks = stack(**kwargs, scanned=True, name="blocks")
        x_BxTxE, new_kv = blocks(x_BxTxE, positions_BxT, None, kv, at, *kinds)
        if self.num_experts:  # [layers / every, every, ...] -> [layers, ...]
            new_kv = jax.tree.map(lambda c: c.reshape(L, *c.shape[2:]), new_kv)
        return x_BxTxE, new_kv

    def _logits_fn(self, embed: nn.Embed) -> Any:
        """Final hidden states -> logits: by the tied embedding or the head (`Head`),
        soft-capped by ``final_logit_softcap``."""
        if self.tie_embeddings:
            kernel_ExV = embed.embedding.T
        else:
            kernel_ExV = Head(self.vocab_size, self.embed_dim, name="head").kernel
        logits_fn = functools.partial(project, kernel_ExV=kernel_ExV, dtype=self.dtype)
        if self.final_logit_softcap is not None:
            logits_fn = functools.partial(softcapped, logits_fn, cap=self.final_logit_softcap)
        return logits_fn

    def __post_init__(self):
        if self.head_dim is None and self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim={self.embed_dim} does not divide into num_heads={self.num_heads}."
            )
        if self.positions not in ("learned", "rotary"):
            raise ValueError(f"positions={self.positions!r}: use 'learned' or 'rotary'.")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attention={self.attention!r}: use one of {ATTENTION_IMPLEMENTATIONS}."
            )
        remat_lib.check_policy(self.remat_policy)
        key_checks.check_block_keys(self)
        key_checks.check_gemma_keys(self)
        key_checks.check_parallel_keys(self)
        if lora.key_problems(self):
            raise ValueError(lora.key_problems(self)[0] + ".")
        if self.pipeline_microbatches is not None or self.pipeline_repeats != 1:
            if not self.scan_layers:
                raise ValueError("A pipeline runs the stacked blocks: keep scan_layers=True.")
        super().__post_init__()

    @nn.compact
    def __call__(
        self,
        tokens_BxT: jax.Array,
        *,
        train: bool = False,
        targets: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: kv_cache.KVCache | None = None,
        adapters: bool = True,
    ) -> Any:
        """The logits ``[batch, time, vocab]``; with ``targets`` ``[batch, time]``, the
        per-token cross-entropy in nats instead (chunked by ``loss_chunk``).

        ``positions`` (int32 ``[batch, time]``, default ``0 .. time - 1``) are each
        token's position in its document, for the position table or the rotary
        embedding; ``segment_ids`` (int32 ``[batch, time]``) keep attention within
        each segment (packed documents).

        Decoding (`experiments.lm.sample`), ``cache`` is a `kv_cache.KVCache`: the
        tokens continue it (each row's positions count from its own start), and the
        call returns ``(logits, the cache with their keys and values)``. ``adapters=False``
        computes the base model, LoRA's adapters left out (`experiments.lm.lora`)."""
        length = tokens_BxT.shape[1]
        key_checks.check_length(length, self.max_len)
        if cache is not None:
            positions = kv_cache.positions(cache, length)
        # Load balancing over "context": the sequence reordered once, here, so that each
        # shard holds chunks i and 2 CP - 1 - i; positions follow the tokens, the
        # per-token outputs are put back in order at the end.
        cp = context_size()
        balanced = self.context_load_balance and cp > 1
        per_token = (tokens_BxT, targets, positions, segment_ids)
        if balanced:
            per_token = tuple(None if x is None else load_balance(x, cp) for x in per_token)
        # Under `Replicator.run` (context manual, each replica's whole sequences on
        # every context device) each device takes its block, and the per-token output
        # is gathered back at the end; elsewhere these do nothing. A mixture of
        # experts keeps whole sequences: its capacity is per sequence.
        split = not self.num_experts
        if split:
            per_token = tuple(None if x is None else split_sequence(x) for x in per_token)
        tokens_BxT, targets, positions_BxT, segment_ids = per_token
        embed = nn.Embed(
            self.vocab_size,
            self.embed_dim,
            dtype=self.dtype,
            embedding_init=normal(0.02, (VOCAB, EMBED)),
            name="token_embedding",
        )
        x_BxTxE = embed(tokens_BxT)
        if self.embed_scale:  # in the compute dtype, as Gemma rounds it
            x_BxTxE = x_BxTxE * jnp.asarray(math.sqrt(self.embed_dim), x_BxTxE.dtype)
        if self.positions == "learned":
            table = self.param(
                "position_embedding",
                normal(0.02, (None, EMBED)),
                (self.max_len, self.embed_dim),
            )
            if positions_BxT is None:
                positions_BxT = sequence_positions(tokens_BxT, balanced)  # [T]
            x_BxTxE = x_BxTxE + jnp.asarray(table[positions_BxT], x_BxTxE.dtype)
            positions_BxT = None  # the blocks' attention needs none
        x_BxTxE = nn.Dropout(self.dropout_rate, deterministic=not train)(x_BxTxE)

        if cache is None:
            x_BxTxE = self._blocks(x_BxTxE, train, adapters, positions_BxT, segment_ids)
        else:
            x_BxTxE, new_kv = self._decode_blocks(x_BxTxE, positions_BxT, cache, adapters)
        x_BxTxE = make_norm(self.norm, self.norm_eps, self.dtype, "ln_final")(x_BxTxE)
        logits_fn = self._logits_fn(embed)
        if cache is not None:
            return logits_fn(x_BxTxE), kv_cache.write(cache, *new_kv)
        out = token_outputs(x_BxTxE, targets, logits_fn, self.loss_chunk)
        out = gather_sequence(out) if split else out
        return restore_order(out, cp) if balanced else out


def softcapped(logits_fn: Any, x_BxTxE: jax.Array, *, cap: float) -> jax.Array:
    """``cap * tanh(logits_fn(x) / cap)``: logits soft-capped (Gemma 2's final logits).

    >>> float(softcapped(lambda x: x, jnp.float32(1e6), cap=30.0))
    30.0
    """
    logits = logits_fn(x_BxTxE)
    return (cap * jnp.tanh(logits / cap)).astype(logits.dtype)


def layer_is_local(layer: int, every: int | None) -> bool:
    """Whether ``layer`` (from 0) attends within the sliding window when every
    ``every``-th layer is global (None: none is): Gemma 2's pattern 2, Gemma 3's 6.

    >>> [layer_is_local(i, 6) for i in range(7)]
    [True, True, True, True, True, False, True]
    """
    return every is None or (layer + 1) % every != 0


def local_layers(model: Transformer) -> np.ndarray | None:
    """bool ``[num_layers]``: which layers attend within ``sliding_window`` (None: the
    model has no window, every layer global)."""
    if model.sliding_window is None:
        return None
    every = model.sliding_window_pattern
    return np.array([layer_is_local(i, every) for i in range(model.num_layers)])


def _block_kwargs(model: Transformer, train: bool, adapters: bool = True) -> dict[str, Any]:
    scaling = model.rope_scaling
    return dict(
        num_heads=model.num_heads,
        head_dim=model.head_dim or model.embed_dim // model.num_heads,
        mlp_dim=model.mlp_dim or 4 * model.embed_dim,
        out_stddev=0.02 / math.sqrt(2 * model.num_layers),
        rotary=model.positions == "rotary",
        use_bias=model.use_bias,
        attention=model.attention,
        dropout_rate=model.dropout_rate,
        deterministic=not train,
        dtype=model.dtype,
        context_strategy=model.context_strategy,
        context_load_balance=model.context_load_balance,
        num_experts=model.num_experts or None,
        experts_per_token=model.experts_per_token,
        expert_capacity_factor=model.expert_capacity_factor,
        expert_routing=model.expert_routing,
        norm=model.norm,
        norm_eps=model.norm_eps,
        mlp_activation=model.mlp_activation,
        num_kv_heads=model.num_kv_heads,
        qkv_bias=model.qkv_bias,
        qk_norm=model.qk_norm,
        moe_balance_pooled=model.moe_balance_pooled,
        rope_theta=model.rope_theta,
        # Hashable, as a module's attributes had better be.
        rope_scaling=None if scaling is None else tuple(sorted(dict(scaling).items())),
        lora=lora.spec_of(model, train, adapters),
        post_norms=model.post_norms,
        attn_logit_softcap=model.attn_logit_softcap,
        query_pre_attn_scalar=model.query_pre_attn_scalar,
        sliding_window=model.sliding_window,
        rope_local_theta=model.rope_local_theta,
    )


def count_params(params: Any) -> int:
    """How many numbers ``params`` holds (logical-axis boxes unwrapped)."""
    return sum(x.size for x in jax.tree.leaves(nn.meta.unbox(params)))
