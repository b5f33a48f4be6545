"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, one seed per sample.

Every row samples by Gumbel-max: argmax of logits/temperature plus Gumbel noise, over the
tokens at or above the row's truncation threshold. Top-k and top-p become that threshold (the
k-th largest tempered logit, and the smallest logit inside the top-p mass of what top-k
kept); min-p raises it to max + log(min_p). Ties at a threshold keep every tied token. The
noise of each row is a hash of (sample seed, position, column) (``rollout.noise``), so a seed
reproduces its samples whatever else shares the batch. The returned log-prob is that of
the sampled token under softmax(logits/temperature), before truncation (raw log-softmax for
greedy rows), computed from the same logits that were sampled. The thresholds are formed
here, with PyTorch and only for the rows' options in use; on CUDA two Triton kernels do the
rest (one reads each slice of the vocabulary once, one merges a row's slices), elsewhere a
PyTorch path computes the same noise. A model whose output logits are soft-capped (Gemma 2) hands them over
uncapped: the sampler caps them in float32, cap * tanh(logit / cap), before the temperature, as the trainer's
log-prob kernels do (the kernel as it reads each logit; up front where thresholds need the capped values, and on
the PyTorch path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from reinforge.rollout.native.model_runner import to_device
from reinforge.rollout.native.sequence import Sequence
from reinforge.rollout.noise import gumbel_noise, noise_keys

MAX_INV_TEMPERATURE = 1e30
"""The largest 1 / temperature sampled with: tempered logits stay finite in float32 up to |logit| = 3e8."""


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device; all (rows,). Only ``positions`` changes between decode steps."""

    inv_temperatures: Tensor
    greedy: Tensor
    top_k: Tensor
    top_p: Tensor
    log_min_p: Tensor
    sample_seeds: Tensor
    needs_truncation: bool
    """Some row uses top-k or top-p (the sort or top-k pass runs only then)."""
    needs_min_p: bool
    """Some row uses min-p (the row maxima are taken only then)."""
    positions: Tensor | None = None
    """Position of the token each row samples; with the sample seed it keys the row's noise."""
    num_top_log_probs: int = 0
    """The most alternatives a row asks for (``SamplingParams.num_top_log_probs``); 0: none are computed."""

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], device: torch.device) -> SamplingTensors:
        """Parameters for sampling each sequence's next tokens (set ``positions`` before use)."""
        temperatures = np.fromiter((seq.sampling.temperature for seq in seqs), dtype=np.float32, count=len(seqs))
        greedy = temperatures == 0.0
        top_k = np.fromiter((seq.sampling.top_k for seq in seqs), dtype=np.int64, count=len(seqs))
        top_p = np.fromiter((seq.sampling.top_p for seq in seqs), dtype=np.float32, count=len(seqs))
        min_p = np.fromiter((seq.sampling.min_p for seq in seqs), dtype=np.float32, count=len(seqs))
        top_k = np.where(greedy | (top_k < 0), 0, top_k)
        top_p = np.where(greedy, 1.0, top_p).astype(np.float32)
        with np.errstate(divide="ignore", over="ignore"):
            log_min_p = np.where(greedy | (min_p <= 0), -np.inf, np.log(np.maximum(min_p, 1e-30))).astype(np.float32)
            inv_temperatures = np.where(greedy, 1.0, 1.0 / np.where(greedy, 1.0, temperatures))
        # a temperature so small its inverse overflows float32 samples as the smallest one that does not (the argmax)
        inv_temperatures = np.minimum(inv_temperatures, MAX_INV_TEMPERATURE).astype(np.float32)
        sample_seeds = np.fromiter((seq.sample_seed for seq in seqs), dtype=np.int64, count=len(seqs))
        # copied without waiting for the device: the engine builds these while a decode step may be in flight
        floats = to_device(np.stack([inv_temperatures, top_p, log_min_p]), device)
        integers = to_device(np.stack([greedy.astype(np.int64), top_k, sample_seeds]), device)
        return cls(inv_temperatures=floats[0], greedy=integers[0].to(torch.int32), top_k=integers[1],
                   top_p=floats[1], log_min_p=floats[2], sample_seeds=integers[2],
                   needs_truncation=bool((top_k > 0).any() or (top_p < 1.0).any()),
                   needs_min_p=bool(np.isfinite(log_min_p).any()),
                   num_top_log_probs=max(seq.sampling.num_top_log_probs for seq in seqs))


