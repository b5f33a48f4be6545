import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reinforge.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages, masked_whiten
from reinforge.config.schema import AlgorithmConfig


def outcome_rewards(scores, lengths, response_len=4):
    """One row per score, the score on the row's last valid token."""
    rewards = torch.zeros(len(scores), response_len)
    mask = torch.zeros(len(scores), response_len)
    for row, (score, length) in enumerate(zip(scores, lengths, strict=True)):
        mask[row, :length] = 1
        rewards[row, length - 1] = score
    return rewards, mask


def run(name, scores, group_ids, lengths=None, config=None, **kwargs):
    lengths = lengths or [4] * len(scores)
    rewards, mask = outcome_rewards(scores, lengths)
    return compute_advantages(
        name,
        token_level_rewards=rewards,
        response_mask=mask,
        group_ids=torch.tensor(group_ids),
        config=config or AlgorithmConfig(),
        **kwargs,
    ), mask


def per_row(advantages):
    return advantages[:, 0]


def test_grpo_by_hand():
    (advantages, returns), mask = run(
        "grpo", [1.0, 0.0, 2.0, 3.0, 1.0, 2.0], [0, 0, 1, 2, 2, 2], lengths=[1, 2, 3, 4, 4, 4]
    )
    std_0 = math.sqrt(0.5)
    expected = torch.tensor(
        [0.5 / (std_0 + 1e-6), -0.5 / (std_0 + 1e-6), 2 / (1 + 1e-6), 1 / (1 + 1e-6), -1 / (1 + 1e-6), 0.0]
    )
    torch.testing.assert_close(per_row(advantages), expected)
    torch.testing.assert_close(advantages, expected.unsqueeze(-1) * mask)
    assert returns is advantages


def test_grpo_epsilon_is_configurable():
    (advantages, _), _ = run("grpo", [1.0, 0.0], [0, 0], config=AlgorithmConfig(grpo_epsilon=0.5))
    std = math.sqrt(0.5)
    torch.testing.assert_close(per_row(advantages), torch.tensor([0.5 / (std + 0.5), -0.5 / (std + 0.5)]))
    (advantages, _), _ = run("grpo_passk", [1.0, 3.0], [0, 0], config=AlgorithmConfig(grpo_epsilon=0.5))
    torch.testing.assert_close(per_row(advantages), torch.tensor([0.0, 2.0 / (math.sqrt(2.0) + 0.5)]))


def test_gdpo_normalises_each_reward_then_whitens_their_weighted_sum():
    config = AlgorithmConfig(gdpo_reward_keys=["format", "acc"], gdpo_reward_weights=[1.0, 2.0])
    components = {"format": torch.tensor([1.0, 0.0, 1.0, 1.0]), "acc": torch.tensor([0.0, 0.0, 2.0, 0.0])}
    (advantages, returns), mask = run("gdpo", [9.0, 9.0, 9.0, 9.0], [0, 0, 1, 1], lengths=[2, 2, 2, 2],
                                      config=config, reward_components=components)
    # format: group 0 -> +-0.5 / (sqrt(0.5) + 1e-6), group 1 has std 0 -> 0; acc: group 1 -> +-1 / (sqrt(2) + 1e-6)
    unit = 0.5 / (math.sqrt(0.5) + 1e-6)
    acc = 1.0 / (math.sqrt(2.0) + 1e-6)
    summed = torch.tensor([unit, -unit, 2 * acc, -2 * acc])
    # whitened over the 8 valid tokens (two per row): mean 0, Bessel variance
    variance = 2 * summed.square().sum() / 7
    torch.testing.assert_close(per_row(advantages), summed / torch.sqrt(variance + 1e-8))
    torch.testing.assert_close(advantages, per_row(advantages).unsqueeze(-1) * mask)
    assert returns is advantages
    with pytest.raises(ValueError, match=r"the scorer returned no 'acc' \(algorithm.gdpo_reward_keys\); it returned format"):
        run("gdpo", [1.0, 0.0], [0, 0], config=config, reward_components={"format": torch.tensor([1.0, 0.0])})
    with pytest.raises(ValueError, match="needs algorithm.gdpo_reward_keys"):
        run("gdpo", [1.0, 0.0], [0, 0])


