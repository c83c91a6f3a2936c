"""Flax's ImageNet example for replicator's port tests: the ResNet (the classify
experiment's, `experiments.classify.resnet`), its L2 penalty and its loss.

The one change the port makes to the model is ``axis_name``: ``None`` is the
single-device original (or pmap's per-device statistics); ``repl.axis_name``
gives cross-replica BatchNorm under ``repl.run`` and the global batch's
statistics under ``repl.compile``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from experiments.classify.resnet import ResNet as ResNet
from experiments.classify.resnet import ResNetBlock as ResNetBlock


def weight_penalty(params: Any, weight_decay: float = 1e-4) -> jax.Array:
    """The example's L2 penalty: kernels only (leaves of rank > 1)."""
    return 0.5 * weight_decay * sum(jnp.sum(p**2) for p in jax.tree.leaves(params) if p.ndim > 1)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example softmax cross-entropy with integer labels."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
