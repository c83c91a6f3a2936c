"""TRL's own preference losses, run on given per-token log-probabilities.

TRL computes its losses inside trainer methods: `DPOTrainer._compute_loss` (which
runs the model, then the loss and its logged metrics) and the CPO trainer's
`cpo_loss` (sequence log-probabilities -> losses). Here they run as they are, on a
stand-in for the trainer's few attributes and a stand-in model whose output is the
log-probabilities we give: TRL's code computes the loss, its gradient (torch's
autograd) and the metrics it logs.
"""

from __future__ import annotations

import collections
import types

import torch


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def dpo(
    loss_type: str, token_logps, completion_mask, ref_chosen, ref_rejected, *, beta: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """`trl.DPOTrainer._compute_loss` with precomputed reference log-probabilities.

    Args:
      loss_type: TRL's ``loss_type`` (``"sigmoid"``, ``"ipo"``).
      token_logps: ``[2B, T - 1]`` torch tensor (requires grad): each next token's
        log-probability, rows ``[chosen..., rejected...]`` as TRL concatenates them.
      completion_mask: ``[2B, T]`` 0/1, the completion's tokens (TRL's layout: its
        shift ``[:, 1:]`` marks the predicted ones).
      ref_chosen, ref_rejected: ``[B]`` the reference's sequence log-probabilities.
      beta: DPO's beta.

    Returns:
      The loss (a torch scalar) and the metrics TRL logs (name -> value).
    """
    from trl import DPOTrainer

    mask = torch.as_tensor(completion_mask)
    logged = collections.defaultdict(lambda: collections.defaultdict(list))
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_Accelerator(),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=0.0, use_weighting=False, _metrics=logged, _total_train_tokens=0,
        _tp_size=1,
    )  # fmt: skip
    zeros = torch.zeros_like(token_logps.detach())

    def model(**kwargs):
        return types.SimpleNamespace(
            log_probs=token_logps * mask[:, 1:], entropy=zeros, mean_logits=zeros,
            is_top1=zeros.bool(),
        )  # fmt: skip

    inputs = {
        "input_ids": torch.zeros(mask.shape, dtype=torch.long), "attention_mask": mask,
        "completion_mask": mask, "ref_chosen_logps": torch.as_tensor(ref_chosen),
        "ref_rejected_logps": torch.as_tensor(ref_rejected),
    }  # fmt: skip
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return loss, {name: values[-1] for name, values in logged["train"].items()}


def cpo(
    loss_type: str, chosen_logps, rejected_logps, *, beta: float, label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The CPO trainer's ``cpo_loss`` (``"sigmoid"``, ``"simpo"``; AlphaPO off): per-pair
    losses and rewards of the given sequence log-probabilities."""
    from trl.experimental.cpo import CPOTrainer

    trainer = types.SimpleNamespace(
        alpha=0.0, beta=beta, label_smoothing=label_smoothing, loss_type=loss_type,
        simpo_gamma=simpo_gamma, accelerator=_Accelerator(),
    )  # fmt: skip
    return CPOTrainer.cpo_loss(trainer, chosen_logps, rejected_logps)
