"""How far the rollout engine's token probabilities are from the trainer's recomputed ones.

Engines and trainers compute the same distribution with different kernels and precisions;
the gap biases the policy gradient (see rollout correction in reinforge.algorithms).
"""

from __future__ import annotations

import torch
from torch import Tensor


def rollout_mismatch_metrics(training_log_probs: Tensor, rollout_log_probs: Tensor,
                             response_mask: Tensor) -> dict[str, float]:
    """Mean/max |p_rollout - p_train| over valid tokens, the same of |log p_rollout - log p_train| (which keeps
    its scale where the probabilities are all small, as for a model that has not learnt its vocabulary yet), and
    the Pearson correlation of the probabilities."""
    valid = response_mask.bool()
    if not valid.any():
        return {}
    train_valid, rollout_valid = training_log_probs.float()[valid], rollout_log_probs.float()[valid]
    train_probs, rollout_probs = train_valid.exp(), rollout_valid.exp()
    difference = (train_probs - rollout_probs).abs()
    log_difference = (train_valid - rollout_valid).abs()
    metrics = {"training/rollout_probs_diff_mean": float(difference.mean()),
               "training/rollout_probs_diff_max": float(difference.max()),
               "training/rollout_log_probs_diff_mean": float(log_difference.mean()),
               "training/rollout_log_probs_diff_max": float(log_difference.max())}
    if train_probs.numel() > 1 and train_probs.std() > 0 and rollout_probs.std() > 0:
        stacked = torch.stack([train_probs, rollout_probs])
        metrics["training/rollout_actor_probs_pearson_corr"] = float(torch.corrcoef(stacked)[0, 1])
    return metrics
