"""Precision policies: which dtype parameters are stored in, computed in, and output in."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy.

    Attributes:
      name: the preset's name (``"fp32"``, ``"bf16"``).
      param_dtype: storage dtype of parameters and optimizer state.
      compute_dtype: dtype of activations and matmuls inside the model.
      output_dtype: dtype of logits and losses.
    """

    name: str
    param_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    output_dtype: jnp.dtype


_F32 = jnp.dtype("float32")
PRESETS = {
    "fp32": Policy("fp32", _F32, _F32, _F32),
    "bf16": Policy("bf16", _F32, jnp.dtype("bfloat16"), _F32),
}


def get_policy(precision: str | Policy | None) -> Policy:
    """Returns the policy for a preset name (``None`` means ``"fp32"``) or a `Policy`.

    >>> get_policy("bf16").compute_dtype
    dtype(bfloat16)
    """
    if isinstance(precision, Policy):
        return precision
    name = "fp32" if precision is None else precision
    if name == "fp16":
        raise ValueError(
            "precision='fp16' needs dynamic loss scaling, which replicator does not have "
            "yet; use 'bf16' (same speed-ups on TPU and Ampere+ GPUs, no loss scale) or None."
        )
    if name not in PRESETS:
        raise ValueError(f"Unknown precision {precision!r}; choose one of {[None, *PRESETS]}.")
    return PRESETS[name]
