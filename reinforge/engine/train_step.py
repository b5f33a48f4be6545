"""One update of a model over a batch: epochs x mini-batches x token-budget micro-batches.

Shared by the actor, the critic and the SFT trainer. The caller drives the loop, so its
forward and loss are written where it reads them, one call away from the model:

    update = ModelUpdate(model, optimizer, scheduler, settings, device)
    for micro, counts in update.micro_batches(batch):
        log_probs, _ = response_log_probs(model, micro)
        update.backward(loss_of(log_probs, micro, counts), metrics)
    metrics = update.metrics("actor")

The loss of each micro-batch is normalised by the *global* counts of its mini-batch (tokens
and sequences across all micro-batches and data-parallel ranks), so that summing micro-batch
gradients gives exactly the mini-batch gradient whatever the split. FSDP averages gradients
over the ranks while globally normalised losses must be summed, so each backward is scaled by
the world size. The gradient norm is clipped over the sharded gradients of all ranks. A step
whose gradient norm is not finite is skipped (and counted), never applied.

Rows the loss gives no gradient (``no_grad_rows``: a GRPO group whose samples all scored the
same has advantage 0 everywhere) need no backward: they form ``FORWARD_ONLY`` micro-batches whose
forward the caller still runs, so every metric stays the mean over all rows, while the counts
that normalise the loss include them too.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reinforge.engine.distributed import all_reduce, world_size
from reinforge.engine.forward import runs_padded
from reinforge.engine.fsdp import clip_grad_norm_, fsdp_units, kept_gathered, reduce_gradients_now
from reinforge.engine.micro_batches import (
    iter_balanced_micro_batches,
    iter_padded_micro_batches,
    split_by_token_budget,
    without_loss_tokens,
)
from reinforge.engine.packing import PLAN_KEY, PackingPlan
from reinforge.engine.perf import attention_flops, attention_layers, forward_share, update_perf_metrics
from reinforge.protocol import Batch

MicroBatchFn = Callable[[Batch, int, str], Iterable[Batch]]
"""(mini-batch, token budget, mask key) -> its micro-batches."""
FORWARD_ONLY = "forward_only"
"""``Batch.meta`` key of a micro-batch whose rows get no gradient from the loss: the caller runs its forward
for the metrics and ``ModelUpdate.record``s them, with no backward."""


def packed_micro_batches(batch: Batch, max_tokens: int, mask_key: str) -> Iterator[Batch]:
    """Token-balanced micro-batches, packed without padding, a prompt's rows together (the RL workers)."""
    return iter_balanced_micro_batches(batch, max_tokens, mask_key, share_prompts=True)


def padded_micro_batches(batch: Batch, max_tokens: int, mask_key: str) -> list[Batch]:
    """Consecutive micro-batches in the padded layout, trimmed (the SFT trainer's forward)."""
    return split_by_token_budget(batch, max_tokens)


@dataclass(frozen=True)
class MiniBatchCounts:
    """Global counts of one mini-batch: over all its micro-batches and all data-parallel ranks.

    The loss turns them into its normaliser (``reinforge.algorithms.LossNormalizer`` has the
    same fields); the engine itself knows nothing of losses.
    """

    num_tokens: float
    """Tokens of the mask (``UpdateSettings.mask_key``)."""
    num_sequences: float
    """Rows with at least one such token."""
    max_response_length: int
    """Width of the mask."""


@dataclass
class UpdateSettings:
    """How one update walks its batch; every value comes from the run's config (no defaults of its own there)."""

    max_tokens_per_micro_batch: int
    grad_clip: float
    num_mini_batches: int = 1
    """Optimizer steps per epoch (the config's mini-batch size turned into a count)."""
    epochs: int = 1
    shuffle: bool = False
    """Shuffle rows between mini-batches, with a generator seeded by ``seed``."""
    seed: int = 0
    mask_key: str = "response_mask"
    """The tokens that count for the loss normaliser and the metric weights."""
    skip_on_device: bool = False
    """With torch's fused AdamW, a step whose gradient norm is not finite is skipped by the optimizer's own kernel
    (its ``found_inf``), so the host queues the step without waiting for the backward to end."""
    keep_gathered: bool = False
    """One device: every FSDP unit keeps its gathered parameters through the update, and a mini-batch's gradients
    are reduced once, by its last micro-batch's backward (``engine.fsdp.kept_gathered``), not after each."""


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


