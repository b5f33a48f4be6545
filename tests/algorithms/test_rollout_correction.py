import math

import pytest
import torch

from reinforge.algorithms import ROLLOUT_RS_RULES, compute_importance_weights, compute_rollout_correction
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


def test_sequence_rollout_is_max_is_the_weight_before_truncation():
    # row products 1.5 and 1.44, both truncated to 1.2; verl reports the larger raw one
    _, _, metrics = correct(rollout_is="sequence", rollout_is_threshold=1.2)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(1.5, rel=1e-5)
    # IcePop zeroes both rows outside [0.5, 1.2]; the maximum is still the raw 1.5
    _, _, metrics = correct(rollout_is="sequence", rollout_is_threshold="0.5_1.2")
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(1.5, rel=1e-5)


def test_sequence_rollout_is_max_is_bounded_at_exp_20():
    old = ROLLOUT_LOG_PROBS + torch.tensor([[15.0, 10.0, 0.0], [0.0, 0.0, 0.0]])
    _, _, metrics = compute_rollout_correction(old, ROLLOUT_LOG_PROBS, MASK,
                                               RolloutCorrectionConfig(rollout_is="sequence"))
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(20.0), rel=1e-5)


def test_k3_kl_does_not_bound_the_log_ratio():
    # one token with log rho = 25 (k3 = e^25 - 26), one with log rho = 0 (k3 = 0): verl's unbounded mean
    old = torch.tensor([[23.0, -2.0]])
    metrics = compute_rollout_correction(old, torch.full((1, 2), -2.0), torch.ones(1, 2),
                                         RolloutCorrectionConfig())[2]
    assert metrics["rollout_corr/k3_kl"] == pytest.approx((math.exp(25.0) - 26.0) / 2, rel=1e-5)


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
    with pytest.raises(ValueError, match="must be at least 1 for token_k1.*or write lower_upper"):
        correct(rollout_rs="token_k1", rollout_rs_threshold=0.5)
    with pytest.raises(ValueError, match=r"has 3 values for 2 rules \(token_k1, seq_sum_k2\)"):
        correct(rollout_rs="token_k1,seq_sum_k2", rollout_rs_threshold="2.0,0.5,0.7")
    with pytest.raises(ValueError, match=r"\(seq_sum_k2\)='0.8_1.25': this rule takes one upper bound"):
        correct(rollout_rs="seq_sum_k2", rollout_rs_threshold="0.8_1.25")
    with pytest.raises(ValueError, match="lower bound above its upper bound"):
        correct(rollout_is="token", rollout_is_threshold="5.0_0.5")
    with pytest.raises(ValueError, match="holds 'x', which is not a positive number"):
        correct(rollout_is="token", rollout_is_threshold="0.5_x")
    with pytest.raises(ValueError, match="token, sequence or null"):
        correct(rollout_is="geometric")


def test_importance_weights_ignore_masked_log_ratios_when_called_directly():
    log_ratio = OLD_LOG_PROBS - ROLLOUT_LOG_PROBS  # the masked token holds log 100
    weights = compute_importance_weights(log_ratio, MASK, "sequence", 10.0)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.5, 1.5], [1.44, 1.44, 0.0]]))


def test_icepop_zeroes_weights_outside_the_band():
    # token ratios 3, 0.5, 1 | 1.2, 1.2: inside [0.6, 2.5] they stay as they are (no truncation)
    weights, keep_mask, metrics = correct(rollout_is="token", rollout_is_threshold="0.6_2.5")
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0, 1.0], [1.2, 1.2, 0.0]]))
    torch.testing.assert_close(keep_mask, MASK)
    assert metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 5)
    # sequence products 1.5 and 1.44 against [0.6, 1.45]
    weights, _, _ = correct(rollout_is="sequence", rollout_is_threshold="0.6_1.45")
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0, 0.0], [1.44, 1.44, 0.0]]))


def test_batch_normalized_weights_average_one():
    weights, _, metrics = correct(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    mean = (2.0 + 0.5 + 1.0 + 1.2 + 1.2) / 5
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 1.0], [1.2, 1.2, 0.0]]) / mean)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(mean)  # before normalising, as verl
    # at sequence level the mean is over sequences, not tokens: (1.5 + 1.44) / 2
    weights, _, _ = correct(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.5, 1.5], [1.44, 1.44, 0.0]]) / 1.47)


@pytest.mark.parametrize(("threshold", "expected_keep"), [
    # k1 bounds pi_rollout / pi_train = 1/3, 2, 1 | 1/1.2, 1/1.2 (verl's convention)
    ("0.8_2.5", [[0, 1, 1], [1, 1, 0]]),
    ("0.3_0.9", [[1, 0, 0], [1, 1, 0]]),
    ("2.0", [[0, 1, 1], [1, 1, 0]]),  # one number: [1/2, 2]
])
def test_asymmetric_k1_thresholds(threshold, expected_keep):
    _, keep_mask, _ = correct(rollout_rs="token_k1", rollout_rs_threshold=threshold)
    torch.testing.assert_close(keep_mask, torch.tensor(expected_keep, dtype=torch.float32))


def test_each_rule_can_have_its_own_threshold():
    # token_k2 <= 0.5 rejects log 3 (0.60); seq_mean_k1 in [0.85, 1]: exp(-mean log rho) is 1.5^(-1/3) = 0.874
    # for row 0 and 1/1.2 = 0.833 for row 1
    _, keep_mask, metrics = correct(rollout_rs="token_k2,seq_mean_k1", rollout_rs_threshold="0.5,0.85_1.0")
    torch.testing.assert_close(keep_mask, torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert metrics["rollout_corr/rollout_rs_token_k2_masked_fraction"] == pytest.approx(1 / 5)
    assert metrics["rollout_corr/rollout_rs_seq_mean_k1_masked_fraction"] == pytest.approx(2 / 5)


def test_verls_weight_metrics_are_reported_under_its_names():
    """rollout_is_ratio_fraction_{high,low}, rollout_is_seq_* and each rule's rows (verl's dashboards read them)."""
    _, _, metrics = correct(rollout_is="token", rollout_is_threshold=1.4, rollout_rs="token_k1",
                            rollout_rs_threshold=2.5)
    # raw weights [3, 0.5, 1 | 1.2, 1.2]: 3 above 1.4, 0.5 below 1 / 1.4; applied rows [1.4, 0.5, 1] and [1.2, 1.2]
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)
    assert metrics["rollout_corr/rollout_is_seq_mean"] == pytest.approx((2.9 / 3 + 1.2) / 2, rel=1e-5)
    assert metrics["rollout_corr/rollout_is_seq_max"] == pytest.approx(1.2, rel=1e-5)
    assert metrics["rollout_corr/rollout_is_seq_min"] == pytest.approx(2.9 / 3, rel=1e-5)
    assert metrics["rollout_corr/rollout_is_seq_std"] == pytest.approx((1.2 - 2.9 / 3) / math.sqrt(2), rel=1e-4)
    assert metrics["rollout_corr/rollout_is_seq_max_deviation"] == pytest.approx(0.2, rel=1e-4)
    assert metrics["rollout_corr/rollout_is_seq_fraction_high"] == 0.5  # raw row means 1.5 and 1.2
    assert metrics["rollout_corr/rollout_is_seq_fraction_low"] == 0.0
    assert metrics["rollout_corr/rollout_rs_token_k1_seq_masked_fraction"] == 0.5  # 1/3 < 1/2.5 in row 0 only
    _, _, metrics = correct(rollout_is="sequence", rollout_is_threshold=1.4)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 1.0  # row products 1.5 and 1.44
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == 0.0