def truncation_thresholds(scaled_logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Smallest tempered logit kept by top-k then top-p, per row (-inf keeps all).

    scaled_logits: (rows, vocab) float32; top_k: (rows,) (0 = off); top_p: (rows,). Returns (rows,).
    """
    rows, vocab_size = scaled_logits.shape
    thresholds = torch.full((rows,), float("-inf"), device=scaled_logits.device)
    if bool((top_p < 1.0).any()):
        sorted_logits = scaled_logits.sort(dim=-1, descending=True).values
    else:
        sorted_logits = scaled_logits.topk(min(int(top_k.max()), vocab_size), dim=-1).values  # top_k > vocab: all
    width = sorted_logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=width), width)
    kth = sorted_logits.gather(1, (k - 1)[:, None])[:, 0]
    thresholds = torch.where(top_k > 0, kth, thresholds)
    if bool((top_p < 1.0).any()):
        # what top-k kept, its ties at the k-th logit included (as the threshold keeps them): the nucleus is
        # formed over the very tokens that can be sampled
        kept = sorted_logits >= thresholds[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(~kept, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        num_kept = ((mass_before < top_p[:, None]) & kept).sum(dim=-1).clamp(min=1)
        nucleus = sorted_logits.gather(1, (num_kept - 1)[:, None])[:, 0]
        thresholds = torch.where(top_p < 1.0, torch.maximum(thresholds, nucleus), thresholds)
    return thresholds


def soft_capped(logits: Tensor, softcap: float) -> Tensor:
    """softcap * tanh(logits / softcap) in float32."""
    return softcap * torch.tanh(logits.float() / softcap)


class Sampler:
    def __init__(self, use_triton: bool, softcap: float | None = None):
        """softcap: the model's final logit soft-cap (Gemma 2), applied here to the uncapped logits it is given."""
        self.use_triton = use_triton
        self.softcap = softcap

    def __call__(self, logits: Tensor, params: SamplingTensors) -> tuple[Tensor, Tensor]:
        """Sampled token ids (rows,) int64 and their log-probs (rows,) float32. logits: (rows, vocab)."""
        rows = logits.shape[0]
        num_params = (params.inv_temperatures.shape[0], params.positions.shape[0])
        if num_params != (rows, rows):  # the kernel would read parameters past the rows it was given
            raise RuntimeError(f"sampling parameters of {num_params[0]} rows (positions of {num_params[1]}) for "
                               f"logits of {rows} rows: SamplingTensors must be made from the step's own sequences")
        softcap = self.softcap
        if softcap is not None and (params.needs_truncation or params.needs_min_p or not self.use_triton):
            # the thresholds and the kernel must see the same capped values: cap once, here
            logits, softcap = soft_capped(logits, softcap), None
        thresholds = torch.full((rows,), float("-inf"), device=logits.device)
        if params.needs_truncation:
            thresholds = truncation_thresholds(logits.float() * params.inv_temperatures[:, None], params.top_k,
                                               params.top_p)
        if params.needs_min_p:
            # scaling by a positive float keeps the order, so this is exactly the max of the tempered logits
            row_max = logits.max(dim=-1).values.float() * params.inv_temperatures
            thresholds = torch.maximum(thresholds, row_max + params.log_min_p)
        if self.use_triton:
            from reinforge.rollout.native import triton_kernels

            return triton_kernels.sample(logits, params.inv_temperatures, params.greedy, thresholds,
                                         params.sample_seeds, params.positions, softcap=softcap)
        return self._sample_torch(logits, params, thresholds)

    def top_log_probs(self, logits: Tensor, params: SamplingTensors) -> tuple[Tensor, Tensor]:
        """The ``params.num_top_log_probs`` most likely tokens of each row's distribution, as the sampled token's
        log-prob is taken (softmax of the tempered, soft-capped logits, before truncation; raw for greedy rows):
        log-probs (rows, k) float32, most likely first, and their ids (rows, k) int64. logits: (rows, vocab)."""
        scaled = soft_capped(logits, self.softcap) if self.softcap is not None else logits.float()
        log_probs = torch.log_softmax(scaled * params.inv_temperatures[:, None], dim=-1)
        return log_probs.topk(min(params.num_top_log_probs, log_probs.shape[-1]), dim=-1)

    @staticmethod
    def _sample_torch(logits: Tensor, params: SamplingTensors, thresholds: Tensor) -> tuple[Tensor, Tensor]:
        scaled = logits.float() * params.inv_temperatures[:, None]
        log_probs = torch.log_softmax(scaled, dim=-1)
        keys = noise_keys(params.sample_seeds.tolist(), params.positions.tolist(), scaled.device)
        sampled_scores = torch.where(scaled >= thresholds[:, None], scaled + gumbel_noise(keys, scaled.shape[1]),
                                     float("-inf"))
        scores = torch.where(params.greedy.bool()[:, None], scaled, sampled_scores)
        tokens = scores.argmax(dim=-1)
        return tokens, log_probs.gather(1, tokens[:, None])[:, 0]
