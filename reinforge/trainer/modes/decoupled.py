"""The decoupled PPO objective for batches sampled by older weights (one_step_off and async modes).

Three policies: the behaviour policy that sampled each token (its rollout log-probs), the
proximal policy (the trust region's centre) and the current one being updated. The loss is
PPO's clipped ratio current/proximal, weighted per token by the truncated importance weight
proximal/behaviour (``rollout_correction``'s token-level TIS, threshold
``algorithm.rollout_correction.rollout_is_threshold``). The proximal policy is either
recomputed with the weights before the update (``trainer.proximal=recompute``: one forward)
or interpolated in log space per token (``loglinear``: log p_prox = log p_behav + alpha
(log p_cur - log p_behav), alpha = (v_prox - v_behav) / (v_cur - v_behav) in updates; the
actor computes it inside the loss from the ``proximal_alpha`` column).

A batch whose every token was sampled by the current weights (no update since the sync that
made them, all tokens of that version) is on-policy: behaviour = proximal, the weights are 1,
and it trains exactly as the synchronous trainer does.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from reinforge.algorithms import compute_rollout_correction
from reinforge.config.schema import Config
from reinforge.protocol import Batch


def is_fresh(batch: Batch, version: int, updates_since_sync: int) -> bool:
    """True when the weights being updated sampled every token of the batch."""
    valid = batch["response_mask"].bool()
    return updates_since_sync == 0 and bool((batch["token_versions"][valid] == version).all())


def proximal_alpha(token_versions: torch.Tensor, response_mask: torch.Tensor, update_index: int,
                   trigger_sync_steps: int) -> torch.Tensor:
    """alpha per token: (v_prox - v_behav) / (v_cur - v_behav) with versions counted in updates.

    The behaviour weights of version b are those after b x trigger_sync_steps updates; the proximal
    ones are before this update (update_index updates done), the current ones after it.
    """
    behaviour = token_versions.clamp(min=0).double() * trigger_sync_steps
    alpha = (update_index - behaviour) / (update_index + 1 - behaviour)
    return torch.where(response_mask.bool(), alpha, torch.zeros_like(alpha)).float()


def prepare_stale_batch(config: Config, batch: Batch, compute_log_prob, update_index: int,
                        metrics: dict[str, float], trigger_sync_steps: int | None = None) -> Batch:
    """Add what the decoupled loss needs: old_log_probs (proximal) and rollout_is_weights, or proximal_alpha.

    ``trigger_sync_steps``: the updates between two syncs in the calling mode, trainer.trigger_sync_steps when None
    (one_step_off syncs after every update whatever that async key says, and passes 1)."""
    if config.trainer.proximal == "loglinear":
        batch["proximal_alpha"] = proximal_alpha(batch["token_versions"], batch["response_mask"], update_index,
                                                 trigger_sync_steps or config.trainer.trigger_sync_steps)
        return batch
    batch = batch | compute_log_prob(batch)
    correction = config.algorithm.rollout_correction
    weights, keep, correction_metrics = compute_rollout_correction(
        batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"],
        replace(correction, rollout_is=correction.rollout_is or "token"))
    batch["rollout_is_weights"] = weights
    batch["response_mask"] = batch["response_mask"] * keep
    metrics |= correction_metrics
    return batch
