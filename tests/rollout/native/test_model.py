"""PagedDecoder: the fused q|k|v and gate|up projections give the model's own logits and follow weight syncs."""

from __future__ import annotations

import pytest
import torch
import transformers

from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.native.attention import AttentionMetadata
from reinforge.rollout.native.model import PagedDecoder


def llama_with_biases() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, attention_bias=True,
                                      mlp_bias=True)
    return transformers.LlamaForCausalLM(config).eval()


def prefill_logits(decoder: PagedDecoder, token_ids: list[int]) -> torch.Tensor:
    """Logits (tokens, vocab) of one sequence prefilled into a fresh cache of 8-token blocks."""
    num_tokens = len(token_ids)
    device = decoder.device
    kv_cache = torch.zeros(decoder.kv_cache_shape(-(-num_tokens // 8), 8), dtype=decoder.dtype, device=device)
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(slot_mapping=positions, is_prefill=True, seq_lens=[num_tokens],
                             batch_index=torch.zeros(num_tokens, dtype=torch.int64, device=device),
                             token_index=positions)
    with torch.no_grad():
        return decoder.forward(torch.tensor(token_ids, device=device), positions, kv_cache, meta)


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "llama", "llama_with_biases"])
def test_the_weight_copies_give_the_models_logits(architecture, use_triton, tiny):
    if use_triton:
        pytest.importorskip("triton")
    model = llama_with_biases() if architecture == "llama_with_biases" else tiny.build(architecture)
    on_gpu = use_triton and torch.cuda.is_available()  # Triton runs interpreted on the CPU only without a GPU
    model = model.to("cuda" if on_gpu else "cpu")
    decoder = PagedDecoder(model, max_model_len=64, use_triton=use_triton)
    decoder.load_weights()
    prompt = tiny.prompts([19])[0]
    with torch.no_grad():
        expected = model(torch.tensor([prompt], device=model.device)).logits[0]
    tolerance = 1e-4 if on_gpu else 1e-5
    torch.testing.assert_close(prefill_logits(decoder, prompt), expected, atol=tolerance, rtol=tolerance)


def test_weight_copies_are_refreshed_in_place_and_freed(tiny):
    model = tiny.build("qwen2", seed=5)
    decoder = PagedDecoder(model, max_model_len=64, use_triton=False)
    decoder.load_weights()
    weights = decoder.weights
    first = weights.layers[1]
    pointers = decoder.parameter_pointers()
    assert first["qkv_weight"].data_ptr() in pointers and first["qkv_bias"].shape == (64 + 2 * 32,)
    assert first["gate_up_bias"] is None and first["q_norm"] is None
    assert not any(tensor.data_ptr() == parameter.data_ptr()  # copies, never the parameters themselves
                   for tensor in weights.tensors() for parameter in model.parameters())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.5)
    decoder.load_weights()
    assert decoder.weights.layers[1] is first and decoder.parameter_pointers() == pointers
    layer = model.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    assert torch.equal(first["qkv_weight"], torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(first["qkv_bias"], torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    assert torch.equal(first["gate_up_weight"], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert torch.equal(first["o_weight"], attn.o_proj.weight) and torch.equal(first["down_weight"], mlp.down_proj.weight)
    assert torch.equal(first["input_layernorm"], layer.input_layernorm.weight)
    assert torch.equal(weights.embed, model.model.embed_tokens.weight)
    assert torch.equal(weights.final_norm, model.model.norm.weight)
    assert (weights.lm_head is weights.embed) == model.config.tie_word_embeddings
    assert torch.equal(weights.lm_head, model.lm_head.weight)
    decoder.free_weights()
    assert decoder.weights is None


def test_sync_weights_while_awake_refreshes_the_copies(tiny):
    model = tiny.build("llama", seed=4)
    prompt = tiny.prompts([10])[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=8, max_num_seqs=4)
    assert engine.runner.decoder.weights is None  # nothing is copied until wake-up
    before = engine.generate([GenerationRequest(prompt, greedy)])[0][0].token_ids
    pointers = engine.runner.decoder.parameter_pointers()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    engine.sync_weights(model)
    assert engine.is_awake and engine.runner.decoder.parameter_pointers() == pointers
    after = engine.generate([GenerationRequest(prompt, greedy)])[0][0].token_ids
    assert after == tiny.hf_greedy(model, prompt, 8) and after != before
    engine.sleep()
    assert engine.runner.decoder.weights is None and engine.runner.kv_cache is None


def test_kept_on_sleep_the_copies_and_cache_stay_and_follow_the_model(tiny):
    model = tiny.build("qwen2", seed=6)
    prompt = tiny.prompts([12])[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=8, max_num_seqs=4, free_on_sleep=False)
    before = engine.generate([GenerationRequest(prompt, greedy)])[0][0].token_ids
    engine.sleep()
    kv_cache, pointers = engine.runner.kv_cache, engine.runner.decoder.parameter_pointers()
    assert not engine.is_awake and kv_cache is not None and pointers
    with torch.no_grad():  # an optimizer step, and the parameters' storage moving (FSDP regathers it elsewhere)
        for parameter in model.parameters():
            parameter.data = parameter.data + torch.randn_like(parameter) * 0.05
    engine.sync_weights(model)
    after = engine.generate([GenerationRequest(prompt, greedy)])[0][0].token_ids
    assert after == tiny.hf_greedy(model, prompt, 8) and after != before
    assert engine.runner.kv_cache is kv_cache and engine.runner.decoder.parameter_pointers() == pointers


def test_a_multimodal_wrapper_outside_the_table_is_named_by_its_own_model_type():
    """Llava's language model is a Llama, which the table has; the wrapper is what the engine does not run."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from reinforge.models.tiny import tiny_config
    from reinforge.rollout.native.model import unsupported_reason

    tower = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, image_size=28, patch_size=14)
    config = AutoConfig.for_model("llava", text_config=tiny_config("llama", vocab_size=64, num_layers=1).to_dict(),
                                  vision_config=tower, image_token_index=63)
    assert unsupported_reason(AutoModelForImageTextToText.from_config(config)) == (
        "LlavaForConditionalGeneration (model_type 'llava') has no entry in the architecture table "
        "(reinforge/models/architectures.py)")