def test_dr_grpo_skips_the_std():
    (advantages, _), _ = run("grpo", [1.0, 0.0, 4.0, 2.0], [7, 7, 3, 3], config=AlgorithmConfig(norm_adv_by_std=False))
    torch.testing.assert_close(per_row(advantages), torch.tensor([0.5, -0.5, 1.0, -1.0]))


def test_grpo_passk_by_hand():
    (advantages, _), _ = run("grpo_passk", [1.0, 3.0, 2.0, 5.0, 5.0], [0, 0, 0, 1, 1])
    torch.testing.assert_close(per_row(advantages), torch.tensor([0.0, 1 / (1 + 1e-6), 0.0, 0.0, 0.0]))
    (advantages, _), _ = run("grpo_passk", [1.0, 3.0, 2.0], [0, 0, 0], config=AlgorithmConfig(norm_adv_by_std=False))
    torch.testing.assert_close(per_row(advantages), torch.tensor([0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        run("grpo_passk", [1.0, 3.0, 2.0], [0, 0, 1])


def test_rloo_is_score_minus_mean_of_the_others():
    (advantages, _), _ = run("rloo", [1.0, 0.0, 2.0, 5.0], [0, 0, 0, 1])
    torch.testing.assert_close(per_row(advantages), torch.tensor([1 - 1.0, 0 - 1.5, 2 - 0.5, 5.0]))


def test_opo_uses_a_length_weighted_baseline():
    (advantages, _), _ = run("opo", [1.0, 0.0, 3.0], [0, 0, 1], lengths=[2, 4, 3])
    torch.testing.assert_close(per_row(advantages), torch.tensor([2 / 3, -1 / 3, 3.0]))


def test_gpg_scales_by_the_share_of_nonzero_scores():
    (advantages, _), _ = run("gpg", [1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0])
    torch.testing.assert_close(per_row(advantages), torch.tensor([1.0, -1.0, -1.0, 1.0]))


def test_remax_by_hand():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages, returns = compute_advantages(
        "remax",
        token_level_rewards=rewards,
        response_mask=mask,
        group_ids=torch.tensor([0, 1]),
        config=AlgorithmConfig(),
        reward_baselines=torch.tensor([0.5, 3.0]),
    )
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0]]))


def test_reinforce_plus_plus_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    advantages, returns = compute_advantages(
        "reinforce_plus_plus",
        token_level_rewards=rewards,
        response_mask=mask,
        group_ids=torch.arange(3),
        config=AlgorithmConfig(gamma=0.5),
    )
    # the tool token of row 2 is skipped: no reward, no discount
    expected_returns = torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0], [0.5, 0.0, 1.0]])
    torch.testing.assert_close(returns, expected_returns)
    valid = torch.tensor([0.25, 0.5, 1.0, 1.0, 2.0, 0.5, 1.0])
    whitened = (valid - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
    torch.testing.assert_close(advantages[mask.bool()], whitened)
    assert (advantages[~mask.bool()] == 0).all()


def test_reinforce_plus_plus_baseline_whitens_group_centred_scores():
    (advantages, _), mask = run("reinforce_plus_plus_baseline", [1.0, 0.0, 3.0], [0, 0, 1], lengths=[1, 2, 3])
    centred = torch.tensor([0.5, -0.5, 3.0]).unsqueeze(-1) * mask  # a group of one has baseline 0
    torch.testing.assert_close(advantages, masked_whiten(centred, mask))


def test_gae_by_hand_and_tool_tokens_are_skipped():
    config = AlgorithmConfig(gamma=0.9, lam=0.8)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6], [0.5, 0.6]])
    # the second row has a tool token in the middle: same numbers, one column later
    rewards_with_tool = torch.tensor([[0.0, 0.0, 1.0]])
    values_with_tool = torch.tensor([[0.5, 9.0, 0.6]])
    advantages, returns = compute_advantages(
        "gae",
        token_level_rewards=rewards,
        response_mask=torch.ones(2, 2),
        group_ids=torch.arange(2),
        config=config,
        values=values,
    )
    # A1 = 1 - 0.6 = 0.4; A0 = (0.9 * 0.6 - 0.5) + 0.72 * 0.4 = 0.328
    torch.testing.assert_close(returns, torch.tensor([[0.828, 1.0], [0.828, 1.0]]))
    torch.testing.assert_close(advantages[0], torch.tensor([-1.0, 1.0]) * 0.036 / math.sqrt(4 * 0.036**2 / 3 + 1e-8))
    _, returns_with_tool = compute_advantages(
        "gae",
        token_level_rewards=rewards_with_tool,
        response_mask=torch.tensor([[1.0, 0.0, 1.0]]),
        group_ids=torch.arange(1),
        config=config,
        values=values_with_tool,
    )
    torch.testing.assert_close(returns_with_tool, torch.tensor([[0.828, 0.0, 1.0]]))


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="gae, gdpo, gpg, grpo"):
        run("ppo", [1.0], [0])
    with pytest.raises(ValueError, match="critic"):
        run("gae", [1.0], [0])
    with pytest.raises(ValueError, match="reward_baselines"):
        run("remax", [1.0], [0])
    with pytest.raises(ValueError, match="one id per row"):
        run("grpo", [1.0, 2.0], [0])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(2, 4), min_size=1, max_size=4), st.integers(0, 2**16), st.booleans())
