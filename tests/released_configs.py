"""The config structure of released dense checkpoints, at tiny sizes: what the family defaults of the tiny models leave
out (rope scalings as their config.json files write them, head dims other than hidden / heads, GQA ratios, windows on
some layers only, Gemma's query_pre_attn_scalar and local rotary base, NoPE layers, tied or untied heads).

Test modules import it as ``tests.released_configs``. Each entry is (model_type, options for ``build_tiny_causal_lm``);
every entry gives its own ``sliding_window`` (4 keys where the checkpoint slides: fewer than the test sequences), and
lengths past which a rope scaling switches lie beyond the test sequences (LongRoPE's switch has tests of its own).
"""

from __future__ import annotations

import torch

from reinforge.models.tiny import build_tiny_causal_lm

RELEASED_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama-3.2": ("llama", {"sliding_window": None, "tie_word_embeddings": True, "max_position_embeddings": 64,
                            "rope_theta": 500000.0, "rope_scaling": {
                                "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8}}),
    "mistral-7b-v0.1": ("mistral", {"sliding_window": 4, "num_kv_heads": 1, "tie_word_embeddings": False}),
    "mistral-nemo": ("mistral", {"sliding_window": None, "head_dim": 32, "tie_word_embeddings": False}),
    "qwen2.5-yarn": ("qwen2", {"sliding_window": 32, "use_sliding_window": False, "max_window_layers": 1,
                               "max_position_embeddings": 64, "rope_theta": 1e6,
                               "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen2-windows-from-layer-2": ("qwen2", {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 2}),
    "qwen3-mqa-yarn": ("qwen3", {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 0,
                                 "head_dim": 24, "num_kv_heads": 1, "max_position_embeddings": 64, "rope_parameters": {
                                     "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                     "rope_theta": 1e6, "attention_factor": 0.8, "beta_fast": 16.0, "beta_slow": 2.0}}),
    "gemma-2-27b": ("gemma2", {"sliding_window": 4, "head_dim": 32, "query_pre_attn_scalar": 16,
                               "tie_word_embeddings": True}),
    "gemma-3-4b": ("gemma3_text", {"sliding_window": 4, "layer_types": None, "sliding_window_pattern": 2,
                                   "head_dim": 24, "query_pre_attn_scalar": 24, "attn_logit_softcapping": None,
                                   "final_logit_softcapping": None, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    "phi-3-mini-4k": ("phi3", {"sliding_window": 5, "partial_rotary_factor": 1.0, "tie_word_embeddings": False}),
    "phi-4-mini": ("phi3", {"sliding_window": 64, "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
                            "max_position_embeddings": 64, "original_max_position_embeddings": 32,
                            "rope_theta": 10000.0, "rope_scaling": {
                                "type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0, 1.0, 1.2],
                                "long_factor": [2.0, 4.0, 8.0, 16.0, 3.0, 5.0]}}),
    "olmo-2": ("olmo2", {"sliding_window": None, "num_kv_heads": 4, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}),
    "smollm3-3b": ("smollm3", {"sliding_window": None, "no_rope_layer_interval": 4, "rope_theta": 5e6}),
}


def released_model(name: str, vocab_size: int, seed: int) -> torch.nn.Module:
    """A tiny fp32 model of 4 layers with the structure of ``RELEASED_CONFIGS[name]``."""
    arch, options = RELEASED_CONFIGS[name]
    return build_tiny_causal_lm(arch, vocab_size=vocab_size, num_layers=4, seed=seed, **options)
