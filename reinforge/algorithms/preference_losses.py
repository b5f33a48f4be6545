"""Losses on preference pairs: the reward model's Bradley-Terry loss and DPO's family.

Each function returns one loss per pair; the trainer sums them over its micro-batch and divides by the
mini-batch's number of pairs, so gradient accumulation gives the same update whatever the split.

Bradley-Terry (reward model): ``-log sigmoid(r_chosen - r_rejected - margin)``, plus
``center_coefficient * (r_chosen + r_rejected)^2`` (Eisenstein et al., 2023), which keeps the rewards near 0
without changing which completion wins; TRL's RewardTrainer adds the mean of the same term.

DPO (Rafailov et al., 2023), with ``delta = (logp_c - ref_c) - (logp_r - ref_r)``, the log-probs summed over
each completion's tokens:

- ``sigmoid``: ``-log sigmoid(beta * delta)``. ``label_smoothing`` is not read: TRL's sigmoid loss has
  ignored it since its 0.29 (conservative DPO is the ``robust`` loss's job here);
- ``ipo`` (Azar et al., 2023): ``(delta - 1 / (2 beta))^2`` with each log-prob divided by its completion's
  length (the caller passes per-token means), as TRL does;
- ``hinge`` (SLiC): ``relu(1 - beta * delta)``;
- ``robust`` (Chowdhury et al., 2024): ``((1 - e) * -log sigmoid(beta * delta) + e * log sigmoid(-beta *
  delta)) / (1 - 2e)`` with ``e = label_smoothing``, the fraction of pairs assumed mislabelled; an unbiased
  estimate of the clean loss, equal to ``sigmoid`` at ``e = 0``.

The implicit rewards ``beta * (logp - ref)`` of each side are returned for the metrics.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, margins: Tensor | None = None,
                       center_coefficient: float = 0.0) -> Tensor:
    """Per-pair loss (P,) of a reward model that should score the chosen completion higher.

    chosen_rewards, rejected_rewards, margins: (P,)
    """
    difference = chosen_rewards - rejected_rewards
    if margins is not None:
        difference = difference - margins
    loss = -F.logsigmoid(difference)
    if center_coefficient:
        loss = loss + center_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return loss


def dpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, reference_chosen_logps: Tensor,
             reference_rejected_logps: Tensor, *, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(per-pair loss (P,), chosen rewards (P,), rejected rewards (P,)); every input (P,).

    The log-probs are sums over each completion's tokens (per-token means for ``ipo``).
    """
    chosen_ratio = chosen_logps - reference_chosen_logps
    rejected_ratio = rejected_logps - reference_rejected_logps
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        loss = -F.logsigmoid(beta * delta)
    elif loss_type == "ipo":
        loss = (delta - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "hinge":
        loss = F.relu(1.0 - beta * delta)
    elif loss_type == "robust":
        loss = ((1.0 - label_smoothing) * -F.logsigmoid(beta * delta)
                + label_smoothing * F.logsigmoid(-beta * delta)) / (1.0 - 2.0 * label_smoothing)
    else:
        raise ValueError(f"dpo.loss_type={loss_type!r} is not one of sigmoid, ipo, hinge, robust")
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
