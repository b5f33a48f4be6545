"""Causal LMs outside the architecture table that name their sizes and blocks their own way, or have no attention:
each is planned, sharded, probed and trained through its transformers modules instead of being refused; only a model
whose own transformers forward fails is refused, in one line.

GPT-2 (``n_embd``, blocks in ``h``, an implicit 4 x hidden MLP), OPT (``ffn_dim``), Falcon, BLOOM, MPT
(``d_model``, blocks in ``blocks``), DBRX (sizes nested in ``attn_config`` and ``ffn_config``), NemotronH (layers
counted by its block pattern), Mamba (no
attention: its mixer reads the mask as padding, so it runs padded rows) and Llama 4's text model (whose decoder
``get_decoder`` does not find).
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from reinforge.cli import main
from reinforge.engine.forward import PACKS_ROWS, build_position_ids, decoder_of, packs_rows, response_log_probs
from reinforge.engine.fsdp import decoder_layers
from reinforge.engine.fused import check_packed_sequences_stay_apart
from reinforge.engine.memory_plan import MemoryPlanError, ModelShape
from reinforge.models.tiny import build_char_tokenizer, save_hf_folder
from reinforge.protocol import Batch

sys.path.insert(0, str(Path(__file__).parent))
from test_families import assert_pass_equals_transformers_padded_forward  # noqa: E402

TINY = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),
    "opt": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=96, word_embed_proj_dim=64,
                max_position_embeddings=128),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4),
    "mpt": dict(d_model=64, n_layers=2, n_heads=4, expansion_ratio=3, max_seq_len=128),
    "dbrx": dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=128,
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2}),
    "mamba": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, state_size=8),
    "llama4_text": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=48, intermediate_size_mlp=96, num_local_experts=4),
    "bart": dict(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, encoder_layers=2,
                 encoder_attention_heads=4, encoder_ffn_dim=128, max_position_embeddings=128),
    "electra": dict(hidden_size=64, embedding_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=128, is_decoder=True),
    "codegen": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, rotary_dim=8),
    # intermediate_size null, as EleutherAI's checkpoints leave it: its MLP is then 4 x hidden
    "gpt_neo": dict(hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                    max_position_embeddings=128, window_size=8, intermediate_size=None),
    "git": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=128, vision_config={"hidden_size": 32, "num_hidden_layers": 1,
                                                            "num_attention_heads": 2, "intermediate_size": 64,
                                                            "image_size": 32, "patch_size": 16}),
    # Mamba layers between two hybrid ones, which share one attention block: one FSDP unit together
    "zamba": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=128, layers_block_type=["linear_attention", "hybrid", "hybrid"], mamba_d_state=8,
                  mamba_dt_rank=8, use_mamba_kernels=False, attention_hidden_size=128, attention_head_dim=32),
    "jamba": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8,
                  use_mamba_kernels=False),
    "inkling2_text": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, max_position_embeddings=128, n_routed_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32),
    # index_topk above the probe's 9 tokens, below the 13 of the test batch: its selection leaves keys out only there
    "deepseek_v32": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, n_group=2, topk_group=1,
                         num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                         qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8, index_topk=10,
                         index_head_dim=16, index_n_heads=2, max_position_embeddings=128),
}
SIZES = {  # hidden, layers, heads, KV heads (Falcon's multi-query: one), MLP width (an expert's), experts
    "gpt2": (64, 2, 4, 4, 256, 0), "opt": (64, 2, 4, 4, 96, 0), "falcon": (64, 2, 4, 1, 256, 0),
    "bloom": (64, 2, 4, 4, 256, 0), "mpt": (64, 2, 4, 4, 192, 0), "dbrx": (64, 2, 4, 2, 48, 4),
    "mamba": (64, 2, 1, 1, 128, 0), "gpt_neo": (64, 2, 4, 4, 256, 0),
}


def known(model_type: str) -> None:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type!r}")


def tiny_config(model_type: str, vocab_size: int = 64):
    known(model_type)
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, **TINY[model_type])


def tiny_model(model_type: str, vocab_size: int = 64):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size)).eval()


@pytest.mark.parametrize("model_type", sorted(SIZES))
def test_the_planner_reads_each_familys_own_size_names(model_type):
    shape = ModelShape.from_hf_config(tiny_config(model_type).to_dict())
    hidden, layers, heads, kv_heads, width, experts = SIZES[model_type]
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads) == (hidden, layers, heads, kv_heads)
    assert (shape.expert_intermediate_size if experts else shape.intermediate_size) == width
    assert shape.num_experts == experts and shape.experts_per_token == (2 if experts else 0)
    assert shape.num_params > 0


def test_a_hybrids_layer_count_comes_from_its_block_pattern(tmp_path):
    """NemotronH's config.json stores no num_hidden_layers: its layers are its block pattern's entries."""
    known("nemotron_h")
    config = AutoConfig.for_model("nemotron_h", hidden_size=64, num_attention_heads=4, intermediate_size=128)
    config.save_pretrained(tmp_path)
    assert "num_hidden_layers" not in json.loads((tmp_path / "config.json").read_text())
    shape = ModelShape.from_model_path(str(tmp_path))
    assert shape.num_layers == config.num_hidden_layers == len(config.layers_block_type)


def test_a_size_given_per_layer_is_planned_at_its_largest(tmp_path):
    """Gemma 3n's config.json lists an MLP width per layer: the planner refused the model, whose intermediate_size it
    took for no whole number; it plans each layer at the widest."""
    from reinforge.engine.memory_plan import check_model_config

    known("gemma3n_text")
    config = AutoConfig.for_model("gemma3n_text", vocab_size=64, vocab_size_per_layer_input=64, hidden_size=64,
                                  hidden_size_per_layer_input=16, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, intermediate_size=[128, 96],
                                  num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0])
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["intermediate_size"] == [128, 96]
    check_model_config(str(tmp_path))
    shape = ModelShape.from_model_path(str(tmp_path))
    assert (shape.hidden_size, shape.num_layers, shape.intermediate_size) == (64, 2, 128)


def test_a_size_a_known_family_leaves_out_is_its_class_default_and_an_unknown_familys_is_named_in_one_line():
    config = tiny_config("mpt").to_dict() | {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                               "num_attention_heads": 4}
    assert ModelShape.from_hf_config(config).intermediate_size == 11008  # what transformers builds the model with
    with pytest.raises(MemoryPlanError, match="config.json has no 'intermediate_size'"):
        ModelShape.from_hf_config(config | {"model_type": "not_a_family"})


def test_decoder_blocks_are_found_whatever_their_list_is_called():
    mpt = tiny_model("mpt")
    assert decoder_layers(mpt) == list(mpt.transformer.blocks)
    git = tiny_model("git")  # its image encoder's ``layers`` beside its text ``layer``: the text blocks are sharded
    assert decoder_layers(git) == list(git.git.encoder.layer)

    class Stack(torch.nn.Module):  # blocks under a name no family uses, beside a list of another kind
        def __init__(self):
            super().__init__()
            self.heads = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU()])
            self.stages = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    stack = Stack()
    assert decoder_layers(stack) == list(stack.stages)
    with pytest.raises(ValueError, match="no ModuleList of decoder blocks"):
        decoder_layers(torch.nn.Linear(2, 2))


def _batch(vocab: int) -> Batch:
    from reinforge.engine.forward import build_position_ids

    generator = torch.Generator().manual_seed(0)
    prompts, responses = torch.randint(3, vocab, (2, 4), generator=generator), torch.randint(3, vocab, (2, 3),
                                                                                           generator=generator)
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    return Batch.from_dict(tensors={"prompts": prompts, "responses": responses, "response_mask": torch.ones(2, 3),
                                    "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
                                    "position_ids": build_position_ids(attention_mask)})


def test_a_model_whose_layers_take_no_packed_row_runs_padded_rows():
    """Mamba's mixer multiplies by the attention mask, which a packed forward hands over as a placeholder: the
    probe takes padded rows instead of refusing the model, and the log-probs are those of its own forward."""
    from reinforge.engine.attention import use_varlen_attention

    model = tiny_model("mamba")
    use_varlen_attention(model)
    assert not packs_rows(model) and getattr(model, PACKS_ROWS) is False
    check_packed_sequences_stay_apart(model)
    batch = _batch(64)
    log_probs = response_log_probs(model, batch)[0]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, 3:-1].log_softmax(-1)
    expected = logits.gather(-1, batch["responses"][..., None])[..., 0]
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=1e-5)


SOFT_CAPPED = {
    "recurrent_gemma": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                            intermediate_size=128, lru_width=64, attention_window_size=16,
                            block_types=["recurrent", "attention"]),
    "xlstm": dict(hidden_size=64, embedding_dim=64, num_hidden_layers=2, num_blocks=2, num_heads=4),
}


@pytest.mark.parametrize("model_type", sorted(SOFT_CAPPED))
def test_a_final_logit_soft_cap_is_applied_as_the_model_applies_it(model_type):
    """RecurrentGemma caps its logits (``logits_soft_cap``), xLSTM too (``output_logit_soft_cap``): the training
    log-probs are those of its own forward, through the fused projection. xLSTM's cap was left out: the probe then
    read its whole logits where they were far from the projection's, and where its logits were still small (a
    tiny model's) it trained on log-probs up to 5e-4 from its own."""
    known(model_type)
    config = AutoConfig.for_model(model_type, vocab_size=64, **SOFT_CAPPED[model_type])
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # logits near the cap of 30, where it matters
    batch = _batch(64)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, 3:-1].log_softmax(-1)
    expected = logits.gather(-1, batch["responses"][..., None])[..., 0]
    from reinforge.engine.attention import use_varlen_attention

    use_varlen_attention(model)
    check_packed_sequences_stay_apart(model)
    from reinforge.engine.forward import OWN_LOGITS

    assert not getattr(model, OWN_LOGITS, False)
    torch.testing.assert_close(response_log_probs(model, batch)[0], expected, atol=1e-5, rtol=1e-5)


