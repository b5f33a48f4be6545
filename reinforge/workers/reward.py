"""The reward worker: rule-based scorers chosen by data_source, run by a RewardManager."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from reinforge.config.schema import Config
from reinforge.controller import Dispatch, Worker, register
from reinforge.models import load_tokenizer
from reinforge.protocol import Batch
from reinforge.reward.manager import RewardManager


class RewardWorker(Worker):
    def __init__(self, config: Config, reward_functions: Sequence[Callable[..., Any]] | None = None):
        """``reward_functions``: function objects that replace the scorers by data source (reward.weights)."""
        super().__init__()
        tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path,
                                   trust_remote_code=config.model.trust_remote_code)
        self.manager = RewardManager(config.reward, tokenizer, config.data.max_response_length,
                                     functions=reward_functions)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def score(self, batch: Batch) -> Batch:
        """token_level_scores (B, R) and one ``reward_<key>`` column per scorer extra (acc, pred, ...)."""
        output = self.manager.score(batch)
        scored = output.to_batch()
        scored.meta["reward_metrics"] = dict(output.metrics)
        return scored
