"""The rollout's bandwidth floor: the bytes its decode steps must read, over a device copy's rate."""

import numpy as np
import pytest

from reinforge.bench.floor import (
    COPY_BYTES_PER_S,
    MATMUL_FLOPS_PER_S,
    context_floor_ms,
    decode_product_flops,
    decode_weight_bytes,
    kv_token_bytes,
    rollout_floor,
)
from reinforge.bench.shapes import shape_config
from reinforge.engine.memory_plan import ModelShape


def shape(name: str) -> ModelShape:
    return ModelShape.from_hf_config(shape_config(name))


def test_qwen25_1_5b_at_8k_reads_its_kv_and_weights_in_36_seconds():
    model = shape("1.5b")
    assert model.kv_bytes_per_token(2) == 28_672  # 28 layers x 2 KV heads x head dim 128 x (K, V) x bf16
    assert decode_weight_bytes(model, np.array([128]))[0] == pytest.approx(3.09e9, rel=1e-3)
    floor = rollout_floor(model, [128] * 128, [8192] * 128)
    assert floor.decode_steps == 8191  # the first token is the prefill's
    # a step at the mean context (128 + 4,096 cached tokens) reads 15.5 GB of KV and the weights: 4.4 ms
    assert floor.kv_bytes / 8191 == pytest.approx(128 * (128 + 4096) * 28_672)
    assert floor.seconds == pytest.approx(36.34, abs=0.01)
    assert floor.seconds == pytest.approx((floor.kv_bytes + floor.weight_bytes) / COPY_BYTES_PER_S)
    assert context_floor_ms(model, 128, 4224) == pytest.approx(4.44, abs=0.01)


def test_shorter_responses_stop_reading_when_they_end():
    model = shape("0.5b")
    long_and_short = rollout_floor(model, [10, 10], [100, 40])
    assert long_and_short.decode_steps == 99
    per_token = model.kv_bytes_per_token(2)
    assert long_and_short.kv_bytes == per_token * (sum(range(11, 110)) + sum(range(11, 50)))
    weights = decode_weight_bytes(model, np.array([1]))[0]
    assert long_and_short.weight_bytes == pytest.approx(99 * weights)  # one read a step, however many sequences
    assert rollout_floor(model, [10], [100], bytes_per_s=1e12).seconds == pytest.approx(
        rollout_floor(model, [10], [100]).seconds * COPY_BYTES_PER_S / 1e12)


def test_an_fp8_kv_cache_reads_a_byte_a_value_and_a_scale_per_token_and_kv_head():
    model = shape("1.5b")
    # 28 layers x (K, V) x 2 KV heads x (128 e4m3 values + a float32 scale): 132 bytes a head vector against 256
    assert kv_token_bytes(model, "fp8") == 28 * 2 * 2 * (128 + 4) == 14_784
    assert kv_token_bytes(model) == 28_672 and kv_token_bytes(model, "auto", 4) == 2 * 28_672
    bf16, fp8 = (rollout_floor(model, [128] * 8, [4096] * 8, kv_cache_dtype) for kv_cache_dtype in ("auto", "fp8"))
    assert fp8.kv_bytes == bf16.kv_bytes * 132 / 256 and fp8.weight_bytes == bf16.weight_bytes
    # the 128 x 8k step at the mean context reads 8.0 GB of fp8 KV and 3.1 GB of weights: 2.65 ms
    assert context_floor_ms(model, 128, 4224, "fp8") == pytest.approx(
        1e3 * (128 * 4224 * 14_784 + decode_weight_bytes(model, np.array([128]))[0]) / COPY_BYTES_PER_S)
    assert context_floor_ms(model, 128, 4224, "fp8") == pytest.approx(2.65, abs=0.01)
    assert rollout_floor(model, [128] * 128, [8192] * 128, "fp8").seconds == pytest.approx(21.66, abs=0.01)


def test_the_bench_counts_the_floor_by_the_runs_kv_cache_dtype():
    from argparse import Namespace

    from reinforge.bench.train import floor_dtypes
    from reinforge.config.schema import Config

    config = Config()
    assert floor_dtypes(config, Namespace(cpu=False)) == {"kv_cache_dtype": "auto", "value_bytes": 2}
    config.rollout.kv_cache_dtype = "fp8"
    assert floor_dtypes(config, Namespace(cpu=True)) == {"kv_cache_dtype": "fp8", "value_bytes": 4}
    model = shape("0.5b")  # 24 layers x 2 KV heads of 64: 68 bytes a fp8 head vector
    assert rollout_floor(model, [0], [10], **floor_dtypes(config, Namespace(cpu=False))).kv_bytes == \
        24 * 2 * 2 * 68 * sum(range(10))