def test_a_head_that_changes_the_logits_beyond_lm_head_trains_on_its_own_logits(caplog):
    """Training on other probabilities than the rollout samples would be a silent failure: the probe compares the
    log-probs with the model's own forward once, at start, and a head it does not reproduce is read whole."""
    import logging

    from reinforge.engine.attention import use_varlen_attention

    model = tiny_model("gpt2")
    original = model.forward

    def doubled(*args, **kwargs):  # a head that scales its logits where reinforge does not know to
        output = original(*args, **kwargs)
        output.logits = output.logits * 2.0
        return output

    model.forward = doubled
    use_varlen_attention(model)
    with caplog.at_level(logging.WARNING, logger="reinforge.engine.fused"):
        check_packed_sequences_stay_apart(model)
    assert "GPT2LMHeadModel (model_type='gpt2') computes its logits beyond lm_head" in caplog.text
    from reinforge.engine.forward import runs_padded

    assert runs_padded(model)  # its micro-batches are sized for padded rows
    batch = _batch(64)
    with torch.no_grad():
        logits = (doubled(input_ids=batch["input_ids"]).logits[:, 3:-1] / 0.7).log_softmax(-1)
    log_probs, entropy, sum_pi_squared = response_log_probs(model, batch, temperature=0.7, with_entropy=True,
                                                            with_sum_pi_squared=True)
    torch.testing.assert_close(log_probs, logits.gather(-1, batch["responses"][..., None])[..., 0])
    torch.testing.assert_close(entropy, -(logits.exp() * logits).sum(-1))
    torch.testing.assert_close(sum_pi_squared, logits.exp().square().sum(-1))
    assert response_log_probs(model, batch)[1] is None
    log_probs.sum().backward()  # the update's gradients flow through the model's own head
    assert model.transformer.h[0].attn.c_attn.weight.grad.abs().sum() > 0


