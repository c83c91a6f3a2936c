"""The LM's layers: norms, rotary positions, self-attention and MLPs, GPT-2's and Llama's.

GPT-2's block is LayerNorm, one fused q/k/v projection, a GELU MLP (the tanh
approximation, Hugging Face's ``gelu_new``) and biases everywhere. The Llama
family's (Llama 2 and 3, Mistral, Qwen2) is RMSNorm, a query projection beside a
key/value one of ``num_kv_heads`` heads (grouped-query attention: each key/value
head serves ``num_heads / num_kv_heads`` query heads), a SwiGLU MLP
(``down(silu(gate(x)) * up(x))``), rotary positions of base ``rope_theta``, with
Llama 3's rescaling of the long wavelengths (`rope_frequencies`), and no biases
but Qwen2's on q/k/v. Gemma 2 and 3 keep Llama's attention with their own pieces:
`GemmaRMSNorm` (``x / rms(x) * (1 + scale)``), a GeGLU MLP (`GatedFeedForward` with
the tanh GELU), soft-capped scores, ``query_pre_attn_scalar`` (`SelfAttention._scaled`),
and local layers within a sliding window with a rotary base of their own, each layer
picking its kind's kernel and frequencies (`by_layer_kind`).
`experiments.lm.model.Transformer` picks them by its keys.

Rotary embeddings use the half-split layout (GPT-NeoX's, Hugging Face's
``rotate_half``): feature ``i`` pairs with ``i + D/2``, so Hugging Face's Llama
``q_proj``/``k_proj`` weights map onto ``q_kernel``/``kv_kernel`` without a
permutation.

Under FSDP a projection whose activation is large per device (`GATHER_ABOVE`)
gathers its kernel whole before the product rather than leave XLA a collective
matmul that reads the activation once per shard (`gather_spec`).

Every parameter carries logical axis names (`nn.with_logical_partitioning`):
``embed``, ``heads`` (query heads, and key/value heads too: the rules split both
over ``tensor`` where they divide, and keep them whole, with a warning, where not),
``kv`` (the head width), ``mlp``. Activations are named for the rules
(`replicator.parallel.activations.constrain`) and, for rematerialisation, with MaxText's
checkpoint names (`replicator.step.remat`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import promote_dtype
from jax.ad_checkpoint import checkpoint_name

from experiments.lm import kv_cache
from experiments.lm import lora as lora_lib
from replicator.attention.context import context_attention, context_size, sequence_positions
from replicator.parallel import axes as mesh_axes
from replicator.parallel.activations import batch_axes, constrain, current_axes

VOCAB, EMBED, MLP, HEADS, KV = "vocab", "embed", "mlp", "heads", "kv"
# The activations' logical axes (MaxText's names): the rules table shards them under
# `Replicator.compile` (`replicator.parallel.activations.constrain`); under `run` they are no-ops.
ACTIVATION_BxTxE = ("activation_batch", "activation_length", "activation_embed")
ACTIVATION_BxTxHxD = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
ACTIVATION_BxTxM = ("activation_batch", "activation_length", "activation_mlp")
NORMS = ("layernorm", "rmsnorm", "gemma_rmsnorm")
MLP_ACTIVATIONS = ("gelu", "swiglu", "geglu")
GATHER_ABOVE = 32 * 2**20
"""Bytes per device above which a projection's activation (its input or output) makes
it gather its kernel whole for the product (`gather_spec`)."""
ROPE_SCALING_KEYS = (
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
)  # fmt: skip


def normal(stddev: float, names: tuple[str | None, ...]) -> Any:
    return nn.with_logical_partitioning(nn.initializers.normal(stddev), names)


def _kernel(module, name: str, stddev: float, shape: tuple, names: tuple) -> jax.Array:
    """The projection kernel ``name`` (normal init), stored as QLoRA says (`lora_lib.kernel`)."""
    init = nn.initializers.normal(stddev)
    return lora_lib.kernel(module, name, init, shape, names, module.lora)


def _adapted(module, name: str, equation: str, x, y, shape: tuple, names: tuple) -> jax.Array:
    """``y = einsum(equation, x, kernel)`` plus LoRA's term where the kernel has an adapter,
    whose ``A`` and ``B`` are gathered as the kernel is (`gather_spec`: XLA would rather
    move the activations than the small adapters)."""

    def gathered(w: jax.Array, w_names: tuple) -> jax.Array:
        spec = gather_spec(w, w_names, x, y)
        return w if spec is None else jax.lax.with_sharding_constraint(w, spec)

    extra = lora_lib.delta(module, name, equation, x, shape, names, module.lora, gathered)
    return y if extra is None else y + extra.astype(y.dtype)


def zeros(names: tuple[str | None, ...]) -> Any:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def ones(names: tuple[str | None, ...]) -> Any:
    return nn.with_logical_partitioning(nn.initializers.ones_init(), names)


def make_norm(kind: str, eps: float, dtype: Any, name: str, axis: str = EMBED) -> nn.Module:
    """``"layernorm"`` (``scale`` and ``bias``) or ``"rmsnorm"`` (``scale`` only) over the
    last axis, statistics in float32; ``axis`` names it for the sharding rules (the
    embedding width, or ``KV``: a head's, for q/k norms).

    >>> x = jnp.array([[6.0, -2.0]])  # x / sqrt(mean(x**2)): x / sqrt(20)
    >>> y = make_norm("rmsnorm", 0.0, None, "n").apply({"params": {"scale": jnp.ones(2)}}, x)
    >>> [round(float(v), 4) for v in y[0]]
    [1.3416, -0.4472]
    """
    if kind == "rmsnorm":
        return nn.RMSNorm(epsilon=eps, dtype=dtype, scale_init=ones((axis,)), name=name)
    if kind == "gemma_rmsnorm":
        return GemmaRMSNorm(eps, dtype, names=(axis,), name=name)
    return nn.LayerNorm(
        epsilon=eps, dtype=dtype, scale_init=ones((axis,)), bias_init=zeros((axis,)), name=name
    )


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + scale)``, ``scale`` starting at zero (Hugging
    Face's stored ``weight``), computed in float32 and cast to the compute dtype after the
    product (Gemma's order; Llama's casts before it). ``names``: the scale's logical axis.

    >>> y = GemmaRMSNorm(0.0).apply({"params": {"scale": jnp.ones(2)}}, jnp.array([[6.0, -2.0]]))
    >>> [round(float(v), 4) for v in y[0]]  # x / sqrt(20) * 2
    [2.6833, -0.8944]
    """

    epsilon: float
    dtype: Any = None
    names: tuple = (EMBED,)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", zeros(self.names), (x.shape[-1],))
        x32 = jnp.asarray(x, jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        return (normed * (1.0 + jnp.asarray(scale, jnp.float32))).astype(self.dtype or x.dtype)


def check_rope_scaling(scaling: Mapping[str, Any] | None) -> None:
    """Raises a one-line ``ValueError`` unless ``scaling`` is None, Llama 3's rope
    scaling (Hugging Face's ``rope_scaling`` with ``rope_type`` ``"llama3"``, or without it)
    or a linear one (``{"rope_type": "linear", "factor": f}``: Gemma 3's global layers).

    >>> check_rope_scaling({"rope_type": "yarn", "factor": 4.0})
    Traceback (most recent call last):
    ...
    ValueError: rope_scaling of rope_type='yarn': only 'llama3' and 'linear' are supported.
    """
    if scaling is None:
        return
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", scaling.pop("type", "llama3"))
    if kind == "linear":
        if set(scaling) != {"factor"} or not float(scaling["factor"]) > 0:
            raise ValueError("rope_scaling of rope_type='linear' takes a positive factor alone.")
        return
    if kind != "llama3":
        raise ValueError(
            f"rope_scaling of rope_type={kind!r}: only 'llama3' and 'linear' are supported."
        )
    missing = [k for k in ROPE_SCALING_KEYS if k not in scaling]
    unknown = sorted(set(scaling) - set(ROPE_SCALING_KEYS))
    if missing or unknown:
        what = f"lacks {', '.join(map(repr, missing))}" if missing else f"has {unknown}"
        raise ValueError(
            f"rope_scaling {what}: Llama 3's scaling takes {', '.join(ROPE_SCALING_KEYS)}."
        )
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"] > 0:
        raise ValueError("rope_scaling: high_freq_factor must exceed low_freq_factor > 0.")


def rope_frequencies(
    head_dim: int, theta: float = 10_000.0, scaling: Mapping[str, Any] | None = None
) -> np.ndarray:
    """The rotary angular frequencies (float32 ``[head_dim / 2]``), as Hugging Face
    computes them: ``theta ** (-2i / head_dim)``, and with Llama 3's ``scaling`` the
    wavelengths above ``original_max_position_embeddings / low_freq_factor`` divided
    by ``factor``, those below ``original_max_position_embeddings / high_freq_factor``
    kept, and those between interpolated smoothly.

    Args:
      head_dim: the (even) head width.
      theta: the base (``rope_theta``: 10,000 for GPT-NeoX and Llama 2, 500,000
        for Llama 3).
      scaling: None, or Llama 3's ``rope_scaling`` (`check_rope_scaling`), or a linear
        one (every frequency divided by ``factor``), as a mapping or its pairs.

    Returns:
      float32 frequencies, feature ``i`` of the first half paired with ``i + D/2``.

    >>> rope_frequencies(4, theta=100.0).tolist()
    [1.0, 0.10000000149011612]
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = np.float32(1.0) / (np.float32(theta) ** exponents)
    if scaling is None:
        return inv
    s = dict(scaling)
    if s.get("rope_type", s.get("type")) == "linear":  # positions divided by the factor
        return (inv / np.float32(s["factor"])).astype(np.float32)
    factor, low, high = (np.float32(s[k]) for k in ROPE_SCALING_KEYS[:3])
    context = np.float32(s["original_max_position_embeddings"])
    wavelength = np.float32(2 * math.pi) / inv
    long = wavelength > context / low  # divided by the factor
    scaled = np.where(long, inv / factor, inv)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < context / high) & ~long
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rotary(
    x_BxTxHxD: jax.Array,
    base: float = 10_000.0,
    positions: Any = None,
    scaling: Mapping[str, Any] | None = None,
) -> jax.Array:
    """Rotary position embedding (RoFormer; GPT-NeoX's half-split layout) of queries or keys.

    Pairs feature ``i`` with ``i + D/2`` and rotates each pair by ``t * f_i`` at
    position ``t`` (``positions``: ``[T]`` or per row ``[B, T]``, default
    ``0 .. T - 1``; a load-balanced sequence's are `context_positions`), ``f`` being
    `rope_frequencies`, so that query-key products depend on relative position only.

    >>> x = jnp.ones((1, 3, 1, 4))
    >>> bool(jnp.allclose(apply_rotary(x)[:, 0], x[:, 0]))  # position 0: unchanged
    True
    """
    half = x_BxTxHxD.shape[-1] // 2
    return rotate(x_BxTxHxD, rope_frequencies(2 * half, base, scaling), positions)


def rotate(x_BxTxHxD: jax.Array, frequencies_D2: Any, positions: Any = None) -> jax.Array:
    """`apply_rotary` by ``frequencies_D2`` (float32 ``[D/2]``, `rope_frequencies`; traced
    where a scanned layer picks its kind's)."""
    half = x_BxTxHxD.shape[-1] // 2
    if positions is None:
        positions = np.arange(x_BxTxHxD.shape[1])
    angles = jnp.asarray(positions, jnp.float32)[..., None] * frequencies_D2  # [(B,) T, D/2]
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    x1, x2 = x_BxTxHxD[..., :half].astype(jnp.float32), x_BxTxHxD[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxTxHxD.dtype)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention: q/k/v projections, attention, output projection.

    With ``num_kv_heads`` None one fused projection ``qkv_kernel [E, 3, H, D]``
    (GPT-2's); else ``q_kernel [E, H, D]`` and ``kv_kernel [E, 2, K, D]``, the ``K``
    key/value heads repeated to ``H`` for the attention (grouped-query attention).
    ``qkv_bias`` (None: ``use_bias``) adds their biases, ``use_bias`` the output's.
    ``rope_scaling``: Llama 3's, as ``(key, value)`` pairs (hashable). ``lora``: the
    projections' adapters (`experiments.lm.lora.LoraSpec`, or None). Gemma's:
    ``attn_logit_softcap`` soft-caps the scores, ``query_pre_attn_scalar`` scales them by
    its ``-1/2`` power (None: ``head_dim``'s), ``sliding_window`` is the local layers'
    window and ``rope_local_theta`` their rotary base (None: ``rope_theta``, scaled).
    ``qk_norm``: the queries and keys normalised over each head's width before the
    rotary embedding (Qwen3's, Gemma 3's), a norm of kind ``norm`` each (`head_norms`)."""

    num_heads: int
    head_dim: int
    out_stddev: float
    rotary: bool
    use_bias: bool
    attention: str
    dtype: Any
    context_strategy: str = "gather"
    context_load_balance: bool = False
    num_kv_heads: int | None = None
    qkv_bias: bool | None = None
    rope_theta: float = 10_000.0
    rope_scaling: tuple | None = None
    lora: Any = None
    attn_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    qk_norm: bool = False
    norm: str = "rmsnorm"
    norm_eps: float = 1e-6

    @nn.compact
    def __call__(
        self, x_BxTxE: jax.Array, positions: Any = None, segment_ids: Any = None,
        cache: Any = None, local: Any = None,
    ) -> Any:  # fmt: skip
        """``positions`` (``[B, T]``, or None for the sequence's own) rotate q and k;
        ``segment_ids`` ``[B, T]`` keep attention within each segment; ``local``: this
        layer attends within ``sliding_window`` (a bool, traced under a scan of layers of
        both kinds; None or False: a global layer, `by_layer_kind`). Decoding,
        ``cache`` is ``((k, v), (index, mask[, window mask]))``, this layer's cache and
        where the new tokens go (`experiments.lm.kv_cache.attend`), and the call returns the output
        and the new tokens' (rotated) keys and values, ``K`` heads, for the cache."""
        embed_dim = x_BxTxE.shape[-1]
        q, k, v = self._project(x_BxTxE)
        if self.qk_norm:
            q, k = head_norms(self, q, k)
        cp = context_size()
        balanced = self.context_load_balance and cp > 1
        if self.rotary:  # the original positions, of this device's block where split
            if positions is None:
                positions = sequence_positions(q, balanced)
            frequencies = self._frequencies(q.shape[-1], local)
            q, k = rotate(q, frequencies, positions), rotate(k, frequencies, positions)
        q = self._scaled(q)
        if cache is not None:
            index, mask, *window_mask = cache[1]
            if window_mask:  # a local layer's: the slots within its window
                mask = by_layer_kind(local, lambda: window_mask[0], lambda: mask)
            out_BxTxHxD = kv_cache.attend(q, k, v, cache[0], index, mask, self.attn_logit_softcap)
            return self._out(out_BxTxHxD, embed_dim), (k, v)
        if k.shape[2] != self.num_heads:  # grouped: each k/v head serves H / K query heads
            k, v = (jnp.repeat(x, self.num_heads // x.shape[2], axis=2) for x in (k, v))
            k, v = (constrain(x, ACTIVATION_BxTxHxD) for x in (k, v))
        # Over a "context" axis the sequence's blocks attend across devices
        # (`replicator.attention.context`); without one this is `causal_attention`.
        segments = {} if segment_ids is None else {"segment_ids": segment_ids}

        def attend(window: int | None) -> jax.Array:
            return context_attention(
                q, k, v, strategy=self.context_strategy, load_balanced=balanced,
                implementation=self.attention, window=window, softcap=self.attn_logit_softcap,
                **segments,
            )  # fmt: skip

        window = self.sliding_window
        out_BxTxHxD = by_layer_kind(
            local if window else None, lambda: attend(window), lambda: attend(None)
        )
        return self._out(out_BxTxHxD, embed_dim)

    def _frequencies(self, head_dim: int, local: Any) -> Any:
        """The rotary frequencies of this layer's kind (`rope_frequencies`): a local
        layer's of base ``rope_local_theta``, unscaled (Gemma 3's), else ``rope_theta``'s
        with ``rope_scaling``."""
        frequencies = rope_frequencies(head_dim, self.rope_theta, self.rope_scaling)
        if self.rope_local_theta is None or self.sliding_window is None:
            return frequencies
        own = rope_frequencies(head_dim, self.rope_local_theta)
        return by_layer_kind(local, lambda: jnp.asarray(own), lambda: jnp.asarray(frequencies))

    def _scaled(self, q: jax.Array) -> jax.Array:
        """The queries scaled so that the kernels' ``1 / sqrt(head_dim)`` makes the scores'
        scale ``query_pre_attn_scalar ** -0.5`` (Gemma's), every kernel alike."""
        if self.query_pre_attn_scalar is None or self.query_pre_attn_scalar == self.head_dim:
            return q
        return q * jnp.asarray(math.sqrt(self.head_dim / self.query_pre_attn_scalar), q.dtype)

    def _out(self, out_BxTxHxD: jax.Array, embed_dim: int) -> jax.Array:
        """The output projection (and bias) of the heads' outputs."""
        # `replicator.attention` names its output (or splash its residuals) "context".
        out_BxTxHxD = constrain(out_BxTxHxD, ACTIVATION_BxTxHxD)
        out_shape, names = (self.num_heads, self.head_dim, embed_dim), (HEADS, KV, EMBED)
        out_kernel = _kernel(self, "out_kernel", self.out_stddev, out_shape, names)
        equation = "bthd,hde->bte"
        y_BxTxE = _product(equation, out_BxTxHxD, jnp.asarray(out_kernel, out_BxTxHxD.dtype), names)
        y_BxTxE = _adapted(self, "out_kernel", equation, out_BxTxHxD, y_BxTxE, out_shape, names)
        if self.use_bias:
            bias = self.param("out_bias", zeros((EMBED,)), (embed_dim,))
            y_BxTxE = y_BxTxE + jnp.asarray(bias, y_BxTxE.dtype)
        return checkpoint_name(y_BxTxE, "out_proj")

    def _project(self, x_BxTxE: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries ``[B, T, H, D]``, keys and values ``[B, T, K, D]``."""
        E, H, D = x_BxTxE.shape[-1], self.num_heads, self.head_dim
        bias = self.use_bias if self.qkv_bias is None else self.qkv_bias
        fused = "bte,ekhd->btkhd"
        if self.num_kv_heads is None:  # GPT-2's fused projection
            names = (EMBED, None, HEADS, KV)
            bias_of = ("qkv_bias", names[1:]) if bias else None
            qkv = self._projection(x_BxTxE, "qkv_kernel", fused, (E, 3, H, D), names, bias_of)
            qkv = checkpoint_name(qkv, "qkv_proj")
            return tuple(constrain(qkv[:, :, i], ACTIVATION_BxTxHxD) for i in range(3))
        K = self.num_kv_heads
        q_bias, kv_bias = (
            (("q_bias", (HEADS, KV)), ("kv_bias", (None, HEADS, KV))) if bias else (None, None)
        )
        q_names, kv_names = (EMBED, HEADS, KV), (EMBED, None, HEADS, KV)
        q = self._projection(x_BxTxE, "q_kernel", "bte,ehd->bthd", (E, H, D), q_names, q_bias)
        kv = self._projection(x_BxTxE, "kv_kernel", fused, (E, 2, K, D), kv_names, kv_bias)
        q = checkpoint_name(constrain(q, ACTIVATION_BxTxHxD), "query_proj")
        k, v = (checkpoint_name(kv[:, :, i], n) for i, n in ((0, "key_proj"), (1, "value_proj")))
        return q, k, v

    def _projection(self, x_BxTxE, name: str, equation: str, shape, names, bias) -> jax.Array:
        """``x @ kernel`` (+ bias, + LoRA's term) of the kernel ``name`` (`_dense`)."""
        kernel = _kernel(self, name, 0.02, shape, names)
        y = _dense(self, x_BxTxE, kernel, equation, bias, names)
        return _adapted(self, name, equation, x_BxTxE, y, shape, names)


def by_layer_kind(local: Any, local_fn: Any, global_fn: Any) -> Any:
    """``local_fn()`` in a sliding-window layer, ``global_fn()`` in a global one.

    ``local`` is a Python bool where the layers are unrolled (or None: a global layer),
    and traced under a scan over layers of both kinds (each layer's flag a row of the
    scan's input): `jax.lax.cond` then runs the one branch of the layer's kind, each
    branch compiled once for every layer.

    >>> by_layer_kind(None, lambda: "local", lambda: "global")
    'global'
    >>> int(jax.jit(lambda x: by_layer_kind(x, lambda: 1, lambda: 2))(jnp.bool_(True)))
    1
    """
    if local is None or isinstance(local, (bool, np.bool_)):
        return local_fn() if local else global_fn()
    return jax.lax.cond(local, local_fn, global_fn)


def head_norms(module: SelfAttention, q_BxTxHxD: jax.Array, k_BxTxKxD: jax.Array):
    """Queries and keys each normalised over a head's width by a norm of their own
    (``q_norm``, ``k_norm``: one scale ``[head_dim]`` shared by the heads), of the kind
    and epsilon of the block's norms: Qwen3's ``q_norm``/``k_norm``."""
    kind, eps, dtype = module.norm, module.norm_eps, module.dtype
    q_BxTxHxD = make_norm(kind, eps, dtype, "q_norm", axis=KV)(q_BxTxHxD)
    k_BxTxKxD = make_norm(kind, eps, dtype, "k_norm", axis=KV)(k_BxTxKxD)
    return q_BxTxHxD, k_BxTxKxD


def _dense(module, x_BxTxE, kernel, equation: str, bias: tuple | None, names: tuple):
    """``x @ kernel`` by ``equation`` in the module's dtype (`_product`; ``names``: the
    kernel's logical axes), plus a zero-initialised bias (``(param name, logical
    names)``) shaped like the kernel's output dimensions."""
    x_BxTxE, kernel = promote_dtype(x_BxTxE, kernel, dtype=module.dtype)
    y = _product(equation, x_BxTxE, kernel, names)
    if bias is not None:
        name, names = bias
        y = y + jnp.asarray(module.param(name, zeros(names), kernel.shape[1:]), y.dtype)
    return y


class FeedForward(nn.Module):
    """Dense to ``mlp_dim``, GELU (tanh approximation), dense back: ``fc``, ``proj``."""

    mlp_dim: int
    out_stddev: float
    use_bias: bool
    dtype: Any
    lora: Any = None

    @nn.compact
    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        hidden = _mlp_dense(self, self.mlp_dim, 0.02, (EMBED, MLP), "fc")(x_BxTxE)
        hidden = checkpoint_name(constrain(hidden, ACTIVATION_BxTxM), "mlpwi")
        out = _mlp_dense(self, x_BxTxE.shape[-1], self.out_stddev, (MLP, EMBED), "proj")
        return checkpoint_name(out(nn.gelu(hidden)), "mlpwo")


class GatedFeedForward(nn.Module):
    """SwiGLU (Shazeer 2020; Llama's MLP): ``down(silu(gate(x)) * up(x))``; with
    ``activation=nn.gelu`` (its tanh approximation) GeGLU, Gemma's MLP."""

    mlp_dim: int
    out_stddev: float
    use_bias: bool
    dtype: Any
    lora: Any = None
    activation: Any = nn.silu

    @nn.compact
    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        gate, up = (
            checkpoint_name(
                constrain(_mlp_dense(self, self.mlp_dim, 0.02, (EMBED, MLP), n)(x_BxTxE),
                          ACTIVATION_BxTxM),
                "mlpwi",
            )
            for n in ("gate", "up")
        )  # fmt: skip
        down = _mlp_dense(self, x_BxTxE.shape[-1], self.out_stddev, (MLP, EMBED), "down")
        return checkpoint_name(down(self.activation(gate) * up), "mlpwo")


def _mlp_dense(module, features: int, stddev: float, names, name: str) -> Dense:
    return Dense(features, stddev, names, module.use_bias, module.dtype, module.lora, name=name)


class Dense(nn.Module):
    """``x @ kernel + bias`` over the last axis, with `nn.Dense`'s parameters (``kernel``
    ``[in, features]``, ``bias``), the kernel gathered for the product where large
    (`_gathered`) and LoRA's term where ``lora`` gives it an adapter."""

    features: int
    stddev: float
    names: tuple
    use_bias: bool
    dtype: Any
    lora: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape, equation = (x.shape[-1], self.features), "...i,io->...o"
        kernel = _kernel(self, "kernel", self.stddev, shape, self.names)
        bias = ("bias", self.names[1:]) if self.use_bias else None
        y = _dense(self, x, kernel, equation, bias, self.names)
        return _adapted(self, "kernel", equation, x, y, shape, self.names)


# ------------------------------------------------------- gathering kernels for a product
# Under FSDP a kernel is split over the devices that split the batch. XLA:TPU then
# multiplies in a loop over the kernel's shards as they pass round the ring (a
# "collective matmul"), reading the whole local activation once per shard: cheap
# while that activation stays in on-chip memory (a sequence per chip), but with four
# sequences per chip of lm_1b the qkv gradient (100 MB) is read 8 times per layer in
# the backward pass (and copied 4 times), the MLP's hidden activation as often in each
# direction (v5e-16, remat "minimal": 354 GiB of HBM traffic per step, 464 ms
# HBM-bound). Gathered whole first, the kernel is one all-gather and each product
# reads its activation once (204 GiB, 299 ms compute-bound, 8.27 -> 7.67 GiB per
# chip): `gather_spec`. The gradient is then all-reduced (3.2 GiB sent per step), not
# reduce-scattered. On a v5p-128, where XLA gathers lm_8b's kernels itself, it no
# longer gathers the qkv kernel twice in the backward pass (7.59 -> 7.17 GiB per chip).

_ACTIVATION_OF = {EMBED: "activation_embed", HEADS: "activation_heads", MLP: "activation_mlp",
                  KV: "activation_kv"}  # fmt: skip


def gather_spec(kernel: Any, names: tuple, *activations: Any) -> Any:
    """How a product gathers ``kernel``: split as its activations are (heads and MLP
    width over ``tensor``, by the activation rules), whole over the FSDP axes; None
    (the kernel as it is placed) unless an activation exceeds `GATHER_ABOVE` bytes per
    device of the batch's split, and off a mesh or under `run`.

    Args:
      kernel: the kernel (its shape).
      names: its logical axes (``embed``, ``heads``, ``kv``, ``mlp``, None).
      activations: the product's input and output (shapes and dtypes); the first's
        leading dimension is the batch.

    Returns:
      A ``PartitionSpec``, or None.

    >>> gather_spec(jnp.ones((4, 8)), (EMBED, MLP), jnp.ones((2, 3, 4))) is None  # no mesh
    True
    """
    mesh = jax.sharding.get_abstract_mesh()
    auto = mesh_axes.auto_axes(mesh) if not mesh.empty else ()
    if not auto:
        return None
    split = math.prod(mesh.shape[a] for a in batch_axes(mesh, activations[0].shape[0]))
    if max(a.size * a.dtype.itemsize for a in activations) / split <= GATHER_ABOVE:
        return None
    parts, taken = [], set()
    for size, name in zip(kernel.shape, names):
        axes = current_axes(_ACTIVATION_OF[name]) if name in _ACTIVATION_OF else ()
        axes = tuple(a for a in axes if a in auto and mesh.shape[a] > 1 and a not in taken)
        if not axes or size % math.prod(mesh.shape[a] for a in axes):
            parts.append(None)
            continue
        taken.update(axes)
        parts.append(axes[0] if len(axes) == 1 else axes)
    return jax.sharding.PartitionSpec(*parts)


def _gathered(product, x: jax.Array, kernel: jax.Array, out: Any, names: tuple) -> jax.Array:
    """``product(x, kernel)``, the kernel gathered first where `gather_spec` says.

    Under a remat policy the backward pass gathers it again (the whole kernel is no
    saved activation); with ``remat_policy`` None it is kept from the forward pass, one
    more copy of the layers' kernels in the compute dtype. (Inside a `jax.checkpoint`
    that saves nothing it never would be, but under ``full`` remat that costs memory:
    lm_8b on a v5p-128 needed 8.84 GiB per chip, against 7.17 GiB without.)"""
    spec = gather_spec(kernel, names, x, out)
    if spec is None:
        return product(x, kernel)
    return product(x, jax.lax.with_sharding_constraint(kernel, spec))


def _product(equation: str, x: jax.Array, kernel: jax.Array, names: tuple) -> jax.Array:
    """``einsum(equation, x, kernel)`` (`_gathered`)."""
    product = functools.partial(jnp.einsum, equation)
    return _gathered(product, x, kernel, jax.eval_shape(product, x, kernel), names)