def test_fp8_is_refused_for_latent_attention():
    mla = ModelShape.from_hf_config(dict(
        model_type="deepseek_v2", vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=512, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        num_experts_per_tok=6))
    with pytest.raises(ValueError, match=r"latent attention \(MLA\) keeps its compressed cache in the model dtype"):
        rollout_floor(mla, [0], [10], "fp8")


def test_sliding_layers_read_at_most_their_window():
    mistral = shape("mistral-7b")  # every layer slides over 4,096 keys
    assert set(mistral.attention_windows) == {4096}
    assert rollout_floor(mistral, [0], [10_000]).kv_bytes == mistral.kv_bytes_per_token(2) * (
        sum(range(1, 4096)) + (10_000 - 4096) * 4096)
    gemma = shape("gemma2-2b")  # even layers slide, odd ones see everything
    assert gemma.attention_windows[:4] == (4096, 0, 4096, 0)
    per_layer = gemma.kv_bytes_per_token(2) // gemma.num_layers
    assert rollout_floor(gemma, [0], [5000]).kv_bytes == per_layer * 13 * (
        sum(range(1, 4096)) + 904 * 4096 + sum(range(5000)))
    assert shape("1.5b").attention_windows == ()  # Qwen2.5 leaves use_sliding_window off


def test_a_mixture_of_experts_reads_the_experts_its_batch_chooses():
    model = shape("qwen3-30b-a3b")  # 128 experts, top-8, in all 48 layers
    one, many = decode_weight_bytes(model, np.array([1, 512]))
    per_expert = 2 * 3 * model.hidden_size * model.expert_intermediate_size * model.num_layers
    assert many - one == pytest.approx(per_expert * 128 * ((1 - 8 / 128) - (1 - 8 / 128) ** 512))
    assert many == pytest.approx(2 * (model.num_params - model.vocab_size * model.hidden_size), rel=1e-3)


def test_a_sequence_decodes_one_step_fewer_than_its_tokens_the_first_being_the_prefills():
    """The prefill samples a sequence's first token; decode step t feeds token t and reads the prompt's P cached
    tokens and the t generated ones, so R tokens take R - 1 steps reading P + 1 .. P + R - 1 tokens."""
    model = shape("0.5b")
    per_token = model.kv_bytes_per_token(2)
    floor = rollout_floor(model, [100, 7], [3, 1])  # the second ends with the prefill's token: no decode step
    assert floor.decode_steps == 2
    assert floor.kv_bytes == per_token * (101 + 102)
    assert floor.weight_bytes == pytest.approx(2 * decode_weight_bytes(model, np.array([1]))[0])
    assert rollout_floor(model, [5], [1]).seconds == 0.0


def test_latent_attention_reads_its_latent_and_rotary_key():
    # DeepSeek-V2-Lite's attention sizes: a 512-wide latent and a 64-wide rotary key per token and layer
    mla = ModelShape.from_hf_config(dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
        intermediate_size=10944, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts_per_tok=6))
    assert rollout_floor(mla, [0], [100]).kv_bytes == 27 * (512 + 64) * 2 * sum(range(1, 100))


def test_the_medians_leave_out_the_first_step_the_profiled_one_and_any_that_compiled_again():
    from reinforge.bench.train import measured_steps

    rows = [{"step": step} for step in (1, 2, 3, 4, 5)]
    assert [row["step"] for row in measured_steps(rows, None)] == [2, 3, 4, 5]
    assert [row["step"] for row in measured_steps(rows, 5)] == [2, 3, 4]
    assert [row["step"] for row in measured_steps(rows[:2], 2)] == [2]  # nothing else left: the profiled one
    assert [row["step"] for row in measured_steps(rows[:1], None)] == [1]
    compiled = [{"step": step, "compile_s": seconds} for step, seconds in ((1, 19.9), (2, 4.5), (3, 0.0), (4, 0.2))]
    assert [row["step"] for row in measured_steps(compiled, None)] == [3, 4]
    assert [row["step"] for row in measured_steps(compiled[:2], None)] == [2]  # nothing steady: the second step


