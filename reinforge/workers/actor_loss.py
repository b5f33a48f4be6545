"""The actor's loss on one micro-batch: the policy loss (bypass mode's in-loss correction, or the
decoupled PPO loss with a log-linear proximal policy), minus the entropy bonus, plus the KL loss, plus
a mixture-of-experts model's router load-balancing loss where its weight is not 0.

``ActorRolloutWorker.update_actor`` calls it after its forward, inside the engine's update loop;
the normaliser comes from the mini-batch's global counts, so the sum over micro-batches is the
mini-batch's loss whatever the split.
"""

from __future__ import annotations

from torch import Tensor

from reinforge.algorithms import (
    LossNormalizer,
    aggregate_loss,
    compute_bypass_policy_loss,
    compute_policy_loss,
    kl_penalty,
)
from reinforge.algorithms.rollout_correction import compute_importance_weights, parse_is_threshold
from reinforge.config.schema import Config
from reinforge.engine.moe import RouterOutputs
from reinforge.engine.train_step import MiniBatchCounts
from reinforge.protocol import Batch

LINEAR_IN_ADVANTAGE = frozenset({"vanilla", "gspo", "geo_mean", "gpg", "cispo", "sapo", "dppo_tv", "dppo_kl"})
"""Policy losses whose every term is the advantage times something finite: where every advantage of a row is
0, so is its gradient (not dro, whose log-ratio penalty has none; not clip_cov or kl_cov, which pick the tokens
they clip or penalise by statistics over the whole micro-batch)."""


def no_grad_rows(config: Config, batch: Batch, router_aux_loss_coef: float = 0.0) -> Tensor | None:
    """(B,) bool: rows whose loss has no gradient (every response token's advantage 0), when the actor's whole
    loss is linear in the advantage (``actor.skip_zero_advantage_backward``); None where that does not hold
    (a router aux loss of nonzero weight gives every row a gradient)."""
    actor = config.actor
    if (not actor.skip_zero_advantage_backward or actor.use_kl_loss or actor.entropy_coeff != 0
            or router_aux_loss_coef != 0
            or actor.policy_loss.loss_mode not in LINEAR_IN_ADVANTAGE or "advantages" not in batch):
        return None
    return ((batch["advantages"] == 0) | (batch["response_mask"] == 0)).all(dim=-1)


def actor_loss(config: Config, micro: Batch, counts: MiniBatchCounts, log_probs: Tensor, entropy: Tensor,
           on_policy: bool, router: RouterOutputs | None = None, router_aux_loss_coef: float = 0.0
           ) -> tuple[Tensor, dict[str, float | Tensor]]:
    """The actor's loss on one micro-batch and its metrics, from the current ``log_probs`` and ``entropy`` (B, R).

    ``on_policy``: the batch has no old log-probs, the current ones (detached) stand for them. ``router``: the
    MoE routers' statistics of this forward (``engine.moe``); their load-balancing loss, weighted by the
    micro-batch's share of the mini-batch's loss tokens (so the micro-batches sum to the token-weighted mean),
    is ``moe/aux_loss`` and joins the loss times ``router_aux_loss_coef``.
    """
    actor, correction = config.actor, config.algorithm.rollout_correction
    normalizer = LossNormalizer.of_counts(counts, actor.loss_scale_factor)
    mask = micro["response_mask"]
    old_log_probs = log_probs.detach() if on_policy else micro.get("old_log_probs")
    weights = micro.get("rollout_is_weights")
    if "proximal_alpha" in micro:  # decoupled PPO, log-linear proximal policy between behaviour and current
        behaviour = micro["rollout_log_probs"]
        old_log_probs = behaviour + micro["proximal_alpha"] * (log_probs.detach() - behaviour)
        weights = compute_importance_weights(old_log_probs - behaviour, mask.bool(), "token",
                                             parse_is_threshold(correction.rollout_is_threshold))
    if correction.bypass_mode and weights is None:  # an off-policy mode's stale batch has its weights
        pg_loss, pg_metrics = compute_bypass_policy_loss(
            log_probs=log_probs, rollout_log_probs=micro["rollout_log_probs"], advantages=micro["advantages"],
            response_mask=mask, loss_agg_mode=actor.loss_agg_mode, config=actor.policy_loss,
            correction=correction, normalizer=normalizer)
    else:
        pg_loss, pg_metrics = compute_policy_loss(
            actor.policy_loss.loss_mode, old_log_probs=old_log_probs, log_probs=log_probs,
            advantages=micro["advantages"], response_mask=mask, loss_agg_mode=actor.loss_agg_mode,
            config=actor.policy_loss, importance_weights=weights, normalizer=normalizer)
    entropy_loss = aggregate_loss(entropy, mask, actor.loss_agg_mode, normalizer)
    loss = pg_loss - actor.entropy_coeff * entropy_loss
    metrics = {"pg_loss": pg_loss, "entropy": (entropy.detach() * mask).sum() / mask.sum().clamp(min=1),
               **pg_metrics}
    if actor.use_kl_loss:
        kl = kl_penalty(log_probs, micro["ref_log_probs"], actor.kl_loss_type)
        kl_loss = aggregate_loss(kl, mask, actor.loss_agg_mode, normalizer)
        loss = loss + actor.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss
        metrics["kl_coef"] = actor.kl_loss_coef
    if router is not None:
        aux_loss = router.aux_loss * (mask.sum() / max(counts.num_tokens, 1.0))
        if router_aux_loss_coef:
            loss = loss + router_aux_loss_coef * aux_loss
        metrics["moe/aux_loss"] = aux_loss.detach()
        metrics["moe/load_imbalance"] = router.load_imbalance
        metrics["moe/unused_experts"] = router.unused_experts
    return loss, metrics
