"""Preference losses on the sequence log-probabilities of chosen and rejected responses.

A preference batch (``preferences/...`` data, `experiments.datasets.chat`) packs pairs:
in each window, pair ``p``'s chosen sequence is segment ``2p + 1`` and its rejected one
segment ``2p + 2``, the response tokens weighted 1. `pair_logps` sums each sequence's
per-token log-probabilities over its response (`sequence_sums`: a segment sum, so
packed pairs equal pairs run alone), and `losses` turns a pair's sums into its loss
and its TRL-named rewards:

* ``dpo`` (Rafailov et al. 2023, sigmoid): ``-log sigmoid(beta * delta)`` with
  ``delta = (chosen - ref_chosen) - (rejected - ref_rejected)``; with
  ``label_smoothing`` e, conservative DPO: ``-(1 - e) log sigmoid(beta delta) - e log
  sigmoid(-beta delta)`` (TRL's ``DPOTrainer`` loss ``sigmoid`` at e = 0; its
  ``CPOTrainer`` ``sigmoid`` on the same log-ratios for e > 0).
* ``ipo`` (Azar et al. 2023): ``(delta_avg - 1 / (2 beta))**2``, the log-ratios
  averaged over each response's tokens (TRL's ``ipo``, which its authors confirmed).
* ``simpo`` (Meng et al. 2024), reference-free: ``-log sigmoid(beta (avg_chosen -
  avg_rejected) - gamma)``, smoothed as DPO (TRL's ``CPOTrainer`` ``simpo``, with
  ``cpo_alpha=0``).

The rewards are TRL's: ``beta`` x the log-ratio of each response (DPO, IPO), or ``beta``
x its average log-probability (SimPO); ``logps/chosen`` and ``logps/rejected`` are the
sequences' log-probabilities (summed; averaged per token for SimPO, as TRL's CPO trainer
logs them), and, with a reference, ``logps/ref_chosen`` and ``logps/ref_rejected`` the
reference's, so that ``rewards/chosen = beta * (logps/chosen - logps/ref_chosen)`` can
be checked from the records. Every value a step returns is a sum over the batch's
pairs, so means are exact on any mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

REFERENCE_FREE = ("simpo",)
METRIC_NAMES = (
    "loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
    "logps/chosen", "logps/rejected",
)  # fmt: skip


class PairLogps(NamedTuple):
    """Each pair's chosen and rejected sequence log-probabilities ``[B, P]`` (summed over
    the response), their response lengths, and which pairs are real (``valid``)."""

    chosen: jax.Array
    rejected: jax.Array
    chosen_tokens: jax.Array
    rejected_tokens: jax.Array
    valid: jax.Array


def sequence_sums(values_BxT: jax.Array, segments_BxT: jax.Array) -> jax.Array:
    """``values`` summed per segment of each row: ``[B, T + 1]``, column ``s`` segment ``s``
    (segment 0, padding, included).

    >>> sequence_sums(jnp.array([[1.0, 2.0, 4.0]]), jnp.array([[1, 1, 2]])).tolist()
    [[0.0, 3.0, 4.0, 0.0]]
    """
    count = segments_BxT.shape[1] + 1
    one_row = lambda v, s: jax.ops.segment_sum(v, s, num_segments=count)  # noqa: E731
    return jax.vmap(one_row)(values_BxT, segments_BxT)


def pair_logps(token_logps_BxT: jax.Array, weights_BxT: jax.Array, segments_BxT: jax.Array):
    """The `PairLogps` of a packed preference batch.

    Args:
      token_logps_BxT: each target token's log-probability.
      weights_BxT: 1 where the target is a response token, else 0.
      segments_BxT: each target's segment (``2p + 1`` chosen, ``2p + 2`` rejected; 0 none).

    >>> logps = jnp.array([[-1.0, -2.0, -3.0, -4.0]])
    >>> out = pair_logps(logps, jnp.ones((1, 4)), jnp.array([[1, 1, 2, 2]]))
    >>> out.chosen[0, 0].item(), out.rejected[0, 0].item(), out.valid[0].tolist()[:2]
    (-3.0, -7.0, [True, False])
    """
    logps = sequence_sums(token_logps_BxT * weights_BxT, segments_BxT)
    tokens = sequence_sums(weights_BxT.astype(jnp.float32), segments_BxT)
    pairs = (logps.shape[1] - 1) // 2
    chosen, rejected = logps[:, 1 : 2 * pairs : 2], logps[:, 2 : 2 * pairs + 1 : 2]
    n_chosen, n_rejected = tokens[:, 1 : 2 * pairs : 2], tokens[:, 2 : 2 * pairs + 1 : 2]
    return PairLogps(chosen, rejected, n_chosen, n_rejected, (n_chosen > 0) & (n_rejected > 0))


def _smoothed(logits: jax.Array, label_smoothing: float) -> jax.Array:
    """``-(1 - e) log sigmoid(x) - e log sigmoid(-x)``."""
    e = label_smoothing
    return -(1 - e) * jax.nn.log_sigmoid(logits) - e * jax.nn.log_sigmoid(-logits)


def losses(
    objective: str,
    policy: PairLogps,
    reference: PairLogps | None,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Each pair's loss ``[B, P]`` (0 where not ``valid``), and the TRL-named values per
    pair (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
    ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``).

    Args:
      objective: ``"dpo"``, ``"ipo"`` or ``"simpo"`` (the module docstring's).
      policy: the trained model's `PairLogps`.
      reference: the reference model's (None for ``simpo``).
      beta: the loss's beta (IPO's regularisation 1 / (2 beta)).
      label_smoothing: DPO's and SimPO's chance of a flipped label.
      gamma: SimPO's target margin.

    >>> zero = PairLogps(*(jnp.zeros((1, 1)),) * 4, jnp.ones((1, 1), bool))
    >>> loss, values = losses("dpo", zero, zero, beta=0.1)
    >>> round(loss.item(), 6), values["rewards/accuracies"].item()  # log 2 at the start
    (0.693147, 0.0)
    """
    valid = policy.valid
    tokens_c = jnp.maximum(policy.chosen_tokens, 1.0)
    tokens_r = jnp.maximum(policy.rejected_tokens, 1.0)
    if objective == "simpo":
        avg_c, avg_r = policy.chosen / tokens_c, policy.rejected / tokens_r
        loss = _smoothed(beta * (avg_c - avg_r) - gamma, label_smoothing)
        reward_c, reward_r = beta * avg_c, beta * avg_r
        logps_c, logps_r = avg_c, avg_r
    else:
        if reference is None:
            raise ValueError(f"objective={objective!r} needs the reference model's logps.")
        ratio_c, ratio_r = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        if objective == "dpo":
            loss = _smoothed(beta * (ratio_c - ratio_r), label_smoothing)
        elif objective == "ipo":
            loss = (ratio_c / tokens_c - ratio_r / tokens_r - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(f"objective={objective!r}: use 'dpo', 'ipo' or 'simpo'.")
        reward_c, reward_r = beta * ratio_c, beta * ratio_r
        logps_c, logps_r = policy.chosen, policy.rejected
    zero = lambda x: jnp.where(valid, x, 0.0)  # noqa: E731  (not x * valid: 0 * inf is nan)
    values = {
        "rewards/chosen": reward_c,
        "rewards/rejected": reward_r,
        "rewards/margins": reward_c - reward_r,
        "rewards/accuracies": (reward_c > reward_r).astype(jnp.float32),
        "logps/chosen": logps_c,
        "logps/rejected": logps_r,
    }
    if reference is not None:  # (beyond TRL's names: the rewards recomputed from the logs)
        values.update(
            {"logps/ref_chosen": reference.chosen, "logps/ref_rejected": reference.rejected}
        )
    return zero(loss), {k: jax.lax.stop_gradient(zero(v)) for k, v in values.items()}


def summarize(sums: Any) -> dict[str, float]:
    """A preference step's (or eval's) sums -> means per pair, and the pairs and response
    tokens counted.

    >>> summarize({"loss": 2.0, "pairs": 4.0, "tokens": 40.0, "rewards/margins": 1.0})
    {'loss': 0.5, 'rewards/margins': 0.25, 'pairs': 4, 'trained_tokens': 40}
    """
    pairs = float(sums["pairs"])
    out = {
        name: float(value) / pairs if pairs else float("nan")
        for name, value in sums.items()
        if name not in ("pairs", "tokens")
    }
    return {**out, "pairs": int(pairs), "trained_tokens": int(float(sums["tokens"]))}
