"""The reward worker: rule-based scorers chosen by data_source, run by a RewardManager."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from reinforge.config.schema import Config
from reinforge.controller import Dispatch, Worker, register
from reinforge.controller.dispatch import PADDING_ROWS, ROW_MEANS, SUMMED_METRICS
from reinforge.models import load_tokenizer
from reinforge.protocol import EMPTY_VALUES, Batch
from reinforge.reward.manager import RewardManager, ScorerFailure, all_failed_message

REWARD_TOTALS = ("reward/errors", "reward/timeouts", "reward/memory_exceeded", "reward/overlong/count")
"""The reward metrics that count samples: several members' counts add up."""

REWARD_FRACTIONS = ("reward/overlong/fraction",)
"""The reward metrics that are fractions of the samples: several members' are weighted by their rows."""

SCORER_FAILURES = "scorer_failures"
"""On several members: the column of each row's failure (``error``, ``timeout``, ``memory`` or None) and the meta
key of the member's ``RewardOutput.failure_report``, which ``raise_if_every_row_failed`` reads over the gathered
batch."""


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
        """token_level_scores (B, R) and one ``reward_<key>`` column per scorer extra (acc, pred, ...).

        The counts (``REWARD_TOTALS``) add up over the members. The chunk's padding rows (``PADDING_ROWS``, copies of
        other members' rows, which the controller drops) are not scored: no scorer runs twice for a row, and no count
        covers them (a chunk of padding alone counts nothing).

        Alone, a member raises ``ScorerFailure`` where every row failed. One of several members decides nothing on its
        share of the rows: it reports each row's failure (``SCORER_FAILURES``), and the caller raises where every row
        of the gathered batch failed (``raise_if_every_row_failed``)."""
        alone = self.world_size == 1
        output = self.manager.score(batch, raise_when_all_failed=alone,
                                    padding_rows=int(batch.meta.get(PADDING_ROWS, 0)))
        scored = output.to_batch()
        # a row without a scorer's extra or a logged value has None or NaN; another member's rows may have none at all
        scored.meta[EMPTY_VALUES] = {**{f"reward_{key}": None for key in output.extras},
                                     **{key: math.nan for key in output.logged_metrics}}
        if not alone:
            scored[SCORER_FAILURES] = np.array(output.failures, dtype=object)
            scored.meta[SCORER_FAILURES] = dict(output.failure_report)
        scored.meta["reward_metrics"] = dict(output.metrics)
        scored.meta[SUMMED_METRICS] = tuple(name for name in scored.meta["reward_metrics"] if name in REWARD_TOTALS)
        scored.meta[ROW_MEANS] = tuple(name for name in scored.meta["reward_metrics"] if name in REWARD_FRACTIONS)
        return scored


def raise_if_every_row_failed(scored: Batch) -> Batch:
    """``scored`` (a reward group's result) without the members' failure reports; raises ``ScorerFailure``, the line
    one member alone raises, where every row of it failed. A result without the reports (one member's, which raised
    itself where every row failed) passes as it is."""
    if SCORER_FAILURES not in scored.non_tensors:
        return scored
    failures = list(scored.non_tensors.pop(SCORER_FAILURES))
    report = scored.meta.pop(SCORER_FAILURES, {})
    if failures and all(failure is not None for failure in failures):
        raise ScorerFailure(all_failed_message(report, len(failures), failures.count("timeout"),
                                               failures.count("memory")))
    return scored