def test_a_decoder_that_get_decoder_misses_is_found_by_its_blocks():
    model = tiny_model("llama4_text")
    assert model.get_decoder() is model  # transformers' lookup gives the causal LM back
    assert decoder_of(model) is model.model
    assert_pass_equals_transformers_padded_forward(model.train(), share_prompts=True)


@pytest.mark.parametrize("model_type", ["gpt2", "mamba", "bart", "git", "zamba", "gpt_neo"])
def test_one_grpo_step_of_a_classic_and_a_recurrent_causal_lm(model_type, arithmetic_data_dir, tmp_path):
    tokenizer = build_char_tokenizer(())
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, **TINY[model_type]))
    folder = save_hf_folder(model, tokenizer, tmp_path / "model")
    run = tmp_path / "run"
    args = {"model.path": folder, "data.train_files": f"[{arithmetic_data_dir / 'train.parquet'}]",
            "data.train_batch_size": 2, "data.max_prompt_length": 64, "data.max_response_length": 8,
            "rollout.n": 2, "rollout.name": "hf", "trainer.output_dir": run, "trainer.loggers": "[jsonl]",
            "trainer.total_steps": 1, "trainer.val_before_train": False}
    assert main(["train", *(f"{key}={value}" for key, value in args.items())]) == 0
    [row] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # BART's generation_config forces EOS at the last token: the rollout leaves that out and samples what trains
    assert row["actor/num_skipped_steps"] == 0 and row["training/rollout_probs_diff_max"] < 1e-4


