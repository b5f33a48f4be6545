"""One update of a model over a batch: epochs x mini-batches x token-budget micro-batches.

Shared by the actor, the critic and the SFT trainer. The loss of each micro-batch is
normalised by the *global* counts of its mini-batch (tokens and sequences across all
micro-batches and data-parallel ranks), so that summing micro-batch gradients gives exactly
the mini-batch gradient whatever the split. FSDP averages gradients over the ranks while
globally normalised losses must be summed, so each backward is scaled by the world size.
The gradient norm is clipped over the sharded gradients of all ranks. A step whose gradient
norm is not finite is skipped (and counted), never applied.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from reinforge.engine.distributed import all_reduce, world_size
from reinforge.engine.fsdp import clip_grad_norm_, fsdp_units
from reinforge.engine.micro_batches import iter_balanced_micro_batches, split_by_token_budget
from reinforge.engine.packing import PLAN_KEY
from reinforge.engine.perf import update_perf_metrics
from reinforge.protocol import Batch

MicroBatchFn = Callable[[Batch, int, str], Iterable[Batch]]
"""(mini-batch, token budget, mask key) -> its micro-batches."""



@dataclass(frozen=True)
class MiniBatchCounts:
    """Global counts of one mini-batch: over all its micro-batches and all data-parallel ranks.

    The loss function turns them into its normaliser (``reinforge.algorithms.LossNormalizer``
    has the same fields); the engine itself knows nothing of losses.
    """

    num_tokens: float
    """Tokens of the mask (``UpdateSettings.mask_key``)."""
    num_sequences: float
    """Rows with at least one such token."""
    max_response_length: int
    """Width of the mask."""


MicroLossFn = Callable[[Batch, MiniBatchCounts], tuple[Tensor, dict[str, float | Tensor]]]
"""(micro-batch, counts of its mini-batch) -> (loss to backpropagate, metrics of the micro-batch).

Metrics may be scalar device tensors: they are read back once, after the last optimizer step,
so the host never waits for the device between micro-batches.

