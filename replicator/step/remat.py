"""Rematerialisation by name: which of a block's named tensors the backward pass keeps.

A model names the tensors worth keeping with ``jax.ad_checkpoint.checkpoint_name``
(MaxText's names: ``query_proj``, ``key_proj``, ``value_proj``, ``qkv_proj`` for
the attention's input projections, ``context`` for the attention's output before
its projection (named by `replicator.attention`: splash's output and the
log-sum-exp its backward needs), ``out_proj`` after it, ``mlpwi`` / ``mlpwo`` for the MLP's two
matmuls) and wraps each repeated block in ``jax.checkpoint`` (``nn.remat``) with
`checkpoint_policy`. The policies are MaxText's, by the same names, so a recipe
read there means the same here:

============================  ==============================================
``None``                      no rematerialisation: everything is kept
``"full"``                    nothing is kept but the block's input
``"minimal"``                 every projection (q/k/v, out, both MLP matmuls)
``"minimal_with_context"``    as ``minimal``, and the attention's output before its
                              projection (``context``)
``"save_dot_except_mlp"``     the attention projections, not the MLP's
``"save_qkv_proj"``           only the q/k/v projections
``"minimal_offloaded"``       as ``minimal``, but kept in host memory
                              (``pinned_host``), not in HBM
============================  ==============================================

Every policy computes the same numbers; they trade memory for recomputation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

ATTENTION_PROJECTIONS = ("query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj")
MLP_PROJECTIONS = ("mlpwi", "mlpwo")
ATTENTION_OUTPUT = "context"
REMAT_POLICIES = (
    None,
    "full",
    "minimal",
    "minimal_with_context",
    "save_dot_except_mlp",
    "save_qkv_proj",
    "minimal_offloaded",
)


def check_policy(name: str | None) -> None:
    """Raises a one-line ``ValueError`` for a name that is not in `REMAT_POLICIES`.

    >>> check_policy("minimal")
    >>> check_policy("minimum")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: remat_policy='minimum' is not a policy; use one of (None, 'full', ...).
    """
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={name!r} is not a policy; use one of {REMAT_POLICIES}.")


def checkpoint_policy(name: str) -> Callable[..., Any] | None:
    """The ``policy`` for ``jax.checkpoint`` / ``nn.remat`` that the named policy is.

    Args:
      name: one of `REMAT_POLICIES` other than None (None means no
        ``jax.checkpoint`` at all: see `is_remat`).

    Returns:
      A `jax.checkpoint_policies` policy, or None for ``"full"`` (``jax.checkpoint``'s
      default: keep nothing).

    >>> checkpoint_policy("full") is None
    True
    >>> f = jax.checkpoint(lambda x: jnp.sin(x) * 2, policy=checkpoint_policy("minimal"))
    >>> float(jax.grad(f)(0.0))
    2.0
    """
    check_policy(name)
    policies = jax.checkpoint_policies
    if name is None:
        raise ValueError("remat_policy=None means no jax.checkpoint; wrap nothing.")
    if name == "full":
        return None
    if name == "minimal":
        return policies.save_only_these_names(*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS)
    if name == "minimal_with_context":
        return policies.save_only_these_names(
            *ATTENTION_PROJECTIONS, *MLP_PROJECTIONS, ATTENTION_OUTPUT
        )
    if name == "save_dot_except_mlp":
        return policies.save_only_these_names(*ATTENTION_PROJECTIONS)
    if name == "save_qkv_proj":
        return policies.save_only_these_names(*ATTENTION_PROJECTIONS[:4])
    return policies.save_and_offload_only_these_names(  # minimal_offloaded
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS],
        offload_src="device",
        offload_dst="pinned_host",
    )


def is_remat(name: str | None) -> bool:
    """Whether the named policy wraps a block in ``jax.checkpoint`` at all.

    >>> is_remat(None), is_remat("full")
    (False, True)
    """
    check_policy(name)
    return name is not None