def test_a_head_that_reshapes_the_hidden_state_trains_on_its_own_logits(caplog):
    """Electra's generator head projects the hidden state to its embedding width before lm_head: the hidden state
    through lm_head fails, so the probe reads the logits the model's own forward returns."""
    import logging

    from reinforge.engine.attention import use_varlen_attention
    from reinforge.engine.forward import OWN_LOGITS

    model = tiny_model("electra")
    use_varlen_attention(model)
    with caplog.at_level(logging.WARNING, logger="reinforge.engine.fused"):
        check_packed_sequences_stay_apart(model)
    assert getattr(model, OWN_LOGITS) is True and "its last hidden state through lm_head fails" in caplog.text
    batch = _batch(64)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, 3:-1].log_softmax(-1)
    torch.testing.assert_close(response_log_probs(model, batch)[0],
                               logits.gather(-1, batch["responses"][..., None])[..., 0], atol=1e-5, rtol=1e-5)


def test_a_model_whose_own_forward_fails_is_refused_in_one_line():
    """CodeGen rotating more dimensions than a head has fails in transformers' forward itself: one line names the
    model type, the failure and what to do."""
    from reinforge.engine.attention import use_varlen_attention

    known("codegen")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("codegen", vocab_size=64,
                                                                  **dict(TINY["codegen"], rotary_dim=32)))
    use_varlen_attention(model)
    with pytest.raises(ValueError) as refused:
        check_packed_sequences_stay_apart(model)
    message = str(refused.value)
    assert "CodeGenForCausalLM (model_type='codegen', from model.path's config.json) fails in transformers' own " \
           "forward on cpu (RuntimeError: " in message and "check the config's sizes" in message
    assert "\n" not in message


def test_a_model_whose_training_forward_fails_is_refused_at_start_in_one_line():
    """Reformer's forward in training mode takes only sequences as long as its axial position shape: the probes ran
    it in eval mode, and the run failed at its first update with transformers' error. It is refused at start."""
    from reinforge.engine.attention import use_varlen_attention

    known("reformer")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "reformer", vocab_size=64, hidden_size=64, num_attention_heads=2, attention_head_size=32, feed_forward_size=64,
        attn_layers=["local", "local"], axial_pos_embds_dim=[32, 32], axial_pos_shape=[8, 8], is_decoder=True,
        max_position_embeddings=64))
    use_varlen_attention(model)
    with pytest.raises(ValueError) as refused:
        check_packed_sequences_stay_apart(model)
    message = str(refused.value)
    assert message.startswith("ReformerModelWithLMHead (model_type='reformer', from model.path's config.json) fails in "
                              "transformers' own forward in training mode on cpu (ValueError: If training, ")
    assert "\n" not in message


@pytest.mark.parametrize("model_type,sizes,fix", [
    # causal=true would not help: its generate still predicts a mask token appended to the inputs
    ("xlm", dict(emb_dim=64, n_layers=2, n_heads=4, causal=False), "so it is no causal LM and would train on other "
     "probabilities than it samples; use a causal LM"),
    ("xlnet", dict(d_model=64, n_layer=2, n_head=4, d_inner=128, attn_type="bi"), "; use a causal LM"),
    ("bert", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
     "set is_decoder=true in its config.json or use a causal LM"),  # switched so, it passes the probe
    ("gemma3_text", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, use_bidirectional_attention=True),
     "set use_bidirectional_attention=false in its config.json"),  # an EmbeddingGemma: outside the table
])
def test_a_model_that_reads_the_tokens_after_each_position_is_refused_in_one_line(model_type, sizes, fix):
    """XLM without ``causal`` and XLNet's bidirectional attention see the tokens after each position, which generate
    never shows them: trained on whole sequences they would follow other probabilities than they sample. A switch
    is advised only where the model switched so passes the probe (an EmbeddingGemma's), never XLM's ``causal``."""
    from reinforge.engine.attention import use_varlen_attention

    known(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=64, **sizes))
    use_varlen_attention(model)
    with pytest.raises(ValueError, match=rf"\(model_type='{model_type}', from model.path's config.json\) reads the "
                                         r"tokens after each position .*" + re.escape(fix)):
        check_packed_sequences_stay_apart(model)
    if model_type == "xlm":  # causal, its generate still predicts a mask token appended to the inputs
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=64,
                                                                      **dict(sizes, causal=True)))
        use_varlen_attention(model)
        with pytest.raises(ValueError, match=r"\(model_type='xlm', from model.path's config.json\) samples in "
                                             r"transformers' generate from other probabilities than its forward"):
            check_packed_sequences_stay_apart(model)


