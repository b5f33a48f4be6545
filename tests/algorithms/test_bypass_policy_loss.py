import math

import pytest
import torch

from reinforge.algorithms import compute_bypass_policy_loss, compute_policy_loss
from reinforge.config.schema import PolicyLossConfig, RolloutCorrectionConfig

# current log-probs -1, -1; rollout -26, -1.5: log-ratios 25 and 0.5
ROLLOUT = torch.tensor([[-26.0, -1.5]], dtype=torch.float64)


def bypass(advantages, **correction):
    log_probs = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = compute_bypass_policy_loss(
        log_probs=log_probs, rollout_log_probs=ROLLOUT, advantages=torch.tensor([advantages], dtype=torch.float64),
        response_mask=torch.ones(1, 2), loss_agg_mode="token-mean", config=PolicyLossConfig(),
        correction=RolloutCorrectionConfig(bypass_mode=True, **correction))
    loss.backward()
    return loss.item(), metrics, log_probs.grad


def test_reinforce_applies_truncated_weights_from_the_current_policy():
    loss, metrics, grad = bypass([-1.0, 1.0], loss_type="reinforce", rollout_is="token", rollout_is_threshold="2.0")
    # w = min(e^25 bounded to e^20, 2) = 2 and e^0.5; loss = -A w log pi, token-mean
    weight = math.exp(0.5)
    assert loss == pytest.approx((-2.0 + weight) / 2)
    torch.testing.assert_close(grad, torch.tensor([[1.0, -weight / 2]], dtype=torch.float64))
    assert float(metrics["ppo_kl"]) == pytest.approx(-25.5 / 2)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(2.0)


def test_reinforce_drops_rejected_tokens():
    loss, metrics, grad = bypass([-1.0, 1.0], loss_type="reinforce", rollout_rs="token_k1", rollout_rs_threshold="2.0")
    # the log-ratio-25 token is rejected; no rollout_is: w = 1 on the kept token
    assert loss == pytest.approx(1.0)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.0]], dtype=torch.float64))
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)


def test_ppo_clip_is_vanilla_against_the_rollout_policy_without_weights():
    loss, metrics, grad = bypass([-1.0, 1.0], rollout_is="token", rollout_is_threshold="2.0")
    log_probs = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    expected, _ = compute_policy_loss(
        "vanilla", old_log_probs=ROLLOUT, log_probs=log_probs, advantages=torch.tensor([[-1.0, 1.0]]),
        response_mask=torch.ones(1, 2), loss_agg_mode="token-mean", config=PolicyLossConfig())
    expected.backward()
    # dual clip 3 on the first token, clip 1.2 on the second: (3 - 1.2) / 2, no gradient
    assert loss == pytest.approx(expected.item()) == pytest.approx((3.0 - 1.2) / 2)
    torch.testing.assert_close(grad, log_probs.grad)
    assert "rollout_corr/rollout_is_mean" in metrics


def test_unknown_loss_type():
    with pytest.raises(ValueError, match="loss_type='pg' is unknown; use ppo_clip or reinforce"):
        bypass([1.0, 1.0], loss_type="pg")
