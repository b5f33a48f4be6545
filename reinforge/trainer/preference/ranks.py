"""How the preference runs spread over data-parallel ranks (processes started by torchrun, or gloo processes).

Every rank holds the FSDP2 shards of the model and takes its own share of each batch's pairs (``rank_share``);
the update's counts, losses and gradients are summed over the ranks by the engine, and the per-pair values
the metrics read are gathered onto every rank (``PairValues``), so every rank logs the whole batch's
numbers. Only rank 0 writes into the run folder: it holds the lock, writes ``config.yaml``, the metrics and
the checkpoints; the other ranks take part in the collective gathers of a checkpoint and log nothing
(``SilentTracker``). In a group of one all of this is a no-op.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from torch import Tensor

from reinforge.engine.distributed import rank, world_size
from reinforge.protocol import Batch
from reinforge.tracking.console import StepProgress


def rank_share(batch: Batch) -> Batch:
    """This rank's pairs of ``batch`` (rows 2i and 2i + 1 are pair i): pairs rank, rank + world, ...

    A rank left without a pair (a batch smaller than the group) gets the first pair with ``pair_weight`` and
    ``response_mask`` zero: its forward and backward pair up with the other ranks' FSDP collectives and count
    for nothing."""
    ranks = world_size()
    if ranks == 1:
        return batch
    pairs = range(rank(), len(batch) // 2, ranks)
    if pairs:
        return batch.index([row for pair in pairs for row in (2 * pair, 2 * pair + 1)])
    piece = batch.index([0, 1])
    for key in ("pair_weight", "response_mask"):
        piece[key] = torch.zeros_like(piece[key])
    return piece


def gather_from_ranks(values: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each name's tensor (n, ...) of every rank, concatenated in rank order on the CPU (one exchange); the tensors
    themselves in a group of one."""
    values = {name: tensor.detach().cpu() for name, tensor in values.items()}
    if world_size() == 1:
        return values
    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, values)
    return {name: torch.cat([part[name] for part in parts]) for name in values}


class PairValues:
    """Per-pair values (rewards, log-probs, losses) of the real pairs, collected over micro-batches and gathered
    over the ranks: what the metrics of a step read. They stay where they were computed until ``gathered``, so
    collecting them makes the host wait for the device nowhere inside the step's loop."""

    def __init__(self) -> None:
        self.parts: dict[str, list[Tensor]] = defaultdict(list)
        self.real: list[Tensor] = []

    def add(self, real: Tensor, **values: Tensor) -> None:
        """``real`` (pairs,): the micro-batch's pairs that count (not a rank's padding pair); each value (pairs,)."""
        self.real.append(real.detach())
        for name, tensor in values.items():
            self.parts[name].append(tensor.detach().float())

    def gathered(self) -> dict[str, Tensor]:
        """Every rank's values of each name. Collective: every rank calls it."""
        real = torch.cat(self.real).cpu()
        return gather_from_ranks({name: torch.cat(parts).cpu()[real] for name, parts in sorted(self.parts.items())})


class SilentTracker:
    """The tracker of a rank other than 0: it logs nothing (rank 0 logs the metrics every rank computed alike)."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def progress(self, total_steps: int, initial: int = 0) -> StepProgress:
        return StepProgress(Console(), total_steps, initial, enabled=False)

    def close(self) -> None:
        pass
