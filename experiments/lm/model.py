"""A decoder-only transformer of the GPT-2 / nanoGPT shape, annotated for sharding.

Token embedding plus learned (or rotary) positions, pre-LayerNorm blocks of
causal self-attention and a GELU MLP, a final LayerNorm, and output logits
through the tied token embedding (or a separate head). The blocks are one
``nn.scan`` over parameters stacked on a ``layers`` axis (MaxText's
``scan_layers``), rematerialised by a named policy (`replicator.remat`), and
attention goes through each backend's fused kernel
(`replicator.attention.causal_attention`: splash on TPU, cuDNN on GPU).

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
import optax
from flax.linen.dtypes import promote_dtype
from jax.ad_checkpoint import checkpoint_name

from replicator import attention as attention_lib
from replicator import remat as remat_lib
from replicator.activations import constrain
from replicator.context_parallel import (
    STRATEGIES,
    context_attention,
    context_positions,
    context_size,
    gather_sequence,
    load_balance,
    restore_order,
    sequence_positions,
    split_sequence,
)
from replicator.moe import MoEFeedForward
from replicator.pipelining import pipeline, stage_count

VOCAB, EMBED, MLP, HEADS, KV = "vocab", "embed", "mlp", "heads", "kv"
# The activations' logical axes (MaxText's names): the rules table shards them under
# `Replicator.compile` (`replicator.activations.constrain`); under `run` they are no-ops.
ACTIVATION_BxTxE = ("activation_batch", "activation_length", "activation_embed")
ACTIVATION_BxTxHxD = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
ACTIVATION_BxTxM = ("activation_batch", "activation_length", "activation_mlp")
ATTENTION_IMPLEMENTATIONS = attention_lib.IMPLEMENTATIONS


def _normal(stddev: float, names: tuple[str | None, ...]) -> Any:
    return nn.with_logical_partitioning(nn.initializers.normal(stddev), names)


def _zeros(names: tuple[str | None, ...]) -> Any:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def _ones(names: tuple[str | None, ...]) -> Any:
    return nn.with_logical_partitioning(nn.initializers.ones_init(), names)


def _layer_norm(dtype: Any, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=1e-5,
        dtype=dtype,
        scale_init=_ones((EMBED,)),
        bias_init=_zeros((EMBED,)),
        name=name,
    )


def apply_rotary(
    x_BxTxHxD: jax.Array, base: float = 10_000.0, positions_T: Any = None
) -> jax.Array:
    """Rotary position embedding (RoFormer; GPT-NeoX's half-split layout) of queries or keys.

    Pairs feature ``i`` with ``i + D/2`` and rotates each pair by ``t * base**(-2i/D)``
    at position ``t`` (``positions_T``, default ``0 .. T - 1``: a load-balanced
    sequence's are `context_positions`), so that query-key products depend on
    relative position only.

    >>> x = jnp.ones((1, 3, 1, 4))
    >>> bool(jnp.allclose(apply_rotary(x)[:, 0], x[:, 0]))  # position 0: unchanged
    True
    """
    half = x_BxTxHxD.shape[-1] // 2
    frequencies_D2 = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if positions_T is None:
        positions_T = np.arange(x_BxTxHxD.shape[1])
    angles_TxD2 = jnp.asarray(positions_T, jnp.float32)[:, None] * frequencies_D2
    cos = jnp.cos(angles_TxD2)[None, :, None, :]
    sin = jnp.sin(angles_TxD2)[None, :, None, :]
    x1, x2 = x_BxTxHxD[..., :half].astype(jnp.float32), x_BxTxHxD[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxTxHxD.dtype)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention: fused q/k/v projection, attention, output projection."""

    num_heads: int
    head_dim: int
    out_stddev: float
    rotary: bool
    use_bias: bool
    attention: str
    dtype: Any
    context_strategy: str = "gather"
    context_load_balance: bool = False

    @nn.compact
    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        embed_dim = x_BxTxE.shape[-1]
        shape = (embed_dim, 3, self.num_heads, self.head_dim)
        qkv_kernel = self.param("qkv_kernel", _normal(0.02, (EMBED, None, HEADS, KV)), shape)
        x_BxTxE, qkv_kernel = nn.dtypes.promote_dtype(x_BxTxE, qkv_kernel, dtype=self.dtype)
        qkv_BxTx3xHxD = jnp.einsum("bte,ekhd->btkhd", x_BxTxE, qkv_kernel)
        if self.use_bias:
            bias = self.param("qkv_bias", _zeros((None, HEADS, KV)), shape[1:])
            qkv_BxTx3xHxD = qkv_BxTx3xHxD + jnp.asarray(bias, qkv_BxTx3xHxD.dtype)
        qkv_BxTx3xHxD = checkpoint_name(qkv_BxTx3xHxD, "qkv_proj")
        q, k, v = (constrain(qkv_BxTx3xHxD[:, :, i], ACTIVATION_BxTxHxD) for i in range(3))
        cp = context_size()
        balanced = self.context_load_balance and cp > 1
        if self.rotary:  # the original positions, of this device's block where split
            positions = sequence_positions(q, balanced)
            q, k = apply_rotary(q, positions_T=positions), apply_rotary(k, positions_T=positions)
        # Over a "context" axis the sequence's blocks attend across devices
        # (`replicator.context_parallel`); without one this is `causal_attention`.
        out_BxTxHxD = context_attention(
            q, k, v, strategy=self.context_strategy, load_balanced=balanced,
            implementation=self.attention,
        )  # fmt: skip
        out_BxTxHxD = checkpoint_name(constrain(out_BxTxHxD, ACTIVATION_BxTxHxD), "context")
        out_shape = (self.num_heads, self.head_dim, embed_dim)
        out_kernel = self.param(
            "out_kernel", _normal(self.out_stddev, (HEADS, KV, EMBED)), out_shape
        )
        y_BxTxE = jnp.einsum(
            "bthd,hde->bte", out_BxTxHxD, jnp.asarray(out_kernel, out_BxTxHxD.dtype)
        )
        if self.use_bias:
            bias = self.param("out_bias", _zeros((EMBED,)), (embed_dim,))
            y_BxTxE = y_BxTxE + jnp.asarray(bias, y_BxTxE.dtype)
        return checkpoint_name(y_BxTxE, "out_proj")


class FeedForward(nn.Module):
    """Dense to ``mlp_dim``, GELU, dense back to the embedding width."""

    mlp_dim: int
    out_stddev: float
    use_bias: bool
    dtype: Any

    @nn.compact
    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        embed_dim = x_BxTxE.shape[-1]
        hidden = nn.Dense(
            self.mlp_dim,
            use_bias=self.use_bias,
            dtype=self.dtype,
            kernel_init=_normal(0.02, (EMBED, MLP)),
            bias_init=_zeros((MLP,)),
            name="fc",
        )(x_BxTxE)
        hidden = checkpoint_name(constrain(hidden, ACTIVATION_BxTxM), "mlpwi")
        out = nn.Dense(
            embed_dim,
            use_bias=self.use_bias,
            dtype=self.dtype,
            kernel_init=_normal(self.out_stddev, (MLP, EMBED)),
            bias_init=_zeros((EMBED,)),
            name="proj",
        )(nn.gelu(hidden))
        return checkpoint_name(out, "mlpwo")


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``;
    with ``num_experts`` the MLP is a mixture of experts (`replicator.moe`), whose
    `MoEAux` it sows as ``intermediates/.../moe_aux``.

    ``scanned``: called by ``nn.scan`` over a stack of blocks, so it takes and
    returns ``(x, None)`` (the scan's carry and per-layer output)."""

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

    @nn.compact
    def __call__(self, x_BxTxE: jax.Array, _: Any = None) -> Any:
        dropout = nn.Dropout(self.dropout_rate, deterministic=self.deterministic)
        h = _layer_norm(self.dtype, "ln_attention")(x_BxTxE)
        h = SelfAttention(
            self.num_heads,
            self.head_dim,
            self.out_stddev,
            self.rotary,
            self.use_bias,
            self.attention,
            self.dtype,
            self.context_strategy,
            self.context_load_balance,
            name="attention",
        )(h)
        x_BxTxE = constrain(x_BxTxE + dropout(h), ACTIVATION_BxTxE)
        h = _layer_norm(self.dtype, "ln_mlp")(x_BxTxE)
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
                self.expert_capacity_factor, activation=nn.gelu, name="moe",
            )(h, token_order=order)  # fmt: skip
            self.sow("intermediates", "moe_aux", aux)
        else:
            h = FeedForward(self.mlp_dim, self.out_stddev, self.use_bias, self.dtype, name="mlp")(h)
        x_BxTxE = constrain(x_BxTxE + dropout(h), ACTIVATION_BxTxE)
        return (x_BxTxE, None) if self.scanned else x_BxTxE


class BlockGroup(nn.Module):
    """``every`` blocks in a row, the last a mixture of experts (``block_<i>``): what
    ``nn.scan`` stacks when only every ``moe_every``-th block is one."""

    every: int
    block: Any
    kwargs: Any
    scanned: bool = False

    @nn.compact
    def __call__(self, x_BxTxE: jax.Array, _: Any = None) -> Any:
        kwargs = dict(self.kwargs)
        num_experts = kwargs.pop("num_experts")
        for i in range(self.every):
            moe = num_experts if i == self.every - 1 else None
            x_BxTxE = self.block(**kwargs, num_experts=moe, name=f"block_{i}")(x_BxTxE)
        return (x_BxTxE, None) if self.scanned else x_BxTxE


class Head(nn.Module):
    """The output projection's kernel ``[embed, vocab]`` when embeddings are not tied:
    `nn.Dense`'s ``head/kernel`` parameter (no bias), reachable as ``self.kernel``
    so that the logits can be made whole or in chunks (`project`)."""

    features: int
    in_features: int

    def setup(self):
        init = _normal(0.02, (EMBED, VOCAB))
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
      num_heads: attention heads; ``embed_dim`` must divide by it.
      embed_dim: the residual stream's width.
      mlp_dim: the MLP's hidden width; None means ``4 * embed_dim``.
      max_len: the longest sequence (the context); a longer input is an error.
      positions: ``"learned"`` (a GPT-2 position table) or ``"rotary"``.
      tie_embeddings: compute logits with the token embedding (GPT-2) instead
        of a separate output matrix.
      use_bias: biases in the attention and MLP projections (GPT-2 has them).
      dropout_rate: dropout on the embeddings and each residual branch while
        training (``train=True`` with a ``"dropout"`` rng).
      attention: `replicator.attention.causal_attention`'s implementation:
        ``"auto"`` (Pallas splash attention on TPU, cuDNN on GPUs for 16-bit
        inputs, else XLA), ``"splash"``, ``"cudnn"`` or ``"xla"``.
      remat_policy: which of each block's activations the backward pass keeps
        (`replicator.remat`: MaxText's names, e.g. ``"full"`` keeps only the
        block's input, ``"minimal"`` the projections); None keeps all of them.
      scan_layers: the blocks as one ``nn.scan`` over parameters stacked on a
        leading ``layers`` axis (``params/blocks/...``, ``[num_layers, ...]``):
        one block's program, compiled once, instead of ``num_layers`` copies
        (``params/block_<i>/...``, the layout of checkpoints written before).
      loss_chunk: with ``targets`` (the model computes its own loss), make the
        logits this many positions of the sequence at a time, recomputed in the
        backward pass: the ``[batch, time, vocab]`` logits never exist at once
        (`chunked_token_nats`). None or 0: all positions at once.
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
    moe_every: int = 1
    dtype: Any = None

    def _blocks(self, x_BxTxE: jax.Array, train: bool) -> jax.Array:
        """The ``num_layers`` blocks, scanned or unrolled, rematerialised by the policy."""
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
                x_BxTxE = block(**kwargs, num_experts=moe, name=f"block_{i}")(x_BxTxE)
            return x_BxTxE
        if self.num_experts:  # scanned in groups of `every` blocks, the last one MoE
            scanned, kwargs = BlockGroup, dict(every=every, block=block, kwargs=kwargs)
        else:
            scanned = block
        stack = nn.scan(
            scanned,
            variable_axes={"params": 0, "intermediates": 0},
            split_rngs={"params": True, "dropout": True},
            length=self.num_layers // every,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        blocks = stack(**kwargs, scanned=True, name="blocks")
        if self.is_initializing() or stage_count() == 1:
            x_BxTxE, _ = blocks(x_BxTxE, None)
            return x_BxTxE
        # Over a "stage" axis: the same stacked parameters, one block per layer_fn call.
        if self.num_experts:
            raise ValueError("A pipeline does not run mixture-of-experts blocks: num_experts=0.")
        if self.dropout_rate and train:
            raise ValueError("A pipeline does not run dropout yet: set dropout_rate=0.")
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

    def __post_init__(self):
        if self.embed_dim % self.num_heads:
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
        _check_parallel_keys(self)
        if self.pipeline_microbatches is not None or self.pipeline_repeats != 1:
            if not self.scan_layers:
                raise ValueError("A pipeline runs the stacked blocks: keep scan_layers=True.")
        super().__post_init__()

    @nn.compact
    def __call__(
        self, tokens_BxT: jax.Array, *, train: bool = False, targets: jax.Array | None = None
    ) -> jax.Array:
        """The logits ``[batch, time, vocab]``; with ``targets`` ``[batch, time]``, the
        per-token cross-entropy in nats instead (chunked by ``loss_chunk``)."""
        length = tokens_BxT.shape[1]
        check_length(length, self.max_len)
        # Load balancing over "context": the sequence reordered once, here, so that each
        # shard holds chunks i and 2 CP - 1 - i; positions follow the tokens, the
        # per-token outputs are put back in order at the end.
        cp = context_size()
        balanced = self.context_load_balance and cp > 1
        if balanced:
            tokens_BxT = load_balance(tokens_BxT, cp)
            targets = None if targets is None else load_balance(targets, cp)
        # Under `Replicator.run` (context manual, each replica's whole sequences on
        # every context device) each device takes its block, and the per-token output
        # is gathered back at the end; elsewhere these do nothing. A mixture of
        # experts keeps whole sequences: its capacity is per sequence.
        split = not self.num_experts
        if split:
            tokens_BxT = split_sequence(tokens_BxT)
            targets = None if targets is None else split_sequence(targets)
        positions_T = sequence_positions(tokens_BxT, balanced)
        embed = nn.Embed(
            self.vocab_size,
            self.embed_dim,
            dtype=self.dtype,
            embedding_init=_normal(0.02, (VOCAB, EMBED)),
            name="token_embedding",
        )
        x_BxTxE = embed(tokens_BxT)
        if self.positions == "learned":
            table = self.param(
                "position_embedding",
                _normal(0.02, (None, EMBED)),
                (self.max_len, self.embed_dim),
            )
            x_BxTxE = x_BxTxE + jnp.asarray(table[positions_T], x_BxTxE.dtype)
        x_BxTxE = nn.Dropout(self.dropout_rate, deterministic=not train)(x_BxTxE)

        x_BxTxE = self._blocks(x_BxTxE, train)
        x_BxTxE = _layer_norm(self.dtype, "ln_final")(x_BxTxE)
        if self.tie_embeddings:
            logits_fn = functools.partial(project, kernel_ExV=embed.embedding.T, dtype=self.dtype)
        else:
            head = Head(self.vocab_size, self.embed_dim, name="head")
            logits_fn = functools.partial(project, kernel_ExV=head.kernel, dtype=self.dtype)
        if targets is None:
            out = logits_fn(x_BxTxE)
        elif not self.loss_chunk or self.loss_chunk >= tokens_BxT.shape[1]:
            out = token_nats(logits_fn(x_BxTxE), targets)
        else:
            out = chunked_token_nats(x_BxTxE, targets, logits_fn, self.loss_chunk)
        out = gather_sequence(out) if split else out
        return restore_order(out, cp) if balanced else out


def _block_kwargs(model: Transformer, train: bool) -> dict[str, Any]:
    return dict(
        num_heads=model.num_heads,
        head_dim=model.embed_dim // model.num_heads,
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
    )


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