@pytest.mark.parametrize("model_type", ["gpt2", "mamba"])
def test_generate_samples_from_the_training_passes_probabilities(model_type):
    """The start-up probe's greedy tokens from generate, scored by the training passes: the same log-probs."""
    from reinforge.engine.attention import use_varlen_attention
    from reinforge.engine.fused import _generate_gap

    known(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=64, **TINY[model_type]))
    use_varlen_attention(model)
    check_packed_sequences_stay_apart(model)
    prompts = torch.randint(3, 64, (2, 4), generator=torch.Generator().manual_seed(0))

    def batch_of(responses):
        mask = torch.ones(2, 4 + responses.shape[1], dtype=torch.long)
        return Batch.from_dict(tensors={"prompts": prompts, "responses": responses,
                                        "response_mask": torch.ones(responses.shape),
                                        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask,
                                        "position_ids": build_position_ids(mask)})

    gap = _generate_gap(model, prompts[:1], batch_of)
    assert gap is not None and gap < 1e-4


def test_a_checkpoint_of_a_model_that_builds_its_attention_by_name_is_written(tmp_path):
    """GIT picks its attention classes by attn_implementation when it is built: the checkpoint's model (and the copy
    that finds the dtypes it loads in) is built eager, not with the training passes' varlen attention, and loads
    back."""
    from reinforge.engine.attention import use_varlen_attention
    from reinforge.workers.checkpointing import save_sharded_hf_folder

    model = tiny_model("git")
    use_varlen_attention(model)
    save_sharded_hf_folder(model, type(model), build_char_tokenizer(()), tmp_path / "hf", dtype=torch.bfloat16)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert torch.equal(reloaded.state_dict()["output.weight"], model.state_dict()["output.weight"].to(torch.bfloat16))


def test_a_text_model_that_the_auto_table_does_not_list_loads_by_its_architecture(tmp_path):
    """Emu3's causal LM is saved with its text config (``emu3_text_model``), which AutoModelForCausalLM does not map:
    the class its ``architectures`` names loads it."""
    from reinforge.models.loading import load_causal_lm

    known("emu3")
    from transformers import Emu3ForCausalLM, Emu3TextConfig

    tokenizer = build_char_tokenizer(())
    config = Emu3TextConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
                            eos_token_id=tokenizer.eos_token_id, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128)
    folder = save_hf_folder(Emu3ForCausalLM(config), tokenizer, tmp_path / "emu3")
    assert type(load_causal_lm(str(folder), dtype=torch.float32, device="cpu")) is Emu3ForCausalLM


def test_a_critic_reads_the_bodys_output_width_and_attention(tmp_path):
    """OPT projects its hidden size out to its embeddings' width (the critic's head reads that); MPT's and Mamba's
    bodies run no SDPA (the critic loads them eager)."""
    from reinforge.models.value_model import ValueModel

    tokenizer = build_char_tokenizer(())
    options = {"opt": dict(TINY["opt"], word_embed_proj_dim=48), "mpt": TINY["mpt"], "mamba": TINY["mamba"]}
    for model_type, sizes in options.items():
        known(model_type)
        config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                      **sizes)
        folder = save_hf_folder(AutoModelForCausalLM.from_config(config), tokenizer, tmp_path / model_type)
        critic = ValueModel.from_pretrained(folder)
        assert critic.value_head.in_features == (48 if model_type == "opt" else 64)
        values = critic(torch.randint(3, 40, (2, 5)), torch.ones(2, 5, dtype=torch.long))
        assert values.shape == (2, 5) and torch.isfinite(values).all()


def test_lora_adapts_a_family_without_llama_style_projections(caplog, tmp_path):
    """Default targets that name no layer of the model become its linear layers (Mamba: not the mixer's out_proj,
    which peft refuses; all-linear likewise); targets the user named that match nothing list the model's layers."""
    import logging

    from peft import PeftModel

    from reinforge.config.schema import LoraConfig
    from reinforge.engine.lora import adapter_state, add_lora, lora_layers, write_adapter_folder

    with caplog.at_level(logging.INFO, logger="reinforge.engine.lora"):
        adapted = add_lora(tiny_model("mamba"), LoraConfig(rank=4))
    assert {layer_name.rsplit(".", 1)[-1] for layer_name, module in adapted.named_modules()
            if module in lora_layers(adapted)} == {"dt_proj", "in_proj", "x_proj"}
    assert "its adapters go on its linear layers dt_proj, in_proj, x_proj" in caplog.text
    config = LoraConfig(rank=4, target_modules=["all-linear"])
    adapted = add_lora(tiny_model("mamba"), config)
    assert {layer_name.rsplit(".", 1)[-1] for layer_name, module in adapted.named_modules()
            if module in lora_layers(adapted)} == {"dt_proj", "in_proj", "x_proj"}
    tiny_model("mamba").save_pretrained(tmp_path / "base")
    write_adapter_folder(tmp_path / "adapter", adapter_state(adapted.base_model.model.state_dict()), config,
                         str(tmp_path / "base"))
    PeftModel.from_pretrained(tiny_model("mamba"), str(tmp_path / "adapter"))  # peft loads what it wrote
    with pytest.raises(ValueError, match=r"target_modules=\['wq'\] matches no layer of MptForCausalLM; name some of "
                                         r"its linear layers \(Wqkv, out_proj, up_proj, down_proj\)"):
        add_lora(tiny_model("mpt"), LoraConfig(rank=4, target_modules=["wq"]))