Metrics whose name ends in ``_loss`` are already normalised by the mini-batch's global counts:
they are summed over its micro-batches and the data-parallel ranks (giving the mini-batch's
loss), then averaged over optimizer steps. Other metrics are averaged with weights equal to each
micro-batch's tokens, over all ranks; every rank returns the same values.
"""


@dataclass
class UpdateSettings:
    num_mini_batches: int = 1
    epochs: int = 1
    max_tokens_per_micro_batch: int = 16384
    grad_clip: float = 1.0
    shuffle: bool = False
    seed: int = 0
    mask_key: str = "response_mask"


def _padded_split(batch: Batch, max_tokens: int, mask_key: str) -> list[Batch]:
    return split_by_token_budget(batch, max_tokens)


def _sum_over_ranks(*tallies: dict[str, float], device: torch.device) -> None:
    """Each rank's loss shares and weighted sums become the whole data-parallel batch's, in place."""
    if world_size() == 1:
        return
    keys = [(index, key) for index, tally in enumerate(tallies) for key in sorted(tally)]
    totals = all_reduce([tallies[index][key] for index, key in keys], device)
    for (index, key), total in zip(keys, totals, strict=True):
        tallies[index][key] = total


def mini_batch_counts(mini_batch: Batch, mask_key: str, device: torch.device) -> MiniBatchCounts:
    mask = mini_batch[mask_key]
    num_tokens, num_sequences = all_reduce(
        [float(mask.sum()), float((mask.sum(-1) > 0).sum())], device)
    return MiniBatchCounts(num_tokens=num_tokens, num_sequences=num_sequences, max_response_length=mask.shape[1])


def run_update(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
               batch: Batch, loss_fn: MicroLossFn, settings: UpdateSettings, device: torch.device,
               micro_batches: MicroBatchFn = _padded_split) -> dict[str, float]:
    """Run the optimizer steps of one training step; returns metrics averaged over them.

    Also ``computed_tokens``: the tokens this rank ran through the model (packed: its plans'
    tokens; padded: rows x width), summed over all micro-batches.

    ``micro_batches`` cuts each mini-batch; the default keeps the padded layout (trimmed).
    """
    loss_scale = float(world_size()) if fsdp_units(model) else 1.0
    sums: dict[str, float] = defaultdict(float)
    weights: dict[str, float] = defaultdict(float)
    loss_sums: dict[str, float] = defaultdict(float)
    num_steps = 0
    grad_norms: list[float] = []
    num_skipped = 0
    computed_tokens = 0
    generator = torch.Generator().manual_seed(settings.seed)
    for _ in range(settings.epochs):
        order = torch.randperm(len(batch), generator=generator) if settings.shuffle else torch.arange(len(batch))
        for mini_rows in order.chunk(settings.num_mini_batches):
            whole = settings.num_mini_batches == 1 and not settings.shuffle  # rows in order: no copy needed
            mini_batch = batch if whole else batch.index(mini_rows)
            counts = mini_batch_counts(mini_batch, settings.mask_key, device)
            optimizer.zero_grad(set_to_none=True)
            for micro in micro_batches(mini_batch, settings.max_tokens_per_micro_batch, settings.mask_key):
                weight = float(micro[settings.mask_key].sum())  # before the copy: no wait on the device
                plan = micro.meta.get(PLAN_KEY)
                computed_tokens += plan.num_tokens if plan is not None else micro["attention_mask"].numel()
                micro = micro.to(device, non_blocking=True)
                loss, metrics = loss_fn(micro, counts)
                (loss * loss_scale if loss_scale != 1.0 else loss).backward()
                for key, value in metrics.items():  # device tensors stay there until the step ends
                    value = value.detach().float() if isinstance(value, Tensor) else float(value)
                    if key.endswith("_loss"):
                        loss_sums[key] = loss_sums[key] + value
                    else:
                        sums[key] = sums[key] + value * weight
                        weights[key] += weight
            grad_norm = clip_grad_norm_(model.parameters(), settings.grad_clip)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:
                num_skipped += 1
            scheduler.step()
            grad_norms.append(float(grad_norm))
            num_steps += 1
    optimizer.zero_grad(set_to_none=True)
    sums = {key: float(value) for key, value in sums.items()}
    loss_sums = {key: float(value) for key, value in loss_sums.items()}
    _sum_over_ranks(sums, weights, loss_sums, device=device)
    result = {key: sums[key] / max(weights[key], 1e-12) for key in sums}
    result |= {key: value / max(num_steps, 1) for key, value in loss_sums.items()}
    finite = [g for g in grad_norms if g == g and g != float("inf")]
    result["grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
    result["num_skipped_steps"] = float(num_skipped)
    result["lr"] = scheduler.get_last_lr()[0]
    result["computed_tokens"] = float(computed_tokens)
    return result


def run_timed_update(role: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: torch.optim.lr_scheduler.LRScheduler, batch: Batch, loss_fn: MicroLossFn,
                     settings: UpdateSettings, device: torch.device) -> dict[str, float]:
    """``run_update`` over packed, token-balanced micro-batches (prompts shared), timed to the device's end.

    Returns ``<role>/*`` metrics, ``perf/*/<role>`` (``engine.perf``) and
    ``timing_s/update_<role>_compute``. The update of the actor and of the critic.
    """
    start = time.perf_counter()
    metrics = run_update(model, optimizer, scheduler, batch, loss_fn, settings, device,
                         micro_batches=partial(iter_balanced_micro_batches, share_prompts=True))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    computed = metrics.pop("computed_tokens")
    result = {f"{role}/{key}": value for key, value in metrics.items()}
    num_tokens = float(batch["attention_mask"].sum()) * settings.epochs
    result |= update_perf_metrics(role, model, num_tokens, seconds, device, computed)
    result[f"timing_s/update_{role}_compute"] = seconds
    return result
