"""The memory planner's KV cache for models whose full and sliding layers keep separate pools.

The plan asks for the bytes from which the native engine's split (``models/kv_layout.py``) gives its full pool
every sequence of a step plus the lookahead token and each sliding pool what it can use: one full-length sequence
and every other sequence's window. Gemma 2 and Gemma 3 at long responses ask for far less than a cache of every
layer at full length; models without windows are planned as before.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig

from reinforge.bench.shapes import shape_config
from reinforge.config.schema import Config
from reinforge.engine.memory_plan import (
    KV_BLOCK_TOKENS,
    GiB,
    ModelShape,
    RunShape,
    kv_pool_blocks,
    needed_kv_gib,
    plan_memory,
)
from reinforge.models.architectures import FAMILIES, architecture_spec
from reinforge.models.kv_layout import split_pool_blocks, window_pool_blocks
from reinforge.models.tiny import FAMILY_OPTIONS, build_tiny_causal_lm
from reinforge.rollout.native import NativeEngine
from reinforge.workers.rollout_side import planned_concurrency

GEMMA3_4B = dict(
    model_type="gemma3_text", vocab_size=262208, hidden_size=2560, num_hidden_layers=34, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, intermediate_size=10240, sliding_window=1024,
    layer_types=["full_attention" if (index + 1) % 6 == 0 else "sliding_attention" for index in range(34)],
    query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
"""A Gemma-3-4B-like text model: five sliding layers (window 1,024) per full one."""

PROMPT, RESPONSE, PROMPTS, SAMPLES = 128, 8192, 16, 8


def run_shape(response: int = RESPONSE, dtype_bytes: int = 2) -> RunShape:
    return RunShape(prompts=PROMPTS, samples_per_prompt=SAMPLES, prompt_length=PROMPT, response_length=response,
                    dtype_bytes=dtype_bytes)


def every_layer_gib(shape: ModelShape, run: RunShape) -> float:
    """A cache that keeps every layer's keys for every sequence at full length."""
    blocks = -(-(run.prompt_length + run.response_length + 1) // KV_BLOCK_TOKENS)
    return run.sequences * blocks * shape.kv_block_bytes(KV_BLOCK_TOKENS, run.kv_cache_dtype, run.dtype_bytes) / GiB


@pytest.mark.parametrize("config, window, response, most", [
    (shape_config("gemma2-2b"), 4096, 8192, 0.76), (shape_config("gemma2-2b"), 4096, 32768, 0.6),
    (GEMMA3_4B, 1024, 8192, 0.3), (GEMMA3_4B, 1024, 32768, 0.2)])
def test_the_engine_split_of_the_planned_bytes_holds_every_sequence(config, window, response, most):
    """The engine's split of the planned bytes gives the full pool every sequence's blocks plus the lookahead and
    the sliding pool what the engine lets it use; the plan is at most ``most`` of a cache of every layer."""
    shape, run = ModelShape.from_hf_config(config), run_shape(response)
    sizes, counts = kv_pool_blocks(shape, run)
    length = PROMPT + response
    caps = [window_pool_blocks(None, run.sequences, length, KV_BLOCK_TOKENS),
            window_pool_blocks(window, run.sequences, length, KV_BLOCK_TOKENS)]
    assert split_pool_blocks(needed_kv_gib(shape, run) * GiB, sizes, caps) == counts
    assert counts[0] == run.sequences * -(-(length + 1) // KV_BLOCK_TOKENS)
    assert counts[1] == min(counts[0], caps[1])
    assert needed_kv_gib(shape, run) <= most * every_layer_gib(shape, run)


@pytest.mark.parametrize("family, layers, window", [("gemma2", 4, 4096), ("gemma3_text", 6, 1024)])
def test_an_engine_given_the_planned_bytes_holds_every_sequence_in_each_pool(family, layers, window):
    """A tiny model of the same layer pattern: the engine's pools from the plan's bytes are the plan's counts."""
    model = build_tiny_causal_lm(family, vocab_size=128, num_layers=layers, sliding_window=window).eval()
    shape, run = ModelShape.from_hf_config(model.config.to_dict()), run_shape(dtype_bytes=4)
    planned = math.ceil(needed_kv_gib(shape, run) * GiB)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=PROMPT + RESPONSE, use_triton=False,
                          device=torch.device("cpu"), kv_cache_bytes=planned, max_num_seqs=run.sequences)
    counts = engine._num_kv_blocks()
    assert counts == kv_pool_blocks(shape, run)[1]
    assert counts[0] >= run.sequences * -(-(PROMPT + RESPONSE + 1) // KV_BLOCK_TOKENS)
    held = sum(engine.runner.kv_bytes_per_block(group) * count for group, count in enumerate(counts))
    assert planned - engine.runner.kv_bytes_per_block(0) < held <= planned


WINDOW_SETTINGS = ({"sliding_window": 6}, {"sliding_window": 6, "use_sliding_window": True},
                   {"sliding_window": 6, "use_sliding_window": True, "max_window_layers": 1},
                   {"sliding_window": 6, "use_sliding_window": True, "max_window_layers": 3},
                   {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"] * 2})
"""Window keys of a config.json, each read by some families and ignored by others."""


@pytest.mark.parametrize("family", FAMILIES)
def test_the_planner_slides_the_layers_the_model_slides(family):
    """Qwen3-MoE with use_sliding_window and max_window_layers=1 slides every layer in transformers and the native
    engine (``architecture_spec``), where the planner read Qwen2's rule and kept layer 0 whole; Mistral, Phi-3 and
    Mixtral slide every layer whatever layer_types say. The planner's windows are the model's, for each family of the
    table, from the config.json as written and as transformers saves it."""
    text_type = "gemma3_text" if family == "gemma3" else family
    sizes = dict(model_type=text_type, vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4 if family.startswith("deepseek") else 2, intermediate_size=96,
                 **FAMILY_OPTIONS[text_type])
    compared = 0
    for window_keys in WINDOW_SETTINGS:
        given = sizes | window_keys
        if family == "gemma3":  # the multimodal wrapper: its language model's config
            given = dict(model_type="gemma3", text_config=given, vision_config=dict(num_hidden_layers=1))
        try:
            config = AutoConfig.for_model(**given)
            spec = architecture_spec(config)
        except ValueError:  # a config transformers cannot run (Qwen's sliding layer_types without use_sliding_window)
            continue
        windows = tuple(layer.sliding_window or 0 for layer in spec.layers)
        for written in (given, config.to_dict()):
            assert (ModelShape.from_hf_config(written).attention_windows or (0,) * 4) == windows, (window_keys, written)
        compared += 1
    assert compared >= 3


def held_sequences(shape: ModelShape, run: RunShape, kv_cache_gib: float) -> float:
    """Full-length sequences the engine's split of ``kv_cache_gib`` holds in its full-attention pool."""
    sizes, _ = kv_pool_blocks(shape, run)
    length = run.prompt_length + run.response_length
    caps = [window_pool_blocks(window, run.sequences, length, KV_BLOCK_TOKENS)
            for window in (None, shape.attention_windows[0])]
    return split_pool_blocks(kv_cache_gib * GiB, sizes, caps)[0] / -(-(length + 1) // KV_BLOCK_TOKENS)


@pytest.mark.parametrize("share", [2, 4, 8])
def test_a_smaller_planned_cache_holds_its_share_of_the_sequences(share):
    """The planner's smaller caches are priced as holding a half, a quarter, an eighth of the sequences: the
    engine's split of each holds that many."""
    shape, run = ModelShape.from_hf_config(GEMMA3_4B), run_shape(32768)
    held = held_sequences(shape, run, round(needed_kv_gib(shape, run, share), 3))
    assert run.sequences / share - 0.01 < held < run.sequences / share + 0.01


@pytest.mark.parametrize("response, share", [(8192, 1), (32768, 2)])
def test_gemma3_plans_hold_more_sequences(response, share):
    """On an H200 the plan's cache holds all 128 sequences at 8k tokens and half of them at 32k (a cache sized as
    if every layer kept the whole context holds half and an eighth)."""
    shape, run = ModelShape.from_hf_config(GEMMA3_4B), run_shape(response)
    plan = plan_memory(shape, run, {}, 139 * GiB, 1000 * GiB)
    assert plan.fits and not plan.settings.optimizer_offload
    held = held_sequences(shape, run, plan.settings.kv_cache_gib or needed_kv_gib(shape, run))
    assert held >= run.sequences / share - 0.01


@pytest.mark.parametrize("size", ["0.5b", "7b"])
def test_models_without_windows_keep_every_layer_at_full_length(size):
    shape, run = ModelShape.from_hf_config(shape_config(size)), run_shape()
    assert needed_kv_gib(shape, run) == every_layer_gib(shape, run)


def test_the_rollout_engine_runs_the_sequences_its_planned_cache_was_sized_for():
    """Where the planner sizes the cache, the engine's max_num_seqs is one device's sequences of a step (the
    concurrency the plan's sliding pools hold windows for); a cache sized by gpu_memory_utilization keeps 512."""
    config = Config()
    config.data.train_batch_size, config.rollout.n, config.trainer.devices_per_node = 16, 8, 2
    config.rollout.gpu_memory_utilization = None
    assert planned_concurrency(config) == {"max_num_seqs": 64}
    config.data.train_batch_size = 1024
    assert planned_concurrency(config) == {"max_num_seqs": 512}
    config.rollout.gpu_memory_utilization = 0.5
    assert planned_concurrency(config) == {}
