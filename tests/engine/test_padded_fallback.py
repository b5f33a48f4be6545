"""Models whose attention cannot take packed rows run their padded rows, exactly.

StableLM's modeling code (transformers 5) drops the forward's keyword arguments on the way to its attention, and
Falcon calls no attention function of transformers' table: packed, their sequences would attend to each other.
``engine.forward.packs_rows`` probes a model outside the architecture table once; such a model runs the
micro-batch's padded rows through its own masked attention, and its log-probs, values and gradients equal
transformers' padded forward. Tiny fp32 models, dropout off.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from reinforge.engine.attention import use_varlen_attention
from reinforge.engine.forward import PACKS_ROWS, packs_rows, response_log_probs
from reinforge.engine.packing import attach_plan
from reinforge.protocol import Batch

sys.path.insert(0, str(Path(__file__).parent))
from test_families import assert_pass_equals_transformers_padded_forward, padded_reference  # noqa: E402
from test_packing import grouped_batch  # noqa: E402

SIZES = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=64, pad_token_id=None, bos_token_id=None, eos_token_id=None)
UNPACKED = {"stablelm": dict(SIZES, num_key_value_heads=2), "falcon": dict(SIZES, new_decoder_architecture=True,
                                                                            num_kv_heads=2)}


def tiny(arch: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **UNPACKED[arch])).float().eval()


@pytest.mark.parametrize("arch", sorted(UNPACKED))
def test_a_model_whose_attention_cannot_pack_runs_padded_and_equals_transformers(arch):
    model = tiny(arch)
    assert_pass_equals_transformers_padded_forward(model, share_prompts=True)
    assert getattr(model, PACKS_ROWS) is False


def test_the_probe_would_have_caught_the_packed_error():
    """Forced onto the packed path, StableLM's sequences attend across each other: the probe is what saves it."""
    model = tiny("stablelm")
    batch = grouped_batch(num_prompts=2, samples=3)
    _, expected, _ = padded_reference(model, batch, temperature=1.0)
    use_varlen_attention(model)
    forced = copy.deepcopy(model)
    setattr(forced, PACKS_ROWS, True)
    micro = attach_plan(Batch(dict(batch.tensors), {}, {}), share_prompts=False)
    with torch.no_grad():
        packed, _ = response_log_probs(forced, micro)
    assert (packed - expected).abs().max() > 1e-3


def test_a_family_of_the_table_packs_without_a_probe():
    from reinforge.models.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm("qwen2", vocab_size=64)
    use_varlen_attention(model)
    calls = []
    model.forward = lambda *args, **kwargs: calls.append(kwargs)  # a probe would run the model's forward
    assert packs_rows(model) and not calls


def test_one_grpo_step_of_a_padded_model_with_dropout_keeps_rollout_and_training_together(
        arithmetic_data_dir, tmp_path, caplog):
    """StableLM with its config's dropout on, through ``reinforge train``: dropout off (one line), padded rows,
    and the training forward gives the rollout's probabilities."""
    import json
    import logging

    from reinforge.cli import main
    from reinforge.models.export import save_hf_folder
    from reinforge.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    options = dict(UNPACKED["stablelm"], vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                   eos_token_id=tokenizer.eos_token_id, hidden_dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("stablelm", **options)).float()
    model_dir = save_hf_folder(model, tokenizer, tmp_path / "stablelm")
    run_dir = tmp_path / "run"
    args = {"model.path": model_dir, "data.train_files": f"[{arithmetic_data_dir / 'train.parquet'}]",
            "data.train_batch_size": 2, "data.max_prompt_length": 64, "data.max_response_length": 12,
            "rollout.n": 2, "rollout.name": "hf", "trainer.output_dir": run_dir, "trainer.loggers": "[jsonl]",
            "trainer.total_steps": 1, "trainer.val_before_train": False, "actor.optim.lr": 1e-3}
    with caplog.at_level(logging.INFO):
        assert main(["train", *(f"{key}={value}" for key, value in args.items())]) == 0
    messages = [record.getMessage() for record in caplog.records]
    assert any(line.startswith("dropout off for RL: stablelm") for line in messages)
    assert any(line.startswith("training passes of stablelm: transformers modules for stablelm over padded rows")
               for line in messages)
    [row] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["training/rollout_probs_diff_max"] < 1e-4


def test_a_padded_models_micro_batches_keep_their_padded_tokens_within_the_budget():
    """The passes of a model that runs padded rows cut micro-batches by rows x (longest prompt + longest response),
    padding counted, so a long response does not pad a budget's worth of short rows to its length; the scoring pass
    over them gives the log-probs of one pass over the whole batch."""
    from reinforge.engine.forward import ScoringPass, runs_padded
    from reinforge.engine.micro_batches import iter_padded_micro_batches, sequence_extents

    model = tiny("stablelm")
    use_varlen_attention(model)
    assert runs_padded(model)
    batch = grouped_batch(num_prompts=3, samples=4)
    budget = 40
    pieces = list(iter_padded_micro_batches(batch, budget))
    assert sorted(row for piece in pieces for row in piece.meta["rows"]) == list(range(len(batch)))
    for piece in pieces:  # each trimmed to its own rows' longest prompt and response
        prompts, responses = sequence_extents(piece)
        assert piece["input_ids"].shape[1] == int(prompts.max()) + max(int(responses.max()), 1)
        assert len(piece) * piece["input_ids"].shape[1] <= budget
    assert len(pieces) < len(batch)  # not one row each
    with torch.no_grad():
        whole, _ = response_log_probs(model, batch)
    with ScoringPass(model, batch, budget, torch.device("cpu")) as scoring:
        for micro in scoring:
            scoring.add(response_log_probs(model, micro)[0])
    (scored,) = scoring.outputs()
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(scored[mask], whole[mask], atol=1e-5, rtol=0)