def test_the_roofline_counts_products_that_many_sequences_make_compute_bound():
    gemma = shape("gemma2-2b")
    flops = decode_product_flops(gemma, np.array([512]))[0]
    assert flops == pytest.approx(2 * gemma.num_params * 512)  # tied embeddings: the head's weights are counted once
    assert flops == pytest.approx(2.68e12, rel=0.01)
    floor = rollout_floor(gemma, [128] * 512, [512] * 512)
    # each step's products take 3.35 ms at the matrix rate against 1.25 ms to read their weights
    steps_compute = floor.decode_steps * flops / MATMUL_FLOPS_PER_S
    assert floor.roofline_seconds == pytest.approx(floor.kv_bytes / COPY_BYTES_PER_S + steps_compute)
    assert floor.roofline_seconds > floor.seconds + 1.0
    assert floor.product_flops == pytest.approx(floor.decode_steps * flops)
    # 128 sequences of the 1.5B model read their weights longer than they multiply them: the two floors agree
    long = rollout_floor(shape("1.5b"), [128] * 128, [8192] * 128)
    assert long.roofline_seconds == pytest.approx(long.seconds)
    assert set(long.as_dict()) >= {"rollout_floor_roofline_s", "rollout_floor_product_tflop"}


def test_a_mixture_of_experts_multiplies_only_the_experts_a_token_runs_through():
    moe = shape("olmoe-1b-7b")
    assert decode_product_flops(moe, np.array([1]))[0] == pytest.approx(
        2 * (moe.num_active_params - moe.vocab_size * moe.hidden_size))
    assert moe.num_active_params < moe.num_params / 4


def test_a_prompts_samples_that_read_its_blocks_once_a_step_save_all_but_one_read_of_its_whole_blocks():
    """Two prompts of 40 tokens (two whole blocks of 16) with three samples each: while L of a prompt's samples
    live, a step reads its 32 whole-block tokens once instead of L times; the 8 tokens of its partial block and the
    generated ones stay each sample's own."""
    model = shape("0.5b")
    responses = [10, 30, 20, 5, 5, 50]
    plain = rollout_floor(model, [40] * 6, responses)
    assert plain.shared_prompt_seconds is None and "rollout_floor_shared_prompts_s" not in plain.as_dict()
    grouped = rollout_floor(model, [40] * 6, responses, groups=["a", "a", "a", "b", "b", "b"], page=16)
    saved_tokens = 32 * ((9 + 29 + 19 - 29) + (4 + 4 + 49 - 49))  # each sample's decode steps: its tokens less one
    assert grouped.seconds == plain.seconds
    assert grouped.shared_prompt_seconds == pytest.approx(
        plain.seconds - saved_tokens * model.kv_bytes_per_token(2) / COPY_BYTES_PER_S)
    assert rollout_floor(model, [40] * 6, responses, groups=list(range(6))).shared_prompt_seconds == plain.seconds
    standard = rollout_floor(model, [128] * 512, [512] * 512, groups=[row // 8 for row in range(512)])
    assert standard.shared_prompt_seconds / standard.seconds == pytest.approx(
        1 - 7 / 8 * 128 * 512 * 511 * model.kv_bytes_per_token(2) / COPY_BYTES_PER_S / standard.seconds)


def test_a_window_that_holds_every_context_shares_the_prompt_and_one_that_slides_past_it_does_not():
    """Phi-3-mini's layers all slide over 2,047 tokens: a 640-token context never leaves the window, so each of
    its layers reads a prompt's blocks once a step; past the window the floor counts no saving on them."""
    model = shape("phi3-mini")
    groups = [row // 8 for row in range(16)]
    short_plain = rollout_floor(model, [128] * 16, [512] * 16)
    short = rollout_floor(model, [128] * 16, [512] * 16, groups=groups)
    assert short.shared_prompt_seconds == pytest.approx(
        short_plain.seconds - 7 / 8 * 128 * 16 * 511 * model.kv_bytes_per_token(2) / COPY_BYTES_PER_S)
    long = rollout_floor(model, [128] * 16, [4096] * 16, groups=groups)
    assert long.shared_prompt_seconds == long.seconds
