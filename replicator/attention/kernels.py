"""Causal attention of a whole sequence through each backend's fused kernel.

(A sequence split over the mesh axis ``context`` runs block by block through the
kernel interface, `replicator.attention.blocks`, which picks its blocks' kernel the
same way: splash on TPU, XLA's elsewhere.)

`causal_attention` is multi-head causal self-attention, ``softmax(q k^T / sqrt(D)) v``
over ``[batch, time, heads, head_dim]`` inputs, optionally within a sliding ``window``
(a query sees itself and the ``window - 1`` keys before it: Mistral's and Gemma's local
layers) and with its scores soft-capped (``softcap * tanh(score / softcap)``: Gemma 2),
computed by:

* ``"splash"``: Pallas's splash attention on TPU (the kernel MaxText uses). It
  works on blocks of the ``[time, time]`` scores in VMEM, never writes the scores
  or probabilities to HBM, and skips the blocks above the diagonal (the causal
  half; with a window, splash's local mask, the blocks left of the band too). On a
  CPU it runs in Pallas's interpreter: slow, but the same program, so its numbers
  can be checked anywhere (`replicator.attention.splash`).
* ``"cudnn"``: cuDNN's fused kernel through `jax.nn.dot_product_attention` on GPU
  (its ``local_window_size`` for a window; no soft-capping).
* ``"xla"``: `jax.nn.dot_product_attention`'s XLA version: any backend; with
  soft-capping, the same computation written out (`jax.nn.dot_product_attention`
  has none), the ``[time, time]`` scores in float32.
* ``"auto"``: splash on TPU where the sequence splits into blocks of 128 (in the
  global view: `Replicator.compile`), cuDNN on GPU for 16-bit inputs and head
  widths up to 128 in multiples of 8 (and, with segment ids, an even length),
  XLA elsewhere (and with soft-capping, which cuDNN's has not).
  The platform is that of the mesh being compiled for (a TPU topology compiled
  from a CPU host picks splash), else JAX's default backend.

A Pallas kernel is one device's program: under `Replicator.compile` it runs inside
``jax.shard_map`` over the mesh axes the batch and heads are split over, as the
activation rules split them (`replicator.parallel.activations`). Inside `Replicator.run`
splash is refused: its backward pass does not keep track of the values that vary
per replica (JAX's ``check_vma``), so a per-replica step uses XLA's attention.

For rematerialisation (`replicator.step.remat`) the output is named ``context``
(``checkpoint_name``); splash names its output and log-sum-exp, all its backward
needs, so a policy keeping ``context`` runs no second forward kernel.

Packed documents: with ``segment_ids`` (int32 ``[batch, time]``) a query attends
only to the keys at or before it that carry its own id. Splash takes them as its
``SegmentIds`` (it skips no more blocks than the causal mask, but masks within
them). XLA masks its scores with their comparison. cuDNN, through
`jax.nn.dot_product_attention`, has no segment ids of its own in JAX 0.10 (only
padding lengths; its packed layout is not in the public API), so they go in as its
``mask``, which it adds to the scores as a ``[batch, 1, time, time]`` bias: fused
still, but that bias lives in memory, ``2 * time**2`` bytes per sequence in 16 bits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from replicator.attention import splash

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash")


def causal_attention(
    q_BxTxHxD: jax.Array,
    k_BxTxHxD: jax.Array,
    v_BxTxHxD: jax.Array,
    *,
    implementation: str = "auto",
    segment_ids: jax.Array | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Causal multi-head attention ``[batch, time, heads, head_dim]`` -> the same shape.

    Args:
      q_BxTxHxD: queries; k_BxTxHxD, v_BxTxHxD: keys and values, the same shape.
      implementation: one of `IMPLEMENTATIONS` (see the module docstring).
      segment_ids: None, or int32 ``[batch, time]``: packed documents, a query
        attending only to earlier keys of its own segment.
      window: None (every earlier key), or a sliding window: the query at ``i`` sees
        the keys at ``i - window + 1 .. i`` (Hugging Face's ``sliding_window``).
      softcap: None, or the scores become ``softcap * tanh(score / softcap)`` before
        the mask and softmax (Gemma 2's ``attn_logit_softcapping``).

    Returns:
      ``softmax(q k^T / sqrt(head_dim), causal) v`` in ``q``'s dtype.

    >>> x = jax.random.normal(jax.random.key(0), (2, 128, 2, 8))
    >>> fused = causal_attention(x, x, x, implementation="splash")  # Pallas's interpreter
    >>> plain = causal_attention(x, x, x, implementation="xla")
    >>> bool(jnp.allclose(fused, plain, atol=1e-5))
    True
    >>> ids = jnp.repeat(jnp.array([[0, 1], [0, 1]]), 64, axis=1)  # two documents of 64
    >>> apart = causal_attention(x, x, x, implementation="xla", segment_ids=ids)
    >>> alone = causal_attention(x[:, 64:], x[:, 64:], x[:, 64:], implementation="xla")
    >>> bool(jnp.allclose(apart[:, 64:], alone, atol=1e-5))
    True
    >>> local = causal_attention(x, x, x, implementation="xla", window=64)
    >>> bool(jnp.allclose(local[:, 64:], causal_attention(x, x, x, implementation="splash",
    ...                                                     window=64)[:, 64:], atol=1e-5))
    True
    """
    shape = q_BxTxHxD.shape
    _check_window(window, softcap)
    chosen = choose_implementation(
        implementation, q_BxTxHxD.dtype, shape, segment_ids, softcap=softcap
    )
    if chosen == "splash":  # names its output and log-sum-exp "context" itself
        return _splash_attention(
            q_BxTxHxD, k_BxTxHxD, v_BxTxHxD, segment_ids, window=window, softcap=softcap
        )
    mask = None
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids)
        _check_segment_ids(segment_ids, shape)
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # Bx1xTxT
    if softcap is not None:
        out = _capped_attention(q_BxTxHxD, k_BxTxHxD, v_BxTxHxD, mask, window, softcap)
        return checkpoint_name(out, "context")
    out = jax.nn.dot_product_attention(
        q_BxTxHxD, k_BxTxHxD, v_BxTxHxD, mask=mask, is_causal=True, implementation=chosen,
        local_window_size=None if window is None else (window - 1, 0),
    )  # fmt: skip
    return checkpoint_name(out, "context")


