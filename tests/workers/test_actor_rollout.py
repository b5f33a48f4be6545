"""The actor worker on the CPU: FSDP (a group of one), packed scoring, collective checkpoints."""

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


def test_response_tensors_pad_each_completion_and_keep_its_finish_reason():
    from types import SimpleNamespace

    from reinforge.workers.actor_rollout import _response_tensors

    completions = [SimpleNamespace(token_ids=[5, 6, 7], log_probs=[-0.1, -0.2, -0.3], finish_reason="stop"),
                   SimpleNamespace(token_ids=[], log_probs=[], finish_reason="length"),
                   SimpleNamespace(token_ids=[9, 9, 9, 9], log_probs=[-1.0] * 4, finish_reason="length")]
    responses, mask, log_probs, stop = _response_tensors(completions, width=4, pad_id=0)
    assert responses.tolist() == [[5, 6, 7, 0], [0, 0, 0, 0], [9, 9, 9, 9]]
    assert mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert log_probs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0])
    assert stop.tolist() == [True, False, False] and responses.dtype == torch.long and mask.dtype == torch.float32


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


def test_native_rollout_on_one_device_copies_the_shards_without_gathering(tiny_model_dir, monkeypatch):
    """On one device the engine reads each FSDP parameter's local shard (the whole parameter): no unshard, and
    the same tokens and log-probs as when the parameters are gathered first (the path of several devices)."""
    from torch.distributed.fsdp import FSDPModule

    import reinforge.workers.actor_rollout as actor_module
    from reinforge.rollout.base import SamplingParams

    config = make_config(tiny_model_dir)
    config.rollout.name = "native"
    worker = ActorRolloutWorker(config, total_training_steps=2)
    worker.update_actor(scored_batch())  # weights that differ from the loaded ones
    batch = prompt_batch().repeat(2, interleave=True)
    sampling = SamplingParams(max_tokens=6, temperature=1.0)
    unshards = []
    original = FSDPModule.unshard
    monkeypatch.setattr(FSDPModule, "unshard", lambda self, *a, **k: (unshards.append(self), original(self, *a, **k))[1])
    direct = worker.generate(batch, sampling, 7)
    assert unshards == []
    monkeypatch.setattr(actor_module, "world_size", lambda: 2)  # take the gathering path on the same device
    gathered = worker.generate(batch, sampling, 7)
    assert unshards, "the gathering path did not gather"
    assert torch.equal(direct["responses"], gathered["responses"])
    torch.testing.assert_close(direct["rollout_log_probs"], gathered["rollout_log_probs"])


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_offloaded_parameters_train_and_generate_like_resident_ones(tiny_model_dir, lora_rank):
    """actor.param_offload (FSDP's CPU offload; with LoRA too): the same update and the same samples from the
    native engine, which copies the weights at wake-up onto the worker's device, not the parameters' (the CPU
    between phases on a GPU machine)."""
    from reinforge.rollout.base import SamplingParams

    batch = prompt_batch().repeat(2, interleave=True)
    results = []
    for offload in (False, True):
        config = make_config(tiny_model_dir)
        config.rollout.name = "native"
        config.actor.param_offload = offload
        config.model.lora.rank = lora_rank
        worker = ActorRolloutWorker(config, total_training_steps=2)
        assert worker.engine.device == worker.device
        metrics = worker.update_actor(scored_batch())
        results.append((metrics["actor/grad_norm"], worker.generate(batch, SamplingParams(max_tokens=6), 7)))
    (norm, resident), (offloaded_norm, offloaded) = results
    assert offloaded_norm == pytest.approx(norm, rel=1e-5)
    assert torch.equal(resident["responses"], offloaded["responses"])
    torch.testing.assert_close(resident["rollout_log_probs"], offloaded["rollout_log_probs"])


def test_a_failed_rollout_raises_its_own_error_and_the_next_one_runs(tiny_model_dir, monkeypatch):
    from reinforge.rollout.base import SamplingParams

    config = make_config(tiny_model_dir)
    config.rollout.name = "native"
    worker = ActorRolloutWorker(config, total_training_steps=1)
    batch = prompt_batch()
    decode = worker.engine.runner.decode

    def failing_decode(*args, **kwargs):
        raise RuntimeError("decode failed")

    monkeypatch.setattr(worker.engine.runner, "decode", failing_decode)
    with pytest.raises(RuntimeError, match="decode failed"):  # not "sleep() was called while requests ..."
        worker.generate(batch, SamplingParams(max_tokens=6), 7)
    monkeypatch.setattr(worker.engine.runner, "decode", decode)
    assert worker.generate(batch, SamplingParams(max_tokens=6), 7)["responses"].shape == (2, 6)
