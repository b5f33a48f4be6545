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


def test_attention_pairs_count_causal_windowed_and_shared_prompt_segments():
    assert perf.attention_pairs([4], [4]) == 1 + 2 + 3 + 4
    assert perf.attention_pairs([4], [4], window=2) == 1 + 2 + 2 + 2
    # a response of 3 tokens over its 2-token prompt: the queries see 3, 4 and 5 keys
    assert perf.attention_pairs([2, 3], [2, 5]) == (1 + 2) + (3 + 4 + 5)
    assert perf.attention_pairs([2, 3], [2, 5], window=4) == (1 + 2) + (3 + 4 + 4)
    assert perf.attention_pairs([32896], [32896]) == 32896 * 32897 / 2


def test_attention_layers_follow_the_config_and_its_sliding_windows():
    from reinforge.models.tiny import build_tiny_causal_lm

    qwen = build_tiny_causal_lm("qwen2", num_layers=2, num_heads=4, hidden_size=64)  # head dim 16
    assert perf.attention_layers(qwen) == ((0, 2 * 4 * 32), (0, 2 * 4 * 32))
    gemma = build_tiny_causal_lm("gemma2", num_layers=4, sliding_window=8)
    assert [window for window, _ in perf.attention_layers(gemma)] == [8, 0, 8, 0]
    assert perf.attention_layers(nn.Linear(2, 2)) == ()


def test_mfu_with_attention_adds_the_attention_products(monkeypatch):
    monkeypatch.setattr(perf, "peak_flops", lambda device, table=perf.DATASHEET_BF16_FLOPS: 1e12)
    model = nn.Linear(100, 100, bias=False)
    metrics = perf.update_perf_metrics("actor", model, num_tokens=1000.0, seconds=1.0, device=torch.device("cpu"),
                                       computed_attention_flops=4e9)
    assert metrics["perf/mfu/actor"] == pytest.approx(6 * 10_000 * 1000 / 1e12)
    assert metrics["perf/mfu_with_attention/actor"] == pytest.approx((6 * 10_000 * 1000 + 4e9) / 1e12)
    assert "perf/mfu_with_attention/actor" not in perf.update_perf_metrics(
        "actor", model, num_tokens=1000.0, seconds=1.0, device=torch.device("cpu"))


def test_an_update_counts_the_attention_of_each_sequence_it_ran(tiny_model_dir, monkeypatch):
    from reinforge.config.schema import Config
    from reinforge.engine.forward import build_position_ids
    from reinforge.protocol import Batch
    from reinforge.workers.actor_rollout import ActorRolloutWorker

    monkeypatch.setattr(perf, "peak_flops", lambda device, table=perf.DATASHEET_BF16_FLOPS: 1e12)
    config = Config()
    config.model.path, config.trainer.device = str(tiny_model_dir), "cpu"
    config.data.train_batch_size, config.actor.max_tokens_per_micro_batch = 3, 12
    worker = ActorRolloutWorker(config, total_training_steps=1)
    prompts, responses = torch.randint(3, 60, (3, 4)), torch.randint(3, 60, (3, 5))
    attention_mask = torch.ones(3, 9, dtype=torch.long)
    attention_mask[0, :2] = 0
    attention_mask[1, 7:] = 0
    batch = Batch.from_dict(tensors={
        "prompts": prompts, "responses": responses, "response_mask": attention_mask[:, 4:].float(),
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
        "position_ids": build_position_ids(attention_mask), "advantages": torch.randn(3, 5)})
    metrics = worker.update_actor(batch)
    lengths = [7, 7, 9]  # every row one causal sequence
    model_config = worker.model.config
    per_pair = 3 * 2 * model_config.num_attention_heads * 2 * (
        model_config.hidden_size // model_config.num_attention_heads) * model_config.num_hidden_layers
    attention = per_pair * sum(length * (length + 1) / 2 for length in lengths)
    parameters = perf.update_flops_per_token(worker.model) * metrics["perf/computed_tokens/actor"]
    assert metrics["perf/mfu_with_attention/actor"] / metrics["perf/mfu/actor"] == pytest.approx(
        1 + attention / parameters)


def tiny_vision_language_model() -> nn.Module:
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(
        "qwen2_5_vl", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1]))
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


def test_a_vision_language_model_counts_no_vision_tower_flops_per_token():
    """The tower encodes image patches, not the tokens, and frozen it runs once a step without gradients: a token
    runs through the language model's parameters only (6 each when they train)."""
    from reinforge.models.vision import freeze_vision_tower, vision_tower

    model = tiny_vision_language_model()
    tower = freeze_vision_tower(model)
    assert tower > 0 and sum(p.numel() for p in vision_tower(model).parameters()) == tower
    language = perf.num_parameters(model) - tower
    assert perf.num_active_parameters(model) == language
    assert perf.update_flops_per_token(model) == 6 * language


def test_a_forward_only_micro_batch_counts_its_forwards_share_of_the_update_flops(monkeypatch):
    """A forward costs 2 x active parameters a token: a third of a fully trained token's 6, about half of a LoRA
    token's 4 x the frozen base + 6 x the adapter."""
    from reinforge.engine.train_step import ModelUpdate, UpdateSettings
    from reinforge.protocol import Batch

    base = nn.Linear(100, 100, bias=False).requires_grad_(False)  # 10,000 frozen weights
    adapter = nn.Sequential(nn.Linear(100, 4, bias=False), nn.Linear(4, 100, bias=False))  # 800 trainable
    model = nn.ModuleDict({"base": base, "adapter": adapter})
    assert perf.forward_share(model) == pytest.approx(2 * 10_800 / (4 * 10_800 + 2 * 800))
    assert perf.forward_share(nn.Linear(10, 10)) == pytest.approx(1 / 3)
    optimizer = torch.optim.AdamW(adapter.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def whole(batch, budget, mask_key):
        yield batch

    update = ModelUpdate(model, optimizer, scheduler, UpdateSettings(max_tokens_per_micro_batch=64, grad_clip=1.0),
                         torch.device("cpu"), split=whole)
    mask = torch.ones(4, 6)
    batch = Batch.from_dict(tensors={"attention_mask": mask.long(), "response_mask": mask})
    for _ in update.micro_batches(batch, no_grad_rows=torch.tensor([True, True, False, False])):
        pass
    assert update.computed_tokens == pytest.approx(12 * perf.forward_share(model) + 12)


@pytest.mark.parametrize("name, datasheet, measured", [
    ("NVIDIA H200", 989e12, 799e12),
    ("NVIDIA H100 80GB HBM3", 989e12, None),
    ("NVIDIA GH200 480GB", 989e12, None),
    ("NVIDIA H100 PCIe", 756e12, None),  # not the SXM part's 989
    ("NVIDIA H100 NVL", None, None),  # a form whose rate the table does not hold: no MFU rather than a wrong one
    ("NVIDIA H200 NVL", None, None),  # nor this project's H200's measured rate
    ("NVIDIA A100-SXM4-80GB", 312e12, None),
    ("NVIDIA A100-PCIE-40GB", 312e12, None),
    ("NVIDIA A100 80GB PCIe", 312e12, None),
    ("NVIDIA L40S", None, None),
])
def test_the_peak_is_that_of_the_devices_own_form(name, datasheet, measured):
    assert perf.table_flops(name, perf.DATASHEET_BF16_FLOPS) == datasheet
    assert perf.table_flops(name, perf.MEASURED_BF16_FLOPS) == measured
