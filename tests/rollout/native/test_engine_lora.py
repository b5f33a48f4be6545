"""A LoRA actor's rollout on the native engine: the engine's own weight copy gets W + s B A at wake-up."""

from __future__ import annotations

import pytest
import torch

from reinforge.config.schema import LoraConfig
from reinforge.engine.lora import add_lora, lora_deltas
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("arch", ["qwen2", "phi3"])  # Phi-3's adapters sit on its fused qkv_proj and gate_up_proj
def test_merged_copy_generates_what_the_adapted_model_does(tiny, arch, device):
    """On the GPU (float32) the copy runs the Triton kernels and CUDA graphs."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = tiny.build(arch, device)
    torch.manual_seed(0)
    peft_model = add_lora(model, LoraConfig(rank=4, alpha=8.0))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)
    weights_before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, block_size=8 if device == "cpu" else 16,
                          max_num_seqs=16)
    if device == "cuda":
        assert engine.runner.decoder.use_triton and engine.runner.cuda_graph_batch_sizes
    prompts = tiny.prompts([3, 17, 9])
    engine.sync_weights(model)
    engine.wake_up()
    engine.add_to_weights(lora_deltas(peft_model))
    completions = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=10, temperature=0.0))
                                   for p in prompts])
    engine.sleep()
    changed = False
    for prompt, (sample,) in zip(prompts, completions, strict=True):
        reference = tiny.hf_greedy(model, prompt, 10)  # peft's layers, adapters applied unmerged
        assert sample.token_ids == reference
        expected = tiny.recomputed_log_probs(model, prompt, reference)
        torch.testing.assert_close(torch.tensor(sample.log_probs), expected, atol=1e-4, rtol=0)
        with peft_model.disable_adapter():
            changed |= tiny.hf_greedy(model, prompt, 10) != reference
    assert changed  # the adapters change what is generated: the equality above means something
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in weights_before.items())
