"""The model shapes ``reinforge bench train --model`` builds with random weights, one per name.

The Qwen2.5 sizes (0.5b .. 7b) and one shape of each other family the training path supports, with the
sizes of the published config.json: Gemma-2-2B, Phi-3-mini (3.8B), OLMo-2-1B, Mistral-7B, OLMoE-1B-7B (64
experts, top-8) and Qwen3-30B-A3B (128 experts, top-8), which trains a rank-32 LoRA adapter (attention
projections; the experts stay frozen) and has its weights built on the device as the actor loads them, not
written to disk; the vision-language Qwen2.5-VL-3B's prompts carry an image each (``bench/vision.py``).
``write_shape_config`` writes a shape's config.json alone, which is all the memory planner reads
(``reinforge plan --model NAME``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

_QWEN25 = dict(model_type="qwen2", max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)


@dataclass(frozen=True)
class BenchShape:
    config: dict
    """The HF config's keys (``model_type`` included), as in the published config.json."""
    lora_rank: int = 0
    """The rank of the LoRA adapter this shape trains (0: every parameter)."""
    lora_targets: tuple[str, ...] = ()
    """Its adapted projections (empty: ``model.lora.target_modules``' default)."""
    weights_on_disk: bool = True
    """False: the bench writes a folder of config.json and tokenizer only, and the actor builds the random weights
    on the device as it loads (``reinforge.models.random_weights``; no 57 GiB folder for Qwen3-30B-A3B)."""
    notes: dict = field(default_factory=dict)
    trl_script: str = "trl_grpo.py"
    """The TRL twin of its workload in ``benchmarks/`` (``bench train --trl``)."""

    @property
    def family(self) -> str:
        return self.config["model_type"]

    @property
    def vision(self) -> bool:
        """A vision-language shape: its prompts carry images (``bench/vision.py``)."""
        return "vision_config" in self.config

    @property
    def training(self) -> str:
        return f"LoRA r{self.lora_rank}" if self.lora_rank else "full"

    def adapter(self, rank: int = 0) -> tuple[int, tuple[str, ...]]:
        """(rank, adapted projections) of the LoRA adapter a case of this shape trains: ``rank`` (``--lora``) or the
        shape's own, on its projections or ``model.lora.target_modules``' default; (0, ()) for full fine-tuning."""
        from reinforge.config.schema import LoraConfig

        rank = rank or self.lora_rank
        return (rank, self.lora_targets or tuple(LoraConfig().target_modules)) if rank else (0, ())

    def config_overrides(self) -> list[str]:
        """The training settings the shape stands for, as ``a.b=c`` overrides."""
        if not self.lora_rank:
            return []
        overrides = [f"model.lora.rank={self.lora_rank}", f"model.lora.alpha={2 * self.lora_rank}"]
        if self.lora_targets:
            overrides.append(f"model.lora.target_modules=[{','.join(self.lora_targets)}]")
        return overrides


ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")

SHAPES: dict[str, BenchShape] = {
    "0.5b": BenchShape(dict(_QWEN25, vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                            num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True)),
    "1.5b": BenchShape(dict(_QWEN25, vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                            num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True)),
    "3b": BenchShape(dict(_QWEN25, vocab_size=151936, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                          num_key_value_heads=2, intermediate_size=11008, tie_word_embeddings=True)),
    "7b": BenchShape(dict(_QWEN25, vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                          num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False)),
    "gemma2-2b": BenchShape(dict(
        model_type="gemma2", vocab_size=256000, hidden_size=2304, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, intermediate_size=9216, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "phi3-mini": BenchShape(dict(
        model_type="phi3", vocab_size=32064, hidden_size=3072, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, intermediate_size=8192, max_position_embeddings=4096, sliding_window=2047,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "olmo2-1b": BenchShape(dict(
        model_type="olmo2", vocab_size=100352, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, intermediate_size=8192, max_position_embeddings=4096, rope_theta=500000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "mistral-7b": BenchShape(dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, sliding_window=4096, max_position_embeddings=32768,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "olmoe-1b-7b": BenchShape(dict(
        model_type="olmoe", vocab_size=50304, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, intermediate_size=1024, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "qwen3-30b-a3b": BenchShape(dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
        lora_rank=32, lora_targets=ATTENTION_PROJECTIONS, weights_on_disk=False),
    "qwen2.5-vl-3b": BenchShape(dict(
        model_type="qwen2_5_vl", vocab_size=151936, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, intermediate_size=11008, max_position_embeddings=128000, rope_theta=1000000.0,
        rms_norm_eps=1e-6, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, tie_word_embeddings=True,
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", tokens_per_second=2)),
        trl_script="trl_grpo_vl.py"),
}
"""name -> shape: what ``reinforge bench train --model`` and ``reinforge plan --model`` know."""
QWEN25_SIZES = ("0.5b", "1.5b", "3b", "7b")


STANDARD_WORKLOAD = ("data.train_batch_size=64", "rollout.n=8", "data.max_prompt_length=128",
                     "data.max_response_length=512", "rollout.name=native")
"""The bench's workload as overrides: 64 prompts x 8 samples, 128 + 512 tokens, the native engine."""


def shape_config(name: str) -> dict:
    """The HF config keys of shape ``name`` (``model_type`` included)."""
    return dict(SHAPES[name].config)


def write_shape_config(name: str, folder: Path) -> Path:
    """Write shape ``name``'s config.json into ``folder`` (created); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape_config(name), indent=1))
    return folder

