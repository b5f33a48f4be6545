"""Rewards: scorers chosen by data source, a user's scorer from a file, and the reward manager.

Importing this package registers the built-in scorers (gsm8k, math, countdown, arithmetic);
it does not import torch, so scorer worker processes start fast. The trainer uses
``reinforge.reward.manager.RewardManager``.
"""

from reinforge.reward import scorers
from reinforge.reward.registry import SCORERS, Scorer, get_scorer, register_scorer

__all__ = ["SCORERS", "Scorer", "get_scorer", "register_scorer", "scorers"]
