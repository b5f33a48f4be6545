import math

import pytest
import torch

from reinforge.algorithms import compute_advantages
from reinforge.config.schema import AlgorithmConfig


def otb(name, rewards, mask, probs, sum_pi_squared, group_ids=(0, 0), **kwargs):
    return compute_advantages(
        name, token_level_rewards=torch.tensor(rewards), response_mask=torch.tensor(mask),
        group_ids=torch.tensor(group_ids), config=AlgorithmConfig(),
        old_log_probs=torch.log(torch.tensor(probs)), sum_pi_squared=torch.tensor(sum_pi_squared), **kwargs)


# row 0: three tokens, score 1; row 1: two tokens, score 0
REWARDS = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
# w = 1 - 2 pi + sum pi^2: row 0 0.5 each (W = 0.5, 1, 1.5); row 1 0.75, 0.5 (W = 0.75, 1.25)
PROBS = [[0.5, 0.5, 0.5], [0.25, 0.5, 0.9]]
SUM_PI_SQUARED = [[0.5, 0.5, 0.5], [0.25, 0.5, 0.9]]


def test_optimal_token_baseline_by_hand():
    advantages, returns = otb("optimal_token_baseline", REWARDS, MASK, PROBS, SUM_PI_SQUARED)
    first = 0.5 / (0.5 + 0.75 + 1e-8)
    second = 1.0 / (1.0 + 1.25 + 1e-8)
    # position 2: only row 0 is that long, so its baseline is 0 there (not its own return)
    expected = torch.tensor([[1 - first, 1 - second, 1.0], [-first, -second, 0.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_optimal_token_baseline_weighs_the_path_variance_by_squared_importance_weights():
    weights = torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, _ = otb("optimal_token_baseline", REWARDS, MASK, PROBS, SUM_PI_SQUARED, rollout_is_weights=weights)
    # row 0: w = 0.5 * 4, 0.5, 0.5 -> W = 2, 2.5
    torch.testing.assert_close(advantages[0, :2], torch.tensor([1 - 2 / 2.75, 1 - 2.5 / 3.75]))


def test_a_group_of_one_has_no_baseline():
    advantages, returns = otb("optimal_token_baseline", REWARDS, MASK, PROBS, SUM_PI_SQUARED, group_ids=(0, 1))
    torch.testing.assert_close(advantages, returns)


def test_tir_aligns_samples_by_their_valid_tokens():
    # row 0 has a tool token (masked) at position 1; w = 0.5 everywhere
    rewards = [[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    mask = [[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
    probs, sum_pi_squared = [[0.5] * 4] * 2, [[0.5] * 4] * 2
    advantages, returns = otb("tir_optimal_token_baseline", rewards, mask, probs, sum_pi_squared)
    # the k-th valid tokens line up: both rows have W = 0.5, 1, 1.5 and the baseline is 1/2 each time
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.0, 0.5, 0.5], [-0.5, -0.5, -0.5, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
    # aligned by position instead: row 0's W is 0.5, 0.5, 1, 1.5 and position 3 is row 0's alone
    advantages, _ = otb("optimal_token_baseline", rewards, mask, probs, sum_pi_squared)
    expected = torch.tensor([[0.5, 0.0, 1 - 1.0 / 2.5, 0.0], [-0.5, 0.0, -1.0 / 2.5, 0.0]])
    torch.testing.assert_close(advantages, expected)


def test_tir_ignores_samples_without_tokens():
    advantages, returns = otb("tir_optimal_token_baseline", [[0.0, 2.0], [0.0, 0.0]], [[1.0, 1.0], [0.0, 0.0]],
                              [[0.5, 0.5]] * 2, [[0.5, 0.5]] * 2)
    torch.testing.assert_close(advantages, torch.tensor([[2.0, 2.0], [0.0, 0.0]]))
    assert math.isclose(returns[0, 0].item(), 2.0)


def test_needs_sum_pi_squared():
    with pytest.raises(ValueError, match="needs old_log_probs and sum_pi_squared"):
        compute_advantages("optimal_token_baseline", token_level_rewards=torch.zeros(2, 2),
                           response_mask=torch.ones(2, 2), group_ids=torch.tensor([0, 0]), config=AlgorithmConfig())
