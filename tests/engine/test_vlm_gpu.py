"""Vision-language models on the GPU: the packed bf16 training path (fused language model, compiled layers, flash
varlen attention) against transformers' padded forward, and a short SFT + GRPO run of the vision demo."""

import sys
from pathlib import Path

import pytest
import torch

from reinforge.engine.forward import response_log_probs
from reinforge.engine.fused import describe_training_path, prepare_for_training
from reinforge.engine.packing import attach_plan
from reinforge.models.tiny_vlm import build_tiny_processor, build_tiny_vlm
from reinforge.models.vision import freeze_vision_tower
from reinforge.protocol import Batch

sys.path.insert(0, str(Path(__file__).parent))
from test_vlm_packing import padded_log_probs, vlm_batch  # noqa: E402

ARCHES = ("qwen2_5_vl", "qwen3_vl")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHES)
def test_packed_bf16_training_pass_matches_the_padded_forward_on_the_gpu(arch):
    device = torch.device("cuda")
    model = build_tiny_vlm(arch, seed=5).to(device, torch.bfloat16)
    reference = build_tiny_vlm(arch, seed=5).to(device, torch.bfloat16)
    freeze_vision_tower(model)
    prepare_for_training(model, device)
    assert "fast path" in describe_training_path(model, device)
    batch = vlm_batch(build_tiny_processor(arch), samples=4, response_width=24).to(device)  # pixels stay on the host
    on_device = Batch(dict(batch.tensors), {"multi_modal_inputs": [
        {key: value.to(device) for key, value in row.items()} for row in batch["multi_modal_inputs"]]}, {})
    with torch.no_grad():
        expected = padded_log_probs(reference, on_device).float()
    for share in (False, True):
        model.zero_grad()
        micro = attach_plan(Batch(dict(batch.tensors), dict(batch.non_tensors), {}), share_prompts=share)
        log_probs, entropy = response_log_probs(model, micro, with_entropy=True)
        torch.testing.assert_close(log_probs * batch["response_mask"], expected, atol=5e-2, rtol=5e-2)
        loss = -(log_probs * batch["advantages"]).sum() / batch["response_mask"].sum()
        loss.backward()
        grads = [parameter.grad for parameter in model.model.language_model.parameters()]
        assert all(grad is not None and torch.isfinite(grad).all() for grad in grads)
        assert all(parameter.grad is None for parameter in model.model.visual.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHES)
def test_cached_image_embeddings_give_the_per_micro_batch_pass_on_the_gpu(arch):
    """bf16 on the fast path: the frozen tower's embeddings encoded once (engine.image_embeddings) give the log-probs
    and language-model gradients of the tower run inside each forward, and the forwards run no tower."""
    from reinforge.engine.image_embeddings import ImageEmbeddingCache
    from reinforge.models.vision import vision_tower

    device = torch.device("cuda")
    model = build_tiny_vlm(arch, seed=8).to(device, torch.bfloat16)
    freeze_vision_tower(model)
    prepare_for_training(model, device)
    batch = vlm_batch(build_tiny_processor(arch), samples=4, response_width=24, seed=8).to(device)
    results, calls = [], []
    vision_tower(model).register_forward_pre_hook(lambda module, args: calls.append(1))
    for cached in (False, True):
        cache = ImageEmbeddingCache(model, device)
        if cached:
            assert cache.prepare(batch) and cache.num_tower_calls == 1
        tower_calls = len(calls)
        model.zero_grad()
        micro = attach_plan(Batch(dict(batch.tensors), dict(batch.non_tensors), {}), share_prompts=True)
        log_probs, _ = response_log_probs(model, micro, image_embeddings=cache)
        (-(log_probs * batch["advantages"]).sum() / batch["response_mask"].sum()).backward()
        assert len(calls) - tower_calls == (0 if cached else 1)
        results.append((log_probs.detach(), [parameter.grad.float() for parameter in
                                             model.model.language_model.parameters()]))
    (expected, expected_grads), (got, grads) = results
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, atol=2e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("rollout", ["hf", "native"])
def test_a_short_vision_demo_runs_sft_and_grpo_on_the_gpu(tmp_path, rollout):
    from reinforge.demo.vision_runner import VisionDemoSettings, run_vision_demo
    from reinforge.demo.vision_task import VisionDemoTask

    settings = VisionDemoSettings(sft_steps=200, total_steps=4, test_every=4, save_every=4, num_val=64,
                                  rollout=rollout)
    result = run_vision_demo(tmp_path / "run", settings=settings, task=VisionDemoTask(num_train=128, num_test=64,
                                                                                     num_sft=3000),
                             device="cuda", loggers=("jsonl",), plots=False)
    assert 0.0 <= result["before"] <= 1.0 and result["after"] >= result["before"], result
