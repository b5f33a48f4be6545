import math

import pytest
import torch

from reinforge.algorithms import ROLLOUT_RS_RULES, compute_rollout_correction
from reinforge.config.schema import RolloutCorrectionConfig

# log rho = old - rollout: row 0 = [log 3, log 0.5, 0], row 1 = [log 1.2, log 1.2, (masked) log 100]
ROLLOUT_LOG_PROBS = torch.full((2, 3), -2.0)
OLD_LOG_PROBS = ROLLOUT_LOG_PROBS + torch.tensor(
    [[math.log(3.0), math.log(0.5), 0.0], [math.log(1.2), math.log(1.2), math.log(100.0)]]
)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def correct(**config):
    return compute_rollout_correction(OLD_LOG_PROBS, ROLLOUT_LOG_PROBS, MASK, RolloutCorrectionConfig(**config))


def test_token_importance_weights_are_truncated():
    weights, keep_mask, metrics = correct(rollout_is="token", rollout_is_threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 1.0], [1.2, 1.2, 0.0]]))
    torch.testing.assert_close(keep_mask, MASK)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx((2.0 + 0.5 + 1.0 + 1.2 + 1.2) / 5)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert metrics["rollout_corr/rollout_is_truncated_fraction"] == pytest.approx(1 / 5)
    assert not weights.requires_grad


def test_sequence_importance_weights_use_the_product():
    weights, _, _ = correct(rollout_is="sequence", rollout_is_threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.5, 1.5], [1.44, 1.44, 0.0]]))


def test_no_correction_by_default():
    weights, keep_mask, metrics = correct()
    assert weights is None
    torch.testing.assert_close(keep_mask, MASK)
    expected_kl = -(math.log(3.0) + math.log(0.5) + 2 * math.log(1.2)) / 5
    assert metrics["rollout_corr/kl"] == pytest.approx(expected_kl, rel=1e-5)


@pytest.mark.parametrize(
    ("rules", "threshold", "expected_keep"),
    [
        # |log 3| > log 2 is rejected; |log 0.5| = log 2 is kept
        ("token_k1", 2.0, [[0, 1, 1], [1, 1, 0]]),
        # row sums: log 1.5 and log 1.44, both inside [1/1.45, 1.45] except the first
        ("seq_sum_k1", 1.45, [[0, 0, 0], [1, 1, 0]]),
        # geometric means: 1.5^(1/3) = 1.14 and 1.2
        ("seq_mean_k1", 1.15, [[1, 1, 1], [0, 0, 0]]),
        # k2 of log 3 is 0.60; of log 0.5 is 0.24
        ("token_k2", 0.5, [[0, 1, 1], [1, 1, 0]]),
        ("seq_max_k2", 0.5, [[0, 0, 0], [1, 1, 0]]),
        # k3 of log 3 = 3 - 1 - log 3 = 0.90; of log 0.5 = 0.19; of log 1.2 = 0.018
        ("token_k3", 0.1, [[0, 0, 1], [1, 1, 0]]),
        ("seq_sum_k3", 1.0, [[0, 0, 0], [1, 1, 0]]),
        ("seq_mean_k3", 0.3, [[0, 0, 0], [1, 1, 0]]),
        ("seq_max_k3", 0.95, [[1, 1, 1], [1, 1, 0]]),
        ("token_k1, seq_mean_k1", 1.15, [[0, 0, 1], [0, 0, 0]]),
    ],
)
def test_rejection_rules_by_hand(rules, threshold, expected_keep):
    _, keep_mask, metrics = correct(rollout_rs=rules, rollout_rs_threshold=threshold)
    torch.testing.assert_close(keep_mask, torch.tensor(expected_keep, dtype=torch.float32))
    rejected_tokens = 5 - sum(map(sum, expected_keep))
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected_tokens / 5)


def test_every_rule_has_a_masked_fraction_metric():
    _, _, metrics = correct(rollout_rs=",".join(ROLLOUT_RS_RULES), rollout_rs_threshold=1.5)
    for rule in ROLLOUT_RS_RULES:
        assert f"rollout_corr/rollout_rs_{rule}_masked_fraction" in metrics


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="token_k1, token_k2"):
        correct(rollout_rs="token_k4")
    with pytest.raises(ValueError, match="must exceed 1"):
        correct(rollout_rs="token_k1", rollout_rs_threshold=0.5)
    with pytest.raises(ValueError, match="token, sequence or null"):
        correct(rollout_is="geometric")
