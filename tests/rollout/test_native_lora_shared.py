"""A LoRA actor's native engine reads the frozen base in place: one copy of the experts on the device.

The engine shares the storage of every frozen parameter it would copy unchanged (experts, routers, norms,
embeddings) and keeps its own copy only of the adapted projections (and the q|k|v group they belong to), where
the adapters' deltas go. Generation equals the adapted model's, before and after the adapters change.
"""

from __future__ import annotations

import copy

import pytest
import torch

from reinforge.config.schema import LoraConfig
from reinforge.engine.lora import add_lora, lora_deltas
from reinforge.models.tiny import build_tiny_causal_lm
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.native.model import whole

PROMPTS = [[5, 9, 33, 2], [17, 4, 250, 61, 8, 90, 3, 11, 47], [100, 7]]
NEW_TOKENS = 6


def adapted_moe(seed: int = 3, **options) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Qwen3-MoE (untied head) with rank-4 adapters on the default targets (its attention, and the MLPs of its
    dense layers if ``options`` give it some), lora_B random (the adapters act)."""
    model = build_tiny_causal_lm("qwen3_moe", seed=seed, max_position_embeddings=64, tie_word_embeddings=False,
                                 **options).eval()
    peft_model = add_lora(model, LoraConfig(rank=4, alpha=8.0), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model, peft_model


def greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (peft's layers, adapters unmerged) and their log-probs from one forward."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        logits = model(torch.tensor([tokens])).logits[0, len(prompt) - 1:-1].float()
    generated = tokens[len(prompt):]
    return generated, torch.log_softmax(logits, -1).gather(1, torch.tensor(generated)[:, None])[:, 0]


def rollout(engine: NativeEngine, model: torch.nn.Module, peft_model: torch.nn.Module) -> list:
    """What the actor's rollout does (workers.rollout_side.CopiedWeights): sync, wake, add the deltas, generate."""
    engine.sync_weights(model)
    engine.wake_up()
    engine.add_to_weights(lora_deltas(peft_model))
    completions = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
                                   for prompt in PROMPTS])
    return [samples[0] for samples in completions]


def assert_generates_as(completions: list, reference: torch.nn.Module) -> None:
    for prompt, sample in zip(PROMPTS, completions, strict=True):
        tokens, log_probs = greedy(reference, prompt)
        assert sample.token_ids == tokens
        torch.testing.assert_close(torch.tensor(sample.log_probs), log_probs, atol=1e-5, rtol=0)


def test_the_sharded_lora_actors_engine_reads_frozen_weights_in_place_and_follows_adapter_updates():
    from reinforge.engine.fsdp import shard_model

    model, peft_model = adapted_moe()
    reference = copy.deepcopy(peft_model).base_model.model  # unsharded, adapters unmerged
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=8, max_num_seqs=4,
                          free_on_sleep=False)  # built before sharding, as the actor does
    shard_model(model, torch.device("cpu"))
    frozen_before = {name: whole(parameter).clone() for name, parameter in model.named_parameters()
                     if not parameter.requires_grad}

    assert_generates_as(rollout(engine, model, peft_model), reference)
    weights = engine.runner.decoder.weights
    inner = model.model
    for index, layer in enumerate(inner.layers):
        copies = weights.layers[index]
        for name, parameter in (("experts_gate_up", layer.mlp.experts.gate_up_proj),
                                ("experts_down", layer.mlp.experts.down_proj), ("router", layer.mlp.gate.weight),
                                ("input_layernorm", layer.input_layernorm.weight)):
            assert copies[name].data_ptr() == whole(parameter).data_ptr(), name
        adapted = whole(layer.self_attn.q_proj.base_layer.weight)
        assert weights.layers[index]["qkv_weight"].data_ptr() != adapted.data_ptr()
    assert weights.embed.data_ptr() == whole(inner.embed_tokens.weight).data_ptr()
    assert weights.lm_head.data_ptr() == whole(model.lm_head.weight).data_ptr()
    pointers = engine.runner.decoder.parameter_pointers()
    engine.sleep()

    with torch.no_grad():  # an update: every adapter moves, the base stays
        for model_, generator in ((model, torch.Generator().manual_seed(8)), (reference, torch.Generator().manual_seed(8))):
            for name, parameter in model_.named_parameters():
                if "lora_" in name:
                    local = whole(parameter)
                    local.add_(torch.randn(local.shape, generator=generator) * 0.2)
    assert_generates_as(rollout(engine, model, peft_model), reference)
    assert engine.runner.decoder.parameter_pointers() == pointers  # refreshed in place: graphs stay valid
    engine.sleep()
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            assert torch.equal(whole(parameter), frozen_before[name]), f"the engine wrote into {name}"


