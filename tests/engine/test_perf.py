"""MFU counts the FLOPs an update computes: no weight gradients for frozen weights (LoRA's base)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import reinforge.engine.perf as perf


def mfu(model: nn.Module, monkeypatch) -> float:
    monkeypatch.setattr(perf, "peak_flops", lambda device, table=perf.DATASHEET_BF16_FLOPS: 1e12)
    metrics = perf.update_perf_metrics("actor", model, num_tokens=1000.0, seconds=1.0, device=torch.device("cpu"))
    return metrics["perf/mfu/actor"]


def test_full_fine_tuning_counts_six_flops_per_parameter_and_token(monkeypatch):
    model = nn.Sequential(nn.Linear(100, 100, bias=False), nn.Linear(100, 10, bias=False))
    assert mfu(model, monkeypatch) == pytest.approx(6 * 11_000 * 1000 / 1e12)


def test_a_lora_update_counts_no_weight_gradients_for_the_frozen_base(monkeypatch):
    base = nn.Linear(100, 100, bias=False).requires_grad_(False)  # 10,000 frozen weights
    adapter = nn.Sequential(nn.Linear(100, 4, bias=False), nn.Linear(4, 100, bias=False))  # 800 trainable
    model = nn.ModuleDict({"base": base, "adapter": adapter})
    # forward 2N and input gradients 2N through the base; forward, input and weight gradients of the adapter
    assert mfu(model, monkeypatch) == pytest.approx((4 * 10_000 + 6 * 800) * 1000 / 1e12)


def test_tied_weights_count_once():
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50, bias=False))
    model[1].weight = model[0].weight
    assert perf.update_flops_per_token(model) == 6 * 400


def test_a_mixture_of_experts_counts_the_experts_a_token_runs_through():
    from reinforge.models.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm("olmoe", vocab_size=64)  # 2 layers of 8 experts, top-2
    experts = [p for name, p in model.named_parameters() if ".experts." in name]
    assert experts and all(p.dim() == 3 and p.shape[0] == 8 for p in experts)
    total, expert_total = perf.num_parameters(model), sum(p.numel() for p in experts)
    active = total - expert_total + expert_total * 2 / 8
    assert perf.num_active_parameters(model) == pytest.approx(active)
    assert perf.update_flops_per_token(model) == pytest.approx(6 * active)
    model.requires_grad_(False)
    assert perf.update_flops_per_token(model) == pytest.approx(4 * active)
