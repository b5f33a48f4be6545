"""Metrics of a training step computed from its batch, with the names verl users know."""

from __future__ import annotations

import numbers as numbers_module

import numpy as np
import torch
from torch import Tensor

from reinforge.protocol import Batch


def _stats(prefix: str, values: Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    values = values.float()
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def _masked_stats(prefix: str, values: Tensor, mask: Tensor) -> dict[str, float]:
    return _stats(prefix, values[mask.bool()])


def compute_data_metrics(batch: Batch, max_response_length: int) -> dict[str, float]:
    mask = batch["response_mask"]
    prompt_width = batch["prompts"].shape[1]
    # a multi-turn response counts its tool tokens too (they share the budget); response_mask marks sampled ones
    response_length = batch["attention_mask"][:, prompt_width:].sum(-1)
    prompt_length = batch["attention_mask"][:, :prompt_width].sum(-1)
    metrics = _stats("critic/score", batch["token_level_scores"].sum(-1))
    metrics |= _stats("critic/rewards", batch["token_level_rewards"].sum(-1))
    metrics |= _masked_stats("critic/advantages", batch["advantages"], mask)
    metrics |= _masked_stats("critic/returns", batch["returns"], mask)
    if "values" in batch:
        metrics |= _masked_stats("critic/values", batch["values"], mask)
        valid = mask.bool()
        returns, values = batch["returns"][valid], batch["values"][valid]
        if returns.numel() > 1:  # verl's definition: unbiased variances, 1e-5 beside the returns' (equal returns
            # would otherwise divide by their rounding noise)
            metrics["critic/vf_explained_var"] = float(1 - (returns - values).var() / (returns.var() + 1e-5))
    metrics |= _stats("response_length", response_length)
    metrics["response_length/clip_ratio"] = float((response_length >= max_response_length).float().mean())
    metrics |= _stats("prompt_length", prompt_length)
    return metrics


def compute_throughput_metrics(batch: Batch, step_seconds: float, num_devices: int = 1) -> dict[str, float]:
    total_tokens = float(batch["attention_mask"].sum())
    return {"perf/total_num_tokens": total_tokens, "perf/time_per_step": step_seconds,
            "perf/throughput": total_tokens / max(step_seconds, 1e-9) / num_devices}


def mean_of_extras(extras: dict[str, list], prefix: str = "reward") -> dict[str, float]:
    """Means of numeric per-sample reward extras (acc, format, ...)."""
    metrics = {}
    for key, values in extras.items():
        # numbers.Real covers numpy's integers and floats too; numpy's bool is no Real, yet a scorer may return one
        numbers = [float(v) for v in values if isinstance(v, (numbers_module.Real, np.bool_))]
        if numbers and len(numbers) == len(values):
            metrics[f"{prefix}/{key}/mean"] = float(torch.tensor(numbers).mean())
    return metrics