def fused_adamw(optimizer: torch.optim.Optimizer) -> bool:
    """torch's AdamW with its fused kernel, which skips a step itself when told ``found_inf``."""
    return isinstance(optimizer, torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


def _marking_the_last(items: Iterable[Batch]) -> Iterator[tuple[Batch, bool]]:
    """(item, whether it is the last) for each item, reading one ahead."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True


class ModelUpdate:
    """The optimizer steps of one training step, timed to the device's end; the caller runs each forward and loss.

    ``micro_batches(batch)`` yields (micro-batch on the device, counts of its mini-batch); the
    caller answers each with one ``backward``. Between mini-batches it clips and steps. Metrics
    may be scalar device tensors: they are read back once, in ``metrics``, so the host never
    waits for the device between micro-batches. Metrics whose name ends in ``_loss`` are already
    normalised by the mini-batch's global counts: they are summed over its micro-batches and the
    data-parallel ranks (giving the mini-batch's loss), then averaged over optimizer steps. Other
    metrics are averaged with weights equal to each micro-batch's tokens, over all ranks; every
    rank returns the same values.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, settings: UpdateSettings, device: torch.device,
                 split: MicroBatchFn | None = None):
        if split is None:  # the RL workers' default: packed rows, or padded ones by padded cost for a model that cannot pack
            split = iter_padded_micro_batches if runs_padded(model) else packed_micro_batches
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.settings, self.device, self.split = settings, device, split
        self.loss_scale = float(world_size()) if fsdp_units(model) else 1.0
        self.sums: dict[str, float | Tensor] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.loss_sums: dict[str, float | Tensor] = defaultdict(float)
        self._checked_optimizer = False
        self.grad_norms: list[float | Tensor] = []
        """Each optimizer step's gradient norm (a device scalar until ``metrics`` reads it)."""
        self.num_skipped = 0
        self.skips_on_device = settings.skip_on_device and fused_adamw(optimizer)
        self.computed_tokens = 0.0
        self.forward_share = forward_share(model)
        """What a ``FORWARD_ONLY`` micro-batch's token counts for in ``computed_tokens``: its forward's FLOPs over an
        updated token's (1/3 when every weight trains, about 1/2 with LoRA)."""
        self.attention_layers = attention_layers(model)
        self.computed_attention_flops = 0.0
        self.num_tokens = 0.0
        self.seconds = 0.0
        self._weight = 0.0

    def micro_batches(self, batch: Batch, no_grad_rows: Tensor | None = None
                      ) -> Iterator[tuple[Batch, MiniBatchCounts]]:
        """Epochs x mini-batches x micro-batches of ``batch``; each optimizer step runs when its last micro-batch is done.

        ``no_grad_rows`` (len(batch),) bool marks rows the loss gives no gradient (every advantage 0
        under a loss linear in it): they go into micro-batches of their own, marked ``FORWARD_ONLY``,
        which come first; the counts that normalise the loss still include them.
        """
        start = time.perf_counter()
        if self.settings.keep_gathered and world_size() == 1 and fsdp_units(self.model):
            with kept_gathered(self.model) as units:
                yield from self._steps(batch, no_grad_rows, units)
        else:
            yield from self._steps(batch, no_grad_rows, [])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - start
        self.num_tokens += float(batch["attention_mask"].sum()) * self.settings.epochs

    def _steps(self, batch: Batch, no_grad_rows: Tensor | None, gathered: list[nn.Module]
               ) -> Iterator[tuple[Batch, MiniBatchCounts]]:
        """The loop of ``micro_batches``; with ``gathered`` units, only each mini-batch's last micro-batch reduces
        their gradients."""
        settings, optimizer = self.settings, self.optimizer
        generator = torch.Generator().manual_seed(settings.seed)
        for _ in range(settings.epochs):
            order = torch.randperm(len(batch), generator=generator) if settings.shuffle else torch.arange(len(batch))
            for mini_rows in order.chunk(settings.num_mini_batches):
                whole = settings.num_mini_batches == 1 and not settings.shuffle  # rows in order: no copy needed
                mini_batch = batch if whole else batch.index(mini_rows)
                counts = mini_batch_counts(mini_batch, settings.mask_key, self.device)
                optimizer.zero_grad(set_to_none=True)
                frozen = None if no_grad_rows is None else no_grad_rows if whole else no_grad_rows[mini_rows]
                micro_batches = self._split(mini_batch, frozen)
                for micro, last in (_marking_the_last(micro_batches) if gathered  # built one ahead
                                    else ((micro, True) for micro in micro_batches)):
                    if gathered:
                        reduce_gradients_now(gathered, last)
                    self._weight = float(micro[settings.mask_key].sum())  # before the copy: no wait on the device
                    plan = micro.meta.get(PLAN_KEY)
                    tokens = plan.num_tokens if plan is not None else micro["attention_mask"].numel()
                    self.computed_tokens += tokens * self.forward_share if micro.meta.get(FORWARD_ONLY) else tokens
                    self.computed_attention_flops += self._attention_flops(micro, plan)
                    yield micro.to(self.device, non_blocking=True), counts
                grad_norm = clip_grad_norm_(self.model.parameters(), settings.grad_clip)
                if not self._checked_optimizer:
                    self._check_optimizer_steps_the_gradients()
                if self.skips_on_device:  # counted in metrics, where the norm is read back
                    optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
                    try:
                        optimizer.step()
                    finally:
                        del optimizer.found_inf
                    self.grad_norms.append(grad_norm)
                else:
                    if torch.isfinite(grad_norm):
                        optimizer.step()
                    else:
                        self.num_skipped += 1
                    self.grad_norms.append(float(grad_norm))
                self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    def _check_optimizer_steps_the_gradients(self) -> None:
        """Once: where the backward left gradients on the model's parameters, some of them are the optimizer's. A
        model whose parameters were replaced after its optimizer was built (its sharding units chosen wrong) would
        otherwise report a gradient norm and step on nothing, and the run would learn nothing."""
        self._checked_optimizer = True
        reached = [parameter for parameter in self.model.parameters() if parameter.grad is not None]
        if not reached:
            return  # no backward in this mini-batch (its rows all forward-only)
        held = {id(parameter) for group in self.optimizer.param_groups for parameter in group["params"]}
        if not any(id(parameter) in held for parameter in reached):
            raise RuntimeError(f"the backward reached {len(reached)} parameters of {type(self.model).__name__} and "
                               "the optimizer holds none of them, so its steps would change nothing; this is a bug in "
                               "how reinforge prepared the model: report it with the model's config.json")

    def _attention_flops(self, micro: Batch, plan: PackingPlan | None) -> float:
        """The attention products' FLOPs of a micro-batch's passes (its packed segments, else its rows)."""
        if not self.attention_layers:
            return 0.0
        if plan is not None:
            queries, keys = plan.query_lengths, plan.key_lengths
        else:
            queries = keys = micro["attention_mask"].sum(-1).tolist()
        flops = attention_flops(self.attention_layers, queries, keys)
        return flops / 3 if micro.meta.get(FORWARD_ONLY) else flops

    def _split(self, mini_batch: Batch, frozen: Tensor | None) -> Iterator[Batch]:
        """The mini-batch's micro-batches: those of its ``frozen`` rows first (marked ``FORWARD_ONLY``), then the rest.

        Every rank makes the same number of each kind, so that their FSDP collectives pair up: a rank
        without rows of one kind gives one row with no loss tokens instead, and the forward-only kind
        is left out only when no rank has such rows. The part with gradients is never empty, so a
        step always has gradients (zeros, like the loss's where every row is frozen) to step with.
        """
        budget, mask_key = self.settings.max_tokens_per_micro_batch, self.settings.mask_key
        if frozen is None or not all_reduce([float(frozen.sum())], self.device, op="max")[0]:
            yield from self.split(mini_batch, budget, mask_key)
            return
        for rows, forward_only in ((frozen.nonzero().flatten(), True), ((~frozen).nonzero().flatten(), False)):
            part = mini_batch.index(rows.tolist()) if len(rows) else without_loss_tokens(mini_batch, mask_key)
            for micro in self.split(part, budget, mask_key):
                micro.meta[FORWARD_ONLY] = forward_only
                yield micro

    def record(self, metrics: dict[str, float | Tensor]) -> None:
        """Tally the metrics of a ``FORWARD_ONLY`` micro-batch (its forward ran; it has no loss to backpropagate)."""
        self._tally(metrics)

    def backward(self, loss: Tensor, metrics: dict[str, float | Tensor]) -> None:
        """Backpropagate the loss of the micro-batch just yielded and tally its metrics (kept on the device)."""
        (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
        self._tally(metrics)

    def _tally(self, metrics: dict[str, float | Tensor]) -> None:
        for key, value in metrics.items():
            value = value.detach().float() if isinstance(value, Tensor) else float(value)
            if key.endswith("_loss"):
                self.loss_sums[key] = self.loss_sums[key] + value
            else:
                self.sums[key] = self.sums[key] + value * self._weight
                self.weights[key] += self._weight

    def metrics(self, role: str) -> dict[str, float]:
        """``<role>/*`` (the tallied metrics, grad_norm, num_skipped_steps, lr), ``perf/*/<role>`` (``engine.perf``)
        and ``timing_s/update_<role>_compute``; identical on every rank."""
        sums = {key: float(value) for key, value in self.sums.items()}
        loss_sums = {key: float(value) for key, value in self.loss_sums.items()}
        weights = dict(self.weights)
        _sum_over_ranks(sums, weights, loss_sums, device=self.device)
        norms = [float(norm) for norm in self.grad_norms]
        num_steps = max(len(norms), 1)
        result = {key: sums[key] / max(weights[key], 1e-12) for key in sums}
        result |= {key: value / num_steps for key, value in loss_sums.items()}
        finite = [g for g in norms if math.isfinite(g)]
        result["grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
        skipped = len(norms) - len(finite) if self.skips_on_device else self.num_skipped
        result["num_skipped_steps"] = float(skipped)
        result["lr"] = self.scheduler.get_last_lr()[0]
        result = {f"{role}/{key}": value for key, value in result.items()}
        result |= update_perf_metrics(role, self.model, self.num_tokens, self.seconds, self.device,
                                      float(self.computed_tokens),
                                      self.computed_attention_flops if self.attention_layers else None)
        result[f"timing_s/update_{role}_compute"] = self.seconds
        return result
