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
import optax
from flax.linen.dtypes import promote_dtype

from experiments.lm import kv_cache
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
from replicator.attention import kernels as attention_lib
from replicator.attention.context import (
    STRATEGIES,
    context_positions,
    context_size,
    gather_sequence,
    load_balance,
    restore_order,
    sequence_positions,
    split_sequence,
)
from replicator.parallel.activations import constrain
from replicator.parallel.moe import MoEFeedForward, resolve_routing
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

    @nn.compact
    def __call__(
        self, x_BxTxE: jax.Array, positions: Any = None, segment_ids: Any = None,
        cache: Any = None, cache_at: Any = None,
    ) -> Any:  # fmt: skip
        """Decoding, ``cache`` is this layer's ``(k, v)`` and ``cache_at`` ``(index,
        mask)`` (`experiments.lm.kv_cache`); the block then returns ``(x, new (k, v))``."""
        dropout = nn.Dropout(self.dropout_rate, deterministic=self.deterministic)
        decoding = {} if cache is None else {"cache": (cache, cache_at)}
        h = make_norm(self.norm, self.norm_eps, self.dtype, "ln_attention")(x_BxTxE)
        h = SelfAttention(
            num_heads=self.num_heads, head_dim=self.head_dim, out_stddev=self.out_stddev,
            rotary=self.rotary, use_bias=self.use_bias, attention=self.attention,
            dtype=self.dtype, context_strategy=self.context_strategy,
            context_load_balance=self.context_load_balance, num_kv_heads=self.num_kv_heads,
            qkv_bias=self.qkv_bias, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            name="attention",
        )(h, positions, segment_ids, **decoding)  # fmt: skip
        h, new_kv = h if decoding else (h, None)
        x_BxTxE = constrain(x_BxTxE + dropout(h), ACTIVATION_BxTxE)
        h = make_norm(self.norm, self.norm_eps, self.dtype, "ln_mlp")(x_BxTxE)
        swiglu = self.mlp_activation == "swiglu"
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
            h, aux = MoEFeedForward(
                self.num_experts, self.experts_per_token, self.mlp_dim,
                self.expert_capacity_factor, gated=swiglu,
                activation=nn.silu if swiglu else nn.gelu, routing=self.expert_routing, name="moe",
            )(h, token_order=order)  # fmt: skip
            self.sow("intermediates", "moe_aux", aux)
        else:
            mlp = GatedFeedForward if swiglu else FeedForward
            h = mlp(self.mlp_dim, self.out_stddev, self.use_bias, self.dtype, name="mlp")(h)
        x_BxTxE = constrain(x_BxTxE + dropout(h), ACTIVATION_BxTxE)
        if self.scanned:
            return x_BxTxE, new_kv  # new_kv: the scan's per-layer output
        return x_BxTxE if new_kv is None else (x_BxTxE, new_kv)


class BlockGroup(nn.Module):
    """``every`` blocks in a row, the last a mixture of experts (``block_<i>``): what
    ``nn.scan`` stacks when only every ``moe_every``-th block is one."""

    every: int
    block: Any
    kwargs: Any
    scanned: bool = False

    @nn.compact
    def __call__(self, x_BxTxE: jax.Array, positions: Any = None, segment_ids: Any = None):
        kwargs = dict(self.kwargs)
        num_experts = kwargs.pop("num_experts")
        for i in range(self.every):
            moe = num_experts if i == self.every - 1 else None
            block = self.block(**kwargs, num_experts=moe, name=f"block_{i}")
            x_BxTxE = block(x_BxTxE, positions, segment_ids)
        return (x_BxTxE, None) if self.scanned else x_BxTxE


class Head(nn.Module):
    """The output projection's kernel ``[embed, vocab]`` when embeddings are not tied:
    `nn.Dense`'s ``head/kernel`` parameter (no bias), reachable as ``self.kernel``
    so that the logits can be made whole or in chunks (`project`)."""

    features: int
    in_features: int

    def setup(self):
        init = normal(0.02, (EMBED, VOCAB))
        self.kernel = self.param("kernel", init, (self.in_features, self.features))


def project(x_BxTxE: jax.Array, kernel_ExV: jax.Array, dtype: Any = None) -> jax.Array:
    """``x @ kernel`` in ``dtype`` (promoted as flax layers promote): the logits."""
    x_BxTxE, kernel_ExV = promote_dtype(x_BxTxE, kernel_ExV, dtype=dtype)
    return jax.lax.dot_general(x_BxTxE, kernel_ExV, (((x_BxTxE.ndim - 1,), (0,)), ((), ())))


