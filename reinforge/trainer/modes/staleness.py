"""Bounded staleness by admission (as AReaL), and the staleness metrics of a training batch.

Versions count weight syncs to the rollouter. Between two syncs the trainer consumes
``groups_per_version`` = trigger_sync_steps x train_batch_size prompt groups. A new group is
admitted only while ``admitted < (version + 1) x groups_per_version + floor(max_staleness x groups_per_version)``,
where ``admitted`` counts every group ever admitted (finished or still running): the rollouter can be at most
``max_staleness`` versions' worth of groups ahead of the version it samples with (a fraction of a version's groups
too: 0.5 lets half of them start early, as verl's staleness_threshold does).
Nothing admitted is ever dropped, so slow (long) samples are trained on like fast ones.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class StalenessBound:
    def __init__(self, max_staleness: float, groups_per_version: int):
        self.max_staleness = max_staleness
        self.groups_per_version = groups_per_version

    def limit(self, version: int) -> int:
        """Groups that may have been admitted in all while the rollouter samples with ``version``."""
        return (version + 1) * self.groups_per_version + math.floor(self.max_staleness * self.groups_per_version)

    def capacity(self, admitted: int, version: int) -> int:
        return max(0, self.limit(version) - admitted)


def staleness_metrics(token_versions: Tensor, response_mask: Tensor, version: int) -> dict[str, float]:
    """Versions behind (token-weighted), the fraction of partial samples (tokens from several versions)
    and their version span. token_versions, response_mask: (batch, response_len)."""
    valid = response_mask.bool() & (token_versions >= 0)
    behind = (version - token_versions)[valid].float()
    large, small = torch.iinfo(torch.long).max, torch.iinfo(torch.long).min
    newest = torch.where(valid, token_versions, torch.full_like(token_versions, small)).amax(-1)
    oldest = torch.where(valid, token_versions, torch.full_like(token_versions, large)).amin(-1)
    has_tokens = valid.any(-1)
    span = (newest - oldest)[has_tokens].float()
    partial = span > 0
    return {
        "async/staleness_mean": float(behind.mean()) if behind.numel() else 0.0,
        "async/staleness_max": float(behind.max()) if behind.numel() else 0.0,
        "async/partial_fraction": float(partial.float().mean()) if span.numel() else 0.0,
        "async/partial_span_max": float(span.max()) if span.numel() else 0.0,
        "async/partial_span_mean": float(span[partial].mean()) if partial.any() else 0.0,
    }
