"""The memory planner on long responses (8k to 32k tokens): every case fits one H200 with the planner's defaults."""

from __future__ import annotations

import math
import re

import pytest

from reinforge.bench.shapes import shape_config
from reinforge.engine.memory_plan import (
    KV_BLOCK_TOKENS,
    LOGITS_CHUNK_ROWS,
    GiB,
    ModelShape,
    RunShape,
    estimate,
    micro_batch_split,
    needed_kv_gib,
    plan_memory,
)
from reinforge.engine.micro_batches import micro_batch_loads, split_group

H200_GIB = 139
LONG_CASES = [("0.5b", 16, 8192), ("0.5b", 16, 16384), ("0.5b", 8, 32768),
              ("1.5b", 16, 8192), ("1.5b", 16, 16384), ("1.5b", 8, 32768)]


def shape(name: str) -> ModelShape:
    return ModelShape.from_hf_config(shape_config(name))


@pytest.mark.parametrize("size, prompts, response", LONG_CASES)
def test_long_responses_fit_an_h200_without_offloading(size, prompts, response):
    model, run = shape(size), RunShape(prompts=prompts, samples_per_prompt=8, prompt_length=128,
                                       response_length=response)
    plan = plan_memory(model, run, {}, H200_GIB * GiB, 1000 * GiB)
    settings = plan.settings
    assert plan.fits and not (settings.optimizer_offload or settings.param_offload)
    # a whole sequence goes into one micro-batch, and none is larger than the budget
    budget = settings.micro_batch_tokens
    assert budget >= 128 + response
    count, largest = micro_batch_split(run, budget)
    assert largest <= budget and count >= prompts * 8 * (128 + response) // budget
    # the logits kept for the backward stay within their buffer, or go LOGITS_CHUNK_ROWS rows at a time
    update = plan.phases["update"]
    kept = largest * run.response_fraction * model.vocab_size * 2
    assert update["logits"] == (kept if kept <= settings.logits_buffer_gib * GiB
                                else LOGITS_CHUNK_ROWS * model.vocab_size * 12)
    assert update["logits"] <= settings.logits_buffer_gib * GiB
    # the rollout's KV cache holds every sequence at full length (all of them decode at once)
    assert settings.kv_cache_gib == 0.0
    assert plan.phases["rollout"]["kv cache"] >= prompts * 8 * (128 + response) * model.kv_bytes_per_token(2)


def test_the_largest_case_keeps_a_32k_sequence_whole_and_frees_the_engine_for_the_update():
    model, run = shape("1.5b"), RunShape(8, 8, 128, 32768)
    plan = plan_memory(model, run, {}, H200_GIB * GiB, 1000 * GiB)
    # two 32,896-token sequences exceed 65,536: each micro-batch holds one
    assert plan.settings.micro_batch_tokens == 65536 and micro_batch_split(run, 65536) == (64, 32896)
    # 64 sequences x 2,057 blocks of 16 tokens x 28,672 bytes: 56.3 GiB, more than the update can keep beside it
    assert plan.phases["rollout"]["kv cache"] == 64 * 2057 * 16 * 28_672
    assert not plan.settings.keep_rollout_memory and "kv cache" not in plan.phases["update"]
    phase, peak = plan.peak
    assert peak <= plan.gpu_budget and phase == "update"


def test_micro_batches_of_long_groups_never_exceed_the_budget():
    for response, budget in ((8192, 49152), (16384, 49152), (16384, 65536), (32768, 65536)):
        items = [cost for _, cost in split_group(128, [response] * 8, budget)] * 16
        loads = micro_batch_loads(items, budget)
        assert max(loads) <= budget and sum(loads) == sum(items), (response, budget)


@pytest.mark.parametrize("size, prompts, response", LONG_CASES)
def test_the_kv_pool_the_plan_gives_the_engine_holds_every_sequence_and_its_lookahead_token(size, prompts, response):
    from reinforge.config.schema import Config
    from reinforge.workers.memory_settings import config_values, run_shape

    model = shape(size)
    config = Config()
    config.data.train_batch_size, config.data.max_prompt_length = prompts, 128
    config.data.max_response_length, config.trainer.gpu_memory_gib = response, H200_GIB
    run = run_shape(config)
    plan = plan_memory(model, run, {}, H200_GIB * GiB, 1000 * GiB)
    gib = config_values(plan.settings, model, run)["rollout.kv_cache_gib"]
    block_bytes = KV_BLOCK_TOKENS * model.kv_bytes_per_token(2)
    engine_blocks = math.ceil(gib * GiB / block_bytes)  # as the rollout side sizes the engine's pool
    # a decode step launched ahead holds room for one token past the sequence's length
    assert engine_blocks >= prompts * 8 * math.ceil((128 + response + 1) / KV_BLOCK_TOKENS)


def test_an_fp8_kv_cache_takes_132_of_bf16s_256_bytes_a_head_vector():
    model = shape("1.5b")  # 128-dim heads: 128 e4m3 values and a float32 scale
    bf16, fp8 = RunShape(8, 8, 128, 32768), RunShape(8, 8, 128, 32768, kv_cache_dtype="fp8")
    assert needed_kv_gib(model, fp8) == pytest.approx(needed_kv_gib(model, bf16) * 132 / 256)
    assert estimate(model, fp8, plan_memory(model, fp8, {}, H200_GIB * GiB, 1000 * GiB).settings)[0][
        "rollout"]["kv cache"] == pytest.approx(needed_kv_gib(model, bf16) * 132 / 256 * GiB)


