"""Pure RL algorithm functions: advantages, policy and value losses, KL, aggregation, rollout correction.

Nothing here does I/O or talks to other processes; every function maps tensors to tensors.
"""

from reinforge.algorithms import (  # noqa: F401  (they register)
    covariance_policy_losses,
    sequence_policy_losses,
    token_baseline_advantages,
)
from reinforge.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    group_statistics,
    register_advantage,
)
from reinforge.algorithms.aggregation import LOSS_AGG_MODES, LossNormalizer, aggregate_loss
from reinforge.algorithms.bypass_policy_loss import BYPASS_LOSS_TYPES, compute_bypass_policy_loss
from reinforge.algorithms.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATOR_ALIASES,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
    register_kl_estimator,
)
from reinforge.algorithms.logits import entropy_from_logits, log_probs_from_logits
from reinforge.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from reinforge.algorithms.policy_losses import POLICY_LOSSES, clip_bounds, compute_policy_loss, register_policy_loss
from reinforge.algorithms.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_RULES,
    compute_importance_weights,
    compute_rejection,
    compute_rollout_correction,
    normalize_importance_weights,
    parse_is_threshold,
    parse_rejection_rules,
)
from reinforge.algorithms.value_loss import compute_value_loss

__all__ = [
    "BYPASS_LOSS_TYPES",
    "ADVANTAGE_ESTIMATORS",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "KL_ESTIMATOR_ALIASES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_RULES",
    "AdaptiveKLController",
    "FixedKLController",
    "LossNormalizer",
    "aggregate_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "clip_bounds",
    "compute_advantages",
    "compute_bypass_policy_loss",
    "compute_importance_weights",
    "compute_policy_loss",
    "compute_rejection",
    "compute_rollout_correction",
    "compute_value_loss",
    "entropy_from_logits",
    "group_statistics",
    "kl_penalty",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "normalize_importance_weights",
    "parse_is_threshold",
    "parse_rejection_rules",
    "register_advantage",
    "register_kl_estimator",
    "register_policy_loss",
]
