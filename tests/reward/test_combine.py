"""reward.combine: the training score from the reward model's and the rule's, worked out by hand."""

import pytest
import torch

from reinforge.config.schema import RewardCombineConfig
from reinforge.reward.combine import combine_scores

RM = torch.tensor([0.5, -1.0, 2.0])
RULE = torch.tensor([1.0, 0.0, 0.0])


def test_replace_is_the_reward_models_score_alone():
    assert combine_scores(RM, None, RewardCombineConfig()).tolist() == [0.5, -1.0, 2.0]
    assert combine_scores(RM, RULE, RewardCombineConfig()).tolist() == [0.5, -1.0, 2.0]


def test_sum_weighs_each_score():
    config = RewardCombineConfig(mode="sum", rm_weight=0.5, rule_weight=2.0)
    assert combine_scores(RM, RULE, config).tolist() == [2.25, -0.5, 1.0]


def test_gate_gives_the_reward_models_score_only_where_the_rule_passes():
    assert combine_scores(RM, RULE, RewardCombineConfig(mode="gate")).tolist() == [0.5, 0.0, 0.0]
    # at the threshold itself the rule has not passed
    assert combine_scores(RM, RULE, RewardCombineConfig(mode="gate", gate_threshold=1.0)).tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="reward.combine.mode=gate needs the rule-based scores"):
        combine_scores(RM, None, RewardCombineConfig(mode="gate"))


@pytest.mark.parametrize("mode", ["replace", "sum", "gate"])
def test_a_non_finite_model_score_is_refused_in_one_line(mode):
    with pytest.raises(ValueError, match=r"^reward.judge gave 2 of 3 samples a non-finite score \(sample 1: nan\)"):
        combine_scores(torch.tensor([0.5, float("nan"), float("inf")]), RULE, RewardCombineConfig(mode=mode),
                       "reward.judge")