def token_nats(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Per-token cross-entropy ``[B, T]`` in nats, computed in float32 (or wider)."""
    logits_BxTxV = logits_BxTxV.astype(jnp.promote_types(logits_BxTxV.dtype, jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)


def chunked_token_nats(
    x_BxTxE: jax.Array, targets_BxT: jax.Array, logits_fn: Any, chunk: int
) -> jax.Array:
    """`token_nats` of ``logits_fn(x)``, ``chunk`` positions of the sequence at a time.

    Each chunk's logits are made, reduced to nats and dropped, and made again in
    the backward pass (``jax.checkpoint``): the ``[batch, time, vocab]`` logits,
    and their float32 copy, never exist at once. The same numbers as computing
    them whole, for a fraction of the memory when the vocabulary is large.
    """

    @jax.checkpoint
    def nats(x, targets):
        return token_nats(logits_fn(x), targets)

    # A loop (lax.map), so that the chunks run one after another, the backward
    # pass's too; unrolled, XLA may keep every chunk's logits alive at once.
    batch, length = targets_BxT.shape
    whole = length - length % chunk
    x_NxBxCxE = jnp.moveaxis(x_BxTxE[:, :whole].reshape(batch, -1, chunk, x_BxTxE.shape[-1]), 1, 0)
    targets_NxBxC = jnp.moveaxis(targets_BxT[:, :whole].reshape(batch, -1, chunk), 1, 0)
    nats_NxBxC = jax.lax.map(lambda pair: nats(*pair), (x_NxBxCxE, targets_NxBxC))
    pieces = [jnp.moveaxis(nats_NxBxC, 0, 1).reshape(batch, whole)]
    if whole < length:  # the rest, shorter than a chunk
        pieces.append(nats(x_BxTxE[:, whole:], targets_BxT[:, whole:]))
    return jnp.concatenate(pieces, axis=1)


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
    dtype: Any = None

    def _blocks(self, x_BxTxE: jax.Array, train: bool, *per_token: Any) -> jax.Array:
        """The ``num_layers`` blocks, scanned or unrolled, rematerialised by the policy;
        ``per_token``: the blocks' ``positions`` and ``segment_ids`` (or None)."""
        block = Block
        if remat_lib.is_remat(self.remat_policy):
            policy = remat_lib.checkpoint_policy(self.remat_policy)
            # Under scan the loop keeps XLA from merging recomputation away (CSE).
            block = nn.remat(Block, policy=policy, prevent_cse=not self.scan_layers)
        kwargs = _block_kwargs(self, train)
        every = self.moe_every if self.num_experts else 1
        if not self.scan_layers:
            experts = kwargs.pop("num_experts")
            for i in range(self.num_layers):
                moe = experts if (i + 1) % every == 0 else None
                x_BxTxE = block(**kwargs, num_experts=moe, name=f"block_{i}")(x_BxTxE, *per_token)
            return x_BxTxE
        if self.num_experts:  # scanned in groups of `every` blocks, the last one MoE
            scanned, kwargs = BlockGroup, dict(every=every, block=block, kwargs=kwargs)
        else:
            scanned = block
        stack = nn.scan(
            scanned,
            variable_axes={"params": 0, "intermediates": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast, nn.broadcast),  # every layer sees the same positions
            length=self.num_layers // every,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        blocks = stack(**kwargs, scanned=True, name="blocks")
        if self.is_initializing() or stage_count() == 1:
            x_BxTxE, _ = blocks(x_BxTxE, *per_token)
            return x_BxTxE
        # Over a "stage" axis: the same stacked parameters, one block per layer_fn call.
        if self.num_experts:
            raise ValueError("A pipeline does not run mixture-of-experts blocks: num_experts=0.")
        if self.dropout_rate and train:
            raise ValueError("A pipeline does not run dropout yet: set dropout_rate=0.")
        if any(x is not None for x in per_token):
            raise ValueError(
                "A pipeline does not pass per-token positions or segment ids to its stages "
                "yet: drop the 'stage' mesh axis or pack_documents."
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

    def _decode_blocks(self, x_BxTxE: jax.Array, positions_BxT: Any, cache: kv_cache.KVCache):
        """The blocks over a `kv_cache.KVCache`, scanned or unrolled as the parameters are
        laid out, each layer reading its slice of the cache; the output and every
        layer's new keys and values, ``[layers, batch, time, kv_heads, head_dim]``."""
        kwargs = _block_kwargs(self, train=False)
        at = (cache.index, kv_cache.attention_mask(cache, x_BxTxE.shape[1]))
        if not self.scan_layers:
            new = []
            for i in range(self.num_layers):
                layer = Block(**kwargs, name=f"block_{i}")
                x_BxTxE, kv = layer(x_BxTxE, positions_BxT, None, (cache.k[i], cache.v[i]), at)
                new.append(kv)
            return x_BxTxE, jax.tree.map(lambda *layers: jnp.stack(layers), *new)
        stack = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast),  # the cache by layer
            length=self.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        blocks = stack(**kwargs, scanned=True, name="blocks")
        return blocks(x_BxTxE, positions_BxT, None, (cache.k, cache.v), at)

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
        _check_block_keys(self)
        _check_parallel_keys(self)
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
    ) -> Any:
        """The logits ``[batch, time, vocab]``; with ``targets`` ``[batch, time]``, the
        per-token cross-entropy in nats instead (chunked by ``loss_chunk``).

        ``positions`` (int32 ``[batch, time]``, default ``0 .. time - 1``) are each
        token's position in its document, for the position table or the rotary
        embedding; ``segment_ids`` (int32 ``[batch, time]``) keep attention within
        each segment (packed documents).

        Decoding (`experiments.lm.sample`), ``cache`` is a `kv_cache.KVCache`: the
        tokens continue it (each row's positions count from its own start), and the
        call returns ``(logits, the cache with their keys and values)``."""
        length = tokens_BxT.shape[1]
        check_length(length, self.max_len)
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
            x_BxTxE = self._blocks(x_BxTxE, train, positions_BxT, segment_ids)
        else:
            x_BxTxE, new_kv = self._decode_blocks(x_BxTxE, positions_BxT, cache)
        x_BxTxE = make_norm(self.norm, self.norm_eps, self.dtype, "ln_final")(x_BxTxE)
        if self.tie_embeddings:
            logits_fn = functools.partial(project, kernel_ExV=embed.embedding.T, dtype=self.dtype)
        else:
            head = Head(self.vocab_size, self.embed_dim, name="head")
            logits_fn = functools.partial(project, kernel_ExV=head.kernel, dtype=self.dtype)
        if cache is not None:
            return logits_fn(x_BxTxE), kv_cache.write(cache, *new_kv)
        out = token_outputs(x_BxTxE, targets, logits_fn, self.loss_chunk)
        out = gather_sequence(out) if split else out
        return restore_order(out, cp) if balanced else out


def token_outputs(
    x_BxTxE: jax.Array, targets_BxT: jax.Array | None, logits_fn: Any, loss_chunk: int | None
) -> jax.Array:
    """What the model returns for each token of the final hidden states ``x_BxTxE``.

    Args:
      x_BxTxE: the hidden states after the final norm.
      targets_BxT: the next tokens, or None.
      logits_fn: hidden states -> logits (the head, or the tied embedding).
      loss_chunk: with targets, compute the logits this many positions at a time
        (`chunked_token_nats`); None, 0 or the whole sequence: all at once.

    Returns:
      The logits ``[batch, time, vocab]``, or with targets the per-token
      cross-entropy in nats ``[batch, time]``.
    """
    if targets_BxT is None:
        return logits_fn(x_BxTxE)
    if not loss_chunk or loss_chunk >= x_BxTxE.shape[1]:
        return token_nats(logits_fn(x_BxTxE), targets_BxT)
    return chunked_token_nats(x_BxTxE, targets_BxT, logits_fn, loss_chunk)


def _block_kwargs(model: Transformer, train: bool) -> dict[str, Any]:
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
        rope_theta=model.rope_theta,
        # Hashable, as a module's attributes had better be.
        rope_scaling=None if scaling is None else tuple(sorted(dict(scaling).items())),
    )


def _check_block_keys(model: Transformer) -> None:
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


def _check_parallel_keys(model: Transformer) -> None:
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


def count_params(params: Any) -> int:
    """How many numbers ``params`` holds (logical-axis boxes unwrapped)."""
    return sum(x.size for x in jax.tree.leaves(nn.meta.unbox(params)))