def test_plan_takes_the_workload_flags_of_bench_train(capsys):
    from reinforge.cli import main

    assert main(["plan", "--model", "1.5b", "--prompts", "8", "--response-tokens", "32768", "--gpu-memory-gib", "139",
                 "--host-memory-gib", "1000", "trainer.device=cuda"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("memory plan: peak 102.7 of 130.7 usable GiB on the device (update)")
    assert "actor.keep_gathered                  True       (auto)" in table  # one device, room to spare
    assert "actor.max_tokens_per_micro_batch     65536" in table
    assert "  device, rollout: 82.3 GiB with a KV cache of 56.2 GiB" in table
    # a flag sets what the bench's workload set; an override after it still wins
    assert main(["plan", "--model", "1.5b", "--prompts", "8", "--response-tokens", "32768", "--gpu-memory-gib", "139",
                 "--host-memory-gib", "1000", "trainer.device=cuda", "data.max_response_length=8192"]) == 0
    assert "KV cache of 14.2 GiB" in capsys.readouterr().out


def test_a_kv_cache_size_that_cannot_hold_one_sequence_is_refused_in_one_line(capsys, caplog):
    from reinforge.cli import main

    workload = ["--model", "1.5b", "--prompts", "8", "--response-tokens", "32768", "--gpu-memory-gib", "139",
                "--host-memory-gib", "1000", "trainer.device=cuda"]
    assert main(["plan", *workload, "rollout.kv_cache_gib=0"]) == 2
    assert "rollout.kv_cache_gib=0 leaves the native engine no KV cache" in capsys.readouterr().err
    assert main(["plan", *workload, "rollout.kv_cache_gib=0.5"]) == 2
    error = capsys.readouterr().err
    assert ("rollout.kv_cache_gib=0.5 cannot hold one sequence of data.max_prompt_length + data.max_response_length "
            "= 32896 tokens") in error and "raise it to at least 0.88" in error and error.count("\n") == 1
    assert main(["plan", *workload, "rollout.kv_cache_gib=1"]) == 0
    capsys.readouterr()
    # past the shape's 32,768 positions: plan warns as train does, naming the shape
    assert "more than the 32768 positions the 1.5b shape was trained on" in caplog.text


def test_a_refused_long_plan_names_the_fp8_kv_cache_where_it_would_fit(capsys):
    from reinforge.cli import main

    assert main(["plan", "--model", "1.5b", "--prompts", "8", "--response-tokens", "65536", "--gpu-memory-gib", "24",
                 "--host-memory-gib", "1000", "trainer.device=cuda"]) == 2
    error = capsys.readouterr().err
    assert "would fit with rollout.kv_cache_dtype=fp8" in error and "set " not in error.split("would fit")[1][:5]
    # the hf backend keeps its cache in the model dtype, whatever rollout.kv_cache_dtype says
    assert main(["plan", "--model", "1.5b", "--prompts", "8", "--response-tokens", "65536", "--gpu-memory-gib", "24",
                 "--host-memory-gib", "1000", "trainer.device=cuda", "rollout.name=hf"]) == 2
    error = capsys.readouterr().err
    assert "would fit with data.max_response_length=32768" in error and "kv_cache_dtype" not in error


def test_a_refusal_on_a_gpu_without_fp8_kernels_does_not_name_the_fp8_cache(capsys, monkeypatch):
    """On an A100 (compute capability 8.0) the engine refuses an fp8 cache: the plan's refusal named it as the fix."""
    import torch

    from reinforge.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert main(["plan", "--model", "1.5b", "--prompts", "8", "--response-tokens", "65536", "--gpu-memory-gib", "24",
                 "--host-memory-gib", "1000", "trainer.device=cuda"]) == 2
    error = capsys.readouterr().err
    assert "would fit with data.max_response_length=32768" in error and "kv_cache_dtype" not in error


def test_a_refusal_names_a_smaller_kv_cache_that_would_fit_and_that_cache_fits():
    """Mistral-7B's standard step on 24 GiB fits with a cache of a sixteenth of its sequences, below the eighth the
    planner goes down to; the refusal named only other workloads and the fp8 cache."""
    from reinforge.engine.memory_plan import GiB, MemoryPlanError, ModelShape, RunShape, plan_memory

    mistral = ModelShape.from_hf_config(dict(
        model_type="mistral", vocab_size=32768, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=14336, tie_word_embeddings=False))
    run = RunShape(prompts=64, samples_per_prompt=8, prompt_length=128, response_length=512)
    # what the plan takes there anyway, fixed as the run fixes a setting: fewer combinations to search
    fixed = dict(keep_rollout_memory=False, optimizer_offload=True, param_offload=True, ref_offload=False)
    with pytest.raises(MemoryPlanError) as refusal:
        plan_memory(mistral, run, fixed, 24 * GiB, 128 * GiB, frozenset(fixed))
    size = float(re.search(r"rollout.kv_cache_gib=([\d.]+) \(1/16 of a step's sequences at once\)",
                           str(refusal.value)).group(1))
    assert plan_memory(mistral, run, {**fixed, "kv_cache_gib": size}, 24 * GiB, 128 * GiB).fits
