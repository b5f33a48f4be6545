"""Bounded staleness by admission (as AReaL), and the staleness metrics of a training batch.

Versions count weight syncs to the rollouter. Between two syncs the trainer consumes
``groups_per_version`` = trigger_sync_steps x train_batch_size prompt groups. A new group is
admitted only while ``admitted < (version + 1) x groups_per_version + floor(max_staleness x groups_per_version)``,
where ``admitted`` counts every group ever admitted (finished or still running): the rollouter can be at most
``max_staleness`` versions' worth of groups ahead of the version it samples with (a fraction of a version's groups
too: 0.5 lets half of them start early, as verl's staleness_threshold does).
Nothing admitted is ever dropped, so slow (long) samples are trained on like fast ones.

The bound counts groups ever admitted, so a large ``max_staleness`` lets the rollouter hold
(1 + max_staleness) x groups_per_version groups at once. ``max_in_flight`` caps those admitted and
not yet taken by the trainer (generating, or finished and waiting): ``trainer.max_in_flight_groups``,
by default the bound's own up to ``DEFAULT_VERSIONS_AHEAD`` versions ahead (``in_flight_limit``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from reinforge.config.schema import Config

DEFAULT_VERSIONS_AHEAD = 2
"""trainer.max_in_flight_groups unset: the groups in flight are capped at the staleness bound's for this many
versions ahead (a larger max_staleness holds no more of them at once)."""


def default_in_flight(max_staleness: float, groups_per_version: int) -> int:
    """trainer.max_in_flight_groups' default: G + floor(min(max_staleness, DEFAULT_VERSIONS_AHEAD) x G)."""
    return groups_per_version + math.floor(min(max_staleness, DEFAULT_VERSIONS_AHEAD) * groups_per_version)


def in_flight_limit(config: Config) -> int:
    """The groups in flight the async rollouter may hold: trainer.max_in_flight_groups, or its default."""
    if config.trainer.max_in_flight_groups is not None:
        return config.trainer.max_in_flight_groups
    groups_per_version = config.trainer.trigger_sync_steps * config.data.train_batch_size
    return default_in_flight(config.trainer.max_staleness, groups_per_version)


class StalenessBound:
    def __init__(self, max_staleness: float, groups_per_version: int, max_in_flight: int | None = None):
        self.max_staleness = max_staleness
        self.groups_per_version = groups_per_version
        self.max_in_flight = max_in_flight
        """Groups admitted and not yet taken by the trainer, at most (None: no cap beyond the bound's)."""

    def limit(self, version: int) -> int:
        """Groups that may have been admitted in all while the rollouter samples with ``version``."""
        return (version + 1) * self.groups_per_version + math.floor(self.max_staleness * self.groups_per_version)

    def capacity(self, admitted: int, version: int, taken: int | None = None) -> int:
        """Groups that may be admitted now. ``taken``: the groups the trainer has taken so far; None counts those
        of the updates before ``version`` (fewer, or as many: the trainer took them before the sync), which
        depends on the rollouter's version alone."""
        room = self.limit(version) - admitted
        if self.max_in_flight is not None:
            taken = version * self.groups_per_version if taken is None else taken
            room = min(room, self.max_in_flight - (admitted - taken))
        return max(0, room)


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
