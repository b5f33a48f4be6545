"""The training score from a reward model's score and a rule-based score (``reward.combine``).

verl replaces the rule-based score by the reward model's whenever a reward model is on, and
combining the two takes a custom reward function there. Here ``reward.combine.mode`` says it:
``replace`` (verl's), ``sum`` (``rm_weight x rm + rule_weight x rule``) or ``gate`` (the reward
model's score where the rule passes, ``rule > gate_threshold``, else the rule's score: a wrong
answer cannot be talked up by a reward model that likes its style).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reinforge.config.schema import RewardCombineConfig


def combine_scores(rm_scores: Tensor, rule_scores: Tensor | None, config: RewardCombineConfig,
                   source: str = "reward.reward_model") -> Tensor:
    """Per-sample training scores (B,) float32 from the reward model's (B,) and the rule's (B,; None in replace).

    A non-finite model score (``source`` gave it) is refused: it would make its group's advantages NaN.
    """
    rm_scores = rm_scores.float()
    bad = torch.nonzero(~torch.isfinite(rm_scores)).flatten()
    if len(bad):
        first = int(bad[0])
        raise ValueError(f"{source} gave {len(bad)} of {len(rm_scores)} samples a non-finite score (sample {first}: "
                         f"{float(rm_scores[first])}), which would make the advantages NaN; check the model "
                         "(its weights, model.dtype: float16 overflows where bfloat16 does not)")
    if config.mode == "replace":
        return rm_scores
    if rule_scores is None:
        raise ValueError(f"reward.combine.mode={config.mode} needs the rule-based scores")
    rule_scores = rule_scores.float()
    if config.mode == "sum":
        return config.rm_weight * rm_scores + config.rule_weight * rule_scores
    if config.mode == "gate":
        return torch.where(rule_scores > config.gate_threshold, rm_scores, rule_scores)
    raise ValueError(f"reward.combine.mode={config.mode!r} is not one of replace, sum, gate")