def test_group_advantages_sum_to_zero(group_sizes, seed, norm_adv_by_std):
    generator = torch.Generator().manual_seed(seed)
    group_ids = torch.repeat_interleave(torch.arange(len(group_sizes)), torch.tensor(group_sizes))
    scores = torch.randint(0, 3, (len(group_ids),), generator=generator).double()
    rewards = torch.zeros(len(group_ids), 3, dtype=torch.float64)
    rewards[:, -1] = scores
    mask = torch.ones_like(rewards)
    for name in ["grpo", "rloo", "gpg"]:
        advantages, _ = compute_advantages(
            name,
            token_level_rewards=rewards,
            response_mask=mask,
            group_ids=group_ids,
            config=AlgorithmConfig(norm_adv_by_std=norm_adv_by_std),
        )
        group_sums = torch.zeros(len(group_sizes), dtype=torch.float64).index_add_(0, group_ids, advantages[:, 0])
        torch.testing.assert_close(group_sums, torch.zeros_like(group_sums))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_masked_positions_never_change_results(name, seed):
    """Values and (for per-token estimators) rewards at masked positions are ignored; outputs are 0 there."""
    generator = torch.Generator().manual_seed(seed)
    batch, length = 6, 5
    mask = (torch.rand(batch, length, generator=generator) > 0.3).double()
    mask[:, 0] = 1
    rewards = torch.randn(batch, length, generator=generator, dtype=torch.float64) * mask
    values = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    old_log_probs = -torch.rand(batch, length, generator=generator, dtype=torch.float64)
    sum_pi_squared = torch.rand(batch, length, generator=generator, dtype=torch.float64)

    def noisy(tensor):
        return torch.where(mask.bool(), tensor, torch.full_like(tensor, 1e6))

    kwargs = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        group_ids=torch.tensor([0, 0, 1, 1, 2, 2]),
        config=AlgorithmConfig(gamma=0.9, lam=0.95, gdpo_reward_keys=["format", "acc"]),
        reward_baselines=torch.randn(batch, generator=generator, dtype=torch.float64),
        reward_components={"format": torch.randn(batch, generator=generator), "acc": torch.randn(batch, generator=generator)},
    )
    advantages, returns = compute_advantages(name, values=values, old_log_probs=old_log_probs,
                                             sum_pi_squared=sum_pi_squared, **kwargs)
    noisy_advantages, noisy_returns = compute_advantages(name, values=noisy(values), old_log_probs=noisy(old_log_probs),
                                                         sum_pi_squared=noisy(sum_pi_squared), **kwargs)
    torch.testing.assert_close(advantages, noisy_advantages)
    torch.testing.assert_close(returns, noisy_returns)
    assert advantages.shape == returns.shape == (batch, length)
    assert (advantages[~mask.bool()] == 0).all() and (returns[~mask.bool()] == 0).all()