def _capped_attention(q_BxTxHxD, k_BxTxHxD, v_BxTxHxD, mask_Bx1xTxT, window, softcap):
    """Causal attention with soft-capped scores, written out: float32 scores and softmax."""
    length, head_dim = q_BxTxHxD.shape[1], q_BxTxHxD.shape[-1]
    scores = jnp.einsum(
        "bqhd,bkhd->bhqk", q_BxTxHxD, k_BxTxHxD, preferred_element_type=jnp.float32
    ) / math.sqrt(head_dim)  # fmt: skip
    scores = softcap * jnp.tanh(scores / softcap)
    seen_TxT = local_causal_mask(length, length, 0, window)
    seen = seen_TxT if mask_Bx1xTxT is None else seen_TxT & mask_Bx1xTxT
    weights = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v_BxTxHxD.dtype), v_BxTxHxD)
    return out.astype(q_BxTxHxD.dtype)


def local_causal_mask(q_len: int, k_len: int, offset: int = 0, window: int | None = None):
    """bool ``[q_len, k_len]``: which keys each query sees, the queries starting ``offset``
    positions after the keys: those at or before it, and within ``window`` (None: all).

    >>> local_causal_mask(3, 3, window=2).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    distance = offset + jnp.arange(q_len)[:, None] - jnp.arange(k_len)[None, :]
    seen = distance >= 0
    return seen if window is None else seen & (distance < window)


def _check_window(window: int | None, softcap: float | None) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r}: a sliding window is a positive int (or None).")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap!r}: a soft cap is positive (or None).")


def choose_implementation(
    requested: str,
    dtype: jnp.dtype,
    shape: tuple[int, ...],
    segment_ids: object = None,
    *,
    softcap: float | None = None,
) -> str:
    """The implementation ``"auto"`` stands for here (others are returned as they are);
    ``segment_ids``: whether the call has them (None: it has not); ``softcap``: whether
    the scores are soft-capped, which cuDNN's kernel does not do.

    >>> choose_implementation("auto", jnp.float32, (1, 128, 2, 64))  # on CPU
    'xla'
    """
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"attention={requested!r}: use one of {IMPLEMENTATIONS}.")
    if requested == "splash" and splash.block_size(shape[1]) is None:
        raise ValueError(
            f"attention='splash' needs a sequence length that is a multiple of 128, not "
            f"{shape[1]}; use attention='auto' (XLA for such lengths)."
        )
    per_replica = _inside_run()
    if requested == "splash" and per_replica:
        raise ValueError(
            "attention='splash' runs in the global view (Replicator.compile, "
            "step_path='compile'): inside Replicator.run the kernel's backward pass loses "
            "track of which replica's values it holds; use attention='auto' or 'xla' there."
        )
    if requested == "cudnn" and softcap is not None:
        raise ValueError(
            "attention='cudnn' has no soft-capping of the scores (attn_logit_softcap); use "
            "attention='auto' (XLA's on GPU) or 'xla'."
        )
    if requested != "auto":
        return requested
    platform = target_platform()
    head_dim = shape[-1]
    if platform == "tpu" and splash.block_size(shape[1]) is not None and not per_replica:
        return "splash"
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    # cuDNN takes segment ids as a bias, whose backward pass needs an even length.
    even = segment_ids is None or shape[1] % 2 == 0
    fits = head_dim % 8 == 0 and head_dim <= 128 and even and softcap is None
    if platform == "gpu" and sixteen_bit and fits:
        return "cudnn"
    return "xla"


def target_platform() -> str:
    """The platform of the mesh being traced for (`Replicator.compile` and `run` make
    theirs ambient), else JAX's default backend: ``"tpu"``, ``"gpu"`` or ``"cpu"``.

    >>> target_platform()
    'cpu'
    """
    device = jax.sharding.get_abstract_mesh().abstract_device
    platform = jax.default_backend() if device is None else device.platform
    return "gpu" if platform in ("cuda", "rocm") else platform


def _inside_run() -> bool:
    """Whether the ambient mesh has manual axes (a per-replica step, under shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and any(kind == AxisType.Manual for kind in mesh.axis_types)


def _check_segment_ids(segment_ids: jax.Array, shape: tuple[int, ...]) -> None:
    integers = jnp.issubdtype(segment_ids.dtype, jnp.integer)
    if segment_ids.shape != tuple(shape[:2]) or not integers:
        raise ValueError(
            f"segment_ids {segment_ids.shape} {segment_ids.dtype}: expected integers "
            f"[batch, time] = {tuple(shape[:2])}, aligned with the queries."
        )


def _splash_attention(
    q_BxTxHxD: jax.Array,
    k_BxTxHxD: jax.Array,
    v_BxTxHxD: jax.Array,
    segment_ids_BxT: jax.Array | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
):
    """Splash attention, inside ``shard_map`` over the batch and head axes the mesh
    splits automatically (none left: called directly)."""
    batch, _, heads, _ = q_BxTxHxD.shape
    mesh = jax.sharding.get_abstract_mesh()
    batch_axes, head_axes = kernel_axes(mesh, batch, heads)
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q_BxTxHxD, k_BxTxHxD, v_BxTxHxD))  # BxHxTxD
    args = (q, k, v)
    if segment_ids_BxT is not None:
        _check_segment_ids(segment_ids_BxT, q_BxTxHxD.shape)
        args += (segment_ids_BxT.astype(jnp.int32),)
    interpret = jax.default_backend() != "tpu" and target_platform() != "tpu"
    local = functools.partial(
        splash.whole_sequence, interpret=interpret, window=window, softcap=softcap
    )
    auto = _auto_axes(mesh)
    if not auto:  # every axis manual already (inside run, or no mesh)
        return jnp.swapaxes(local(*args), 1, 2)
    # A Mosaic kernel is never partitioned by XLA: manual over every automatic axis,
    # split over those the batch and heads divide by, the rest replicated.
    spec = P(batch_axes or None, head_axes or None, None, None)
    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec,) * 3 + (P(batch_axes or None, None),) * (len(args) - 3),
        out_specs=spec,
        axis_names=frozenset(auto),
        check_vma=False,
    )
    return jnp.swapaxes(sharded(*args), 1, 2)


def kernel_axes(mesh, batch: int, heads: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The automatic mesh axes a Pallas kernel's batch and heads split over (its
    ``shard_map`` is manual over them): the activation rules' (``activation_batch``,
    ``activation_heads``), where the sizes divide over them.

    Args:
      mesh: the mesh being traced for.
      batch: the size of the batch dimension.
      heads: the number of heads (of keys and values, where fewer than the queries').

    Returns:
      ``(batch axes, head axes)``, no axis in both.
    """
    from replicator.parallel.activations import current_axes

    auto = {name for name in _auto_axes(mesh) if mesh.shape[name] > 1}

    def dividing(axes: tuple[str, ...], size: int) -> tuple[str, ...]:
        axes = tuple(a for a in axes if a in auto)
        return axes if size % math.prod(mesh.shape[a] for a in axes) == 0 else ()

    batch_axes = dividing(current_axes("activation_batch"), batch)
    head_axes = dividing(current_axes("activation_heads"), heads)
    return batch_axes, tuple(a for a in head_axes if a not in batch_axes)


def _auto_axes(mesh) -> tuple[str, ...]:
    if mesh.empty:
        return ()
    return tuple(n for n, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Auto)
