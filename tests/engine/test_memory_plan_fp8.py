"""The memory planner's fp8 KV cache: the pool it sizes holds the blocks the engine allocates, scales included."""

from __future__ import annotations

import math

import pytest

from reinforge.bench.shapes import shape_config
from reinforge.engine.memory_plan import KV_BLOCK_TOKENS, GiB, ModelShape, plan_memory
from reinforge.rollout.native.kv_quant import block_bytes

H200_GIB = 139


@pytest.mark.parametrize("size", ["0.5b", "1.5b"])
def test_the_fp8_pool_the_plan_gives_the_engine_holds_every_32k_sequence_and_its_lookahead_token(size):
    from reinforge.config.schema import Config
    from reinforge.workers.memory_settings import config_values, run_shape

    model = ModelShape.from_hf_config(shape_config(size))
    config = Config()
    config.data.train_batch_size, config.data.max_prompt_length = 8, 128
    config.data.max_response_length, config.trainer.gpu_memory_gib = 32768, H200_GIB
    config.rollout.name, config.rollout.kv_cache_dtype = "native", "fp8"  # the hf backend's cache is bf16
    run = run_shape(config)
    plan = plan_memory(model, run, {}, H200_GIB * GiB, 1000 * GiB)
    gib = config_values(plan.settings, model, run)["rollout.kv_cache_gib"]
    # the engine's fp8 block: every layer's K and V, each its e4m3 values then a float32 scale per token and head
    engine_block = model.num_layers * 2 * block_bytes(KV_BLOCK_TOKENS, model.num_kv_heads, model.head_dim)
    engine_blocks = math.ceil(gib * GiB / engine_block)  # as the rollout side sizes the engine's pool
    assert engine_blocks >= 8 * 8 * math.ceil((128 + 32768 + 1) / KV_BLOCK_TOKENS)
    # and no more than the MiB the plan rounds up to: the scales are counted, not padded for
    assert gib * GiB - 64 * 2057 * engine_block < 2**20


def test_the_planner_counts_an_engines_fp8_block_as_the_engine_allocates_it():
    from reinforge.models.tiny import build_tiny_causal_lm
    from reinforge.rollout.native import NativeEngine

    lm = build_tiny_causal_lm("qwen2", vocab_size=128, num_layers=2, max_position_embeddings=64)
    model = ModelShape.from_hf_config(lm.config.to_dict())
    engine = NativeEngine(lm, eos_token_ids=[], max_model_len=64, block_size=8, kv_cache_dtype="fp8")
    assert engine.runner.kv_bytes_per_block() == model.kv_block_bytes(8, "fp8")
    assert model.kv_block_bytes(8, "fp8") > 8 * model.kv_bytes_per_token(1)  # a byte a value, and the scales
