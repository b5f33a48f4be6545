"""The actor worker on the CPU: FSDP (a group of one), packed scoring, collective checkpoints.

Generation is tested with the rollout side (test_rollout_side.py)."""

import numpy as np
import pytest
import torch

from reinforge.config.schema import Config
from reinforge.engine.forward import build_position_ids
from reinforge.protocol import Batch
from reinforge.workers.actor_rollout import ActorRolloutWorker


def make_config(model_dir) -> Config:
    config = Config()
    config.model.path = str(model_dir)
    config.trainer.device = "cpu"
    config.data.train_batch_size = 3
    config.actor.max_tokens_per_micro_batch = 12
    return config


def scored_batch(rows: int = 3) -> Batch:
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 60, (rows, 4), generator=generator)
    responses = torch.randint(3, 60, (rows, 5), generator=generator)
    prompt_mask = torch.ones(rows, 4, dtype=torch.long)
    prompt_mask[0, :2] = 0
    response_mask = torch.ones(rows, 5)
    response_mask[1, 3:] = 0
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    return Batch.from_dict(tensors={"prompts": prompts, "responses": responses, "response_mask": response_mask,
                                    "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
                                    "position_ids": build_position_ids(attention_mask),
                                    "advantages": torch.randn(rows, 5, generator=generator) * response_mask})


def prompt_batch() -> Batch:
    """Two 6-token prompts (uids a and b), as the trainer hands them to generate."""
    prompts = torch.randint(3, 60, (2, 6), generator=torch.Generator().manual_seed(1))
    return Batch.from_dict(tensors={"input_ids": prompts, "attention_mask": torch.ones_like(prompts)},
                           non_tensors={"uid": np.array(["a", "b"], dtype=object)})


def test_log_probs_do_not_depend_on_the_micro_batch_budget_and_checkpoint_round_trips(tiny_model_dir, tmp_path):
    worker = ActorRolloutWorker(make_config(tiny_model_dir), total_training_steps=4)
    batch = scored_batch()
    small = worker.compute_log_prob(batch)["old_log_probs"]
    worker.config.actor.max_tokens_per_micro_batch = 10_000
    whole = worker.compute_log_prob(batch)["old_log_probs"]
    torch.testing.assert_close(small, whole, atol=1e-5, rtol=1e-5)
    assert torch.all(whole[1, 3:] == 0)

    worker.save_checkpoint(str(tmp_path / "step"))
    assert (tmp_path / "step" / "actor_state.pt").is_file() and (tmp_path / "step" / "hf" / "config.json").is_file()
    metrics = worker.update_actor(batch)
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/num_skipped_steps"] == 0
    assert metrics["perf/update_tokens_per_s/actor"] == pytest.approx(  # the sequences' tokens, prompts included
        float(batch["attention_mask"].sum()) / metrics["timing_s/update_actor_compute"])
    changed = worker.compute_log_prob(batch)["old_log_probs"]
    assert not torch.allclose(changed, whole)
    worker.load_checkpoint(str(tmp_path / "step"))
    torch.testing.assert_close(worker.compute_log_prob(batch)["old_log_probs"], whole)


def test_an_on_policy_update_compares_every_response_token_with_the_rollouts(tiny_model_dir):
    """The rollout mismatch of an on-policy update covers every micro-batch's tokens, not its first micro-batch's
    alone: a gap in the last row's tokens shows in the step's metrics, as it does in compute_log_prob's."""
    from reinforge.rollout.mismatch import rollout_mismatch_metrics

    worker = ActorRolloutWorker(make_config(tiny_model_dir), total_training_steps=4)  # 12-token micro-batches
    batch = scored_batch(rows=4)
    rollout = worker.compute_log_prob(batch)["old_log_probs"].clone()
    rollout[3, 1] -= 0.5  # the rollout sampled the last row's second token at a probability of its own
    batch["rollout_log_probs"] = rollout
    expected = rollout_mismatch_metrics(worker.compute_log_prob(batch)["old_log_probs"], rollout,
                                        batch["response_mask"])
    metrics = worker.update_actor(batch)
    assert metrics["training/rollout_log_probs_diff_max"] == pytest.approx(0.5, abs=1e-4)
    for key in ("probs_diff_mean", "probs_diff_max", "log_probs_diff_mean", "actor_probs_pearson_corr"):
        assert metrics[f"training/rollout_{key}"] == pytest.approx(expected[f"training/rollout_{key}"], abs=1e-5)


def test_compute_log_prob_adds_sum_pi_squared_when_the_estimator_needs_it(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    config = make_config(tiny_model_dir)
    config.rollout.temperature = 0.8
    worker = ActorRolloutWorker(config, total_training_steps=1)
    batch = scored_batch()
    assert "sum_pi_squared" not in worker.compute_log_prob(batch)
    worker.config.algorithm.adv_estimator = "optimal_token_baseline"
    output = worker.compute_log_prob(batch)

    # the same sums from an unpacked forward of a fresh copy of the model
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"]).logits[:, 3:-1] / 0.8
    probs = torch.softmax(logits.float(), dim=-1)
    mask = batch["response_mask"]
    expected = probs.square().sum(-1) * mask
    torch.testing.assert_close(output["sum_pi_squared"], expected, atol=1e-5, rtol=1e-4)
    expected_log_probs = torch.log(probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)) * mask
    torch.testing.assert_close(output["old_log_probs"], expected_log_probs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_a_bf16_rollout_keeps_the_buffers_and_float32_router_a_bf16_load_keeps(mode, tmp_path):
    """The rollout reads the model in the compute dtype (the training model cast while its engine is built, or a copy
    of its own) as transformers loads it in that dtype: the rotary inv_freq and DeepSeek V3's router weight and
    correction bias stay float32, with the checkpoint's values. Cast whole, the training model was left with a bf16
    inv_freq and correction bias (every position's angle and the experts chosen off transformers' own)."""
    from transformers import AutoModelForCausalLM

    from reinforge.models import build_char_tokenizer
    from reinforge.models.export import save_hf_folder
    from reinforge.models.tiny import build_tiny_causal_lm

    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm("deepseek_v3", vocab_size=len(tokenizer), seed=3)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 1.0)
    folder = save_hf_folder(model, tokenizer, tmp_path / "v3")
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    config = make_config(folder)
    config.model.dtype, config.trainer.mode = "bfloat16", mode
    worker = ActorRolloutWorker(config, total_training_steps=2)
    rollout_model = worker.rollout_side.rollout_model
    for candidate in (worker.model,) if rollout_model is None else (worker.model, rollout_model):
        expected = {name: tensor for name, tensor in loaded.named_buffers()}
        for name, buffer in candidate.named_buffers():
            assert buffer.dtype == expected[name].dtype == torch.float32, name
            torch.testing.assert_close(buffer, expected[name], atol=0, rtol=0, msg=name)
    if rollout_model is not None:
        gate = rollout_model.model.layers[1].mlp.gate
        assert gate.weight.dtype == torch.float32 and rollout_model.model.layers[1].self_attn.o_proj.weight.dtype == \
            torch.bfloat16