@pytest.mark.parametrize("dense", [{"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}])
def test_adapters_on_the_dense_mlp_of_a_qwen3_moe_reach_the_engine_the_export_and_the_adapter_folder(tmp_path, dense):
    """A Qwen3-MoE's dense layers (``mlp_only_layers``, or those ``decoder_sparse_step`` skips: layer 0 here) have
    gate/up/down projections, which the default targets adapt beside the attention. The sharded actor's engine
    generates as the adapted model does, and the merged weights and the adapter folder compute what it computes."""
    from reinforge.engine.fsdp import full_model_state, shard_model
    from reinforge.engine.lora import adapter_state, merge_lora_weights, write_adapter_folder
    from reinforge.models.export import save_hf_folder
    from reinforge.models.tiny import build_char_tokenizer
    from reinforge.serve.command import load_model

    model, peft_model = adapted_moe(seed=5, **dense)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in model.named_parameters() if ".lora_A." in name}
    assert {f"model.layers.0.mlp.{name}" for name in ("gate_proj", "up_proj", "down_proj")} <= adapted
    assert not any(".layers.1.mlp." in name for name in adapted)  # the experts of layer 1 stay frozen
    reference = copy.deepcopy(peft_model).base_model.model
    base = build_tiny_causal_lm("qwen3_moe", seed=5, max_position_embeddings=64, tie_word_embeddings=False, **dense)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=8, max_num_seqs=4,
                          free_on_sleep=False)
    shard_model(model, torch.device("cpu"))
    assert_generates_as(rollout(engine, model, peft_model), reference)
    engine.sleep()

    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        expected = reference(ids).logits
    state = full_model_state(model)
    merged = copy.deepcopy(base)
    merged.load_state_dict(merge_lora_weights(dict(state), 2.0))
    write_adapter_folder(tmp_path / "adapter", adapter_state(state), LoraConfig(rank=4, alpha=8.0), "base")
    tokenizer = build_char_tokenizer()
    save_hf_folder(base, tokenizer, tmp_path / "base")
    served, _ = load_model(str(tmp_path / "base"), str(tmp_path / "adapter"), "float32", torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(served(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_a_model_with_nothing_to_train_is_copied_whole():
    """The off-policy rollout copy (no trainable parameter): syncs overwrite it, so the engine keeps its own copy."""
    model = build_tiny_causal_lm("qwen3_moe", seed=4, max_position_embeddings=64).eval().requires_grad_(False)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=8, max_num_seqs=4)
    engine.sync_weights(model)
    engine.wake_up()
    weights = engine.runner.decoder.weights
    assert not weights.shared
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    assert weights.layers[0]["experts_gate_up"].data_ptr() != experts.data_ptr()
    engine.sleep()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_unsharded_lora_model_shares_its_experts_and_the_adapted_rows_stay_its_own(device):
    """The engine's device named as the worker names it (``cuda``, no index) is where the parameters are."""
    model, peft_model = adapted_moe(seed=5)
    model.to(device)
    reference = copy.deepcopy(peft_model).base_model.model
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=8, max_num_seqs=4,
                          device=torch.device(device))
    if device == "cpu":
        assert_generates_as(rollout(engine, model, peft_model), reference)
    else:
        rollout(engine, model, peft_model)
    weights = engine.runner.decoder.weights
    experts = model.model.layers[1].mlp.experts
    assert weights.layers[1]["experts_down"].data_ptr() == experts.down_proj.data_ptr()
    assert weights.shared_bytes() > sum(tensor.nbytes for copies in weights.layers for name, tensor in copies.items()
                                        if tensor is not None and not weights.is_shared(tensor))
    slices = weights.linear_slices(model)
    assert id(model.model.layers[1].self_attn.o_proj) in slices
    assert all(not weights.is_shared(rows) for rows in slices.values())
    engine.sleep()


def test_the_lora_actors_rollouts_score_as_its_updated_model_with_the_experts_held_once(tmp_path):
    """The whole worker on the CPU: a random-weights Qwen3-MoE folder, LoRA on the attention, the native engine
    keeping its memory between rollouts. After an update the next rollout's log-probs are the updated model's."""
    import numpy as np

    from reinforge.config.schema import Config
    from reinforge.models import build_char_tokenizer
    from reinforge.models.random_weights import write_random_weights_folder
    from reinforge.models.tiny import tiny_config
    from reinforge.protocol import Batch
    from reinforge.rollout.base import SamplingParams
    from reinforge.workers.actor_rollout import ActorRolloutWorker

    tokenizer = build_char_tokenizer()
    folder = write_random_weights_folder(tmp_path / "model", tiny_config(
        "qwen3_moe", vocab_size=len(tokenizer), tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id), tokenizer, seed=6)
    config = Config()
    config.model.path = str(folder)
    config.trainer.device = "cpu"
    config.rollout.name = "native"
    config.rollout.free_cache_engine = False
    config.rollout.gpu_memory_utilization = 0.5
    config.model.lora.rank, config.model.lora.alpha = 4, 8.0
    config.model.lora.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    config.actor.optim.lr = 0.05
    config.data.train_batch_size, config.data.max_prompt_length, config.data.max_response_length = 2, 8, 6
    worker = ActorRolloutWorker(config, total_training_steps=2)
    prompts = torch.randint(3, 60, (2, 8), generator=torch.Generator().manual_seed(1))
    batch = Batch.from_dict(tensors={"input_ids": prompts, "attention_mask": torch.ones_like(prompts)},
                            non_tensors={"uid": np.array(["a", "b"], dtype=object)})
    sampling = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)

    def rollout(seed: int) -> Batch:
        generated = worker.generate(batch, sampling, seed)
        scored = worker.compute_log_prob(generated)
        torch.testing.assert_close(generated["rollout_log_probs"], scored["old_log_probs"], atol=1e-4, rtol=0)
        return generated

    first = rollout(0)
    weights = worker.rollout_engine.runner.decoder.weights
    experts = worker.model.model.layers[1].mlp.experts.gate_up_proj
    assert weights.layers[1]["experts_gate_up"].data_ptr() == whole(experts).data_ptr()
    first["advantages"] = torch.randn(first["response_mask"].shape, generator=torch.Generator().manual_seed(2))
    worker.update_actor(first)
    second = rollout(0)
    assert worker.rollout_engine.runner.decoder.weights is weights  # kept, refreshed in place
    assert not torch.equal(second["rollout_log_probs"], first["rollout_log_probs"])  # the adapters moved
