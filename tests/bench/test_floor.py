"""The rollout's bandwidth floor: the bytes its decode steps must read, over a device copy's rate."""

import numpy as np
import pytest

from reinforge.bench.floor import COPY_BYTES_PER_S, context_floor_ms, decode_weight_bytes, rollout_floor
from reinforge.bench.shapes import shape_config
from reinforge.engine.memory_plan import ModelShape


def shape(name: str) -> ModelShape:
    return ModelShape.from_hf_config(shape_config(name))


def test_qwen25_1_5b_at_8k_reads_its_kv_and_weights_in_36_seconds():
    model = shape("1.5b")
    assert model.kv_bytes_per_token(2) == 28_672  # 28 layers x 2 KV heads x head dim 128 x (K, V) x bf16
    assert decode_weight_bytes(model, np.array([128]))[0] == pytest.approx(3.09e9, rel=1e-3)
    floor = rollout_floor(model, [128] * 128, [8192] * 128)
    assert floor.decode_steps == 8192
    # a step at the mean context (128 + 4,095.5 cached tokens) reads 15.5 GB of KV and the weights: 4.4 ms
    assert floor.kv_bytes / 8192 == pytest.approx(128 * (128 + 4095.5) * 28_672)
    assert floor.seconds == pytest.approx(36.34, abs=0.01)
    assert floor.seconds == pytest.approx((floor.kv_bytes + floor.weight_bytes) / COPY_BYTES_PER_S)
    assert context_floor_ms(model, 128, 4224) == pytest.approx(4.44, abs=0.01)


def test_shorter_responses_stop_reading_when_they_end():
    model = shape("0.5b")
    long_and_short = rollout_floor(model, [10, 10], [100, 40])
    assert long_and_short.decode_steps == 100
    per_token = model.kv_bytes_per_token(2)
    assert long_and_short.kv_bytes == per_token * (sum(range(10, 110)) + sum(range(10, 50)))
    weights = decode_weight_bytes(model, np.array([1]))[0]
    assert long_and_short.weight_bytes == pytest.approx(100 * weights)  # one read a step, however many sequences
    assert rollout_floor(model, [10], [100], bytes_per_s=1e12).seconds == pytest.approx(
        rollout_floor(model, [10], [100]).seconds * COPY_BYTES_PER_S / 1e12)


def test_fp8_kv_halves_the_kv_bytes():
    model = shape("1.5b")
    bf16, fp8 = rollout_floor(model, [128] * 8, [4096] * 8), rollout_floor(model, [128] * 8, [4096] * 8, kv_value_bytes=1)
    assert fp8.kv_bytes == bf16.kv_bytes / 2 and fp8.weight_bytes == bf16.weight_bytes


def test_sliding_layers_read_at_most_their_window():
    mistral = shape("mistral-7b")  # every layer slides over 4,096 keys
    assert set(mistral.attention_windows) == {4096}
    assert rollout_floor(mistral, [0], [10_000]).kv_bytes == mistral.kv_bytes_per_token(2) * (
        sum(range(4096)) + (10_000 - 4096) * 4096)
    gemma = shape("gemma2-2b")  # even layers slide, odd ones see everything
    assert gemma.attention_windows[:4] == (4096, 0, 4096, 0)
    per_layer = gemma.kv_bytes_per_token(2) // gemma.num_layers
    assert rollout_floor(gemma, [0], [5000]).kv_bytes == per_layer * 13 * (
        sum(range(4096)) + 904 * 4096 + sum(range(5000)))
    assert shape("1.5b").attention_windows == ()  # Qwen2.5 leaves use_sliding_window off


def test_a_mixture_of_experts_reads_the_experts_its_batch_chooses():
    model = shape("qwen3-30b-a3b")  # 128 experts, top-8, in all 48 layers
    one, many = decode_weight_bytes(model, np.array([1, 512]))
    per_expert = 2 * 3 * model.hidden_size * model.expert_intermediate_size * model.num_layers
    assert many - one == pytest.approx(per_expert * 128 * ((1 - 8 / 128) - (1 - 8 / 128) ** 512))
    assert many == pytest.approx(2 * (model.num_params - model.vocab_size * model.hidden_size), rel=1e-3)


def test_latent_attention_reads_its_latent_and_rotary_key():
    # DeepSeek-V2-Lite's attention sizes: a 512-wide latent and a 64-wide rotary key per token and layer
    mla = ModelShape.from_hf_config(dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
        intermediate_size=10944, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))
    assert rollout_floor(mla, [0], [100]).kv_bytes == 27 * (512 + 64) * 2 * sum(range(100))