def test_adapters_on_gpt2s_transposed_layers_merge_as_peft_applies_them(tmp_path):
    """GPT-2's c_attn, c_fc and c_proj are transformers' Conv1D, weights stored (in, out): the rollout's merged
    forward, the checkpoint's merged weights and the adapter folder all give peft's own adapted model."""
    from peft import PeftModel

    from reinforge.config.schema import LoraConfig
    from reinforge.engine.lora import (
        adapter_state,
        add_lora,
        lora_layers,
        merge_lora_weights,
        merged_weights,
        transposed_layers,
        write_adapter_folder,
    )

    model = tiny_model("gpt2")
    plain = copy.deepcopy(model)
    config = LoraConfig(rank=4, alpha=8.0)
    adapted = add_lora(model, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in lora_layers(adapted):
            layer.lora_B["default"].weight.normal_(0.0, 0.2, generator=generator)
    input_ids = torch.randint(3, 60, (2, 9), generator=generator)
    with torch.no_grad():
        expected = adapted(input_ids=input_ids).logits
        with merged_weights(adapted):
            torch.testing.assert_close(model(input_ids=input_ids).logits, expected, atol=1e-5, rtol=1e-5)
    assert expected.sub(plain(input_ids=input_ids).logits).abs().max() > 1e-2  # the adapters do change it
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    write_adapter_folder(tmp_path / "adapter", adapter_state(state), config, "")
    merged = merge_lora_weights(state, config.alpha / config.rank, transposed_layers(model))
    merged = {name.removeprefix("base_model.model."): tensor for name, tensor in merged.items()}
    checkpoint = copy.deepcopy(plain)
    checkpoint.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(checkpoint(input_ids=input_ids).logits, expected, atol=1e-5, rtol=1e-5)
        reloaded = PeftModel.from_pretrained(copy.deepcopy(plain), tmp_path / "adapter")
        torch.testing.assert_close(reloaded(input_ids=input_ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_a_trained_parameter_that_no_step_reached_resumes():
    """BART's decoder as a causal LM never runs its cross-attention, so AdamW keeps no state for those weights: the
    saved training state still loads into a fresh model and optimizer."""
    from reinforge.engine.fsdp import full_training_state, load_full_training_state

    model = tiny_model("bart").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    input_ids = torch.randint(3, 60, (2, 6))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    assert model.model.decoder.layers[0].encoder_attn.k_proj.weight not in optimizer.state
    state = full_training_state(model, optimizer)
    fresh = tiny_model("bart").train()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load_full_training_state(fresh, fresh_optimizer, state)
    torch.testing.assert_close(fresh.lm_head.weight, model.lm_head.weight)
    torch.testing.assert_close(fresh_optimizer.state[fresh.lm_head.weight]["exp_avg"],
                               optimizer.state[model.lm_head.weight]["exp_avg"])


@pytest.mark.parametrize("model_type", ["git", "inkling2_text"])
def test_a_model_written_for_eager_attention_trains_on_its_own_forwards_probabilities(model_type, caplog):
    """GIT builds its attention classes by name and expects eager's additive masks; Inkling 2 hands its attention
    position biases and sinks that only eager attention reads as it means them (transformers runs neither with
    SDPA). Through the varlen implementation's SDPA-style masks and calls both computed other probabilities (GIT's
    text attended past each position where the causal mask was left out). The start-up probe keeps their own
    attention: the log-probs of a left-padded batch are those of each sequence alone through the model as loaded."""
    import logging

    from reinforge.engine.attention import use_varlen_attention

    model = tiny_model(model_type, vocab_size=96)
    reference = copy.deepcopy(model)
    use_varlen_attention(model)
    with caplog.at_level(logging.INFO, logger="reinforge.engine.fused"):
        check_packed_sequences_stay_apart(model)
    generator = torch.Generator().manual_seed(1)
    prompts, responses = torch.randint(3, 96, (3, 5), generator=generator), torch.randint(3, 96, (3, 4),
                                                                                          generator=generator)
    attention_mask = torch.ones(3, 9, dtype=torch.long)
    attention_mask[0, :2] = 0
    batch = Batch.from_dict(tensors={"prompts": prompts, "responses": responses, "response_mask": torch.ones(3, 4),
                                     "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
                                     "position_ids": build_position_ids(attention_mask)})
    with torch.no_grad():
        alone = [reference(input_ids=batch["input_ids"][row][attention_mask[row].bool()][None]).logits[0, -5:-1]
                 for row in range(3)]
    expected = torch.stack([logits.log_softmax(-1).gather(-1, responses[row][:, None])[:, 0]
                            for row, logits in enumerate(alone)])
    torch.testing.assert_close(response_log_probs(model, batch)[0], expected, atol=1e-5, rtol=1e-5)
    from reinforge.engine.fused import describe_training_path

    assert "over padded rows, not packed ones: it keeps its own eager attention (" in describe_training_path(
        model, torch.device("cpu"))


def _left_padded_batch(vocab: int) -> Batch:
    """Three rows: the first and the last with left-padded prompts, the last with a right-padded response."""
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, vocab, (3, 5), generator=generator)
    responses = torch.randint(3, vocab, (3, 4), generator=generator)
    attention_mask = torch.ones(3, 9, dtype=torch.long)
    attention_mask[0, :2] = 0
    attention_mask[2, :3] = 0
    attention_mask[2, 7:] = 0
    input_ids = torch.cat([prompts, responses], 1) * attention_mask
    return Batch.from_dict(tensors={"prompts": input_ids[:, :5], "responses": input_ids[:, 5:],
                                    "response_mask": attention_mask[:, 5:].float(), "input_ids": input_ids,
                                    "attention_mask": attention_mask,
                                    "position_ids": build_position_ids(attention_mask)})


def _log_probs_of_each_sequence_alone(model, batch: Batch) -> torch.Tensor:
    """The response tokens' log-probs (rows, response width) from ``model``'s forward of each sequence alone."""
    width = batch["prompts"].shape[1]
    expected = torch.zeros(batch["responses"].shape)
    with torch.no_grad():
        for row in range(len(batch)):
            mask = batch["attention_mask"][row].bool()
            logits = model(input_ids=batch["input_ids"][row][mask][None]).logits[0].log_softmax(-1)
            num_prompt, num_response = int(mask[:width].sum()), int(batch["response_mask"][row].sum())
            tokens = batch["responses"][row][:num_response]
            expected[row, :num_response] = logits[num_prompt - 1:num_prompt - 1 + num_response].gather(
                -1, tokens[:, None])[:, 0]
    return expected


def probed_to_padded_rows(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny model of ``model_type`` through the varlen attention and the start-up probe, which must send it to
    padded rows, and an untouched copy of it."""
    from reinforge.engine.attention import use_varlen_attention

    model = tiny_model(model_type, vocab_size=96)
    reference = copy.deepcopy(model)
    use_varlen_attention(model)
    check_packed_sequences_stay_apart(model)
    assert not packs_rows(model)
    return model, reference


@pytest.mark.parametrize("model_type", ["bart"])
def test_a_model_that_numbers_its_own_positions_trains_on_each_sequences_own_log_probs(model_type):
    """BART's decoder takes no position ids: it numbers a row's positions from its first column. Over left-padded
    rows its learned positions counted the padding, and a sequence after two pad tokens had log-probs up to 0.24
    from those of its own forward. Padded rows run with each sequence's tokens first: its positions are its own."""
    model, reference = probed_to_padded_rows(model_type)
    batch = _left_padded_batch(96)
    with torch.no_grad():
        log_probs = response_log_probs(model, batch)[0] * batch["response_mask"]
    torch.testing.assert_close(log_probs, _log_probs_of_each_sequence_alone(reference, batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["jamba", "zamba"])
def test_a_hybrid_whose_recurrent_state_leaks_across_a_packed_row_runs_padded_rows(model_type):
    """Jamba's Mamba layers carry their state from one packed sequence into the next. In a tiny fp32 model that
    moves the next sequence's log-probs by about 5e-4, under the tolerance for rounding between different shapes;
    the probe also runs the same shapes with another first sequence, where only a leak moves anything, and
    the model then runs padded rows: each sequence's log-probs are those of its own forward. Zamba's leak is its
    Mamba convolution's, over the 3 tokens after a boundary only: behind the probe's prompts of 4 tokens it moved
    nothing, and the model packed rows whose short prompts' log-probs were 3e-4 off; it is also probed with
    one-token prompts."""
    model, reference = probed_to_padded_rows(model_type)
    batch = _batch(96)
    with torch.no_grad():
        logits = reference(input_ids=batch["input_ids"]).logits[:, 3:-1].log_softmax(-1)
    expected = logits.gather(-1, batch["responses"][..., None])[..., 0]
    torch.testing.assert_close(response_log_probs(model, batch)[0], expected, atol=1e-5, rtol=1e-5)



def test_a_model_whose_indexer_selects_the_keys_trains_on_its_own_sparse_attention():
    """DeepSeek V3.2 hands its attention the keys its indexer selected as ``indices``, which transformers folds into
    the mask of eager and SDPA attention only; reinforge's varlen attention attended to every key. The probe's
    sequences are shorter than the indexer's top-k (2,048 in the released model, 10 here), so their log-probs agreed
    and the model trained dense: once a sequence was longer, on other probabilities than its own forward gives. The
    model keeps its own attention, and a longer sequence's log-probs are those of its forward alone."""
    from reinforge.engine.attention import use_varlen_attention
    from reinforge.engine.fused import describe_training_path
    from tests.engine.test_packing import grouped_batch

    model = tiny_model("deepseek_v32")
    reference = copy.deepcopy(model)
    use_varlen_attention(model)
    check_packed_sequences_stay_apart(model)
    batch = grouped_batch(num_prompts=2, samples=2)
    assert batch["attention_mask"].sum(-1).max() > model.config.index_topk
    width = batch["prompts"].shape[1]
    expected = torch.zeros(batch["responses"].shape)
    with torch.no_grad():
        for row in range(batch["input_ids"].shape[0]):
            mask = batch["attention_mask"][row].bool()
            logits = reference(input_ids=batch["input_ids"][row][mask][None]).logits[0].log_softmax(-1)
            num_prompt, num_response = int(mask[:width].sum()), int(batch["response_mask"][row].sum())
            tokens = batch["responses"][row][:num_response]
            expected[row, :num_response] = logits[num_prompt - 1:num_prompt - 1 + num_response].gather(
                -1, tokens[:, None])[:, 0]
        log_probs = response_log_probs(model, batch)[0] * batch["response_mask"]
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=1e-5)
    assert "it keeps its own sdpa attention (reinforge's varlen attention would attend to every key, not to those " \
           "its indexer selects)" in describe_training_path(model, torch.device("cpu"))


def test_a_decoder_that_skips_layers_at_random_in_training_mode_keeps_them_once_dropout_is_off():
    """OPT's ``layerdrop`` (BART's ``decoder_layerdrop``) skips whole decoder layers at random in training mode, with
    the ``dropout`` rates that the RL workers switch off; it stayed on, and an OPT fine-tune with layerdrop 0.5
    trained on log-probs up to 0.5 from those it sampled. It is switched off with them."""
    from reinforge.models.dropout import disable_dropout

    known("opt")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "opt", vocab_size=64, layerdrop=0.5, **dict(TINY["opt"], num_hidden_layers=4)))
    assert "config.layerdrop=0.5" in disable_dropout(model)
    input_ids = torch.randint(3, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        evaluated = model.eval()(input_ids=input_ids).logits
        trained = [model.train()(input_ids=input_ids).logits for _ in range(4)]
    for logits in trained:
        torch.testing.assert_close(logits, evaluated)


def test_a_model_whose_modules_need_a_missing_package_is_refused_in_one_line(tmp_path):
    """Gemma 3n's vision tower needs timm: transformers' ImportError spans three lines, and the run's one error line
    ended at "You can install it with pip:". The refusal names the model, the package and the command in one."""
    import importlib.util

    from safetensors.torch import save_file

    from reinforge.models.loading import load_causal_lm

    known("gemma3n")
    if importlib.util.find_spec("timm") is not None:
        pytest.skip("timm is installed: Gemma 3n builds")
    AutoConfig.for_model("gemma3n").save_pretrained(tmp_path)
    save_file({"unused": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ImportError) as refused:
        load_causal_lm(str(tmp_path), dtype=torch.float32, device="cpu")
    message = str(refused.value)
    assert message.startswith(f"model.path={tmp_path} is a 'gemma3n' model, which transformers cannot build here: ")
    assert "`pip install timm`" in message and "\n" not in message
