"""DeepSeek-V2/V3 with LoRA's default targets: adapters on the attention, dense-layer and shared-expert linear
layers, none on the routed experts, and the native engine generates what the adapted model does."""

from __future__ import annotations

import pytest
import torch

from reinforge.config.schema import LoraConfig
from reinforge.engine.lora import add_lora, lora_deltas
from reinforge.models.tiny import build_tiny_causal_lm
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.native.model import unsupported_reason


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_default_targets_leave_the_routed_experts_frozen_and_the_engine_runs_the_adapted_model(family):
    model = build_tiny_causal_lm(family, seed=21, max_position_embeddings=64).eval()
    peft_model = add_lora(model, LoraConfig(rank=4, alpha=8.0), seed=21)
    assert model.config.model_type == family and "model_type" not in vars(model.config)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in model.named_parameters() if ".lora_A." in name}
    assert not any(type(module).__name__ == "ParamWrapper" for module in model.modules())
    assert not any(".experts" in name for name in adapted)
    assert any(".shared_experts.gate_proj" in name for name in adapted)
    assert any(name.endswith("layers.0.mlp.down_proj") for name in adapted)  # the dense first layer
    assert unsupported_reason(model) is None

    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=48, block_size=8, max_num_seqs=4)
    engine.sync_weights(model)
    engine.wake_up()
    engine.add_to_weights(lora_deltas(peft_model))
    prompt = [7, 300, 12, 45, 9]
    (sample,), = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=6, temperature=0.0))])
    engine.sleep()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        logits = model(torch.tensor([tokens])).logits[0, len(prompt) - 1:-1]
    assert sample.token_ids == tokens[len(prompt):]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[len(prompt):])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(sample.log_probs), expected, atol=1e-5, rtol=0)
