"""An engine whose caller says the weights never change (serving, benchmarks) reads them in place: one copy."""

from __future__ import annotations

import pytest
import torch

from reinforge.models.tiny import build_tiny_causal_lm
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine

PROMPTS = [[5, 9, 33, 2], [17, 4, 250, 61, 8, 90, 3, 11, 47]]


def generate(engine: NativeEngine) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=6, temperature=0.0)
    return [samples[0].token_ids for samples in engine.generate([GenerationRequest(p, sampling) for p in PROMPTS])]


def test_fixed_weights_are_read_in_place_and_generate_as_a_copy_does():
    # trainable parameters (as a loaded HF model has them): without the promise the engine copies every one
    model = build_tiny_causal_lm("qwen3_moe", seed=4, max_position_embeddings=64).eval()
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    copied = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=8, max_num_seqs=4)
    copied.wake_up()
    assert not copied.runner.decoder.weights.shared
    assert copied.runner.decoder.weights.layers[0]["experts_gate_up"].data_ptr() != experts.data_ptr()
    reference = generate(copied)
    copied.sleep()

    fixed = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=8, max_num_seqs=4, weights_fixed=True)
    fixed.wake_up()
    weights = fixed.runner.decoder.weights
    inner = model.model
    assert weights.layers[0]["experts_gate_up"].data_ptr() == experts.data_ptr()
    assert weights.layers[1]["experts_down"].data_ptr() == inner.layers[1].mlp.experts.down_proj.data_ptr()
    assert weights.embed.data_ptr() == inner.embed_tokens.weight.data_ptr()
    assert weights.final_norm.data_ptr() == inner.norm.weight.data_ptr()
    assert weights.layers[0]["o_weight"].data_ptr() == inner.layers[0].self_attn.o_proj.weight.data_ptr()
    own = sum(tensor.nbytes for tensor in weights.tensors() if not weights.is_shared(tensor))
    assert weights.shared_bytes() > 4 * own  # the experts dominate: only the q|k|v groups are the engine's own
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    assert generate(fixed) == reference
    # a sync of the same model (a server's wake-up) refreshes nothing it shares and writes nothing into the model
    fixed.sync_weights(model)
    assert generate(fixed) == reference
    fixed.sleep()
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), f"the engine wrote into {name}"


def test_reinforge_serve_reads_the_served_models_weights_in_place(tiny_model_dir):
    from reinforge.serve.command import build_client, load_model

    model, tokenizer = load_model(str(tiny_model_dir), None, "float32", torch.device("cpu"))
    client, name = build_client(model, tokenizer, "native", 256, 0.5, max_num_seqs=4)
    assert name == "native"
    client.engine.wake_up()
    weights = client.engine.runner.decoder.weights
    inner = model.model
    assert weights.embed.data_ptr() == inner.embed_tokens.weight.data_ptr()
    assert weights.layers[0]["o_weight"].data_ptr() == inner.layers[0].self_attn.o_proj.weight.data_ptr()
    assert weights.layers[0]["down_weight"].data_ptr() == inner.layers[0].mlp.down_proj.weight.data_ptr()
    client.engine.sleep()


@pytest.mark.gpu
def test_fixed_weights_take_no_second_copy_of_the_experts_on_the_device():
    model = build_tiny_causal_lm("qwen3_moe", seed=4, max_position_embeddings=64).eval().to("cuda", torch.bfloat16)
    experts = sum(p.nbytes for name, p in model.named_parameters() if ".experts." in name)
    awake = {}
    for fixed in (False, True):
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=8, max_num_seqs=4,
                              num_kv_blocks=16, weights_fixed=fixed)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        engine.runner.load_weights()
        awake[fixed] = torch.cuda.memory_allocated() - before
        assert len(generate(engine)) == len(PROMPTS)
        engine.sleep()
    assert awake[False] - awake[True] >= experts
